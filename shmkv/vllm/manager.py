"""The offload tier's manager: vLLM's ``OffloadingManager`` (LRU) over a shmkv pool shared
by every data-parallel replica on the node.

How a chunk lives in the pool
-----------------------------

The pool is a shmkv ``BlockPool`` of ``num_chunks + 1`` blocks (block 0 is the null block,
block ``b`` is chunk ``b - 1``), with ``hash_block_size = 1`` and medium ``"CPU"``. An
``OffloadKey`` (a block hash of up to 32 bytes, then a 4-byte big-endian group index) is the
block's prefix-cache key: the hash padded to 32 bytes, and a group id that carries the group
index (low 16 bits), the padding length (bits 16..21) and the state:

| state    | pool key              | ref_cnt (sum of the ledger) | lookup      |
|----------|-----------------------|-----------------------------|-------------|
| free     | none                  | 0                           | MISS        |
| pending  | group id | PENDING    | 1: the storer's hold        | HIT_PENDING |
| orphan   | group id | PENDING    | 0: the storer died, reaped  | MISS (the key is dropped) |
| ready    | group id              | pins of every process       | HIT         |

The pool's per-process ledger says who holds what: ``prepare_store`` takes a hold on each new
chunk (``touch``) and caches it under its PENDING key; ``complete_store`` moves the key to its
ready form and drops the hold; ``prepare_load`` pins with a hold and ``complete_load`` drops
it. Every call runs under the pool lock, and the pool's undo journal rolls a hold back as a
whole if its process dies inside it.

Who may reuse a chunk
---------------------

A hold says which process decided a job; the job bits of the tier table say which replica's
bytes are still moving (``shmkv/vllm/replicas.py``). A chunk is handed to a new store only
when nobody holds it AND no replica has a job on it: a replica's bit is set by its
``prepare_store`` / ``prepare_load`` and cleared by the matching completion, by
``on_reset_flushed`` for the jobs a ``reset_cache`` cut off, or when every process of the
replica (engine core and GPU workers) is gone. So an engine core SIGKILLed with a store in
flight gives its chunks back only once its workers, which finish their step first, are gone
too.

Recency lives in the tier table: one int64 rank per block, exactly the ranks of vLLM's
``LRUCachePolicy`` (``(major, -position)`` packed into one int64). The smallest ranks among
ready chunks nobody holds are evicted first, ties broken by key bytes, as vLLM's heap does.

Used by one process, the manager answers call for call as vLLM's
``CPUOffloadingManager(num_chunks, cache_policy="lru")``: lookups, ``keys_to_store``,
``evicted_keys``, refused stores and events (chunk ids differ: fresh chunks are taken lowest
id first). With several processes it behaves as if their calls ran one at a time in lock
order, with two deliberate differences: a ``reset_cache`` leaves chunks that other processes
hold, and ``complete_store``/``complete_load`` act only on this process's own stores and pins.

NOTE: ``lock`` is the pool lock, node-wide. vLLM's connector holds ``manager.lock`` from its
first lookup of a scheduler step to the step's connector metadata (so that a HIT and the
``prepare_load`` that pins it are not separated by an eviction); with the shared tier that
atomicity holds across replicas, and the price is that the connector parts of the replicas'
scheduling steps run one at a time.

ARC (``cache_policy="arc"``) is refused: its ghost lists and adaptive target would need a
second shared structure with its own crash story; LRU is what the shared tier offers.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Collection, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    get_offload_group_idx,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from shmkv.errors import PoolClosedError, SegmentError, ShmKVError, UsageError
from shmkv.events import BlockRemoved, BlockStored, external_block_hash, use_int_block_hashes
from shmkv.pool import layout as L
from shmkv.pool import tier_counters as TC
from shmkv.pool.block_pool import BlockPool
from shmkv.pool.lock import DEFAULT_LOCK_TIMEOUT_S
from shmkv.pool.takeover import DEFAULT_STUCK_AFTER_S
from shmkv.vllm.compat import EVENT_METADATA_ONLY, EVENT_REQ_CONTEXT, ConfigInfoMapping
from shmkv.vllm.identity import check_identity
from shmkv.vllm.lifecycle import MEDIUM, join_as_core, remove_tier
from shmkv.vllm.lru import TierLRU
from shmkv.vllm.recency import MISS, PENDING, READY, RequestRecency, pack_rank
from shmkv.vllm.replicas import (
    reap_gone,
    release_row,
)
from shmkv.vllm.stats import (
    GAUGE_INTERVAL_S,
    SHMKV_CROSS_REPLICA_HITS,
    SHMKV_LOCK_HOLD_S,
    SHMKV_LOCK_HOLDS,
    SHMKV_LOCK_WAIT_S,
    TierStats,
)
from shmkv.vllm.step_lookup import StepLookupCalls, StepLookups, StepRegion
from shmkv.vllm.tier import (
    PENDING_BIT,
    W_GENERATION,
    W_REAPED_SEEN,
    W_REGION_TAG,
    W_REPLICA_REGION,
    replica_label,
    tier_table_name,
)

__all__ = ["SHMKV_CROSS_REPLICA_HITS", "SHMKV_LOCK_HOLDS", "SHMKV_LOCK_HOLD_S",
           "SHMKV_LOCK_WAIT_S", "SharedCPUOffloadingManager", "data_region_engine_id",
           "tier_table_name"]

logger = logging.getLogger("shmkv.vllm")

LOCK_RECORD_FOLD = 1024  # pool lock holds recorded before they are folded into totals
REAP_INTERVAL_S = 0.05  # how often a process waiting on another's store checks for the dead


def data_region_engine_id(pool: str) -> str:
    """The ``engine_id`` under which every replica's workers map the tier's data region
    (vLLM names the file ``/dev/shm/vllm_offload_<engine_id>.mmap``)."""
    return L.offload_data_region_engine_id(pool)


class _ClosedLock:
    """The lock of a closed manager: every call that needs the pool says so."""

    def __enter__(self) -> None:
        raise PoolClosedError("the offload tier manager is closed; make a new one to attach")

    def __exit__(self, *exc: object) -> None:
        return None

    def acquire(self) -> None:
        self.__enter__()


class _Hashes:
    """What ``BlockPool.cache_full_blocks`` reads of a request: its block hashes."""

    __slots__ = ("block_hashes",)

    def __init__(self, block_hashes: list[bytes]) -> None:
        self.block_hashes = block_hashes


class _Hold:
    """``SharedCPUOffloadingManager._hold()``: one hold of the node-wide pool lock in which
    the tier's eviction heap and free stack may change (``lru.py``: marked dirty while
    held, rebuilt first if their last writer died). One object per manager, reused: a
    class costs less per call than a generator context manager. Not nested."""

    __slots__ = ("_manager",)

    def __init__(self, manager: SharedCPUOffloadingManager) -> None:
        self._manager = manager

    def __enter__(self) -> None:
        manager = self._manager
        lock = manager._lock
        lock.acquire()
        try:
            manager._lru.begin()
        except BaseException:
            lock.release()
            raise
        manager._in_hold = True

    def __exit__(self, *exc: object) -> None:
        manager = self._manager
        lock = manager._lock
        try:
            manager._in_hold = False
            if exc[0] is None or issubclass(exc[0], UsageError):  # bad input is refused
                manager._lru.end()  # before any change; any other error (an interrupt in
            # a sift) may leave the heap or free stack half changed: the dirty flag
            # stays, and the next holder rebuilds them
        finally:
            lock.release()
        record = lock.record
        if record is not None and len(record) > LOCK_RECORD_FOLD:
            manager._fold_lock_record()



class SharedCPUOffloadingManager(StepLookupCalls, TierStats, RequestRecency,
                                 OffloadingManager):
    """vLLM's CPU offloading manager (LRU) with its chunk metadata in a shmkv pool shared by
    every process that opens the same ``pool`` name: ONE cache for all of them.

    The first process creates the pool, later ones attach. A completed store of any process
    is a HIT for all; a store in flight in another process is HIT_PENDING and is not stored
    twice; a pin (``prepare_load``) of any process protects its chunk from every process's
    eviction; the pins and unfinished stores of a process that died are released by the
    survivors (the pool reaps it). ``lock`` is the pool lock, so a caller that holds it
    across a lookup and the ``prepare_load`` of its hits holds off every process.

    Private to a process: its requests' access records (in their ``ReqContext``), the keys it
    is storing and the pins it holds (for ``complete_store``/``complete_load``), its events.
    """

    def __init__(
        self,
        pool: str,
        num_chunks: int,
        *,
        enable_events: bool = False,
        cache_policy: str = "lru",
        store_threshold: int = 1,
        info: Any = None,
        max_processes: int = 16,
        event_log_bytes: int | None = None,
        label: str = "vllm-offload",
        lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S,
        stuck_after_s: float = DEFAULT_STUCK_AFTER_S,
        replica_id: str | None = None,
        implicit_step_region: bool = False,
        expect_workers: bool = False,
        dp_rank: int | None = None,
        engine_id: str | None = None,
    ) -> None:
        """Creates the pool ``pool`` of ``num_chunks`` chunks, or attaches to it.

        Args:
            pool: the shmkv pool's name (letters, digits, '.', '_', '-').
            num_chunks: chunks in the tier; every process must give the same number.
            enable_events: queue ``OffloadingEvent``s for :meth:`take_events`, as vLLM's.
            cache_policy: "lru" (the only policy the shared tier offers).
            store_threshold: 0 or 1 (vLLM's "store on first offer"); a reuse threshold
                needs a shared access tracker, which the tier does not have.
            info: the config facts :meth:`config_info` reports (vLLM 0.33's
                ``CPUOffloadingInfo``; None on 0.32, which has none).
            max_processes: processes attached at once (used by the creator only).
            event_log_bytes: size of the pool's global event log, which receives every
                store and eviction of the tier (creator only; default 4 MiB, 0: none).
            label: this process's name in the pool's process table.
            lock_timeout_s: the longest this process waits for the pool lock.
            stuck_after_s: how long the lock may stand taken with no holder recorded
                before this process takes it over (``BlockPool.create``).
            replica_id: the replica this manager belongs to (vLLM's engine id, which its
                GPU workers share: ``replicas.py``); None: a replica of its own.
            implicit_step_region: a step's first lookup opens the step region and
                :meth:`on_schedule_end` closes it, for a vLLM connector that holds no
                ``lock`` (0.32: ``compat.IMPLICIT_STEP_REGION``; the spec sets it). Any
                other caller either enters ``lock`` or gets per-call lookups.
            expect_workers: this replica's GPU workers joined the tier before it (vLLM
                builds them before its scheduler; the spec says so): while no worker of its
                row bound this tier's region, the replica gets no hit and stores nothing
                (its workers joined a removed tier of the same name). False: a manager
                without workers, trusted while no region is bound at all.
            dp_rank: the engine's data-parallel rank (vLLM's ``data_parallel_index``), for
                the row's label that ``shmkv inspect`` shows (``tier.py``); None: not said.
            engine_id: vLLM's ``kv_transfer_config.engine_id``, for the same label (cut,
                with a marker, past 112 UTF-8 bytes); None: not said.

        Raises:
            UsageError: a bad argument (a ``dp_rank`` that is not an int >= 0, an
                ``engine_id`` that is not a str), or an unsupported policy or threshold.
            LayoutMismatchError: the pool exists with another ``num_chunks`` (both values
                named), is not an offload tier, or its tier table is foreign or corrupt.
            SegmentError: the pool belongs to another user, or is not READY in time.
        """
        L.validate_pool_name(pool)
        if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or not (
            1 <= num_chunks < L.MAX_NUM_BLOCKS
        ):
            raise UsageError(
                f"num_chunks must be an int in [1, {L.MAX_NUM_BLOCKS - 1}], got {num_chunks!r}"
            )
        if cache_policy == "arc":
            raise UsageError(
                "cache_policy='arc' is not supported by the shared offload tier: ARC's ghost "
                "lists and adaptive target would need a second shared structure; use 'lru'"
            )
        if cache_policy != "lru":
            raise UsageError(f"unknown cache_policy {cache_policy!r}; the shared tier offers 'lru'")
        if isinstance(store_threshold, bool) or store_threshold not in (0, 1):
            raise UsageError(
                f"store_threshold {store_threshold!r} is not supported by the shared tier "
                "(it stores on the first offer: 0 or 1)"
            )
        if not isinstance(enable_events, bool):
            raise UsageError(f"enable_events must be a bool, got {enable_events!r}")
        self.medium: Medium = Medium.CPU
        self.pool_name = pool
        self._num_chunks = num_chunks
        self._config_info: ConfigInfoMapping = info.as_config_info() if info is not None else {}
        self.events: list[OffloadingEvent] | None = [] if enable_events else None
        self._allocation_sizes: list[int] = []
        self._pending: dict[OffloadKey, int] = {}  # keys this process is storing -> block
        self._pins: dict[OffloadKey, list[int]] = {}  # key -> [block, pins of this process]
        self._last_reap = 0.0
        self._encoded: dict[OffloadKey, tuple[bytes, int]] = {}
        self._as_int = use_int_block_hashes()
        if replica_id is not None and not (isinstance(replica_id, str) and replica_id):
            raise UsageError(f"replica_id must be a non-empty str, got {replica_id!r}")
        row_label = replica_label(dp_rank, engine_id)
        joined = join_as_core(
            pool, num_chunks, max_processes, event_log_bytes, replica_id or secrets.token_hex(16),
            {"label": label, "lock_timeout_s": lock_timeout_s, "stuck_after_s": stuck_after_s},
            row_label)
        self._pool, self._tier, self._locks, self._row = joined
        self._bit = 1 << self._row
        self._unflushed: set[int] = set()  # blocks of jobs a reset cut off, bit still set
        self._warned_region = False
        self._expect_workers = bool(expect_workers)
        tier = self._tier
        self._thdr, self._ranks = tier.words, tier.rank_words
        # memoryviews: a scalar read or write through one costs a fraction of numpy's, and
        # the calls touch 16 or so words each
        self._jobs, self._producer = tier.job_words, tier.producer_words
        self._counts = tier.counter_words  # the tier's counters (tier_counters.py)
        self._words = self._pool.block_words()  # the block rows' int32 words (read only)
        self._has_log = bool(self._pool.event_log.capacity)
        self._cross_hits = 0  # chunks this process loaded that another replica stored
        self._gauges = (-GAUGE_INTERVAL_S, 0.0, 0.0)  # when counted, usage, write usage
        self._lock_totals = [0, 0, 0]  # holds, wait ns, hold ns, since the last get_stats
        self._blocks = self._pool.blocks
        self._handle_cache: list = [None] * (num_chunks + 1)  # block id -> its handle
        self._lock = self._pool.lock()  # node-wide, per call
        if self._lock.record is None:  # time the pool lock for get_stats (unless in use)
            self._lock.record = []
        self._region = StepRegion(self)
        self._implicit_region = bool(implicit_step_region)
        self._lru = TierLRU(tier, self._pool.block_rows, self._words)
        self._in_hold = False  # inside _hold(): the LRU may change
        self._hold_cm = _Hold(self)
        self._lookup_pins: dict[OffloadKey, int] = {}  # this step's HITs -> their blocks
        self._step = StepLookups()  # this step region's lookup answers (step_lookup.py)

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Detaches from the pool: this process's pins and unfinished stores are given back
        (its unfinished stores become orphans, which every process treats as absent), and
        leaves its replica row; the row's job bits go with it once no process of the replica
        is left. Calls after it raise ``PoolClosedError``; closing again does nothing."""
        if self._pool is None:
            return
        try:
            with self._hold():
                pending = list(self._pending.values())
                if pending:  # their keys go now: an orphan nobody reaps would stay keyed
                    self._pool.evict_blocks(pending)
                    self._pool.free_blocks([self._blocks[b] for b in pending])
                    self._pending.clear()
                self._locks.leave(self._row)
                freed = pending
                if self._locks.is_gone(self._row):
                    freed = freed + release_row(self._tier, self._row)
                self._lru.push_free(freed)
        except ShmKVError:
            pass  # the row is released by the next process short of chunks
        self._locks.close()
        del self._thdr, self._ranks, self._jobs, self._producer, self._counts, self._lru
        del self._words
        self._tier.close()
        self._pool.close()
        self._pool = None  # type: ignore[assignment]
        self._lookup_pins.clear()  # the pool gave their holds back
        self._step.clear()
        self._lock = _ClosedLock()

    def __enter__(self) -> SharedCPUOffloadingManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def unlink(pool: str) -> bool:
        """Removes the tier whole, root first (``lifecycle.remove_tier``), as ``shmkv unlink
        --force`` does (mappings of processes still attached stay valid until they close).

        Returns:
            True if anything was removed.

        Raises:
            UsageError: a bad pool name.
        """
        return remove_tier(pool)

    @property
    def pool(self) -> BlockPool:
        """The shmkv pool holding the chunk metadata (for inspection and invariant checks)."""
        return self._pool

    @property
    def num_chunks(self) -> int:
        return self._num_chunks

    # ------------------------------------------------------------------ keys and state

    def _handles(self, block_ids: Iterable[int]) -> list:
        """The pool's handles of the blocks (one list index each once made)."""
        cache = self._handle_cache
        out = [cache[b] for b in block_ids]
        if None in out:
            blocks = self._blocks
            for i, handle in enumerate(out):
                if handle is None:
                    b = block_ids[i]
                    out[i] = cache[b] = blocks[b]
        return out

    def _status(self, key: OffloadKey) -> tuple[int, int]:
        """(state, block id) of a key; drops the key of an orphan (caller holds the lock)."""
        enc = self._encoded.get(key)
        block_hash, gid = enc if enc is not None else self._encode(key)
        pool = self._pool
        block_id = pool.lookup_block_id(block_hash, gid)
        if block_id >= 0:
            return READY, block_id
        block_id = pool.lookup_block_id(block_hash, gid | PENDING_BIT)
        if block_id < 0:
            return MISS, 0
        ref = block_id * L.ROW_I32 + L.F_REF
        if self._words[ref] == 0 or (self._maybe_reap() and self._words[ref] == 0):
            pool.evict_blocks([block_id])  # an orphan: its storer died
            if self._in_hold:
                self._lru.push_free([block_id])
            else:  # a lookup, which holds the pool lock alone
                self._lru.begin()
                self._lru.push_free([block_id])
                self._lru.end()
            return MISS, 0
        return PENDING, block_id

    def _statuses(self, keys: list[OffloadKey], encs: list[tuple[bytes, int]]
                  ) -> list[tuple[int, int]]:
        """``_status`` of each key (caller holds the lock), ``encs`` their pool forms: the
        pool looks every key up in one call; a PENDING one goes through ``_status``
        (orphans)."""
        found_ids = self._pool.lookup_block_ids([enc[0] for enc in encs],
                                                [enc[1] for enc in encs], PENDING_BIT)
        out = []
        for key, found in zip(keys, found_ids, strict=True):
            if found >= 0:
                out.append((READY, found))
            elif found == -1:
                out.append((MISS, 0))
            else:
                out.append(self._status(key))
        return out

    def _maybe_reap(self) -> bool:
        now = time.monotonic()
        if now - self._last_reap < REAP_INTERVAL_S:
            return False
        self._last_reap = now
        if self._pool.reap_dead() > 0:
            released = reap_gone(self._tier, self._locks)  # a replica may be gone with them
            if released:
                in_hold = self._in_hold
                if not in_hold:
                    self._lru.begin()
                self._lru.push_free(released)
                if not in_hold:
                    self._lru.end()
            return True
        return False

    def _collect_orphans(self) -> None:
        """Once some process was reaped since the last look, drops the keys of the stores
        the dead left unfinished and frees their chunks (one O(chunks) pass per reap)."""
        reaped = self._pool.num_reaped()
        if reaped == self._thdr[W_REAPED_SEEN]:
            return
        self._thdr[W_REAPED_SEEN] = reaped
        rows = self._pool.block_rows()
        orphans = np.flatnonzero((rows["ref_cnt"] == 0) & ((rows["group_id"] & PENDING_BIT) != 0)
                                 & (rows["hash_num_tokens"] != L.NO_HASH_TOKENS))
        del rows
        orphans = orphans[orphans > 0].tolist()
        if orphans:
            self._pool.evict_blocks(orphans)
            self._lru.push_free(orphans)

    # ------------------------------------------------------------------ OffloadingManager

    @property
    def lock(self) -> AbstractContextManager[Any]:
        """The step region (``step_lookup.StepRegion``): private to this process; the node-wide
        pool lock is taken per call, and a lookup HIT inside the region stays pinned until
        its ``prepare_load`` or the region's end."""
        return self._region

    def _hold(self) -> _Hold:
        """One hold of the node-wide pool lock, in which the tier's eviction heap and free
        stack may change (``lru.py``: rebuilt first if their last writer died)."""
        return self._hold_cm

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        """Starts the request's access record.

        Args:
            req_context: the new request's context.

        Returns:
            vLLM's default (chunk-level) ``RequestOffloadingContext``.

        Takes no lock: the record is private to this process and notes the tier's
        generation (one aligned word read), which every later call checks under the lock.
        """
        if self._pool is None:
            raise PoolClosedError("the offload tier manager is closed; make a new one to attach")
        self._request_access(req_context)
        return RequestOffloadingContext()

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        """Hits of this tier come from host memory."""
        return CacheHitSource.HOST

    def prepare_load(self, keys: Collection[OffloadKey],
                     req_context: ReqContext) -> LoadStoreSpec:
        """Pins the given ready chunks against every process's eviction until
        :meth:`complete_load`.

        Args:
            keys: offload keys (a block hash of up to 32 bytes + a 4-byte group index).
            req_context: the request's context (its access record and key positions).

        Returns:
            a ``CPULoadStoreSpec`` of their chunk ids.

        Raises:
            UsageError: a key that is not stored, or still being stored, or a bad key or
                position; nothing is pinned.
            SegmentError: this replica's workers map another data region than the tier's
                (``region.py``); nothing is pinned.
        """
        keys = list(keys)
        encs, positions = self._check_positions(keys, req_context)
        with self._hold():
            if self._region_lost():
                raise SegmentError(
                    f"offload tier {self.pool_name!r}: the data region was replaced while "
                    "this replica's workers mapped the old one (or they never bound this "
                    "tier's), so no chunk of it may be loaded here; restart this replica"
                )
            block_ids = []
            known: dict[OffloadKey, tuple[int, int]] = {}
            statuses = self._statuses(keys, encs)
            for i, (key, status) in enumerate(zip(keys, statuses, strict=True)):
                state, block_id = known[key] = status
                if state != READY:
                    raise UsageError(
                        f"prepare_load(): key {i} of {len(keys)} ({key.hex()}) is "
                        f"{'still being stored' if state == PENDING else 'not stored'}"
                    )
                block_ids.append(block_id)
            lookup_pins = self._lookup_pins
            jobs, bit = self._jobs, self._bit
            for block_id in block_ids:  # before the hold: a kill between leaves a bit,
                jobs[block_id] |= bit  # never a bare hold
            to_hold, stale = [], []  # a lookup's hold of the same block becomes the pin
            for key, block_id in zip(keys, block_ids, strict=True):
                held = lookup_pins.pop(key, None)
                if held != block_id:
                    to_hold.append(block_id)
                    if held is not None:  # the key moved blocks since its lookup
                        stale.append(held)
            if to_hold:
                self._pool.touch(self._handles(to_hold))
            if stale:
                self._pool.free_blocks(self._handles(stale))
                self._lru.push_free(self._unkeyed_and_unheld(stale))
            producer, me = self._producer, self._row + 1
            cross = sum(producer[b] != me for b in block_ids)
            self._cross_hits += cross
            TC.add(self._counts, me, TC.C_LOADED, len(block_ids))
            TC.add(self._counts, me, TC.C_CROSS, cross)
            pins = self._pins
            for key, block_id in zip(keys, block_ids, strict=True):
                pin = pins.get(key)
                if pin is None:
                    pins[key] = [block_id, 1]
                else:
                    pin[1] += 1
            access = self._request_access(req_context)
            new_keys = self._new_access_keys(access, keys)
            self._on_request_access(new_keys, req_context, known, positions)
        self._commit_access(access, new_keys, reused_keys=keys)
        return CPULoadStoreSpec([b - 1 for b in block_ids])

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Drops this process's pins of the given keys (one per occurrence).

        Args:
            keys: offload keys (a block hash of up to 32 bytes + a 4-byte group index).
            req_context: the request's context (its access record and key positions).

        Raises:
            UsageError: a key this process has not pinned (that often); nothing changes.
        """
        keys = list(keys)
        with self._hold():
            need: dict[OffloadKey, int] = {}
            for key in keys:
                need[key] = need.get(key, 0) + 1
            for key, count in need.items():
                pin = self._pins.get(key)
                if pin is None or pin[1] < count:
                    raise UsageError(
                        f"complete_load(): key {key.hex()} is unpinned {count} times, this "
                        f"process pinned it {0 if pin is None else pin[1]} times"
                    )
            pins = self._pins
            self._pool.free_blocks(self._handles([pins[key][0] for key in keys]))
            done = []
            for key, count in need.items():
                pin = self._pins[key]
                pin[1] -= count
                if not pin[1]:
                    del self._pins[key]
                    done.append(pin[0])
            self._end_jobs(done)
            self._lru.push_free(self._unkeyed_and_unheld(done))
        self._step.forget(need)  # unpinned: a kept HIT answer may no longer hold

    def _unkeyed_and_unheld(self, block_ids: list[int]) -> list[int]:
        """Those of ``block_ids`` with no key, no hold and no job (caller holds the lock,
        after giving its holds back): a region replacement dropped their keys while they
        were held (``region._forget_chunks``), and nothing else puts them back among the
        free chunks (``pop_free`` checks each again)."""
        words, row, jobs = self._words, L.ROW_I32, self._jobs
        f_ref, f_htok, no_key = L.F_REF, L.F_HASH_TOKENS, L.NO_HASH_TOKENS
        return [b for b in block_ids if words[b * row + f_ref] == 0
                and words[b * row + f_htok] == no_key and jobs[b] == 0]

    def _end_jobs(self, block_ids: list[int]) -> None:
        """Clears this replica's job bit on blocks whose job it has reported done, except
        those a reset cut a job off (``on_reset_flushed`` clears them)."""
        if self._unflushed:
            block_ids = [b for b in block_ids if b not in self._unflushed]
        jobs, keep = self._jobs, ~self._bit
        for block_id in block_ids:
            jobs[block_id] &= keep

    def _region_lost(self) -> bool:
        """Whether this replica's workers map another data region than the one the tier
        describes (it was replaced under them: ``region.py``), or none of them bound the
        tier's region (they joined a removed tier of the same name: vLLM builds a replica's
        workers before its scheduler); their bytes are not the tier's, so this replica gets
        no hit and stores nothing. A replica with no worker is trusted only while no
        region is bound at all (nothing holds bytes)."""
        mine = self._thdr[W_REPLICA_REGION + self._row]  # tier.replica_region[row]
        if mine == self._thdr[W_REGION_TAG] and (mine or not self._expect_workers):
            return False  # bound to the tier's region; or no region yet, and no worker due
        if not self._warned_region:
            self._warned_region = True
            logger.error(
                "shmkv offload tier %r: %s; this replica gets no hits and stores nothing "
                "from the tier until it is restarted", self.pool_name,
                "the data region was replaced while this replica's workers had the old one "
                "mapped" if mine else "no worker of this replica bound the tier's data "
                "region (its workers joined a tier of the same name, removed since)")
        return True

    def prepare_store(self, keys: Collection[OffloadKey],
                      req_context: ReqContext) -> PrepareStoreOutput | None:
        """Allocates chunks for the keys no process has stored or is storing, evicting the
        least recently used ready chunks nobody holds if needed (never one of ``keys``).

        Args:
            keys: offload keys (a block hash of up to 32 bytes + a 4-byte group index).
            req_context: the request's context (its access record and key positions).

        Returns:
            the keys to store, their chunks and the keys evicted; None if not enough chunks
            can be freed, or this replica's workers map another data region than the
            tier's (nothing changes then).

        Raises:
            UsageError: a key the tier cannot hold, or a key position out of range;
                nothing changes.
        """
        keys = list(keys)
        encs, positions = self._check_positions(keys, req_context)
        with self._hold():
            if self._region_lost():
                return None
            keys_to_store: list[OffloadKey] = []
            ready_existing: list[OffloadKey] = []
            queued: set[OffloadKey] = set()
            known: dict[OffloadKey, tuple[int, int]] = {}
            for key, status in zip(keys, self._statuses(keys, encs), strict=True):
                state, _ = known[key] = status
                if state == MISS:
                    if key not in queued:
                        keys_to_store.append(key)
                        queued.add(key)
                elif state == READY:
                    ready_existing.append(key)
            access = self._request_access(req_context)
            recorded = queued.union(ready_existing)
            new_keys = self._new_access_keys(access, [k for k in keys if k in recorded])
            self._on_request_access(new_keys, req_context, known, positions)
            out = self._take_for(keys_to_store, ready_existing, known, positions, req_context)
        access.store_miss_keys.update(keys_to_store)  # an LRU store miss moves no rank
        self._commit_access(access, new_keys, reused_keys=ready_existing)
        if out is None:
            return None
        block_ids, evicted_keys = out
        access.inserted_keys.update(keys_to_store)
        if evicted_keys and self.events is not None:
            self.events.append(OffloadingEvent(keys=evicted_keys, medium=self.medium,
                                               removed=True))
        return PrepareStoreOutput(keys_to_store=keys_to_store,
                                  store_spec=CPULoadStoreSpec([b - 1 for b in block_ids]),
                                  evicted_keys=evicted_keys)

    def _take_for(self, keys_to_store: list[OffloadKey], ready_existing: list[OffloadKey],
                  known: dict[OffloadKey, tuple[int, int]], positions: dict[OffloadKey, int],
                  req_context: ReqContext) -> tuple[list[int], list[OffloadKey]] | None:
        """``prepare_store``'s chunks (caller holds the lock): (block ids in the keys'
        order, evicted keys), or None if too few chunks can be freed (nothing taken)."""
        if not keys_to_store:
            return [], []
        self._allocation_sizes.append(len(keys_to_store))
        chosen = self._choose_chunks(len(keys_to_store), [known[k][1] for k in ready_existing])
        if chosen is None:
            return None
        fresh, victims = chosen
        evicted_keys = [key for key, _ in victims]
        block_ids = fresh + [b for _, b in victims]
        self._take_chunks(block_ids, keys_to_store, len(fresh))
        ranks, pending, request_rank = self._ranks, self._pending, None
        for key, block_id in zip(keys_to_store, block_ids, strict=True):
            position = positions.get(key)
            if position is None:
                ranks[block_id] = self._new_rank()
            else:
                if request_rank is None:
                    request_rank = self._request_rank(req_context)
                ranks[block_id] = pack_rank(request_rank, -position)
            pending[key] = block_id
        self._step.forget(keys_to_store)  # a kept MISS is in flight now
        if evicted_keys:
            self._log_removed(evicted_keys)
        return block_ids, evicted_keys

    def _choose_chunks(self, num: int, protected_ids: list[int]
                       ) -> tuple[list[int], list[tuple[OffloadKey, int]]] | None:
        """(free blocks, (key, block) victims) for ``num`` new chunks, or None, in
        O(num x log chunks) (``lru.py``). ``protected_ids``: the blocks of the call's own
        ready keys, never evicted."""
        protected = set(protected_ids)
        for attempt in (0, 1):
            self._collect_orphans()
            chosen = self._choose_once(num, protected)
            if chosen is not None:
                return chosen
            if attempt == 0:
                reaped = self._pool.reap_dead()
                released = reap_gone(self._tier, self._locks)
                self._lru.push_free(released)
                if reaped or released:
                    continue  # a dead replica's pins and jobs may be what is missing
        return None

    def _choose_once(self, num: int, protected: set[int]
                     ) -> tuple[list[int], list[tuple[OffloadKey, int]]] | None:
        lru, jobs, bit, own = self._lru, self._jobs, self._bit, self._unflushed
        words, row, f_ref, f_htok = self._words, L.ROW_I32, L.F_REF, L.F_HASH_TOKENS
        no_key = L.NO_HASH_TOKENS

        def is_free(b: int) -> bool:  # no key, no hold, no bytes moving; this replica's
            at = b * row  # workers flush its own reset's jobs in order, as vLLM's single
            return (words[at + f_ref] == 0 and words[at + f_htok] == no_key  # tier relies on
                    and (jobs[b] == 0 or (jobs[b] == bit and b in own)))

        keys: dict[int, bytes] = {}

        hash_at, f_gid = L.HASH_BYTE_OFFSET // 4, L.F_GROUP

        def key_of(b: int) -> bytes:
            key = keys.get(b)
            if key is None:
                at = b * row
                keys[b] = key = self._decode(words[at + hash_at:at + hash_at + 8].tobytes(),
                                             words[at + f_gid])
            return key

        free = lru.pop_free(num, is_free)
        victims: list[int] | None = []
        if len(free) < num:
            victims = lru.pop_victims(num - len(free), protected, key_of)
        if victims is None:
            lru.push_free(free[::-1])  # back, lowest on top again
            return None
        return free, [(key_of(b), b) for b in victims]

    def _take_chunks(self, block_ids: list[int], keys: list[OffloadKey],
                     num_fresh: int) -> None:
        """Holds the blocks (this process's ledger), drops their old keys and caches them
        under the new keys' PENDING form (caller holds the lock). The first ``num_fresh``
        blocks are free ones, which hold no key."""
        pool = self._pool
        handles = self._handles(block_ids)
        jobs, bit = self._jobs, self._bit
        for block_id in block_ids:  # before the hold (see prepare_load)
            jobs[block_id] |= bit
        if self._unflushed:
            self._unflushed.difference_update(block_ids)
        pool.touch(handles)
        if num_fresh < len(block_ids):
            pool.evict_blocks(block_ids[num_fresh:])
        self._cache(handles, keys, PENDING_BIT)

    def _cache(self, handles: list, keys: list[OffloadKey], flag: int) -> None:
        """Caches the blocks under the keys' pool form, ``flag`` or-ed into the group id:
        one ``cache_full_blocks`` per group (a call's keys are usually of one group)."""
        encoded, encode = self._encoded, self._encode
        encs = [encoded.get(key) or encode(key) for key in keys]
        gid = encs[0][1] if encs else 0
        if all(enc[1] == gid for enc in encs):
            by_group = {gid | flag: (handles, [enc[0] for enc in encs])}
        else:
            by_group = {}
            for handle, (block_hash, key_gid) in zip(handles, encs, strict=True):
                entry = by_group.setdefault(key_gid | flag, ([], []))
                entry[0].append(handle)
                entry[1].append(block_hash)
        for group, (group_handles, hashes) in by_group.items():
            self._pool.cache_full_blocks(_Hashes(hashes), group_handles, 0, len(hashes), 1,
                                         group)

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext,
                       success: bool = True) -> None:
        """Finishes this process's stores of the given keys: on success they become HITs
        for every process (and evictable); on failure their chunks are freed. Keys this
        process is not storing are skipped. A store into another data region than the
        tier's (replaced under this replica's workers) completes as failed.

        Args:
            keys: offload keys (a block hash of up to 32 bytes + a 4-byte group index).
            req_context: the request's context (its access record and key positions).
            success: whether the workers wrote the chunks.
        """
        with self._hold():
            mine: list[tuple[OffloadKey, int]] = []
            for key in keys:
                block_id = self._pending.pop(key, None)
                if block_id is not None:
                    mine.append((key, block_id))
            if not mine:
                return
            self._step.forget(key for key, _ in mine)
            done_keys = [key for key, _ in mine]
            block_ids = [b for _, b in mine]
            handles = self._handles(block_ids)
            pool = self._pool
            success = success and not self._region_lost()  # written to another region
            pool.evict_blocks(block_ids)
            if success:
                self._cache(handles, done_keys, 0)
            pool.free_blocks(handles)
            self._end_jobs(block_ids)
            if success:
                self._lru.push_many(self._ranks, block_ids)
                producer, me = self._producer, self._row + 1
                for block_id in block_ids:
                    producer[block_id] = me
                TC.add(self._counts, me, TC.C_STORED, len(block_ids))
            else:
                self._lru.push_free(block_ids)
            if success:
                if self.events is not None:
                    # vLLM 0.34 marks a store as evictable later and names its request.
                    extra = ({"removal_expected": True, "req_context": req_context}
                             if EVENT_REQ_CONTEXT else {})
                    self.events.append(OffloadingEvent(keys=done_keys, medium=self.medium,
                                                       removed=False, **extra))
                self._log_stored(done_keys)
            elif self.events is not None and EVENT_METADATA_ONLY:
                self.events.append(OffloadingEvent(keys=done_keys, medium=self.medium,
                                                   removed=True, metadata_only=True))

    def reset_cache(self) -> None:
        """Drops this process's pins and unfinished stores and every chunk no other
        process holds (their removal goes to the global event log); every process's request
        records start over. As vLLM's, it queues no ``take_events`` event.

        The chunks of the stores and loads it cuts off stay out of every replica's hands
        (their job bits) until :meth:`on_reset_flushed`: this replica's workers may still be
        moving their bytes."""
        with self._hold():
            pool, blocks = self._pool, self._blocks
            pending_ids = list(self._pending.values())
            held = [blocks[b] for b in pending_ids]
            for block_id, count in self._pins.values():
                held.extend([blocks[block_id]] * count)
            held.extend(blocks[b] for b in self._lookup_pins.values())
            self._lookup_pins.clear()
            self._step.clear()
            self._unflushed.update(pending_ids)
            self._unflushed.update(block_id for block_id, _ in self._pins.values())
            if pending_ids:
                pool.evict_blocks(pending_ids)
            if held:
                pool.free_blocks(held)
            self._pending.clear()
            self._pins.clear()
            rows = pool.block_rows()
            idle = np.flatnonzero((rows["ref_cnt"] == 0)
                                  & (rows["hash_num_tokens"] != L.NO_HASH_TOKENS))
            idle = idle[idle > 0].tolist()
            removed = [self._decode(bytes(rows["block_hash"][b]), int(rows["group_id"][b]))
                       for b in idle if not int(rows["group_id"][b]) & PENDING_BIT]
            del rows
            if idle:
                pool.evict_blocks(idle)
            self._lru.push_free(sorted(set(idle).union(pending_ids), reverse=True))
            self._thdr[W_GENERATION] = self._thdr[W_GENERATION] + 1
            if removed:
                self._log_removed(removed)

    def on_reset_flushed(self) -> None:
        """vLLM's workers have reported every job in flight at the last reset: the chunks
        those jobs used go back to every replica."""
        with self._hold():
            busy = set(self._pending.values())
            busy.update(block_id for block_id, _ in self._pins.values())
            flushed, self._unflushed = [b for b in self._unflushed if b not in busy], set()
            self._end_jobs(flushed)
            self._lru.push_free(flushed)

    def on_schedule_end(self, context: Any) -> None:
        """The end of a scheduler step: on a vLLM whose connector holds no ``lock`` (0.32),
        closes the step region its first lookup opened (``step_lookup.py``)."""
        self._region.close_implicit()

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Yields the events queued since the last call (stores completed, evictions, and
        the metadata-only removals of failed stores whose key is still absent)."""
        if self.events is None:
            return
        events, self.events = self.events, []
        for event in events:
            if getattr(event, "metadata_only", False):
                with self._hold():
                    keys = [k for k in event.keys if self._status(k)[0] == MISS]
                if not keys:
                    continue
                event = replace(event, keys=keys)
            yield event

    def config_info(self) -> Sequence[ConfigInfoMapping]:
        """The CPU-tier facts given as ``info`` (one series)."""
        return [self._config_info]

    def shutdown(self) -> None:
        """Detaches from the pool (see :meth:`close`)."""
        self.close()

    # ------------------------------------------------------------------ global event log

    def _split(self, keys: list[OffloadKey]) -> dict[int, list]:
        by_group: dict[int, list] = {}
        for key in keys:
            by_group.setdefault(get_offload_group_idx(key), []).append(
                external_block_hash(bytes(key[:-4]), self._as_int))
        return by_group

    def _log_stored(self, keys: list[OffloadKey]) -> None:
        if not self._has_log:  # a pool made without a global event log drops them
            return
        self._pool.log_events([
            BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[],
                        block_size=0, lora_id=None, medium=MEDIUM, lora_name=None,
                        group_idx=group)
            for group, hashes in self._split(keys).items()
        ])

    def _log_removed(self, keys: list[OffloadKey]) -> None:
        if not self._has_log:
            return
        self._pool.log_events([
            BlockRemoved(block_hashes=[h], medium=MEDIUM, group_idx=group)
            for group, hashes in self._split(keys).items() for h in hashes
        ])

    # ------------------------------------------------------------------ replica identity

    def check_identity(self, identity: dict[str, Any]) -> None:
        """Records the first replica's identity in the tier table, or checks that this
        one's equals it (``shmkv/vllm/identity.py``).

        Raises:
            LayoutMismatchError: fields differ (each named, with both values, and the way
                to start afresh), or the identity does not fit the table.
        """
        with self._hold():
            check_identity(self._tier, self.pool_name, identity)
