"""Per-process counters of a pool that other processes can read: prefix-cache queries and
hits (in tokens, as vLLM counts them) and histograms of the pool lock's wait and hold
times, in a sibling segment ``/shmkv_stats-<pool>-v1``.

The pool's own state (usage, free blocks, processes, reaps, take-overs, the event log)
lives in the pool segment and any process can read it; these figures exist only inside
each scheduler process, so a process that wants them exported records them here:

```python
from shmkv.stats import PoolStats
stats = PoolStats.open(pool, time_lock=True)   # before building the KVCacheManager
...
stats.add_prefix_cache_stats(kv_cache_manager.make_prefix_cache_stats())  # each step
```

Layout (little-endian): a 64-byte header (``magic``, ``version``, ``max_processes``,
``num_buckets``), then one ``ROW_DTYPE`` row per process-table slot of the pool. A row is
written only by the process attached in that slot (no lock: one writer, aligned 8-byte
stores) and is never reset: a process that later takes the slot adds to it, so every
figure is a monotonic counter for the life of the segment, summed per slot.

Lock timing (``time_lock=True``) wraps the pool's lock object: every outermost hold of this
process (each public call, each ``with pool.lock():``) is timed, wait from before the
acquire to after it, hold from then to the release; about half a microsecond per call.
"""

from __future__ import annotations

import mmap
import os
import time
from typing import Any

import numpy as np
import posix_ipc

from shmkv import layout as L
from shmkv.errors import LayoutMismatchError, UsageError

STATS_VERSION = 1
_MAGIC = 0x5348_4B56_5354_4101  # "SHKVSTA" + 1
_HEADER_BYTES = 64

# Upper bounds of the lock-time histogram buckets, in seconds (a last bucket: +Inf).
LOCK_BUCKETS_S = (1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3,
                  5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_BOUNDS_NS = np.array([int(round(b * 1e9)) for b in LOCK_BUCKETS_S], dtype=np.int64)
NUM_BUCKETS = len(LOCK_BUCKETS_S) + 1

_HEADER_DTYPE = np.dtype([("magic", "<u8"), ("version", "<u4"), ("max_processes", "<u4"),
                          ("num_buckets", "<u4"), ("_pad", "V44")])
assert _HEADER_DTYPE.itemsize == _HEADER_BYTES

ROW_DTYPE = np.dtype(
    [
        ("pid", "<i8"),                 # the last process that wrote the row
        ("requests", "<u8"),            # prefix-cache lookups of new requests
        ("queries", "<u8"),             # their prompt tokens
        ("hits", "<u8"),                # of which found in the prefix cache
        ("preempted_requests", "<u8"),  # the same for resumed (preempted) requests
        ("preempted_queries", "<u8"),
        ("preempted_hits", "<u8"),
        ("lock_wait_count", "<u8"),
        ("lock_wait_sum_ns", "<u8"),
        ("lock_wait_buckets", "<u8", (NUM_BUCKETS,)),  # not cumulative
        ("lock_hold_count", "<u8"),
        ("lock_hold_sum_ns", "<u8"),
        ("lock_hold_buckets", "<u8", (NUM_BUCKETS,)),
    ]
)


def stats_segment_name(pool_name: str) -> str:
    """``/shmkv_stats-<pool>-v1``."""
    return L.sibling_segment_name("stats", pool_name, STATS_VERSION)


def unlink_stats(pool_name: str) -> bool:
    """Removes a pool's stats segment. False if there was none."""
    try:
        posix_ipc.unlink_shared_memory(stats_segment_name(pool_name))
    except posix_ipc.ExistentialError:
        return False
    return True


def _size(max_processes: int) -> int:
    return _HEADER_BYTES + ROW_DTYPE.itemsize * max_processes


class _StatsSegment:
    def __init__(self, pool_name: str, max_processes: int | None, create: bool) -> None:
        name = stats_segment_name(pool_name)
        flags = posix_ipc.O_CREAT if create else 0
        size = _size(max_processes) if create else 0
        shm = posix_ipc.SharedMemory(name, flags, mode=0o600, size=0)
        try:
            if create and shm.size < size:
                os.ftruncate(shm.fd, size)  # first opener sizes it; zeros = empty rows
            length = max(os.fstat(shm.fd).st_size, 0)
            if length < _HEADER_BYTES:
                raise LayoutMismatchError(f"stats segment {name} is {length} bytes long")
            self.mem = mmap.mmap(shm.fd, length)
        finally:
            shm.close_fd()
        hdr = np.ndarray((1,), _HEADER_DTYPE, buffer=self.mem)[0]
        if int(hdr["magic"]) == 0 and create:
            hdr["version"] = STATS_VERSION
            hdr["max_processes"] = max_processes
            hdr["num_buckets"] = NUM_BUCKETS
            hdr["magic"] = _MAGIC
        for field, want in (("magic", _MAGIC), ("version", STATS_VERSION),
                            ("num_buckets", NUM_BUCKETS)):
            if int(hdr[field]) != want:
                raise LayoutMismatchError(f"stats segment {name}: {field} is "
                                          f"{int(hdr[field]):#x}, expected {want:#x}")
        n = int(hdr["max_processes"])
        del hdr
        if len(self.mem) < _size(n):
            raise LayoutMismatchError(f"stats segment {name}: {len(self.mem)} bytes, "
                                      f"expected {_size(n)}")
        self.rows = np.ndarray((n,), ROW_DTYPE, buffer=self.mem, offset=_HEADER_BYTES)

    def close(self) -> None:
        self.rows = None
        try:
            self.mem.close()
        except BufferError:
            pass


def read_stats(pool_name: str) -> np.ndarray | None:
    """A copy of every slot's row, or None if no process of the pool records stats."""
    try:
        seg = _StatsSegment(pool_name, None, create=False)
    except posix_ipc.ExistentialError:
        return None
    try:
        return seg.rows.copy()
    finally:
        seg.close()


class _TimedLock:
    """The pool's lock with every outermost hold of this process timed into a row."""

    def __init__(self, inner: Any, stats: PoolStats) -> None:
        self._inner = inner
        self._stats = stats
        self._depth = 0
        self._held_since = 0

    def acquire(self) -> None:
        if self._depth:
            self._inner.acquire()
            self._depth += 1
            return
        t0 = time.perf_counter_ns()
        self._inner.acquire()
        t1 = time.perf_counter_ns()
        self._depth = 1
        self._held_since = t1
        self._stats._observe("lock_wait", t1 - t0)

    def release(self) -> None:
        self._depth -= 1
        if self._depth:
            self._inner.release()
            return
        held = time.perf_counter_ns() - self._held_since
        self._inner.release()
        self._stats._observe("lock_hold", held)

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


class PoolStats:
    """This process's row of a pool's stats segment. Open it with :meth:`open`."""

    def __init__(self, pool, seg: _StatsSegment) -> None:
        self._pool = pool
        self._seg = seg
        if pool.slot >= len(seg.rows):
            raise UsageError(f"stats segment has {len(seg.rows)} rows, slot {pool.slot} "
                             "is out of range")
        self._row = seg.rows[pool.slot]
        self._row["pid"] = os.getpid()
        self._timed: _TimedLock | None = None

    @classmethod
    def open(cls, pool, time_lock: bool = False) -> PoolStats:
        """Opens (creating if needed) the stats segment of an attached pool, for this
        process's slot. ``time_lock`` times every hold of the pool lock from now on (open
        it before building managers, which keep a reference to the lock)."""
        seg = _StatsSegment(pool.pool_name, pool.layout.config.max_processes, create=True)
        stats = cls(pool, seg)
        if time_lock:
            stats.time_lock()
        return stats

    def time_lock(self) -> None:
        """Wraps the pool's lock so that every hold is timed (idempotent)."""
        if self._timed is None:
            if isinstance(self._pool._lock, _TimedLock):
                raise UsageError("the pool's lock is timed by another PoolStats already")
            if self._pool._lock.held:
                raise UsageError("time_lock(): call it outside any hold of the pool lock")
            self._timed = _TimedLock(self._pool._lock, self)
            self._pool._lock = self._timed

    def _observe(self, what: str, ns: int) -> None:
        row = self._row
        row[f"{what}_count"] += 1
        row[f"{what}_sum_ns"] += ns
        row[f"{what}_buckets"][int(np.searchsorted(_BOUNDS_NS, ns))] += 1

    def add_prefix_cache(self, queries: int, hits: int, requests: int = 1,
                         preempted: bool = False) -> None:
        """Counts ``requests`` lookups of ``queries`` prompt tokens, ``hits`` of them hit."""
        row = self._row
        prefix = "preempted_" if preempted else ""
        row[f"{prefix}requests"] += requests
        row[f"{prefix}queries"] += queries
        row[f"{prefix}hits"] += hits

    def add_prefix_cache_stats(self, stats) -> None:
        """Adds a ``PrefixCacheStats`` (shmkv's or vLLM's; None is ignored)."""
        if stats is None:
            return
        self.add_prefix_cache(stats.queries, stats.hits, stats.requests)
        if stats.preempted_requests:
            self.add_prefix_cache(stats.preempted_queries, stats.preempted_hits,
                                  stats.preempted_requests, preempted=True)

    @property
    def row(self) -> np.ndarray:
        """A copy of this process's row."""
        return self._row.copy()

    def close(self) -> None:
        """Stops timing the lock and unmaps the row (the figures stay in the segment)."""
        if self._timed is not None and self._pool._lock is self._timed:
            self._pool._lock = self._timed._inner
        self._timed = None
        self._row = None
        self._seg.close()
