"""The models ``shmkv run --model`` names, and their sizes.

- ``tiny``: ``TinyModelConfig()``, 3 layers, a sliding-window layer among them; float32 on the
  CPU in milliseconds a step. The default.
- ``small``: the same transformer at a Llama-like shape whose prefill costs what it costs in
  production: about 0.6 B parameters (vocabulary 32,000, hidden size 1,536, 20 layers of
  full attention, 12 query heads and 4 KV heads of size 128, MLP 4,096), random weights
  from a fixed seed, bfloat16 on a GPU. On a CPU it runs, slowly: tests use
  ``SMALL_MODEL_CONFIG`` with its sizes cut down (``dataclasses.replace``), and check the
  full size by counting (``num_parameters``).

No torch here: a scheduler process needs the configuration, not the model.
"""

from __future__ import annotations

from shmkv.errors import UsageError
from shmkv.serve.config import TinyModelConfig

__all__ = ["MODEL_NAMES", "SMALL_MODEL_CONFIG", "model_config_for", "num_parameters"]

SMALL_MODEL_CONFIG = TinyModelConfig(
    vocab_size=32000, num_layers=20, num_heads=12, num_kv_heads=4, head_size=128,
    hidden_size=1536, intermediate_size=4096, sliding_window=(None,) * 20,
    rope_theta=500000.0, seed=0)

MODEL_NAMES = ("tiny", "small")


def model_config_for(name: str) -> TinyModelConfig:
    """The configuration ``--model name`` runs.

    Raises:
        UsageError: an unknown name (naming ``--model`` and the choices).
    """
    if name == "tiny":
        return TinyModelConfig()
    if name == "small":
        return SMALL_MODEL_CONFIG
    raise UsageError(f"--model must be one of {', '.join(MODEL_NAMES)}, got {name!r}")


def num_parameters(c: TinyModelConfig) -> int:
    """The parameters of ``TinyTransformer(c)``, counted from the configuration: the
    embedding and the LM head (not tied), and per layer the Q/K/V/O projections, the gated
    MLP and two norms, plus the final norm."""
    attn = c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_size
    attn += c.num_heads * c.head_size * c.hidden_size
    mlp = 3 * c.hidden_size * c.intermediate_size
    per_layer = attn + mlp + 2 * c.hidden_size
    return 2 * c.vocab_size * c.hidden_size + c.num_layers * per_layer + c.hidden_size
