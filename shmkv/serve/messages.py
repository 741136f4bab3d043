"""Front end <-> scheduler messages and the control messages of ``shmkv run``.

They build on :mod:`shmkv.messages` (the tagged, versioned ``Message`` base, ``encode`` /
``decode`` and the ``Channel`` transport) and register themselves there, so any shmkv
process decodes them. Requests (front end to scheduler) and replies are paired:

- :class:`AttachScheduler` -> :class:`SchedulerAttached`: the run's settings; the
  scheduler attaches to its pool and says so.
- :class:`GenerateTokens` -> :class:`TokensGenerated`: one request, answered when it
  finishes.
- :class:`DrainScheduler` -> :class:`SchedulerDrained`: finish what is queued and running,
  accept nothing new.
- :class:`ResetPrefixCache` -> :class:`PrefixCacheReset`: reset the pool's prefix cache
  (only when nothing is in use).
- ``Shutdown`` (of :mod:`shmkv.messages`) -> :class:`SchedulerStopped`: stop now, with the
  last figures.
- :class:`SchedulerStats`, unsolicited, a few times a second: the step results so far.
- :class:`MessageRejected`: the reply to a frame the receiver could not decode or use.

A receiver that cannot decode a frame (``ProtocolError``) or gets a message it has no use
for answers :class:`MessageRejected` naming it and goes on: a bad frame never kills it.
"""

from __future__ import annotations

import msgspec

from shmkv.messages import Message, message

__all__ = [
    "AttachScheduler", "DrainScheduler", "GenerateTokens", "MessageRejected",
    "PrefixCacheReset", "ResetPrefixCache", "SchedulerAttached", "SchedulerConfig",
    "SchedulerDrained", "SchedulerStats", "SchedulerStopped", "TokensGenerated",
]


class SchedulerConfig(msgspec.Struct, kw_only=True):
    """What a scheduler process needs to serve (part of :class:`AttachScheduler`)."""

    pool_name: str
    model: dict  # the TinyModelConfig's fields (msgspec.structs.asdict / to_builtins)
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_tables_name: str
    # How often a scheduler reports its figures: 50 ms, the metrics refresh interval of
    # llm-d's endpoint picker, whose scorers read them (shmkv/serve/routing.py).
    stats_interval_s: float = 0.05
    rank_timeout_s: float = 60.0
    model_free: bool = False  # a replay: tokens without a model, no rank, no block tables
    # A replay's cost model (shmkv/serve/replay.py): the time a step takes.
    prefill_ms_per_token: float = 0.0
    decode_ms_per_step: float = 0.0


@message
class AttachScheduler(Message):
    """The first message a scheduler gets: who it is and how to serve."""

    scheduler: int
    config: SchedulerConfig


@message
class SchedulerAttached(Message):
    """The scheduler is attached to its pool and takes requests."""

    scheduler: int
    pid: int
    pool_slot: int
    num_gpu_blocks: int


@message
class GenerateTokens(Message):
    """Serve one request: prefill ``prompt_token_ids``, then ``max_tokens`` greedy tokens."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    cache_salt: str | None = None


@message
class TokensGenerated(Message):
    """A finished request: its tokens and what the prefix cache did for it.

    ``num_cached_tokens`` is the prefix-cache hit of its first scheduling (vLLM's
    ``PrefixCacheStats`` counts the same), in tokens; times are seconds since it arrived.
    """

    request_id: str
    scheduler: int
    output_token_ids: list[int]
    num_prompt_tokens: int
    num_cached_tokens: int
    num_preemptions: int
    first_token_s: float
    finished_s: float
    first_token_steps: int = 0  # its scheduler's steps from its arrival to its first token
    queued_s: float = 0.0  # from its arrival to its first scheduling (waiting in the queue)


@message
class SchedulerStats(Message):
    """A scheduler's figures so far (counters are totals since it attached)."""

    scheduler: int
    num_steps: int
    num_running: int
    num_waiting: int
    num_blocks_held: int  # blocks its running requests hold
    num_free_blocks: int  # in its pool (the shared one, or its private one)
    num_requests_finished: int
    num_prompt_tokens: int
    num_cached_tokens: int
    num_computed_tokens: int  # tokens the model ran (prefill and decode)
    num_generated_tokens: int
    num_preemptions: int
    num_evictions: int  # prefix-cache keys its allocations evicted
    lock_wait_s: float  # time spent waiting for the pool lock
    lock_hold_s: float
    num_lock_acquired: int
    model_s: float  # time waiting for its rank's steps
    # Prompt tokens it computed that another request cached while it computed them.
    num_duplicate_tokens: int = 0


@message
class DrainScheduler(Message):
    """Finish every request already sent; reply :class:`SchedulerDrained` when idle."""


@message
class SchedulerDrained(Message):
    scheduler: int
    num_requests_finished: int


@message
class ResetPrefixCache(Message):
    """Reset the pool's prefix cache (vLLM's ``reset_prefix_cache``); only succeeds when
    no blocks are in use, so drain every scheduler on the pool first."""


@message
class PrefixCacheReset(Message):
    scheduler: int
    success: bool


@message
class SchedulerStopped(Message):
    """The scheduler's last word before it exits (the reply to ``Shutdown``)."""

    scheduler: int
    stats: SchedulerStats


@message
class MessageRejected(Message):
    """The receiver could not decode or use a frame; ``reason`` says why. A refused
    :class:`GenerateTokens` names its ``request_id`` (it will get no ``TokensGenerated``)."""

    sender: str
    reason: str
    request_id: str = ""
