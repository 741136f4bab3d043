"""A scheduler process: vLLM-style continuous batching over its own ``KVCacheManager``.

Each step (:meth:`Scheduler.step`):

1. running requests first, in arrival order: one decode token each (or the rest of a
   chunked prefill) via ``allocate_slots``; when that returns None the newest running
   request is preempted (its blocks freed, back to the head of the waiting queue, computed
   again later: vLLM's recompute preemption) until it fits;
2. then waiting requests while there are sequence slots and token budget:
   ``get_computed_blocks`` (the prefix-cache hit, from any scheduler's work when the pool
   is shared) and ``allocate_slots`` for the rest of the prompt (chunked to the budget);
3. the batch goes to the rank in one call (``execute``): the block ids through the shared
   block tables, the token ids and positions in an ``ExecuteModel`` message; the rank
   answers one greedy token per request;
4. the blocks whose KV the rank has now written are published to the prefix cache
   (``cache_blocks``; ``allocate_slots`` is called with ``delay_cache_blocks=True``): another
   scheduler that hits a block must find its KV already there, so a key is never published
   before its KV is computed;
5. finished requests free their blocks (they stay cached) and are answered.

The process (:func:`scheduler_main`) talks to the front end on two channels (in, out) and
to its rank on two more; it waits on its inbox and its rank's answers at once (they share a
doorbell), so control messages are read even while a step runs.
"""

from __future__ import annotations

import os
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from shmkv.core.request import Request
from shmkv.errors import ProtocolError, ShmKVError
from shmkv.events import BlockRemoved
from shmkv.messages import Channel, ScheduledRequest, Shutdown, recv_any
from shmkv.serve.messages import (
    AttachScheduler,
    DrainScheduler,
    GenerateTokens,
    MessageRejected,
    PrefixCacheReset,
    ResetPrefixCache,
    SchedulerAttached,
    SchedulerDrained,
    SchedulerStats,
    SchedulerStopped,
    TokensGenerated,
)
from shmkv.serve.stopping import EXIT_TERMINATED, TERM_POLL_S, Terminated, terminated

__all__ = ["Scheduler", "ServingRequest", "scheduler_main"]

IDLE_WAIT_S = 0.005  # a step that could schedule nothing waits this long before the next

# execute(step, batch, block_ids) -> one sampled token per request of the batch, where
# block_ids[i] is the i-th request's block ids per KV-cache group.
Execute = Callable[[int, list[ScheduledRequest], list[tuple[list[int], ...]]], list[int]]


@dataclass
class ServingRequest:
    """A request inside a scheduler."""

    request: Request
    max_tokens: int
    arrival: float
    row: int = -1  # its row in the block tables while running
    num_cached_tokens: int = -1  # prefix hit of its first scheduling (-1: not yet)
    first_token: float = 0.0
    first_scheduled: float = 0.0  # when it was first scheduled (queued: since arrival)
    num_preemptions: int = 0
    published_blocks: int = 0  # prompt blocks it computed and has checked for duplicates
    arrival_step: int = 0  # the scheduler's step count when it arrived
    first_token_step: int = 0  # ... when its first token came (steps waited: the difference)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def done(self) -> bool:
        return self.request.num_output_tokens >= self.max_tokens


@dataclass
class SchedulerCounters:
    num_steps: int = 0
    num_requests_finished: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_computed_tokens: int = 0
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    num_evictions: int = 0
    # Prompt tokens it computed that another request cached while it computed them (on a
    # shared pool: often another scheduler): computed twice.
    num_duplicate_tokens: int = 0
    model_s: float = 0.0
    finished: list = field(default_factory=list)


class Scheduler:
    """Continuous batching over one ``KVCacheManager`` (module docstring)."""

    def __init__(self, kv_cache_manager, block_hasher, execute: Execute, *,
                 max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int) -> None:
        self.kvm = kv_cache_manager
        self.hasher = block_hasher
        self.execute = execute
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[ServingRequest] = deque()
        self.running: list[ServingRequest] = []
        self.free_rows = list(range(max_num_seqs - 1, -1, -1))
        self.counters = SchedulerCounters()
        self.last_batch_empty = False

    # ------------------------------------------------------------------ requests

    def add_request(self, request_id: str, prompt_token_ids: list[int], max_tokens: int,
                    cache_salt: str | None = None) -> None:
        """Queues a request.

        Raises:
            ShmKVError: prompt plus output longer than ``max_model_len``, or no tokens.
        """
        if not prompt_token_ids or max_tokens < 1:
            raise ShmKVError(f"request {request_id}: needs a prompt and max_tokens >= 1")
        if len(prompt_token_ids) + max_tokens > self.max_model_len:
            raise ShmKVError(
                f"request {request_id}: {len(prompt_token_ids)} prompt + {max_tokens} new "
                f"tokens exceed max_model_len {self.max_model_len}")
        req = Request(request_id, prompt_token_ids, block_hasher=self.hasher,
                      cache_salt=cache_salt)
        self.waiting.append(ServingRequest(req, max_tokens, time.monotonic(),
                                           arrival_step=self.counters.num_steps))

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_blocks_held(self) -> int:
        total = 0
        for sr in self.running:
            for group in self.kvm.get_block_ids(sr.request_id):
                total += sum(1 for b in group if b)  # the null block (0) pads windows
        return total

    # ------------------------------------------------------------------ one step

    def _preempt(self, sr: ServingRequest) -> None:
        self.kvm.free(sr.request)
        sr.request.num_computed_tokens = 0
        sr.num_preemptions += 1
        self.counters.num_preemptions += 1
        self.free_rows.append(sr.row)
        sr.row = -1
        self.waiting.appendleft(sr)

    def schedule(self) -> list[tuple[ServingRequest, int]]:
        """This step's batch: (request, tokens to compute)."""
        kvm = self.kvm
        with kvm.step():  # one hold of the pool lock for the whole schedule
            return self._schedule_locked(kvm)

    def _schedule_locked(self, kvm) -> list[tuple[ServingRequest, int]]:
        kvm.new_step_starts()
        budget = self.max_num_batched_tokens
        batch: list[tuple[ServingRequest, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            sr = self.running[i]
            req = sr.request
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while True:
                new = kvm.allocate_slots(req, n, delay_cache_blocks=True)
                if new is not None:
                    break
                victim = self.running.pop()  # the newest; not scheduled yet this step
                self._preempt(victim)
                preempted = True
                if victim is sr:
                    break
            if new is None:
                break  # sr itself was preempted; everything after it too
            batch.append((sr, n))
            budget -= n
            i += 1
        # As vLLM: no admissions in a step that had to preempt.
        while (self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
               and not preempted):
            sr = self.waiting[0]
            req = sr.request
            hit, num_hit, _ = kvm.get_computed_blocks(req)
            n = min(req.num_tokens - num_hit, budget)
            new = kvm.allocate_slots(req, n, num_hit, hit, delay_cache_blocks=True)
            if new is None:
                break  # does not fit now; the lookup hold ended in allocate_slots
            self.waiting.popleft()
            if sr.num_cached_tokens < 0:
                sr.first_scheduled = time.monotonic()
                sr.num_cached_tokens = num_hit
                self.counters.num_prompt_tokens += req.num_tokens
                self.counters.num_cached_tokens += num_hit
            req.num_computed_tokens = num_hit
            sr.row = self.free_rows.pop()
            self.running.append(sr)
            batch.append((sr, n))
            budget -= n
        for event in kvm.take_events():  # also ends any lookup hold left
            if isinstance(event, BlockRemoved):
                self.counters.num_evictions += len(event.block_hashes)
        copies, _ = kvm.take_kv_cache_block_copies()
        if copies:  # only with blocks bigger than hash_block_size, which run never makes
            raise ShmKVError(f"{len(copies)} copy-on-write block copies asked for; the "
                             "rank does not do them")
        return batch

    def step(self) -> list[ServingRequest]:
        """Schedules, runs the batch on the rank, publishes what it computed; returns the
        requests that finished."""
        batch = self.schedule()
        self.last_batch_empty = not batch
        if not batch:
            return []
        c = self.counters
        c.num_steps += 1
        t0 = time.monotonic()
        model_free = getattr(self.execute, "tokens_for", None)  # a replay: no rank
        if model_free is not None:
            sampled = model_free(batch)
        else:
            messages, block_ids = [], []
            for sr, n in batch:
                req = sr.request
                start = req.num_computed_tokens
                messages.append(ScheduledRequest(req.request_id, sr.row,
                                                 list(req.all_token_ids[start:start + n]),
                                                 start))
                block_ids.append(self.kvm.get_block_ids(req.request_id))
            sampled = self.execute(c.num_steps, messages, block_ids)
        now = time.monotonic()
        c.model_s += now - t0
        if len(sampled) != len(batch):
            raise ShmKVError(f"rank answered {len(sampled)} tokens for {len(batch)} requests")
        with self.kvm.step():  # publish what the rank computed, in one hold
            for sr, n in batch:
                req = sr.request
                c.num_duplicate_tokens += self._duplicate_tokens(sr, n)
                req.num_computed_tokens += n
                c.num_computed_tokens += n
                self.kvm.cache_blocks(req, req.num_computed_tokens)
        finished = []
        for (sr, _), token in zip(batch, sampled, strict=True):
            req = sr.request
            if req.num_computed_tokens < req.num_tokens:
                continue  # a chunk of a longer prefill: no token yet
            if req.num_output_tokens == 0:
                sr.first_token = now
                sr.first_token_step = c.num_steps
            req.append_output_token_ids(int(token))  # hashes a block it completes
            c.num_generated_tokens += 1
            if sr.done:
                finished.append(sr)
        if finished:
            with self.kvm.step():
                for sr in finished:
                    self.kvm.free(sr.request)
        for sr in finished:
            self.running.remove(sr)
            self.free_rows.append(sr.row)
            sr.row = -1
            c.num_requests_finished += 1
        return finished


    def _duplicate_tokens(self, sr: ServingRequest, n: int) -> int:
        """Prompt tokens computed twice: of the full prompt blocks ``sr`` has just computed
        (``n`` tokens, beyond its prefix hit and what it published before), those whose keys
        another request cached while it computed them, looked up in the step's hold just
        before it publishes them (a request published earlier in the same step counts)."""
        req = sr.request
        if req.num_output_tokens:
            return 0  # decoding: its blocks are its own
        pool = self.kvm.block_pool
        bs = pool.hash_block_size
        full = min(req.num_computed_tokens + n, req.num_prompt_tokens) // bs
        start = max(sr.published_blocks, max(sr.num_cached_tokens, 0) // bs)
        sr.published_blocks = max(sr.published_blocks, full)
        if full <= start:
            return 0
        cached = len(pool.get_cached_prefix(req.block_hashes[:full]))
        return max(0, min(cached, full) - start) * bs


# ---------------------------------------------------------------------- the process


class RankStep:
    """The one call a step makes to its rank: block tables in shared memory, the batch in
    an ``ExecuteModel`` message, the tokens back in ``ModelOutput``."""

    def __init__(self, to_rank: Channel, from_rank: Channel, tables, timeout_s: float,
                 on_other: Callable) -> None:
        self.to_rank = to_rank
        self.from_rank = from_rank
        self.tables = tables
        self.timeout_s = timeout_s
        self.on_other = on_other  # handles front-end messages that arrive meanwhile

    def __call__(self, step: int, batch: list[ScheduledRequest],
                 block_ids: list[tuple[list[int], ...]]) -> list[int]:
        from shmkv.messages import ExecuteModel, ModelOutput

        for sr, ids in zip(batch, block_ids, strict=True):
            self.tables.write_row(sr.row, ids)
        self.tables.commit_step(step)
        self.to_rank.send(ExecuteModel(step=step, requests=batch), timeout_s=self.timeout_s)
        deadline = time.monotonic() + self.timeout_s
        while True:
            if terminated():  # the rank may have been stopped by the same signal
                raise Terminated(f"SIGTERM while waiting for the rank's answer to step {step}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ShmKVError(f"rank gave no answer to step {step} in {self.timeout_s} s")
            channel, msg = self.on_other.receive(min(remaining, TERM_POLL_S))
            if channel is self.from_rank:
                if not isinstance(msg, ModelOutput) or msg.step != step:
                    raise ShmKVError(f"rank answered {msg!r} to step {step}")
                if msg.error:
                    raise ShmKVError(f"rank failed step {step}: {msg.error}")
                return msg.sampled_token_ids


class SchedulerProcess:
    """The loop of one scheduler process (see :func:`scheduler_main`)."""

    def __init__(self, index: int, channel_names: dict[str, str]) -> None:
        self.index = index
        self.inbox = Channel.open(channel_names["inbox"])
        self.outbox = Channel.open(channel_names["outbox"])
        self.to_rank = Channel.open(channel_names["to_rank"])
        self.from_rank = Channel.open(channel_names["from_rank"])
        self.draining = False
        self.stopping = False
        self.last_stats = 0.0
        self.scheduler: Scheduler | None = None
        self.pool = None
        self.tables = None

    def receive(self, timeout_s: float):
        """The next message from the rank or the front end; front-end messages are
        handled here and (None, None) returned for them."""
        try:
            channel, msg = recv_any([self.from_rank, self.inbox], timeout_s)
        except ProtocolError as exc:
            self.outbox.send(MessageRejected(sender=f"scheduler-{self.index}",
                                             reason=str(exc)))
            return None, None
        if channel is self.inbox:
            self.handle(msg)
            return None, None
        return channel, msg

    def handle(self, msg) -> None:
        s = self.scheduler
        if isinstance(msg, GenerateTokens) and s is not None:
            if self.draining:
                self.reject(f"request {msg.request_id}: draining, not accepting requests",
                            msg.request_id)
                return
            try:
                s.add_request(msg.request_id, msg.prompt_token_ids, msg.max_tokens,
                              msg.cache_salt)
            except ShmKVError as exc:
                self.reject(str(exc), msg.request_id)
        elif isinstance(msg, Shutdown):
            self.stopping = True
        elif isinstance(msg, DrainScheduler):
            self.draining = True
        elif isinstance(msg, ResetPrefixCache) and s is not None:
            ok = (not s.has_work) and s.kvm.reset_prefix_cache()
            self.outbox.send(PrefixCacheReset(scheduler=self.index, success=bool(ok)))
        else:
            self.reject(f"unexpected message {type(msg).__name__}")

    def reject(self, reason: str, request_id: str = "") -> None:
        self.outbox.send(MessageRejected(sender=f"scheduler-{self.index}", reason=reason,
                                         request_id=request_id))

    def stats(self) -> SchedulerStats:
        s = self.scheduler
        c = s.counters
        lock = self.pool.lock()
        return SchedulerStats(
            scheduler=self.index, num_steps=c.num_steps, num_running=len(s.running),
            num_waiting=len(s.waiting), num_blocks_held=s.num_blocks_held,
            num_free_blocks=self.pool.get_num_free_blocks(),
            num_requests_finished=c.num_requests_finished,
            num_prompt_tokens=c.num_prompt_tokens, num_cached_tokens=c.num_cached_tokens,
            num_computed_tokens=c.num_computed_tokens,
            num_generated_tokens=c.num_generated_tokens, num_preemptions=c.num_preemptions,
            num_evictions=c.num_evictions,
            num_duplicate_tokens=c.num_duplicate_tokens, lock_wait_s=lock.wait_ns_total / 1e9,
            lock_hold_s=lock.hold_ns_total / 1e9, num_lock_acquired=lock.num_acquired,
            model_s=c.model_s)

    def attach(self, msg: AttachScheduler) -> None:
        from shmkv.pool.block_pool import BlockPool
        from shmkv.serve.engine import build_kv_cache_manager, open_block_tables

        cfg = msg.config
        self.pool = BlockPool.attach(cfg.pool_name, label=f"scheduler-{self.index}")
        kvm = build_kv_cache_manager(self.pool, cfg)
        if cfg.model_free:  # a replay: no rank, no block tables
            from shmkv.serve.replay import CostModel, ModelFreeStep

            execute = ModelFreeStep(cfg.model["vocab_size"], CostModel(
                cfg.prefill_ms_per_token, cfg.decode_ms_per_step))
        else:
            self.tables = open_block_tables(cfg)
            execute = RankStep(self.to_rank, self.from_rank, self.tables, cfg.rank_timeout_s,
                               self)
        self.scheduler = Scheduler(kvm, self.pool.make_block_hasher(), execute,
                                   max_num_seqs=cfg.max_num_seqs,
                                   max_num_batched_tokens=cfg.max_num_batched_tokens,
                                   max_model_len=cfg.max_model_len)
        self.stats_interval_s = cfg.stats_interval_s
        self.outbox.send(SchedulerAttached(scheduler=self.index, pid=os.getpid(),
                                           pool_slot=self.pool.slot,
                                           num_gpu_blocks=self.pool.num_gpu_blocks))

    def run(self, attach_timeout_s: float = 120.0) -> None:
        msg = None
        deadline = time.monotonic() + attach_timeout_s
        while not isinstance(msg, AttachScheduler):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ShmKVError(f"scheduler-{self.index}: no AttachScheduler in "
                                 f"{attach_timeout_s} s")
            try:
                msg = self.inbox.recv(remaining)
            except ProtocolError as exc:
                self.reject(str(exc))
                continue
            if isinstance(msg, Shutdown):
                return
            if msg is not None and not isinstance(msg, AttachScheduler):
                self.reject(f"unexpected message {type(msg).__name__} before AttachScheduler")
        self.attach(msg)
        s = self.scheduler
        drained_sent = False
        while not self.stopping and not terminated():
            if s.has_work:
                # Read what arrived without waiting, then step.
                while True:
                    try:
                        got = self.inbox.poll()
                    except ProtocolError as exc:
                        self.reject(str(exc))
                        continue
                    if got is None:
                        break
                    self.handle(got)
                if self.stopping:
                    break
                finished = s.step()
                if s.last_batch_empty:
                    # Nothing fits now (on a shared pool, others hold the blocks): wait for
                    # a message or a moment instead of spinning on the pool's lock.
                    self.receive(IDLE_WAIT_S)
                for sr in finished:
                    req = sr.request
                    self.outbox.send(TokensGenerated(
                        request_id=sr.request_id, scheduler=self.index,
                        output_token_ids=list(req.output_token_ids),
                        num_prompt_tokens=req.num_prompt_tokens,
                        num_cached_tokens=sr.num_cached_tokens,
                        num_preemptions=sr.num_preemptions,
                        first_token_s=sr.first_token - sr.arrival,
                        first_token_steps=sr.first_token_step - sr.arrival_step,
                        queued_s=sr.first_scheduled - sr.arrival,
                        finished_s=time.monotonic() - sr.arrival))
            else:
                if self.draining and not drained_sent:
                    self.outbox.send(SchedulerDrained(
                        scheduler=self.index,
                        num_requests_finished=s.counters.num_requests_finished))
                    drained_sent = True
                self.receive(self.stats_interval_s)
            now = time.monotonic()
            if now - self.last_stats >= self.stats_interval_s:
                self.outbox.send(self.stats())
                self.last_stats = now
        if self.tables is not None:  # a replay has no rank
            self.to_rank.send(Shutdown(reason="scheduler stopping"), timeout_s=1.0)
        self.outbox.send(SchedulerStopped(scheduler=self.index, stats=self.stats()))

    def close(self) -> None:
        for ch in (self.inbox, self.outbox, self.to_rank, self.from_rank):
            ch.close()
        if self.tables is not None:
            self.tables.close()
        if self.pool is not None:
            self.pool.close()


def scheduler_main(index: int, channel_names: dict[str, str],
                   front_end_pid: int | None = None) -> None:
    """Entry point of a scheduler process (started by the runner)."""
    from shmkv.serve.engine import child_setup

    child_setup(front_end_pid)
    proc = SchedulerProcess(index, channel_names)
    try:
        proc.run()
    except Terminated:
        pass  # a step cut short by SIGTERM: the stop below, as between two steps
    finally:
        proc.close()  # detaches: its block references and its slot go back to the pool
    if terminated():
        sys.exit(EXIT_TERMINATED)
