"""The model-free replay (``shmkv replay``, ``shmkv run --model none``): the run's front end,
routing, scheduler processes, ``KVCacheManager``s and pool(s), with no rank processes and no
model. A step's "sampled" token is a deterministic function of the request's tokens so far
(:class:`ModelFreeStep`), so what a replay measures is the KV-cache layer alone: prefix hits,
evictions, preemptions, scheduler steps waited, the pool's lock.

The KV-cache groups are still the tiny model's (a full-attention group and a sliding-window
one): a replay allocates, caches and evicts exactly the blocks a run with the model does,
so for the same arrivals and routing the two give the same hits (see docs/serving.md for
what can make them differ).
"""

from __future__ import annotations

__all__ = ["ModelFreeStep", "model_free_token"]


def model_free_token(last_token: int, num_tokens: int, vocab_size: int) -> int:
    """The token after ``num_tokens`` tokens ending in ``last_token``: in ``[1, vocab)``,
    the same for the same request state (equal prompts give equal outputs, as greedy
    decoding does)."""
    return 1 + (last_token * 31 + num_tokens * 17) % (vocab_size - 1)


class ModelFreeStep:
    """The scheduler's ``execute`` for a replay: no rank, no block tables, no messages;
    :meth:`tokens_for` gives one token per scheduled request straight from its state."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def tokens_for(self, batch) -> list[int]:
        """``batch``: the scheduler's ``(ServingRequest, num_tokens)`` pairs, before their
        tokens are counted as computed."""
        v = self.vocab_size
        out = []
        for sr, _ in batch:
            req = sr.request
            out.append(model_free_token(req.all_token_ids[-1], req.num_tokens, v))
        return out

    def __call__(self, step, batch, block_ids):  # the rank interface, for completeness
        raise NotImplementedError("ModelFreeStep answers through tokens_for")
