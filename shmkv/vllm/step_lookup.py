"""The manager's step region (its ``lock``) and its lookups: a scheduler step's lookups of
one request, answered from one hold of the node-wide lock.

vLLM's connector asks the manager about a request's keys one at a time, in order: its
prefix lookup walks the request's chunks from the first one not computed, and stops at the
first MISS (a HIT_PENDING counts as a hit and the walk goes on). Taking the pool lock for
each key makes a step's lookups as many holds, and as many waits behind the other replicas'
holds, as the request has cached chunks.

Inside the step region (the manager's ``lock``) the first lookup of a key therefore looks up
a run: that key and the request's next keys of its KV-cache group, by the positions the
scheduler gave them (``ReqContext``), up to ``MAX_RUN`` keys and up to the first MISS. The
run's HITs are pinned in the same hold (the lookup pins the step region keeps until their
``prepare_load`` or the region's end), and every answer of the run is kept for the rest of
the region, so the lookups that follow take no lock. An answer stays true while it is kept:

- a HIT is pinned, so no replica evicts it; a ``complete_load`` of the key in the same
  region (which gives its pin back) drops the answer;
- a HIT_PENDING or MISS was true at the hold; vLLM defers a HIT_PENDING request and asks
  again next step, and a MISS ends its walk. This process's own ``prepare_store`` or
  ``complete_store`` of the key drops the answer, so it reads what vLLM's manager would.

vLLM 0.32's connector holds no ``lock``: for it (the manager's ``implicit_step_region``,
which the spec sets on 0.32) the first lookup of a step opens the region
(``StepRegion.open_implicit``) and the manager's ``on_schedule_end``, which vLLM calls at the
end of every scheduler step, closes it, so a HIT stays pinned until its ``prepare_load``
there too.

The run reads the request's key positions through ``ReqContext``'s position table (vLLM
0.33.0's ``_offload_key_positions``; without it, a run is the one key asked). A run may pin
keys past the ones vLLM asks about in this step (its walk is bounded by the tokens it may
load); those pins go back at the region's end, like any lookup pin no ``prepare_load``
took.
"""

from __future__ import annotations

import threading
from typing import Any

from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext

from shmkv.errors import UsageError
from shmkv.vllm.recency import MISS, PENDING, READY

MAX_RUN = 64  # keys looked up in one hold

_ANSWERS = {READY: LookupResult.HIT, PENDING: LookupResult.HIT_PENDING,
            MISS: LookupResult.MISS}


class StepLookups:
    """This process's lookup answers and request key orders for the current step region
    (cleared when the region ends)."""

    __slots__ = ("answers", "_orders")

    def __init__(self) -> None:
        self.answers: dict[OffloadKey, object] = {}  # key -> its LookupResult
        # (id of the request context, group suffix) -> (context, #positions, keys, index)
        self._orders: dict[tuple[int, bytes], tuple] = {}

    def clear(self) -> None:
        self.answers.clear()
        self._orders.clear()

    def forget(self, keys) -> None:
        """Drops the answers of keys whose state this process just changed."""
        answers = self.answers
        for key in keys:
            answers.pop(key, None)

    def run_from(self, key: OffloadKey, req_context: ReqContext) -> list[OffloadKey]:
        """``key``, then the request's keys of its group that follow it by position, up to
        ``MAX_RUN`` keys and up to the first key already answered."""
        positions = getattr(req_context, "_offload_key_positions", None)
        if not isinstance(positions, dict) or key not in positions:
            return [key]
        group = key[-4:]
        slot = (id(req_context), group)
        entry = self._orders.get(slot)
        if entry is None or entry[0] is not req_context or entry[1] != len(positions):
            order = sorted((k for k in positions if k[-4:] == group), key=positions.__getitem__)
            entry = (req_context, len(positions), order, {k: i for i, k in enumerate(order)})
            self._orders[slot] = entry
        order, index = entry[2], entry[3]
        start = index[key]
        run = [key]
        answers = self.answers
        for later in order[start + 1:start + MAX_RUN]:
            if later in answers:
                break
            run.append(later)
        return run


class StepRegion:
    """The manager's ``lock``, private to this process (re-entrant).

    vLLM's connector holds ``manager.lock`` over the connector part of a scheduler step
    (from the step's first lookup to its connector metadata). The node-wide pool lock is
    taken per call inside it, never across it, so the replicas' steps run side by side.
    What the step region promises vLLM (a lookup's HIT is still there at the
    ``prepare_load`` that pins it, and no ``prepare_store`` of the step evicts it) is kept
    by lookup pins: a HIT found inside the region takes a hold on its chunk, which
    ``prepare_load`` turns into its pin; the holds left are given back when the region
    closes.
    """

    def __init__(self, manager: Any) -> None:
        self._mutex = threading.RLock()
        self._depth = 0
        self._manager = manager
        self._implicit = False  # opened by a lookup, closed by on_schedule_end (vLLM 0.32)

    def open_implicit(self) -> None:
        """Opens the region for a connector that holds no ``lock`` (vLLM 0.32); it stays
        open until :meth:`close_implicit`."""
        self.__enter__()
        self._implicit = True

    def close_implicit(self) -> None:
        """Closes a region :meth:`open_implicit` opened; nothing otherwise."""
        if self._implicit:
            self._implicit = False
            self.__exit__(None, None, None)

    @property
    def active(self) -> bool:
        return self._depth > 0

    def __enter__(self) -> None:
        self._mutex.acquire()
        self._depth += 1

    def __exit__(self, *exc: object) -> None:
        try:
            self._depth -= 1
            if not self._depth:
                self._manager._end_step()
        finally:
            self._mutex.release()


class StepLookupCalls:
    """The manager's ``lookup`` and the end of its step region (a mixin of
    ``SharedCPUOffloadingManager``: it uses the manager's pool, lock, hold, key states and
    its ``_region``, ``_step`` and ``_lookup_pins``)."""

    def _end_step(self) -> None:
        """Gives back the holds of the step's HITs no ``prepare_load`` took, and forgets
        the step's lookup answers."""
        self._step.clear()
        if not self._lookup_pins or self._pool is None:
            return
        with self._hold():
            block_ids = list(self._lookup_pins.values())
            self._lookup_pins.clear()
            self._pool.free_blocks(self._handles(block_ids))
            self._lru.push_free(self._unkeyed_and_unheld(block_ids))

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """HIT if the key is stored and complete (by any process), HIT_PENDING if a
        process is storing it, MISS otherwise. A store of a process that died reads
        HIT_PENDING until this process next reaps the dead (at most ``REAP_INTERVAL_S``
        later), then MISS. Every key is a MISS once this replica's workers map another data
        region than the tier's (``region.py``).

        Args:
            key: an offload key (a block hash of up to 32 bytes + a 4-byte group index).
            req_context: the request's context (a lookup changes no recency; inside the
                step region, its key positions give the run looked up with the key).

        Inside the step region (``lock``), a HIT pins its chunk until the ``prepare_load``
        that loads it, or the region's end; the key is looked up with the request's keys
        that follow it, in one hold, and their answers serve the region's next lookups
        without the lock (this module).

        Returns:
            the ``LookupResult``.

        Raises:
            UsageError: a key the tier cannot hold (hash longer than 32 bytes).
            PoolClosedError: the manager is closed.
        """
        if self._implicit_region and not self._region.active:
            self._region.open_implicit()
        if self._region.active:
            answer = self._step.answers.get(key)
            return answer if answer is not None else self._lookup_run(key, req_context)
        with self._lock:
            if self._region_lost():
                return LookupResult.MISS
            state, _ = self._status(key)
        return _ANSWERS[state]

    def _lookup_run(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """Looks ``key`` and the request's keys after it up in one hold, up to the first
        MISS; pins the HITs and keeps every answer for the step region."""
        run = self._step.run_from(key, req_context)
        encs = [self._encode(key)]
        for later in run[1:]:
            try:
                encs.append(self._encode(later))
            except UsageError:  # a key the tier cannot hold: asked about alone, if at all
                break
        run = run[:len(encs)]
        pins, found, to_hold = self._lookup_pins, {}, {}
        with self._lock:
            if self._region_lost():
                return LookupResult.MISS
            for run_key, (state, block_id) in zip(run, self._statuses(run, encs), strict=True):
                found[run_key] = _ANSWERS[state]
                if state == MISS:
                    break
                if state == READY and run_key not in pins:
                    to_hold[run_key] = block_id
            if to_hold:
                self._pool.touch(self._handles(list(to_hold.values())))
                pins.update(to_hold)  # until prepare_load or the step's end
        self._step.answers.update(found)
        return found[key]
