"""The model-free replay (``shmkv replay``, ``shmkv run --model none``): the run's front end,
routing, scheduler processes, ``KVCacheManager``s and pool(s), with no rank processes and no
model. A step's "sampled" token is a deterministic function of the request's tokens so far
(:class:`ModelFreeStep`), so what a replay measures is the KV-cache layer alone: prefix hits,
evictions, preemptions, scheduler steps waited, the pool's lock.

The KV-cache groups are still the tiny model's (a full-attention group and a sliding-window
one): a replay allocates, caches and evicts exactly the blocks a run with the model does,
so for the same arrivals and routing the two give the same hits (see docs/serving.md for
what can make them differ).

The cost model (:class:`CostModel`): with no model there is no compute time, so a replay's
step takes the time a model's would, by a sleep outside the pool's lock: ``decode_ms_per_step``
for every step that runs something, plus ``prefill_ms_per_token`` for every token it computes
that is not a decode token (prompt tokens not hit in the cache, in chunks, and the tokens a
preempted request computes again). The queues, the time to the first token and the routers'
load then behave as they would in front of a model of that speed: what a request saves by a
prefix hit is its hit tokens times ``prefill_ms_per_token``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from shmkv.errors import UsageError

__all__ = ["CostModel", "ModelFreeStep", "model_free_token"]


@dataclass(frozen=True)
class CostModel:
    """A replay's step time (module docstring); the defaults are ``shmkv replay``'s."""

    prefill_ms_per_token: float = 0.1
    decode_ms_per_step: float = 1.0

    def validate(self) -> None:
        """Raises:
            UsageError: a cost that is negative or not finite, naming its flag."""
        for flag, v in (("--prefill-ms-per-token", self.prefill_ms_per_token),
                        ("--decode-ms-per-step", self.decode_ms_per_step)):
            if not 0.0 <= v < float("inf"):
                raise UsageError(f"{flag} {v!r}: must be a finite number of milliseconds >= 0 "
                                 "(0: no time for it)")

    def step_s(self, batch) -> float:
        """Seconds of one step: ``batch`` the scheduler's ``(ServingRequest, num_tokens)``
        pairs, before their tokens are counted as computed. A decode token is one token of
        a request that has output already; every other token is a prefill token."""
        if not batch:
            return 0.0
        prefill = sum(n for sr, n in batch
                      if not (n == 1 and sr.request.num_output_tokens > 0))
        return (self.decode_ms_per_step + self.prefill_ms_per_token * prefill) / 1e3

    def text(self) -> str:
        return (f"{self.prefill_ms_per_token:g} ms per prefill token, "
                f"{self.decode_ms_per_step:g} ms per step")


def model_free_token(last_token: int, num_tokens: int, vocab_size: int) -> int:
    """The token after ``num_tokens`` tokens ending in ``last_token``: in ``[1, vocab)``,
    the same for the same request state (equal prompts give equal outputs, as greedy
    decoding does)."""
    return 1 + (last_token * 31 + num_tokens * 17) % (vocab_size - 1)


class ModelFreeStep:
    """The scheduler's ``execute`` for a replay: no rank, no block tables, no messages;
    :meth:`tokens_for` gives one token per scheduled request straight from its state."""

    def __init__(self, vocab_size: int, cost: CostModel | None = None) -> None:
        self.vocab_size = vocab_size
        self.cost = cost or CostModel(0.0, 0.0)

    def tokens_for(self, batch) -> list[int]:
        """``batch``: the scheduler's ``(ServingRequest, num_tokens)`` pairs, before their
        tokens are counted as computed; takes the cost model's time for it."""
        wait_s = self.cost.step_s(batch)
        if wait_s > 0:
            time.sleep(wait_s)
        v = self.vocab_size
        out = []
        for sr, _ in batch:
            req = sr.request
            out.append(model_free_token(req.all_token_ids[-1], req.num_tokens, v))
        return out

    def __call__(self, step, batch, block_ids):  # the rank interface, for completeness
        raise NotImplementedError("ModelFreeStep answers through tokens_for")
