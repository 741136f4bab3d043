"""BlockPool: vLLM's ``vllm.v1.core.block_pool.BlockPool`` with its block metadata in POSIX
shared memory.

Used by one process, it gives the same answers as vLLM 0.33.0's BlockPool call for call: the
same block ids, the same hits, the same free-queue order, the same usage and the same events.
What differs is where the state lives: every block's ``ref_cnt``, free-queue links and prefix
hash sit in the segment described in ``shmkv/pool/layout.py``, so another process that attaches
sees the same pool. ``KVCacheBlock`` objects here are thin handles (pool, block id) whose
properties read the live shared state.

Semantics worth knowing (vLLM's, kept exactly):

- block 0 is the null block: never allocated, freed, queued or hashed; it pads skipped
  positions in block tables, and its ``ref_cnt`` is not maintained;
- ``get_new_blocks`` pops from the head of the free queue and evicts each popped block's
  hash (a ``BlockRemoved`` event per key);
- ``free_blocks`` takes blocks in eviction order; of those reaching ``ref_cnt == 0``, the ones
  without a hash go to the front of the queue (reused first) and the hashed ones to the back
  (kept longest, least recently freed first);
- ``touch`` takes a prefix-cache hit that sits in the free queue (``ref_cnt == 0``) out of it;
- ``reset_prefix_cache`` only succeeds when nothing but the null block is in use.

Unlike vLLM, a call given bad input (freeing a free block, an id out of range, a hash of the
wrong width...) raises ``UsageError`` before it changes anything.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import operator
import os
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shmkv.errors import (
    FencedError,
    ForkedPoolError,
    InvariantViolation,
    LockTimeoutError,
    OutOfBlocksError,
    PoolClosedError,
    PoolFullError,
    SegmentError,
    SegmentExistsError,
    UsageError,
)
from shmkv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    external_block_hash,
    use_int_block_hashes,
)
from shmkv.hashing import (
    RequestBlockHasher,
    generate_block_hash_extra_keys,
    generate_lookahead_block_hash_extra_keys,
    get_hash_fn_by_name,
    none_hash,
    to_event_extra_keys,
)
from shmkv.pool import fault as _fault
from shmkv.pool import layout as L
from shmkv.pool._pykernel import PyKernel
from shmkv.pool.barriers import fence
from shmkv.pool.event_log import EventCursor, EventLog, LoggedEvent
from shmkv.pool.free_queue import FreeKVCacheBlockQueue
from shmkv.pool.journal import Journal, JournaledColumn, JournaledView, undo
from shmkv.pool.liveness import NUM_MARKS, AliveLocks, alive_path
from shmkv.pool.lock import (
    DEFAULT_LOCK_TIMEOUT_S,
    SPIN_S,
    WAIT_SLICE_S,
    PoolLock,
    check_semaphore,
    create_semaphore,
    decode_holder,
    holder_word,
    lock_name,
    timeout_message,
)
from shmkv.pool.prefix_index import BlockHashToBlockMap
from shmkv.pool.process_table import ProcessTable
from shmkv.pool.recorder import RECORD_ENV, record_path, recording_class
from shmkv.pool.recovery import SegmentViews, check_invariants, rebuild
from shmkv.pool.repair import Repairer, RepairReport
from shmkv.pool.segment import Segment, read_config, write_header
from shmkv.pool.siblings import unlink_pool, unlink_pool_files, unlink_tiers
from shmkv.pool.takeover import DEFAULT_STUCK_AFTER_S, TakeOver

logger = logging.getLogger(__name__)

try:
    from shmkv.pool import _ckernel
except ImportError:  # not built (no compiler at install time): the Python kernel serves
    _ckernel = None
else:
    _ckernel.set_errors(UsageError, OutOfBlocksError, InvariantViolation, LockTimeoutError,
                        FencedError)

KERNEL_ENV = "SHMKV_KERNEL"
KERNELS = ("c", "python")


def default_kernel() -> str:
    """The kernel a pool uses unless told otherwise: ``$SHMKV_KERNEL``, else C if built."""
    return os.environ.get(KERNEL_ENV) or ("c" if _ckernel is not None else "python")

_R = L.ROW_I32
_REF = L.F_REF
_HTOK = L.F_HASH_TOKENS
_NULL = L.NULL_BLOCK_ID
_HASH_BYTES = L.BLOCK_HASH_BYTES
_NO_BLOCK = L.NO_BLOCK
_NO_HASH_TOKENS = L.NO_HASH_TOKENS
_H_NUM_FREE = L.H_NUM_FREE


def _opener(cls: type, record: str | None, name: str) -> Callable[..., BlockPool]:
    """``cls``, or its recording subclass bound to the history file (``recorder.py``)
    when ``record`` or ``$SHMKV_RECORD_DIR`` asks for one."""
    if record is None and not os.environ.get(RECORD_ENV):
        return cls
    path = record_path(record, name)
    return functools.partial(recording_class(cls), record=path, fresh=record is None)


class _Closed:
    """Stands in for the shared-memory views once the pool is closed."""

    def __getitem__(self, _):
        raise PoolClosedError("the pool is closed; attach again to use it")

    __setitem__ = __getitem__

    def __getattr__(self, _):
        raise PoolClosedError("the pool is closed; attach again to use it")

    def __enter__(self):
        raise PoolClosedError("the pool is closed; attach again to use it")

    def __exit__(self, *exc):
        return None


_CLOSED = _Closed()

# The layout constants the C kernel is compiled with; it refuses to run if they differ.
_C_GEOMETRY = (
    L.ROW_I32, L.ROW_I64, L.F_REF, L.F_PREV, L.F_NEXT, L.F_INDEX_NEXT, L.F_GROUP,
    L.F_HASH_TOKENS, L.F_QUEUE_KEY, L.HASH_BYTE_OFFSET, L.BLOCK_HASH_BYTES, L.H_NUM_FREE,
    L.H_QUEUE_HEAD_KEY, L.H_QUEUE_TAIL_KEY, L.H_JOURNAL_LEN, L.H_LOCK_SEQ, L.GROUP_MIX,
)


class KVCacheBlock:
    """A handle on one block of a shared pool; every property reads the live shared state.

    Handles are created once per pool object and compared by identity, like vLLM's blocks.
    """

    __slots__ = ("_pool", "block_id")

    def __init__(self, pool: BlockPool, block_id: int) -> None:
        self._pool = pool
        self.block_id = block_id

    @property
    def ref_cnt(self) -> int:
        return self._pool._i32[self.block_id * _R + _REF]

    @property
    def block_hash(self) -> bytes | None:
        """The prefix-cache key: 32 hash bytes + the group id as 4 big-endian bytes (vLLM's
        ``BlockHashWithGroupId``), or None."""
        key = self._pool._index.block_key(self.block_id)
        if key is None:
            return None
        return key[0] + key[1].to_bytes(4, "big")

    @property
    def block_hash_num_tokens(self) -> int | None:
        n = self._pool._i32[self.block_id * _R + _HTOK]
        return None if n == _NO_HASH_TOKENS else n

    @property
    def is_null(self) -> bool:
        return self.block_id == _NULL

    @property
    def prev_free_block(self):
        """The block before this one on the free queue (a handle, or the queue's head end),
        or None if this block is not on it: vLLM's field, read from the shared links."""
        queue = self._pool.free_block_queue
        return queue.linked(queue.prev_raw[self.block_id])

    @property
    def next_free_block(self):
        """The block after this one on the free queue (a handle, or the queue's tail end),
        or None if this block is not on it: vLLM's field, read from the shared links."""
        queue = self._pool.free_block_queue
        return queue.linked(queue.next_raw[self.block_id])

    def __repr__(self) -> str:
        try:
            return (
                f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, "
                f"block_hash_num_tokens={self.block_hash_num_tokens})"
            )
        except PoolClosedError:
            return f"KVCacheBlock(block_id={self.block_id}, <pool closed>)"


class BlockHandles(Sequence):
    """``pool.blocks``: every block's handle, by block id, made on first access."""

    def __init__(self, pool: BlockPool) -> None:
        self._pool = pool

    def __len__(self) -> int:
        return self._pool.num_gpu_blocks

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self._pool._handle(i) for i in range(*index.indices(len(self)))]
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"block id {index} out of range [0, {n})")
        return self._pool._handle(index % n)


# A snapshot of the cached keys copies at most this many block rows per hold of the lock
# (about 0.3 ms of numpy work per hold for 32,768 rows), and makes this many chunked copies
# before it copies all in one hold (BlockPool.cached_key_snapshot).
SNAPSHOT_CHUNK_BLOCKS = 32_768
SNAPSHOT_ATTEMPTS = 3


def _published(rows: np.ndarray) -> np.ndarray:
    """The rows whose key a subscriber may see: cached, and not a store still in flight."""
    return ((rows["hash_num_tokens"] != L.NO_HASH_TOKENS)
            & ((rows["group_id"] & L.PENDING_GROUP_BIT) == 0))


@dataclass(frozen=True)
class KeySnapshot:
    """``BlockPool.cached_key_snapshot``'s answer: the group ids and hashes of every cached
    block in block-id order, as they stood right before event ``next_seq``; ``attempts``:
    copies made (``SNAPSHOT_ATTEMPTS + 1``: the last was one hold of the whole pool);
    ``holds``: holds of the lock taken."""

    next_seq: int
    group_ids: np.ndarray
    hashes: np.ndarray
    attempts: int
    holds: int


# Every open pool handle of this process, for the at-fork handler below.
_OPEN_POOLS: weakref.WeakSet = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """os.fork() in a process with open pools: in the child, each handle drops its
    inherited liveness descriptor (without unlocking: the lock is the parent's, and must go
    when the parent dies) and refuses every further use with ForkedPoolError."""
    for pool in list(_OPEN_POOLS):
        pool._forked_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _block_count(caller: str, value: object) -> int:
    """``value`` as a number of blocks (an int; a bool is not one), or a UsageError naming
    ``caller``."""
    if isinstance(value, bool):
        raise UsageError(f"{caller}(): num_blocks must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise UsageError(f"{caller}(): num_blocks must be an int, got {value!r}") from None


class BlockPool:
    """A KV-cache block pool whose metadata lives in one POSIX shared-memory segment, shared
    by every process that attaches to it.

    Build one with :meth:`create` (a new segment) or :meth:`attach` (an existing one); both
    are usable as context managers. The creator's ``with`` block unlinks the segment on exit.

    Every public method is atomic with respect to other processes (the pool lock), and
    ``with pool.lock():`` makes a sequence of calls atomic. Each process holds a slot in the
    segment's process table and a row of the reference ledger: a block's ``ref_cnt`` is the
    sum of the references live processes hold, so ``close()`` or, for a process that died,
    ``reap_dead()`` in any survivor gives back exactly what that process held.
    """

    def __init__(self, segment: Segment, layout: L.Layout, *, owner: bool,
                 kernel: str | None = None, label: str = "",
                 lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S,
                 stuck_after_s: float = DEFAULT_STUCK_AFTER_S,
                 _lock_enabled: bool = True) -> None:
        self.kernel = kernel or default_kernel()
        if self.kernel not in KERNELS:
            raise UsageError(f"kernel must be one of {KERNELS}, got {self.kernel!r}")
        if self.kernel == "c" and _ckernel is None:
            raise UsageError("the C kernel (shmkv.pool._ckernel) is not built; use kernel='python'")
        label_bytes = label.encode() if isinstance(label, str) else None
        if label_bytes is None or len(label_bytes) > L.MAX_LABEL_BYTES:
            raise UsageError(
                f"label must be a str of at most {L.MAX_LABEL_BYTES} bytes, got {label!r}"
            )
        for what, value in (("lock_timeout_s", lock_timeout_s), ("stuck_after_s", stuck_after_s)):
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not value > 0):
                raise UsageError(f"{what} must be a positive number, got {value!r}")
        self._segment = segment
        self._layout = layout
        self._owner = owner
        cfg = layout.config
        self.num_gpu_blocks = cfg.num_blocks
        self.enable_caching = cfg.enable_caching
        self.hash_block_size = cfg.hash_block_size
        self.enable_kv_cache_events = cfg.enable_kv_cache_events
        self.medium = cfg.medium
        self.max_processes = cfg.max_processes
        self.hash_fn_name = cfg.hash_fn_name
        self.num_hash_lookahead_tokens = cfg.num_hash_lookahead_tokens
        self.pool_name = segment.shm_name.split("-", 1)[1].rsplit("-v", 1)[0]
        self.pid = os.getpid()
        self._forked_from = 0  # in a forked child: the pid that opened this handle
        _OPEN_POOLS.add(self)

        buf = segment.buf
        mem = memoryview(buf)
        meta_off = layout.offsets["block_meta"]
        meta_bytes = L.BLOCK_DTYPE.itemsize * (cfg.num_blocks + 2)
        idx_off = layout.offsets["index_buckets"]
        idx_bytes = 4 * cfg.num_index_buckets
        proc_off = layout.offsets["proc_table"]
        proc_bytes = L.PROC_DTYPE.itemsize * cfg.max_processes
        key_bytes = L.BLOCK_DTYPE.itemsize * layout.num_key_rows  # block_meta + block_alias
        self._views = [
            mem,
            mem[0:L.HEADER_DTYPE.itemsize].cast("q"),
            mem[meta_off:meta_off + meta_bytes].cast("i"),
            mem[meta_off:meta_off + meta_bytes].cast("q"),
            mem[idx_off:idx_off + idx_bytes].cast("i"),
            mem[proc_off:proc_off + proc_bytes].cast("Q"),
            mem[meta_off:meta_off + key_bytes].cast("i"),
        ]
        _, self._hdr64, self._i32, self._i64, buckets, self._proc64, key_i32 = self._views
        self._header = layout.view(buf, "header")
        self._blocks = layout.view(buf, "block_meta")
        self._ref_col = self._blocks["ref_cnt"]
        self._htok_col = self._blocks["hash_num_tokens"]
        self._procs = layout.view(buf, "proc_table")
        self._ledger = layout.view(buf, "ledger")
        self._journal = Journal(buf, layout, self._hdr64)
        self._hdr_w = JournaledView(self._hdr64, self._journal, 0, 8)
        self._ref_col_w = JournaledColumn(self._ref_col, self._journal, meta_off)
        self.free_block_queue = FreeKVCacheBlockQueue(
            self._i32, self._i64, self._hdr64, self._blocks, layout, self._journal
        )
        self.free_block_queue.block_handle = self._handle
        self._key_rows = layout.key_rows(buf)
        self._index = BlockHashToBlockMap(
            buf, key_i32, buckets, self._key_rows, layout.view(buf, "index_buckets"), layout,
            self._journal,
        )
        self._log = EventLog(buf, self._hdr64, layout, self._journal)
        self._segment_views = SegmentViews(
            buf=buf, layout=layout, hdr64=self._hdr64, blocks=self._blocks,
            key_rows=self._key_rows, index=self._index, procs=self._procs,
            ledger=self._ledger, log=self._log,
        )
        self._warned_no_aliases = False
        # Handles are made on first use: a million up front would cost a second per attach.
        self._handles: list[KVCacheBlock | None] = [None] * cfg.num_blocks
        self.blocks = BlockHandles(self)
        self.null_block = self._handle(_NULL)
        self._event_queue: list[KVCacheEvent] = []
        # unpin_blocks' callbacks, block id -> on_reuse: private to this process (a callback
        # cannot live in shared memory), fired when this process reuses the block or when
        # poll_reuse finds another process took it.
        self._reuse_watchers: dict[int, Callable[[KVCacheBlock], None]] = {}
        # Watched block id -> (queue_key, epoch) when this process's release put it in the
        # free queue, None while a reference is held (invariant "watch-stamp": poll_reuse).
        self._watch_stamps: dict[int, tuple[int, int] | None] = {}
        self._tiers: dict[str, BlockPool] = {}  # tier(): this handle's tiers, by name
        self._kernel = _CLOSED  # type: ignore[assignment]
        self.slot = -1
        self._alive = self._takeover = self._lock = None  # type: ignore[assignment]
        try:  # every descriptor and mapping of a failed attach is given back
            self._alive = AliveLocks(alive_path(segment.shm_name), create=False,
                                     procs=self._procs)
            check_semaphore(segment.shm_name)
            if not os.path.exists(f"/dev/shm/sem.{lock_name(segment.shm_name)[1:]}"):
                raise SegmentError(f"the pool's lock {lock_name(segment.shm_name)} is missing")
            # The attach hold's holder word names this process's attach mark, not a slot:
            # the row it claims is not its own yet (shmkv/pool/liveness.py, attach marks).
            mark = self._alive.claim_mark(
                lambda byte: (decode_holder(int(self._hdr64[L.H_HOLDER])) or (None,))[0]
                == byte)
            if mark is None:
                raise PoolFullError(
                    f"pool {self.pool_name}: {NUM_MARKS} processes are attaching to it at once"
                )
            self._my_holder_word = holder_word(mark, self.pid)
            self._takeover = TakeOver(
                segment.shm_name, self._hdr64, self._procs, self._alive,
                lambda: self._my_holder_word, stuck_after_s,
            )
            self.process_table = ProcessTable(
                self.pool_name, layout, self._procs, self._ledger, self._alive,
                self._journal, self._hdr_w, self._ref_col, self._ref_col_w, self._htok_col,
                self.free_block_queue, self.enable_caching,
            )
            self._repairer = Repairer(
                self.pool_name, self._segment_views, self._hdr_w, self._header,
                self.process_table, self._takeover, self._log_dropped_keys,
            )
            if self.kernel == "c":  # the same lock, with its fast path in C
                self._lock = _ckernel.CLock(
                    buf, lock_name(segment.shm_name), L.H_HOLDER, L.H_HOLDER_INCARNATION,
                    L.H_HOLDER_SINCE_NS, self._my_holder_word, float(lock_timeout_s),
                    WAIT_SLICE_S, _lock_enabled,
                    lambda: timeout_message(self._hdr64, self._lock.timeout_s,
                                            self.process_table.describe_holder),
                    self._takeover.on_stall, self._repairer.on_dirty,
                )
                self._lock.spin_s = SPIN_S
            else:
                self._lock = PoolLock(
                    segment.shm_name, self._hdr64, slot=mark, pid=self.pid, incarnation=0,
                    timeout_s=lock_timeout_s,
                    describe_holder=self.process_table.describe_holder,
                    enabled=_lock_enabled, on_stall=self._takeover.on_stall,
                    on_dirty=self._repairer.on_dirty,
                )
            # Every mutating call runs through self._lock.mutate(): this is how it rolls back.
            self._lock.set_savepoint(self._event_queue, self._undo_since)
            self._claim_slot(label_bytes)
        except BaseException:
            self._abandon()
            raise
        ledger_off = layout.offsets["ledger"] + self.slot * cfg.num_blocks * 4
        if self.kernel == "c":
            self._kernel = _ckernel.Kernel(
                buf, meta_off, idx_off, ledger_off, cfg.num_blocks, cfg.num_index_buckets,
                layout.offsets["journal"], cfg.journal_entries, cfg.num_alias_rows, _C_GEOMETRY,
            )
        else:
            self._kernel = PyKernel(
                self._i32, self.free_block_queue, self._index, self._blocks,
                self._ledger[self.slot], cfg.num_blocks, self._journal, meta_off, ledger_off,
            )

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    def create(
        cls,
        name: str,
        num_gpu_blocks: int,
        enable_caching: bool = True,
        hash_block_size: int = 16,
        enable_kv_cache_events: bool = False,
        medium: str = "GPU",
        *,
        max_processes: int = 16,
        event_log_bytes: int | None = None,
        hash_fn_name: str = "sha256",
        journal_entries: int | None = None,
        kernel: str | None = None,
        label: str = "creator",
        lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S,
        stuck_after_s: float = DEFAULT_STUCK_AFTER_S,
        partial_keys: bool = False,
        num_hash_lookahead_tokens: int = 0,
        record: str | None = None,
        _tier_of: bytes | None = None,
    ) -> BlockPool:
        """Creates a pool in a new shared-memory segment and attaches this process to it.

        Args:
            name: the pool's name (letters, digits, '.', '_', '-'; at most 64 characters).
            num_gpu_blocks: blocks in the pool, the null block included.
            enable_caching: keep a prefix cache of full blocks.
            hash_block_size: tokens per hash unit of ``request.block_hashes``.
            enable_kv_cache_events: record events for :meth:`take_events` and the global
                event log (:meth:`read_events`).
            medium: the storage medium named in events.
            max_processes: process-table slots (processes attached at once).
            event_log_bytes: size of the global event ring (default 4 MiB with events on,
                0 otherwise).
            hash_fn_name: "sha256" or "sha256_cbor", the block-hash function all processes
                use; its NONE_HASH is stored in the segment.
            journal_entries: size of the undo journal (default: enough for one call on
                every block, at most 2**21); a hold that writes more words is repaired by a
                rebuild instead of an exact rollback if its process dies.
            kernel: "c" or "python", this process's implementation of the hot loops
                (default: ``$SHMKV_KERNEL``, else C when built). Both behave identically.
            label: a name for this process in the process table.
            lock_timeout_s: the longest this process waits for the pool lock.
            stuck_after_s: how long the lock must stand taken with no holder recorded
                before this process takes it over from a dead process that was taking or
                giving it back (``shmkv/pool/takeover.py``).
            partial_keys: give every block an alias row (64 bytes more per block), so a
                block can hold a partial prefix-cache key besides its own, as vLLM's can
                (``cache_partial_block``): wanted when a KV-cache group's blocks are bigger
                than ``hash_block_size`` (see ``shmkv/pool/layout.py``, "Alias rows").
            num_hash_lookahead_tokens: vLLM's: each block hash also covers this many tokens
                after its block (speculative decoding, whose drafter's KV at a block's last
                position depends on them). Kept in the segment, so every process hashes the
                same way; the KV events carry those tokens (``lookahead_token_ids``).
            record: a file to record this process's calls to, for the linearizability
                checker (``shmkv/pool/recorder.py``); default ``$SHMKV_RECORD_DIR``, else
                none. A pool that records nothing runs no recording code.

        Raises:
            UsageError: a bad name or config value.
            SegmentExistsError: a pool of that name exists already.
            NoSpaceError: /dev/shm has no room for the segment (nothing is left behind).
        """
        if event_log_bytes is None:
            event_log_bytes = L.DEFAULT_EVENT_LOG_BYTES if enable_kv_cache_events else 0
        if isinstance(num_hash_lookahead_tokens, bool):  # vLLM's callers pass one (0 or 1)
            num_hash_lookahead_tokens = int(num_hash_lookahead_tokens)
        config = L.PoolConfig(
            num_blocks=num_gpu_blocks,
            hash_block_size=hash_block_size,
            enable_caching=bool(enable_caching),
            enable_kv_cache_events=bool(enable_kv_cache_events),
            medium=medium,
            max_processes=max_processes,
            event_log_bytes=event_log_bytes,
            hash_fn_name=hash_fn_name,
            journal_entries=0 if journal_entries is None else journal_entries,
            partial_keys=partial_keys,
            num_hash_lookahead_tokens=num_hash_lookahead_tokens,
        )
        if not isinstance(partial_keys, bool):
            raise UsageError(f"partial_keys must be a bool, got {partial_keys!r}")
        if journal_entries is not None and (isinstance(journal_entries, bool)
                                            or journal_entries == 0):
            raise UsageError(f"journal_entries must be a positive int, got {journal_entries!r}")
        config.validate()
        if kernel is not None and kernel not in KERNELS:
            raise UsageError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        layout = L.Layout.from_config(config)
        shm_name = L.segment_name(name)
        segment = Segment.create(shm_name, layout.total_bytes, "pool")
        try:
            write_header(segment.buf, layout)
            header = layout.view(segment.buf, "header")
            header["none_hash"] = none_hash(get_hash_fn_by_name(hash_fn_name))
            if _tier_of is not None:  # tier(): this pool is that pool's, before READY
                header["tier_of"] = _tier_of
            pool_id = bytes(header[0]["pool_id"])
            del header
            create_semaphore(shm_name)
            AliveLocks(alive_path(shm_name), create=True).close()
            pool = _opener(cls, record, name)(
                segment, layout, owner=True, kernel=kernel, label=label,
                lock_timeout_s=lock_timeout_s, stuck_after_s=stuck_after_s)
            pool._initialize()
        except BaseException:
            segment.close()
            unlink_pool_files(name)
            raise
        # A tier left by an earlier pool of this name describes pages of a pool that is gone
        # (its host copies would be taken for this pool's): the new pool starts without one.
        # Only a tier by its header: a pool of its own named "<name>.host" is another user's.
        unlink_tiers(name, cls.TIERS, keep_of=pool_id)
        return pool

    def _initialize(self) -> None:
        n = self.num_gpu_blocks
        self._ref_col[:] = 0
        self._blocks["prev"] = _NO_BLOCK
        self._blocks["next"] = _NO_BLOCK
        self._index.initialize()
        # Block 0 is the null block, taken out of the queue for good (vLLM pops it first).
        self.free_block_queue.initialize(range(1, n))
        self._log.reset()
        self._header["state"] = L.STATE_READY

    @classmethod
    def attach(
        cls,
        name: str,
        *,
        num_gpu_blocks: int | None = None,
        hash_block_size: int | None = None,
        enable_caching: bool | None = None,
        enable_kv_cache_events: bool | None = None,
        kernel: str | None = None,
        label: str = "",
        lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S,
        stuck_after_s: float = DEFAULT_STUCK_AFTER_S,
        record: str | None = None,
        _lock_enabled: bool = True,
        _recovering: bool = False,
    ) -> BlockPool:
        """Attaches this process to an existing pool, taking a process-table slot. Any
        config value given must match the segment's. ``record``: as in :meth:`create`.

        Raises:
            UsageError: a bad name or argument.
            SegmentNotFoundError: no pool of that name.
            LayoutMismatchError: not a shmkv segment, another layout version, a size or a
                config value that differs (the message names the field).
            SegmentError: the segment is not READY (still initialising, or poisoned), or is
                owned by another user.
            PoolFullError: every slot is held by a live process (after reaping the dead).
            LockTimeoutError: the pool lock could not be taken.
        """
        shm_name = L.segment_name(name)
        segment = Segment.open(shm_name)
        expected = {
            "num_blocks": num_gpu_blocks,
            "hash_block_size": hash_block_size,
            "enable_caching": enable_caching,
            "enable_kv_cache_events": enable_kv_cache_events,
        }
        try:
            layout = read_config(segment, expected, allow_poisoned=_recovering)
            return _opener(cls, record, name)(
                segment, layout, owner=False, kernel=kernel, label=label,
                lock_timeout_s=lock_timeout_s, stuck_after_s=stuck_after_s,
                _lock_enabled=_lock_enabled)
        except BaseException:
            segment.close()
            raise

    def _abandon(self) -> None:
        """Gives back what a failed ``__init__`` opened (the lock, the take-over's and the
        liveness file's descriptors, the segment's views and mapping), whichever it got to.
        """
        for part in (self._lock, self._takeover, self._alive):
            if part is not None:
                part.close()
        self.free_block_queue.release()
        self._index.release()
        self._journal.release()
        # Their arrays over the segment would keep it mapped (until a garbage collection:
        # the repairer and the take-over refer back to this handle).
        self._lock = self._takeover = self._alive = _CLOSED  # type: ignore[assignment]
        self._repairer = _CLOSED  # type: ignore[assignment]
        self._release_views()
        _OPEN_POOLS.discard(self)

    def _claim_slot(self, label: bytes) -> None:
        """Takes a free process-table slot (reaping the dead if none is free).

        The slot's liveness byte is taken first, without the lock (the kernel arbitrates
        it), so that the lock's ``lock_phase`` marks already sit in a row this process owns
        during the hold that fills the row in. That first look at the table is a dirty
        read: the row may have been freed by a hold that has not committed, and whose holder
        then dies; the repair at the start of this process's hold puts the dead process's
        row back. So the choice is checked again under the lock.
        """
        table = self.process_table
        mark = self._alive.held_mark
        counting = False
        try:
            slot = table.claim_free_slot()
            if slot is not None:
                self._set_lock_identity(slot, None, holder=mark)
            counting = _fault.planned is not None and _fault.begin("attach")
            with self._lock:
                # First under the lock: the mark's hold byte, this hold's lock_phase while
                # it has no row (takeover.py, rule 2), until after the post.
                self._alive.hold_mark(mark)
                if slot is not None and not table.slot_is_free(slot):
                    table.give_up_claim(slot)  # not ours after all
                    self._set_lock_identity(None, None, holder=mark)
                    slot = None
                if slot is None:  # no usable slot yet: reap the dead, under the lock
                    table.reap_dead()
                    slot = table.claim_free_slot()
                    if slot is None:
                        raise PoolFullError(
                            f"pool {self.pool_name}: all {self.max_processes} process slots "
                            f"are held by live processes (pids {table.live_pids()}), or "
                            "their liveness locks by children a dead process forked "
                            "without Python's at-fork hooks (free once those exit)"
                        )
                    self._set_lock_identity(slot, None, holder=mark)
                incarnation = table.fill_row(slot, self.pid, label)
                self.slot = slot
                self._incarnation = incarnation
                self._set_lock_identity(slot, incarnation)
        finally:
            try:
                self._alive.release_mark(mark)
            finally:
                if counting:
                    _fault.end()

    def _set_lock_identity(self, slot: int | None, incarnation: int | None,
                           holder: int | None = None) -> None:
        """Points the lock at this process's row ``slot`` (None: no row, no ``lock_phase``
        marks): its ``lock_phase`` and, once the row carries ``incarnation``, the fence; the
        ``holder`` word names ``holder`` (the attach mark, in the attach hold) or else the
        slot."""
        named = slot if holder is None else holder
        self._my_holder_word = holder_word(named, self.pid)
        words = L.PROC_I64
        fence_index = slot * words + L.P_INCARNATION if incarnation is not None else None
        phase_index = slot * words + L.P_LOCK_PHASE if slot is not None else None
        if isinstance(self._lock, PoolLock):
            self._lock.set_identity(named, incarnation or 0,
                                    self._proc64 if slot is not None else None, fence_index,
                                    phase_index or 0)
        else:
            base = self._layout.offsets["proc_table"]
            self._lock.set_identity(
                self._my_holder_word, incarnation or 0,
                -1 if fence_index is None else base + 8 * fence_index,
                -1 if phase_index is None else base + 8 * phase_index,
            )

    def _forked_child(self) -> None:
        """This process is a fork of the one that opened the handle (see
        ``_after_fork_in_child``): the slot, its references and its lock marks are the
        parent's. Drops the inherited liveness descriptor; every later call raises
        ForkedPoolError (``close()`` only unmaps)."""
        segment = getattr(self, "_segment", None)
        if self._forked_from or segment is None or segment.buf is None:
            return  # already marked, or closed (its views are gone): nothing to drop
        self._forked_from = self.pid
        error = ForkedPoolError(
            f"pool {self.pool_name!r}: this handle was opened by pid {self.pid}, and this "
            f"process (pid {os.getpid()}) is a fork of it; a forked child cannot use its "
            "parent's handle (its slot, lock and liveness are the parent's): attach the pool "
            "again in the child (BlockPool.attach), or start children with the 'spawn' "
            "method"
        )
        alive = getattr(self, "_alive", None)
        if alive is not None:
            alive.drop_after_fork()
        lock = getattr(self, "_lock", None)
        if lock is not None and hasattr(lock, "mark_forked"):
            lock.mark_forked(error)

    def close(self) -> None:
        """Gives back every reference this process holds and its process-table slot, then
        unmaps the segment. Handles of this pool raise PoolClosedError afterwards. In a
        forked child (``ForkedPoolError``) it only unmaps: the slot is the parent's."""
        if self._segment.buf is None:
            return
        tiers, self._tiers = self._tiers, {}
        for tier in tiers.values():
            tier.close()
        counting = _fault.planned is not None and _fault.begin("close")
        try:
            with self._lock:
                self.process_table.release_slot(self.slot)
        except (FencedError, PoolClosedError, ForkedPoolError):
            pass  # the slot is no longer ours (or is the parent's): nothing to give back
        finally:
            if counting:
                _fault.end()
            self._lock.close()
            self._lock = _CLOSED  # type: ignore[assignment]
            self._takeover.close()
            self._alive.close()  # only now: the row's lock_phase was ours until the release
            self._kernel.release()
            self._kernel = _CLOSED  # type: ignore[assignment]
            self.free_block_queue.release()
            self._index.release()
            self._journal.release()
            self._release_views()

    # The tiers a pool may have besides its own blocks, each a pool in its own segment named
    # "<pool name>.<tier>": closed with this handle, unlinked with this pool.
    TIERS = ("host",)

    def tier(self, tier: str, num_blocks: int, *, enable_caching: bool,
             medium: str = "CPU") -> BlockPool:
        """This pool's ``tier`` (HiSparse's host pages: ``"host"``), a pool of ``num_blocks``
        blocks in the segment ``<name>.<tier>``: created by the first process that asks,
        attached by the others, with this pool's hash size, events, process slots, partial
        keys and kernel. It is as shared and as crash-safe as this pool, with its own lock;
        its events are queued with this handle's (``take_events`` returns both, in order).
        The same handle is returned on later calls.

        Raises:
            UsageError: an unknown tier, or ``num_blocks`` / ``enable_caching`` that differ
                from the tier's (made by another process, or by an earlier call).
            SegmentError: ``<name>.<tier>`` exists but is not this pool's tier (its header's
                ``tier_of`` is not this pool's id: a pool of its own, or an earlier pool's).
        """
        if tier not in self.TIERS:
            raise UsageError(f"tier must be one of {self.TIERS}, got {tier!r}")
        pool = self._tiers.get(tier)
        if pool is None:
            name = f"{self.pool_name}.{tier}"
            cfg = self._layout.config
            pool_id = bytes(self.header_snapshot()["pool_id"])
            try:
                pool = BlockPool.create(
                    name, num_blocks, enable_caching=enable_caching,
                    hash_block_size=self.hash_block_size,
                    enable_kv_cache_events=self.enable_kv_cache_events, medium=medium,
                    max_processes=self.max_processes, hash_fn_name=self.hash_fn_name,
                    kernel=self.kernel, label=f"{tier}-tier",
                    lock_timeout_s=self._lock.timeout_s, partial_keys=cfg.partial_keys,
                    _tier_of=pool_id,
                )
            except SegmentExistsError:
                pool = BlockPool.attach(
                    name, num_gpu_blocks=num_blocks, enable_caching=enable_caching,
                    hash_block_size=self.hash_block_size,
                    enable_kv_cache_events=self.enable_kv_cache_events, kernel=self.kernel,
                    label=f"{tier}-tier", lock_timeout_s=self._lock.timeout_s,
                )
                if bytes(pool.header_snapshot()["tier_of"]) != pool_id:
                    pool.close()
                    raise SegmentError(
                        f"pool {name} is not the {tier} tier of pool {self.pool_name} (its "
                        "header names another pool, or none): it is left alone; unlink it "
                        "if it is stale, or give this pool another name"
                    ) from None
            # One queue for both, as vLLM's SharedEventQueueBlockPool: the savepoint of the
            # tier's lock then counts this queue's entries.
            pool._event_queue = self._event_queue
            pool._lock.set_savepoint(self._event_queue, pool._undo_since)
            self._tiers[tier] = pool
        elif pool.num_gpu_blocks != num_blocks or pool.enable_caching != bool(enable_caching):
            raise UsageError(
                f"the {tier} tier has {pool.num_gpu_blocks} blocks (caching "
                f"{pool.enable_caching}), asked for {num_blocks} (caching {enable_caching})"
            )
        return pool

    def mark_stays(self, by: str) -> None:
        """Marks the pool to stay in /dev/shm once no process uses it: ``shmkv cleanup``
        keeps it, and ``shmkv ls`` lists it as staying, made by ``by``, until it is removed
        by name (``shmkv unlink``, :meth:`unlink`) or by ``shmkv cleanup --include-idle``
        (or ``--idle-for``, once idle that long).

        A new pool lives only while a process holds it: once every process attached to it
        is dead (its creator too), cleanup removes it as an orphan. Call this once whatever
        the pool is part of is complete, so that a pool whose maker died half way is still
        an orphan. ``shmkv create``, the vLLM offload tier and the SGLang page store call
        it. Marking a pool that stays already changes nothing (the first ``by`` is kept).

        Args:
            by: what keeps the pool, shown by ``shmkv ls``: at most 12 printable ASCII
                characters (``"shmkv create"``, ``"vllm tier"``).

        Raises:
            UsageError: ``by`` is not such a string; nothing is written.
            PoolClosedError: the pool is closed.
        """
        if (not isinstance(by, str) or not by or not by.isascii() or not by.isprintable()
                or len(by) > L.MAX_STAYS_BY_BYTES):
            raise UsageError(f"mark_stays(by={by!r}): by must be 1 to {L.MAX_STAYS_BY_BYTES} "
                             "printable ASCII characters naming what keeps the pool, e.g. "
                             "'shmkv create'")
        if self._segment.buf is None:
            raise PoolClosedError("the pool is closed; attach again to use it")
        with self._lock:
            if int(self._header[0]["retention"]) == L.RETENTION_STAYS:
                return
            # stays_by first: a reader that sees RETENTION_STAYS sees who marked it
            self._header["stays_by"] = by.encode()
            fence()
            self._header["retention"] = L.RETENTION_STAYS

    @property
    def stays_by(self) -> str | None:
        """What marked the pool to stay (:meth:`mark_stays`); None while it lives only as
        long as a process holds it ("unrecorded" for a pool made before pools recorded
        it, which cleanup keeps)."""
        hdr = self.header_snapshot()
        retention = int(hdr["retention"])
        if retention == L.RETENTION_STAYS:
            return bytes(hdr["stays_by"]).decode(errors="replace")
        return "unrecorded" if retention == L.RETENTION_UNRECORDED else None

    def _release_views(self) -> None:
        self._i32 = self._i64 = self._hdr64 = self._proc64 = self._hdr_w = _CLOSED
        self.free_block_queue = self._index = self._log = _CLOSED  # type: ignore[assignment]
        self._segment_views = _CLOSED  # type: ignore[assignment]
        self._blocks = self._ref_col = self._htok_col = _CLOSED  # type: ignore[assignment]
        self._key_rows = _CLOSED  # type: ignore[assignment]
        self._ref_col_w = self._journal = _CLOSED  # type: ignore[assignment]
        self._procs = self._ledger = self._header = _CLOSED  # type: ignore[assignment]
        self.process_table = _CLOSED  # type: ignore[assignment]
        for view in reversed(self._views):
            view.release()
        self._views = []
        self._segment.close()

    @staticmethod
    def unlink(name: str) -> bool:
        """Removes a pool and every sibling it owns, as ``shmkv unlink`` does: its segment,
        lock and lock file; its tiers (known by their header, never by name alone); its
        stats, publisher position and vLLM offload tier and data region. Returns False if
        the pool's segment did not exist.

        Processes that have it mapped keep working until they close it.
        """
        return unlink_pool(name, BlockPool.TIERS)[0]

    def __enter__(self) -> BlockPool:
        return self

    def __exit__(self, *exc: object) -> None:
        """Closes this handle; the creator's also unlinks the pool and all it owns."""
        name = self.pool_name
        self.close()
        if self._owner:
            self.unlink(name)

    # ------------------------------------------------------------------ helpers

    def _handle(self, block_id: int) -> KVCacheBlock:
        handle = self._handles[block_id]
        if handle is None:
            handle = self._handles[block_id] = KVCacheBlock(self, block_id)
        return handle

    def _evict_cached(self, block_id: int) -> bool:
        """vLLM's ``_maybe_evict_cached_block``: drops every key of the block (its own, then
        its alias), one ``BlockRemoved`` each; False if it held none."""
        keys = self._kernel.evict(block_id)
        if not keys:
            return False
        if self.enable_kv_cache_events:
            self._record_removed(keys)
        return True

    def _record_removed(self, keys: list[tuple[bytes, int]]) -> None:
        as_int = use_int_block_hashes()
        self._log_events([
            BlockRemoved(
                block_hashes=[external_block_hash(h, as_int)], medium=self.medium, group_idx=g
            )
            for h, g in keys
        ])

    def _undo_since(self, mark: int, num_events: int, corrupt: bool = False) -> None:
        """A call failed half way (an exception out of the kernel, KeyboardInterrupt...):
        puts back every word it wrote since the journal stood at ``mark``, and drops the
        events it queued, so it changes nothing, as a rejected call. Calls made earlier in
        the same hold stand. If the journal overflowed meanwhile, rebuilds instead (valid,
        not exact).

        ``corrupt``: the call raised InvariantViolation (a kernel found corrupt shared
        state, e.g. a looping index chain); the pool is then repaired as after a dead hold
        (``Repairer.repair_corruption``), still under the lock, so the next call of any
        process finds it sound; the caller still gets the InvariantViolation."""
        del self._event_queue[num_events:]
        hdr = self._hdr64
        if hdr[L.H_JOURNAL_LEN] != mark:
            if mark >= 0 and hdr[L.H_JOURNAL_LEN] >= 0:
                undo(self._segment.buf, self._layout, hdr, start=mark)
            else:
                rebuild(self._segment_views)
        if corrupt:
            self._repairer.repair_corruption()

    def _log_dropped_keys(self, keys: list[tuple[bytes, int]]) -> None:
        """A rebuild dropped these keys: event subscribers must forget them too."""
        if keys and self.enable_kv_cache_events:
            self._record_removed(keys)

    def reap_dead(self) -> int:
        """Releases the references and slots of processes that died without ``close()``.

        Returns:
            how many processes were reaped.
        """
        counting = _fault.planned is not None and _fault.begin("reap")
        try:
            with self._lock:
                return self.process_table.reap_dead()[0]
        finally:
            if counting:
                _fault.end()

    def has_free_blocks(self, num_blocks: int) -> bool:
        """Whether ``num_blocks`` blocks are free; when they are not, the processes that died
        without ``close()`` are reaped first and the count read again. A peer SIGKILLed while
        it held blocks may be what is missing, and an admission check that only counts (as
        vLLM's does, before any ``get_new_blocks``) would otherwise answer "no room" for ever:
        nothing else reaps in a deployment. With nobody dead, the answer is the count's (a
        count below 1 always fits: vLLM's managers can ask for a negative number of blocks).

        Raises:
            UsageError: ``num_blocks`` is not an int.
        """
        if type(num_blocks) is not int:
            num_blocks = _block_count("has_free_blocks", num_blocks)
        if num_blocks <= self.get_num_free_blocks():
            return True
        return self.reap_dead() > 0 and num_blocks <= self.get_num_free_blocks()

    def repair(self) -> dict:
        """What ``shmkv recover`` does once attached (attaching already took the lock over
        from a dead holder and rolled its hold back, see ``last_repair``): reaps the dead,
        checks every invariant and, if any is broken, rebuilds the derived structures from
        the authoritative ones (``shmkv.pool.recovery.rebuild``) and checks again. A POISONED
        pool that passes is READY again.

        Returns:
            a report: processes reaped, references released, violations found and left,
            whether it rebuilt, the epoch.
        """
        with self._lock:
            return self._repairer.repair()

    def reclaim_slot(self, slot: int) -> int:
        """Takes a process-table slot away from its process, dead or alive: releases every
        reference it holds and frees the slot. For a process that is stuck (stopped, hung)
        but not dead: it is fenced, gets ``FencedError`` on its next call and never writes
        into the pool again. Returns the references released.

        Raises:
            UsageError: ``slot`` is not an active slot, or is this process's own.
        """
        if isinstance(slot, bool) or not isinstance(slot, int):
            raise UsageError(f"reclaim_slot(): slot must be an int, got {slot!r}")
        with self._lock:
            if not 0 <= slot < self.max_processes or (
                slot not in self.process_table.active_slots()
            ):
                raise UsageError(f"reclaim_slot(): slot {slot} is not an active slot")
            if slot == self.slot:
                raise UsageError("reclaim_slot(): that is this process's own slot; close() it")
            pid = int(self._procs[slot]["pid"])
            released = self.process_table.release_slot(slot)
            logger.warning("pool %s: reclaimed slot %d (pid %d, %s): %d block references "
                           "released", self.pool_name, slot, pid,
                           "alive" if self.process_table.is_alive(slot) else "dead", released)
            return released

    def lock(self):
        """The pool lock, as a context manager: ``with pool.lock(): ...`` makes a sequence of
        calls (lookups, touches, allocations) atomic with respect to other processes. It is
        re-entrant within this process.

        Raises (on entry):
            LockTimeoutError: not acquired within ``lock_timeout_s``; names the holder.
            FencedError: this process's slot was reclaimed.
        """
        return self._lock

    def _log_events(self, events: list[KVCacheEvent]) -> None:
        """Records events for take_events() and in the global log (caller holds the lock)."""
        self._event_queue.extend(events)
        if self._log.capacity:
            dropped = self._log.append(self.slot, events)
            if dropped:
                self._hdr_w[L.H_NUM_EVENTS_DROPPED] += dropped

    def event_cursor(self, from_start: bool = True) -> EventCursor:
        """A cursor on the global event log: at its oldest event, or at its end."""
        with self._lock:
            return self._log.oldest() if from_start else self._log.end()

    def read_events(self, cursor: EventCursor,
                    max_events: int | None = None) -> tuple[list[LoggedEvent], int]:
        """Events of every process since ``cursor``, in the pool's order (advances it).

        Returns:
            (events, lost): ``lost`` counts events overwritten before this reader got them.
        """
        with self._lock:
            return self._log.read(cursor, max_events)

    def processes(self) -> list[dict]:
        """The process table: one dict per attached process (slot, pid, label, alive,
        references held, attach time)."""
        with self._lock:
            return self.process_table.rows()

    def cached_blocks(self, limit: int = 1000):
        """What the prefix cache holds, block by block, read in one hold of the lock: the
        first ``limit`` cached blocks, evictable ones in eviction order (``lru_position``
        0 is evicted first), then those requests hold (with the holders' slots, pids and
        references). O(num_blocks) vectorised plus O(limit x max_processes); writes
        nothing (``shmkv/pool/cache_listing.py``).

        Returns:
            ``CachedBlocks(blocks, num_cached, num_free)``.

        Raises:
            UsageError: ``limit`` is not an int >= 0.
        """
        from shmkv.pool.cache_listing import list_cached_blocks

        return list_cached_blocks(self._segment_views, self._lock, self.num_gpu_blocks,
                                  limit)

    @property
    def last_repair(self) -> RepairReport | None:
        """What the last repair at the start of one of this process's holds did (a dead
        holder's hold rolled back, the dead reaped), or None if none was needed."""
        return self._repairer.last_repair

    def holder(self) -> tuple[int, int] | None:
        """(slot, pid) of the process holding the pool lock now, or None. A process inside
        ``attach()`` is named by its attach mark instead of a slot (a number past every slot,
        ``shmkv.pool.liveness.is_mark``)."""
        return decode_holder(self._hdr64[L.H_HOLDER])

    @property
    def none_hash(self) -> bytes:
        """The NONE_HASH digest stored in the segment, shared by every process."""
        return bytes(self._header["none_hash"][0])

    def make_block_hasher(self) -> RequestBlockHasher:
        """A request block hasher with the pool's hash function, block size and NONE_HASH, so
        hashes computed in any process match."""
        return RequestBlockHasher(
            self.hash_block_size, get_hash_fn_by_name(self.hash_fn_name), self.none_hash,
            self.num_hash_lookahead_tokens,
        )

    # ------------------------------------------------------------------ vLLM API

    def get_cached_block(
        self, block_hash: bytes, kv_cache_group_ids: Sequence[int]
    ) -> list[KVCacheBlock] | None:
        """The cached block of ``block_hash`` in every group of ``kv_cache_group_ids``, or
        None if any group misses. Of several blocks with one key, the first cached wins.

        Raises:
            UsageError: the hash is not 32 bytes.
            InvariantViolation: the hash's index chain is corrupt (it loops); the pool is
                repaired under the same hold, so the next call finds it sound.
        """
        lock = self._lock
        lock.acquire()
        try:
            return self._kernel.get_cached(
                block_hash, kv_cache_group_ids, self._handles, self._handle
            )
        except InvariantViolation:
            self._repairer.repair_corruption()  # a lookup found it: repaired as by a write
            raise
        finally:
            lock.release()

    def lookup_block_id(self, block_hash: bytes, group_id: int) -> int:
        """The id of the block that holds (``block_hash``, ``group_id``) (the first cached
        wins), or -1: ``get_cached_block`` of one group without making a handle. A shmkv
        addition for layers that keep block ids (the offload tier).

        Raises:
            UsageError: the hash is not 32 bytes, or a bad group id.
            InvariantViolation: the hash's index chain is corrupt (repaired as by a lookup).
        """
        lock = self._lock
        lock.acquire()
        try:
            return self._kernel.lookup(block_hash, group_id)
        except InvariantViolation:
            self._repairer.repair_corruption()
            raise
        finally:
            lock.release()

    def lookup_block_ids(self, block_hashes: list[bytes], group_ids: list[int],
                         fallback_bit: int = 0) -> list[int]:
        """``lookup_block_id`` of each (hash, group) pair in one hold of the lock. With a
        non-zero ``fallback_bit``, a pair not found is looked up again under
        ``group | fallback_bit`` and a block found there is answered as ``-2 - id`` (block
        0 holds no key, so every such answer is below -1). A shmkv addition for layers that
        keep a second form of a key (the offload tiers' keys still being stored).

        Raises:
            UsageError: the arguments are not two lists of one length, a hash is not 32
                bytes, or a group id or ``fallback_bit`` is bad; nothing is looked up.
            InvariantViolation: an index chain is corrupt (repaired as by a lookup).
        """
        lock = self._lock
        lock.acquire()
        try:
            return self._kernel.lookup_many(block_hashes, group_ids, fallback_bit)
        except InvariantViolation:
            self._repairer.repair_corruption()
            raise
        finally:
            lock.release()

    def get_cached_prefix(self, block_hashes: Sequence[bytes], kv_cache_group_id: int = 0,
                          max_num_blocks: int | None = None) -> list[KVCacheBlock]:
        """The longest run of leading ``block_hashes`` cached in one group: what a
        full-attention hit search finds with one ``get_cached_block`` per hash, in one call
        (and one short hold of the lock). A shmkv addition; vLLM's managers loop.

        Raises:
            UsageError: a hash that is not 32 bytes, a bad group id or limit.
        """
        if (isinstance(kv_cache_group_id, bool) or not isinstance(kv_cache_group_id, int)
                or not 0 <= kv_cache_group_id < 1 << 31):
            raise UsageError(f"get_cached_prefix(): bad kv_cache_group_id {kv_cache_group_id!r}")
        if max_num_blocks is not None and (
            isinstance(max_num_blocks, bool) or not isinstance(max_num_blocks, int)
            or max_num_blocks < 0
        ):
            raise UsageError(f"get_cached_prefix(): bad max_num_blocks {max_num_blocks!r}")
        lock = self._lock
        lock.acquire()
        try:
            return self._kernel.prefix(
                block_hashes, kv_cache_group_id, -1 if max_num_blocks is None else max_num_blocks,
                self._handles, self._handle,
            )
        except InvariantViolation:
            self._repairer.repair_corruption()  # a lookup found it: repaired as by a write
            raise
        finally:
            lock.release()

    def cache_full_blocks(
        self,
        request: Any,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        block_mask: Sequence[bool] | None = None,
    ) -> None:
        """Caches ``blocks[num_cached_blocks:num_full_blocks]`` under the request's hashes.

        Null blocks and blocks whose ``block_mask`` entry is False are skipped. With events
        on, records one ``BlockStored`` for the call.

        Args:
            request: anything with ``.block_hashes`` (computed at ``hash_block_size``), and
                ``.all_token_ids`` when events are on (``.lora_request``, ``.cache_salt`` and
                ``.session_id`` are read if present).
            blocks: all blocks of the request in this group.
            num_cached_blocks: blocks already cached.
            num_full_blocks: full blocks, all cached after the call.
            block_size: the group's block size, a multiple of ``hash_block_size``.
            kv_cache_group_id: the group.
            block_mask: optional, one bool per block of the range.

        Raises:
            UsageError: a bad argument, too few hashes or blocks, a block already cached.
        """
        try:
            nothing_to_cache = num_cached_blocks >= num_full_blocks
        except TypeError:  # not numbers: refused just below, naming the argument
            nothing_to_cache = False
        if nothing_to_cache:
            return
        ratio, fine_hashes = self._check_hash_run(
            "cache_full_blocks", request,
            (("num_cached_blocks", num_cached_blocks), ("num_full_blocks", num_full_blocks)),
            num_full_blocks, block_size, kv_cache_group_id)
        new_full = list(blocks[num_cached_blocks:num_full_blocks])
        num_new = num_full_blocks - num_cached_blocks
        if len(new_full) != num_new:
            raise UsageError(
                f"cache_full_blocks(): blocks has {len(blocks)} entries, fewer than "
                f"num_full_blocks {num_full_blocks}"
            )
        if block_mask is not None and len(block_mask) != num_new:
            raise UsageError(
                f"cache_full_blocks(): block_mask has {len(block_mask)} entries for "
                f"{num_new} blocks"
            )
        self._lock.mutate("cache", self._cache_locked, request, new_full, fine_hashes,
                          num_cached_blocks, num_full_blocks, ratio, block_size,
                          kv_cache_group_id, block_mask)

    def _check_hash_run(self, what: str, request: Any, counts: tuple[tuple[str, Any], ...],
                        num_blocks: int, block_size: int, group_id: int
                        ) -> tuple[int, Sequence[bytes]]:
        """Checks the arguments of a call on a request's first ``num_blocks`` blocks of
        ``block_size`` tokens in group ``group_id``: the counts (name, value) are ints >= 0,
        so is the group (below 2**31), the block size is a positive multiple of
        ``hash_block_size`` and the request has the hashes. Returns (block size / hash block
        size, the request's hashes).

        Raises:
            UsageError: naming the call and the argument.
        """
        for label, value in (*counts, ("block_size", block_size),
                             ("kv_cache_group_id", group_id)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise UsageError(f"{what}(): {label} must be an int >= 0, got {value!r}")
        if group_id >= 1 << 31:
            raise UsageError(f"{what}(): kv_cache_group_id {group_id} >= 2**31")
        hbs = self.hash_block_size
        if block_size == 0 or block_size % hbs:
            raise UsageError(
                f"{what}(): block_size {block_size} is not a positive multiple of "
                f"hash_block_size {hbs}"
            )
        ratio = block_size // hbs
        fine_hashes = request.block_hashes
        if len(fine_hashes) // ratio < num_blocks:
            raise UsageError(
                f"{what}(): the request has {len(fine_hashes)} block hashes at {hbs} tokens, "
                f"{len(fine_hashes) // ratio} at block size {block_size}; {num_blocks} are "
                f"needed"
            )
        return ratio, fine_hashes

    def _cache_locked(self, request, new_full, fine_hashes, num_cached_blocks,
                      num_full_blocks, ratio, block_size, group_id, block_mask) -> None:
        evicted: list[tuple[bytes, int]] | None = [] if self.enable_kv_cache_events else None
        cached = self._kernel.cache(
            new_full, fine_hashes, num_cached_blocks, ratio, block_size, group_id, block_mask,
            evicted,
        )
        if evicted:  # shorter keys the blocks held gave way to the full ones
            self._record_removed(evicted)
        if self.enable_kv_cache_events:
            self._log_events([
                self._block_stored_event(
                    request, cached, num_cached_blocks, num_full_blocks, block_size,
                    group_id, fine_hashes, ratio,
                )
            ])

    def _block_stored_event(self, request, cached, num_cached_blocks, num_full_blocks,
                            block_size, group_id, fine_hashes, ratio) -> BlockStored:
        as_int = use_int_block_hashes()
        parent = (
            external_block_hash(fine_hashes[num_cached_blocks * ratio - 1], as_int)
            if num_cached_blocks > 0
            else None
        )
        lora = getattr(request, "lora_request", None)
        # One entry per cached block, as vLLM: the block's hash extra keys (LoRA,
        # multimodal, cache_salt, prompt embeds) in their untagged event form.
        block_keys = []
        lookahead_ids: list[list[int]] | None = [] if self.num_hash_lookahead_tokens else None
        mm_idx = 0
        for position, _ in cached:
            end = (position + 1) * block_size
            keys, mm_idx = self.generate_event_extra_keys(request, position * block_size, end,
                                                          mm_idx)
            block_keys.append(keys)
            if lookahead_ids is not None:
                lookahead_ids.append(self.get_lookahead_token_ids(request, end))
        extra_keys = to_event_extra_keys(block_keys)
        start, end = num_cached_blocks * block_size, num_full_blocks * block_size
        return BlockStored(
            block_hashes=[external_block_hash(h, as_int) for _, h in cached],
            parent_block_hash=parent,
            token_ids=list(request.all_token_ids[start:end]),
            block_size=block_size,
            lora_id=lora.adapter_id if lora is not None else None,
            medium=self.medium,
            lora_name=lora.name if lora is not None else None,
            extra_keys=extra_keys,
            group_idx=group_id,
            session_id=getattr(request, "session_id", None),
            lookahead_token_ids=lookahead_ids,
        )

    def generate_event_extra_keys(self, request, start: int, end: int, start_mm_idx: int):
        """A block's extra keys for its event: over the same window as its hash (the block
        and, with lookahead, the tokens after it), and the multimodal index to go on from
        (vLLM 0.34's public name)."""
        if self.num_hash_lookahead_tokens:
            return generate_lookahead_block_hash_extra_keys(
                request, start, end, end + self.num_hash_lookahead_tokens, start_mm_idx)
        return generate_block_hash_extra_keys(request, start, end, start_mm_idx)

    def get_lookahead_token_ids(self, request, block_end: int) -> list[int]:
        """The tokens after a block that its hash covers (``BlockStored.lookahead_token_ids``;
        vLLM 0.34's public name)."""
        return list(request.all_token_ids[block_end:block_end + self.num_hash_lookahead_tokens])

    def cache_partial_block(
        self,
        request: Any,
        block: KVCacheBlock,
        num_tokens: int,
        kv_cache_group_id: int,
        block_size: int,
        replace_existing_hashes: bool = False,
    ) -> bytes | None:
        """Makes ``block`` reachable from the prefix boundary at ``num_tokens`` tokens, a hash
        boundary that may lie inside the block: vLLM's partial prefix-cache entry.

        The key is the request's chained hash at that boundary
        (``request.block_hashes[num_tokens // hash_block_size - 1]``). A block without a key
        takes it as its own (``block_hash``, with ``hash_num_tokens = num_tokens``); a block
        whose own key covers fewer tokens gives up its keys first (``BlockRemoved`` each);
        a block whose own key covers as many or more takes it as its alias. With
        ``replace_existing_hashes`` the block's keys are all dropped first (its contents
        were replaced). With events on, a key new to the block records one
        ``BlockStored`` of one hash unit (``block_size`` = ``hash_block_size``).

        shmkv keeps one alias per block (region ``block_alias``): where vLLM would add a
        second alias to a block, the newer replaces the older, with a ``BlockRemoved``. The
        managers ask for a second one only in a rare case (``shmkv/pool/layout.py``, "Alias
        rows").

        Args:
            request: ``.block_hashes`` at ``hash_block_size``; ``.all_token_ids`` when events
                are on.
            block: the block (the null block: nothing is done, None is returned).
            num_tokens: the boundary, a positive multiple of ``hash_block_size`` covered by
                the request's hashes.
            kv_cache_group_id: the group.
            block_size: the group's block size, a positive multiple of ``hash_block_size``.
            replace_existing_hashes: drop the block's keys first.

        Returns:
            the key (32 hash bytes + the group id as 4 big-endian bytes, as
            ``KVCacheBlock.block_hash``), or None for the null block.

        Raises:
            UsageError: a bad argument; nothing is changed then.
        """
        block_id = self._check_block_arg(block, "cache_partial_block")
        hbs = self.hash_block_size
        for label, value in (("num_tokens", num_tokens), ("block_size", block_size),
                             ("kv_cache_group_id", kv_cache_group_id)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise UsageError(
                    f"cache_partial_block(): {label} must be an int >= 0, got {value!r}"
                )
        if kv_cache_group_id >= 1 << 31:
            raise UsageError(
                f"cache_partial_block(): kv_cache_group_id {kv_cache_group_id} >= 2**31"
            )
        if block_size == 0 or block_size % hbs:
            raise UsageError(
                f"cache_partial_block(): block_size {block_size} is not a positive multiple of "
                f"hash_block_size {hbs}"
            )
        if block_id == _NULL:
            return None
        fine_hashes = request.block_hashes
        num_hash_blocks = num_tokens // hbs
        if num_tokens % hbs or not 0 < num_hash_blocks <= len(fine_hashes):
            raise UsageError(
                f"cache_partial_block(): num_tokens {num_tokens} must be a positive multiple of "
                f"hash_block_size {hbs} covered by the request's {len(fine_hashes)} hashes"
            )
        block_hash = fine_hashes[num_hash_blocks - 1]
        if type(block_hash) is not bytes or len(block_hash) != L.BLOCK_HASH_BYTES:
            raise UsageError(
                f"cache_partial_block(): block hash {num_hash_blocks - 1} must be "
                f"{L.BLOCK_HASH_BYTES} bytes"
            )
        self._lock.mutate("partial", self._partial_locked, request, block_id, block_hash,
                          num_tokens, kv_cache_group_id, replace_existing_hashes)
        return block_hash + kv_cache_group_id.to_bytes(4, "big")

    def _partial_locked(self, request, block_id: int, block_hash: bytes, num_tokens: int,
                        group_id: int, replace_existing_hashes: bool) -> None:
        index = self._index
        key = (block_hash, group_id)
        already_cached = index.block_key(block_id) == key or index.alias_key(block_id) == key
        removed: list[tuple[bytes, int]] = []
        held = self._i32[block_id * _R + _HTOK]
        if replace_existing_hashes:
            removed = index.pop_all(block_id)
            already_cached = False
        elif not already_cached and held != _NO_HASH_TOKENS and held < num_tokens:
            removed = index.pop_all(block_id)  # a shorter key gives way
        if not already_cached:
            self._add_key_locked(block_id, block_hash, group_id, num_tokens, removed)
        if removed and self.enable_kv_cache_events:
            self._record_removed(removed)
        if self.enable_kv_cache_events and not already_cached:
            self._log_events([self._partial_stored_event(
                request, block_hash, num_tokens, group_id)])

    def _check_block_arg(self, block: Any, what: str) -> int:
        try:
            block_id = block.block_id
        except AttributeError:
            raise UsageError(f"{what}() takes KVCacheBlock handles, got {type(block).__name__}"
                             ) from None
        if (isinstance(block_id, bool) or not isinstance(block_id, int)
                or not 0 <= block_id < self.num_gpu_blocks):
            raise UsageError(
                f"{what}(): block id {block_id!r} is out of range [0, {self.num_gpu_blocks})"
            )
        return block_id

    def _add_key_locked(self, block_id: int, block_hash: bytes, group_id: int,
                        num_tokens: int, removed_out: list[tuple[bytes, int]]) -> None:
        """vLLM's ``_insert_block_hash``: the key becomes the block's own if it has none, else
        its alias (replacing an older alias, whose key goes to ``removed_out``). A key the
        block holds already is left alone."""
        index = self._index
        key = (block_hash, group_id)
        if index.block_key(block_id) == key or index.alias_key(block_id) == key:
            return
        if self._i32[block_id * _R + _HTOK] == _NO_HASH_TOKENS:
            index.insert(block_hash, group_id, block_id, num_tokens)
            return
        if not index.has_aliases:
            if not self._warned_no_aliases:
                self._warned_no_aliases = True
                logger.warning(
                    "pool %s has no alias rows (created without partial_keys=True): a partial "
                    "prefix-cache key on a block that holds a key already is not kept",
                    self.pool_name,
                )
            return
        alias_row = index.alias0 + block_id
        older = index.pop(alias_row)
        if older is not None:
            removed_out.append(older)
        index.insert(block_hash, group_id, alias_row, num_tokens)

    def _partial_stored_event(self, request, block_hash: bytes, num_tokens: int,
                              group_id: int) -> BlockStored:
        """The ``BlockStored`` of a partial key: the one hash unit ending at ``num_tokens``."""
        as_int = use_int_block_hashes()
        hbs = self.hash_block_size
        num_hash_blocks = num_tokens // hbs
        parent = (external_block_hash(request.block_hashes[num_hash_blocks - 2], as_int)
                  if num_hash_blocks > 1 else None)
        start = num_tokens - hbs
        extra_keys, _ = self.generate_event_extra_keys(request, start, num_tokens, 0)
        lora = getattr(request, "lora_request", None)
        return BlockStored(
            block_hashes=[external_block_hash(block_hash, as_int)],
            parent_block_hash=parent,
            token_ids=list(request.all_token_ids[start:num_tokens]),
            block_size=hbs,
            lora_id=lora.adapter_id if lora is not None else None,
            medium=self.medium,
            lora_name=lora.name if lora is not None else None,
            extra_keys=to_event_extra_keys([extra_keys]),
            group_idx=group_id,
            session_id=getattr(request, "session_id", None),
            lookahead_token_ids=([self.get_lookahead_token_ids(request, num_tokens)]
                                 if self.num_hash_lookahead_tokens else None),
        )

    def move_block_hashes(self, src_block: KVCacheBlock, dst_block: KVCacheBlock) -> None:
        """Moves every prefix-cache key of ``src_block`` to ``dst_block`` (which holds none):
        the copy-on-write of a running request that keeps writing ``src_block`` while the
        cache keeps a private copy under the same keys. The keys stay live; no events.

        Raises:
            UsageError: a bad handle, or ``dst_block`` holds a key (or is ``src_block``).
        """
        src = self._check_block_arg(src_block, "move_block_hashes")
        dst = self._check_block_arg(dst_block, "move_block_hashes")
        self._lock.mutate("move", self._move_locked, src, dst)

    def _move_locked(self, src: int, dst: int) -> None:
        index = self._index
        if dst == _NULL or index.block_key(dst) is not None or index.alias_key(dst) is not None:
            raise UsageError(f"move_block_hashes(): the destination block {dst} must hold no key")
        htok = self._index._htok_raw
        moved = []
        rows = (src, index.alias0 + src) if index.has_aliases else (src,)
        for row in rows:
            key = index.block_key(row)
            if key is not None:
                moved.append((bytes(key[0]), key[1], htok[row]))
        if moved:
            index.pop_all(src)
            index.insert(moved[0][0], moved[0][1], dst, moved[0][2])
            for block_hash, group_id, num_tokens in moved[1:]:
                index.insert(block_hash, group_id, index.alias0 + dst, num_tokens)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pops ``num_blocks`` blocks from the head of the free queue, evicting their hashes.

        Returns:
            the blocks, each with ``ref_cnt == 1``, in queue order.

        Raises:
            OutOfBlocksError: (a ValueError) "Cannot get N free blocks from the pool".
            UsageError: ``num_blocks`` is not an int >= 0.
        """
        if type(num_blocks) is not int:
            num_blocks = _block_count("get_new_blocks", num_blocks)
        if num_blocks < 0:
            raise UsageError(f"get_new_blocks(): num_blocks must be >= 0, got {num_blocks}")
        blocks = self._lock.mutate("allocate", self._allocate_locked, num_blocks)
        if self._reuse_watchers:
            self._notify_reuse(blocks)
        return blocks

    def _notify_reuse(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Fires (once) the ``unpin_blocks`` callback of each block being reused."""
        for block in blocks:
            watcher = self._reuse_watchers.pop(block.block_id, None)
            self._watch_stamps.pop(block.block_id, None)
            if watcher is not None:
                watcher(block)

    def _stamp_watched(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Records the stamp of each watched block this process just released."""
        stamps = self._watch_stamps
        with self._lock:
            epoch = int(self._hdr64[L.H_EPOCH])
            for block in blocks:
                block_id = block.block_id
                if block_id in self._reuse_watchers:
                    stamps[block_id] = (int(self._blocks["queue_key"][block_id]), epoch) \
                        if self._ref_col[block_id] == 0 else None

    def poll_reuse(self) -> int:
        """Calls the watcher (``unpin_blocks``) of every watched block another process has
        taken since this process released it, and returns how many. In one process this
        finds nothing: the process's own ``get_new_blocks`` calls the watchers itself.

        Invariant "watch-stamp": a watched block still holds what it held when unpinned while
        this process references it, or while nobody does and its ``queue_key`` and the pool's
        ``epoch`` are those recorded at this process's last release of it (every entry into
        the free queue takes a key never used before, and a rebuild bumps the epoch). A block
        referenced by more than this process is counted as taken: conservative, a reader
        of a HiSparse page then reads the host copy, which is durable.
        """
        if not self._reuse_watchers:
            return 0
        reused: list[int] = []
        with self._lock:
            epoch = int(self._hdr64[L.H_EPOCH])
            mine = self._ledger[self.slot]
            for block_id in self._reuse_watchers:
                ref = int(self._ref_col[block_id])
                if ref > int(mine[block_id]) or ref == 0 and self._watch_stamps.get(block_id) != (
                        int(self._blocks["queue_key"][block_id]), epoch):
                    reused.append(block_id)
        self._notify_reuse([self._handle(b) for b in reused])
        return len(reused)

    def unpin_blocks(self, blocks: Iterable[KVCacheBlock],
                     on_reuse: Callable[[KVCacheBlock], None]) -> None:
        """Drops one reference from each block, which stays readable until it is reused
        (vLLM's call, for KV a reader still streams from). Blocks reaching ``ref_cnt`` 0
        join the tail of the free queue, hashed or not, so they are the last to be evicted
        and count as free; ``on_reuse(block)`` fires when this process's ``get_new_blocks``
        hands the block out again, or when its ``reset_prefix_cache`` succeeds.

        NOTE: the callbacks are this process's (vLLM's pool has one process): a block that
        another process of a shared pool allocates is reported by :meth:`poll_reuse`
        (HiSparse's coordinator polls at each step), not at the moment it happens. A block
        unpinned twice keeps the last callback, as in vLLM.

        Args:
            blocks: handles of this pool that this process holds, the null block excluded.
            on_reuse: called with the block's handle when it is reused.

        Raises:
            UsageError: a bad handle, the null block, a block unpinned more times than it is
                referenced or than this process references it, or ``on_reuse`` not
                callable. Nothing is changed then.
        """
        if not callable(on_reuse):
            raise UsageError(f"unpin_blocks(): on_reuse must be callable, got {on_reuse!r}")
        blocks = list(blocks)
        with self._lock:  # the stamps in the same hold: no other process comes between
            self._lock.mutate("unpin", self._kernel.unpin, blocks)
            for block in blocks:
                self._reuse_watchers[block.block_id] = on_reuse
            self._stamp_watched(blocks)

    def _allocate_locked(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > self._hdr64[_H_NUM_FREE]:
            self.process_table.reap_dead()  # a dead process's blocks may be the missing ones
            self._lock.savepoint()  # the reap stands, even if the allocation then fails
        evicted: list[tuple[bytes, int]] | None = [] if self.enable_kv_cache_events else None
        blocks = self._kernel.allocate(
            num_blocks, self.enable_caching, self._handles, self._handle, evicted
        )
        if evicted:
            self._record_removed(evicted)
        return blocks

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Adds a reference to each block (a prefix-cache hit), taking blocks with
        ``ref_cnt == 0`` out of the free queue. The null block is skipped.

        Raises:
            UsageError: a block id out of range.
        """
        self._lock.mutate("touch", self._kernel.touch, blocks)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock],
                    evict_first: bool = False) -> None:
        """Drops one reference from each block, given in eviction order (first evicted
        first). Blocks reaching zero go back to the free queue: unhashed ones to the front,
        hashed ones to the back, or to the front too with ``evict_first`` (blocks whose
        bytes another tier holds, to be reused before other cached blocks; they keep their
        keys until reused). The null block is skipped.

        Raises:
            UsageError: a block id out of range, or a block freed more times than it is
                referenced (a double free), or more times than this process references it.
                Nothing is changed then.
        """
        caching = self.enable_caching and not evict_first  # False: every block to the front
        if not self._tiers and not self._reuse_watchers:  # the common case, inline
            self._lock.mutate("free", self._kernel.free, ordered_blocks, caching)
            return
        if self._tiers:
            # As vLLM's pool, blocks of another pool (a tier's) are freed in theirs, after
            # this pool's own.
            ordered_blocks = list(ordered_blocks)
            other: dict[BlockPool, list[KVCacheBlock]] = {}
            for block in ordered_blocks:
                pool = getattr(block, "_pool", self)
                if pool is not self:
                    other.setdefault(pool, []).append(block)
            if other:
                self._free_own([b for b in ordered_blocks
                                if getattr(b, "_pool", self) is self], caching)
                for pool, blocks in other.items():
                    pool.free_blocks(blocks, evict_first=evict_first)
                return
        self._free_own(ordered_blocks, caching)

    def _free_own(self, blocks: Iterable[KVCacheBlock], caching: bool) -> None:
        """``free_blocks`` of this pool's own blocks; blocks unpinned with a watcher get
        their reuse stamp in the same hold (``poll_reuse``)."""
        if not self._reuse_watchers:
            self._lock.mutate("free", self._kernel.free, blocks, caching)
            return
        blocks = list(blocks)
        with self._lock:
            self._lock.mutate("free", self._kernel.free, blocks, caching)
            self._stamp_watched(blocks)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drops the prefix-cache entries of the given blocks (a KV connector failed to load
        them). Blocks stay allocated; blocks without a hash are left alone.

        Raises:
            UsageError: an id that is not an int in [0, num_gpu_blocks). Nothing is changed.
        """
        ids = list(block_ids)
        for block_id in ids:
            if isinstance(block_id, bool) or not isinstance(block_id, (int, np.integer)) or not (
                0 <= block_id < self.num_gpu_blocks
            ):
                raise UsageError(
                    f"evict_blocks(): block id {block_id!r} is not in [0, {self.num_gpu_blocks})"
                )
        self._lock.mutate("evict", self._evict_ids_locked, ids)

    def _evict_ids_locked(self, ids: list) -> None:
        for block_id in ids:
            self._evict_cached(int(block_id))

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        """Drops every prefix-cache key of one block (its own, then its alias), a
        ``BlockRemoved`` each, leaving the block where it is; vLLM's name (a Mamba
        checkpoint block overwritten by a transient state calls it).

        Returns:
            False if the block held no key.

        Raises:
            UsageError: a bad handle; nothing is changed.
        """
        block_id = self._check_block_arg(block, "_maybe_evict_cached_block")
        return self._lock.mutate("evict", self._evict_cached, block_id)

    def reset_prefix_cache(self) -> bool:
        """Empties the prefix cache, if no block but the null block is in use.

        Returns:
            True on success (an ``AllBlocksCleared`` event is recorded), False otherwise.
        """
        done = self._lock.mutate("reset", self._reset_locked)
        if done and self._reuse_watchers:  # every block's contents are forgotten
            self._notify_reuse([self._handle(b) for b in list(self._reuse_watchers)])
        return done

    def _reset_locked(self) -> bool:
        num_used = self.num_gpu_blocks - self.get_num_free_blocks()
        if num_used != 1:
            logger.warning(
                "Failed to reset prefix cache because some blocks (%d) are not freed yet",
                num_used - 1,
            )
            return False
        self._index.clear()
        if self.enable_kv_cache_events:
            self._log_events([AllBlocksCleared()])
        return True

    def get_num_free_blocks(self) -> int:
        """Blocks in the free queue (cached ones with ``ref_cnt == 0`` included)."""
        return self._hdr64[_H_NUM_FREE]

    def get_usage(self) -> float:
        """Fraction of blocks in use, the null block left out (0 for a 1-block pool)."""
        total = self.num_gpu_blocks - 1
        if not total:
            return 0
        return 1.0 - self.get_num_free_blocks() / total

    def take_events(self) -> list[KVCacheEvent]:
        """Returns the events recorded since the last call and clears them ([] if off)."""
        if not self.enable_kv_cache_events:
            return []
        # The same list stays queued: the lock's savepoint counts its entries.
        events = self._event_queue.copy()
        self._event_queue.clear()
        return events

    # ------------------------------------------------------------------ shmkv extras

    @property
    def cached_block_hash_to_block(self) -> BlockHashToBlockMap:
        return self._index

    @property
    def layout(self) -> L.Layout:
        return self._layout

    @property
    def segment_name(self) -> str:
        """The POSIX name of the pool's segment (``/shmkv-<name>-v<layout>``); the file is
        ``/dev/shm`` + this."""
        return self._segment.shm_name

    @property
    def event_log(self) -> EventLog:
        """The pool's global event ring (``capacity`` 0 when events are off). Read it
        under ``pool.lock()``: ``event_log.read_raw(cursor, limit)``."""
        return self._log

    def claim_cache_geometry(self, geometry: str) -> None:
        """Binds the pool to one geometry of its blocks' contents, or checks it is this one.

        A prefix hit hands a process KV that another process wrote: both must lay blocks out
        the same way (groups, block sizes, page sizes, context parallelism). The first call
        on a pool records a digest of ``geometry`` in the header (``cache_geometry``);
        every later one, in any process, must give the same description.

        Args:
            geometry: a canonical description of the caller's layout (the coordinator's
                ``cache_geometry()``).

        Raises:
            UsageError: not a non-empty str, or the pool is bound to another geometry;
                nothing changes.
        """
        if not isinstance(geometry, str) or not geometry:
            raise UsageError(f"claim_cache_geometry(): geometry must be a non-empty str, "
                             f"got {geometry!r}")
        digest = int.from_bytes(hashlib.blake2b(geometry.encode(), digest_size=8).digest(),
                                "little") >> 1 or 1  # 63 bits, never 0 (0: unbound)
        with self._lock:
            bound = int(self._hdr64[L.H_CACHE_GEOMETRY])
            if bound == 0:  # one aligned store, outside the journal (layout.py)
                self._hdr64[L.H_CACHE_GEOMETRY] = digest
                return
        if bound != digest:
            raise UsageError(
                f"pool {self.pool_name} holds KV laid out for another KV-cache configuration "
                f"(geometry digest {bound:#x}); this one is {geometry} ({digest:#x}). Every "
                "process sharing a pool must use the same groups, block sizes, page sizes and "
                "context parallelism: give this configuration a pool of its own")

    @property
    def cache_geometry(self) -> int:
        """The digest the pool is bound to (``claim_cache_geometry``), 0 if none yet."""
        return int(self._hdr64[L.H_CACHE_GEOMETRY])

    def num_reaped(self) -> int:
        """How many processes that died without ``close()`` have been reaped so far (the
        header's ``num_reaped``; one word, no lock: a layer above compares it with what it
        saw last to learn that some process's holds were given back)."""
        if self._segment.buf is None:
            raise PoolClosedError("the pool is closed; attach again to use it")
        return int(self._hdr64[L.H_NUM_REAPED])

    def header_snapshot(self) -> np.void:
        """A copy of the segment header, one structured record (``shmkv/pool/layout.py``,
        the header table: ``creator_pid``, ``none_hash``, ``epoch``, ``num_reaped``,
        ``num_takeovers``, ``lock_seq``, ``next_event_seq``...).

        Takes no lock (so it never counts in ``lock_seq``): hold ``pool.lock()`` around it
        for fields that agree with each other.

        Raises:
            PoolClosedError: the pool is closed.
        """
        if self._segment.buf is None:
            raise PoolClosedError("the pool is closed; attach again to use it")
        return self._header[0].copy()

    @property
    def generation(self) -> bytes:
        """The pool's ``pool_id`` (16 random bytes drawn at its creation, never changed):
        the generation of a tier made with this pool, which every other object of the tier
        records (``shmkv/pool/lifecycle.py``)."""
        return bytes(self.header_snapshot()["pool_id"])

    @property
    def segment_views(self) -> SegmentViews:
        """The segment's structured views (header words, block rows, process table,
        ledger...), as ``shmkv.pool.recovery`` reads them; raw shared state, for recovery
        and tools, not for the hot paths' callers. Raises PoolClosedError once closed."""
        return self._segment_views

    def cached_key_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """``(group ids, hashes)`` of every cached block, in block-id order (not the keys of
        blocks still being written, whose group has ``L.PENDING_GROUP_BIT``): numpy copies
        made in one short hold of the lock (a mask and a copy of the cached rows' two key
        fields; the conversion to Python objects is the caller's, after the hold). On a
        large pool prefer ``cached_key_snapshot``, whose holds are bounded."""
        with self._lock:
            rows = self._blocks[1:self.num_gpu_blocks]
            mask = _published(rows)
            return rows["group_id"][mask], rows["block_hash"][mask]

    def cached_key_snapshot(self, chunk_blocks: int = SNAPSHOT_CHUNK_BLOCKS,
                            attempts: int = SNAPSHOT_ATTEMPTS) -> KeySnapshot:
        """The key fields of every cached block, as ``cached_key_arrays``, copied in holds
        of the lock of at most ``chunk_blocks`` rows each, and consistent: the copy is of
        one state of the pool, the one right before event ``next_seq``.

        Every change of a block's key under the lock logs an event in the same hold (or
        counts one dropped), and a repair bumps the epoch; so the copy is consistent if
        every hold saw the same (``next_event_seq``, ``num_events_dropped``, ``epoch``)
        stamp. A copy whose stamp moved is started again; after ``attempts`` copies the
        last is made in one hold (``attempts`` 0: at once). Without an event log a stamp
        proves nothing, and one hold copies all.

        Raises:
            UsageError: ``chunk_blocks`` < 1 or ``attempts`` < 0.
        """
        if (isinstance(chunk_blocks, bool) or not isinstance(chunk_blocks, int) or chunk_blocks < 1
                or isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 0):
            raise UsageError(f"cached_key_snapshot(): chunk_blocks must be an int >= 1 and "
                             f"attempts an int >= 0, got {chunk_blocks!r}, {attempts!r}")
        n, hdr = self.num_gpu_blocks, self._hdr64
        words = [L.H_NEXT_EVENT_SEQ, L.H_NUM_EVENTS_DROPPED, L.H_EPOCH]
        holds = 0
        for attempt in range(1, attempts + 1 if self._log.capacity else 1):
            groups, hashes = [], []
            stamp = None
            for lo in range(1, n, chunk_blocks):
                with self._lock:
                    holds += 1
                    now = [hdr[w] for w in words]
                    if stamp is not None and now != stamp:
                        break  # the cache changed between two holds: start again
                    stamp = now
                    rows = self._blocks[lo:min(lo + chunk_blocks, n)]
                    mask = _published(rows)
                    groups.append(rows["group_id"][mask])
                    hashes.append(rows["block_hash"][mask])
            else:
                if stamp is None:  # a pool of the null block alone
                    break
                return KeySnapshot(int(stamp[0]), np.concatenate(groups),
                                   np.concatenate(hashes), attempt, holds)
        with self._lock:
            next_seq = int(hdr[L.H_NEXT_EVENT_SEQ])
            group_arr, hash_arr = self.cached_key_arrays()
        return KeySnapshot(next_seq, group_arr, hash_arr, attempts + 1, holds + 1)

    def cached_keys_by_group(self) -> dict[int, list[bytes]]:
        """The prefix cache's keys: for each KV-cache group, the hash of every block cached
        in it, in block-id order (a key several blocks hold comes once per block). Copied in
        bounded, consistent holds of the lock (``cached_key_snapshot``)."""
        snap = self.cached_key_snapshot()
        group_arr, hash_arr = snap.group_ids, snap.hashes
        groups, hashes = group_arr.tolist(), hash_arr.tolist()
        out: dict[int, list[bytes]] = {}
        for group, block_hash in zip(groups, hashes, strict=True):
            out.setdefault(group, []).append(bytes(block_hash))
        return out

    def is_block_writable(self, block: KVCacheBlock) -> bool:
        """Whether the block's holder may change its contents in place (vLLM's call): not the
        null block, exactly one reference (in any process), and no prefix-cache key, so no
        other request can reach it.

        Raises:
            UsageError: not a block handle, or an id out of range.
        """
        block_id = self._check_block_arg(block, "is_block_writable")
        if block_id == _NULL:
            return False
        with self._lock:
            handle = self._handle(block_id)
            return handle.ref_cnt == 1 and handle.block_hash is None

    def emit_cached_block_events(self, request: Any, num_cached_blocks: int, block_size: int,
                                 kv_cache_group_id: int) -> None:
        """Records a ``BlockStored`` for the first ``num_cached_blocks`` blocks of a request
        that were prefix-cache hits (vLLM's call): nothing in the pool changes, the event
        only tells consumers (a router, the cluster index) that the blocks were reused. It
        reads as vLLM's: no parent, the tokens of the whole hit, one extra-keys entry per
        block. Does nothing with events off or no hit.

        Args:
            request: anything with ``.block_hashes`` (at ``hash_block_size``) and
                ``.all_token_ids``.
            num_cached_blocks: the hit's length in blocks of ``block_size``.
            block_size: the group's block size, a multiple of ``hash_block_size``.
            kv_cache_group_id: the group.

        Raises:
            UsageError: a bad argument, or fewer hashes than the hit needs; nothing is
                recorded then.
        """
        ratio, fine_hashes = self._check_hash_run(
            "emit_cached_block_events", request, (("num_cached_blocks", num_cached_blocks),),
            num_cached_blocks, block_size, kv_cache_group_id)
        if not self.enable_kv_cache_events or num_cached_blocks == 0:
            return
        cached = [(i, fine_hashes[(i + 1) * ratio - 1]) for i in range(num_cached_blocks)]
        event = self._block_stored_event(request, cached, 0, num_cached_blocks, block_size,
                                         kv_cache_group_id, fine_hashes, ratio)
        self._lock.mutate("emit", self._log_events, [event])

    def get_free_block_ids(self) -> list[int]:
        """The free queue, head (evicted first) to tail."""
        with self._lock:
            return self.free_block_queue.get_all_free_block_ids()

    def block_rows(self) -> np.ndarray:
        """A read-only numpy view of the block rows (``layout.BLOCK_DTYPE``, one per block id,
        the sentinels left out): ``ref_cnt``, ``group_id``, ``hash_num_tokens`` and
        ``block_hash`` of every block, for vectorised scans by layers above the pool (the
        offload tier picks its victims with it). It reads live shared memory: hold
        ``pool.lock()`` for a consistent picture, and drop the view before ``close()``."""
        view = self._blocks[:self.num_gpu_blocks].view()
        view.flags.writeable = False
        return view

    def block_words(self) -> memoryview:
        """The block rows as one flat int32 memoryview, for single-field reads in hot paths
        of the layers above (a numpy scalar costs several times more): block ``b``'s field
        ``F`` is word ``b * layout.ROW_I32 + layout.F_<FIELD>`` (``F_REF``, ``F_GROUP``,
        ``F_HASH_TOKENS``). Read it only, under ``pool.lock()``; it is released by ``close()``
        (keep no slice or cast of it, which would keep the segment mapped)."""
        return self._i32

    def log_events(self, events: Sequence[KVCacheEvent]) -> int:
        """Appends events made by a layer above the pool (the offload tier's stores and
        evictions) to the global event log, in this process's name, without queueing them
        for :meth:`take_events`. A pool created without a log drops them.

        Returns:
            how many events were not logged (no log, or too large for it).

        Raises:
            UsageError: an event that is not a ``BlockStored``, ``BlockRemoved`` or
                ``AllBlocksCleared``; nothing is logged then.
        """
        events = list(events)
        for event in events:
            if not isinstance(event, (BlockStored, BlockRemoved, AllBlocksCleared)):
                raise UsageError(f"log_events(): {type(event).__name__} is not a KV-cache event")
        if not events:
            return 0
        with self._lock:
            if not self._log.capacity:
                return len(events)
            dropped = self._log.append(self.slot, events)
            if dropped:
                self._hdr_w[L.H_NUM_EVENTS_DROPPED] += dropped
            return dropped

    def check_invariants(self) -> None:
        """Checks every invariant of the shared state.

        Raises:
            InvariantViolation: listing every broken invariant (the segment is then marked
                POISONED).
        """
        if self._segment.buf is None:
            raise PoolClosedError("the pool is closed; attach again to use it")
        with self._lock:
            check_invariants(self._segment_views)
