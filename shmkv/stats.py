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

Layout (little-endian): a 192-byte header (``magic``, ``version``, ``max_processes``,
``num_buckets``; at byte 64 the owner record of ``shmkv/pool/layout.py``, "Sibling segments":
the pool, no creator, for the segment lives as long as its pool), then one ``ROW_DTYPE`` row
per process-table slot of the pool. A row is written only by the process attached in that
slot (no lock: one writer, aligned 8-byte stores) and is never reset: a process that later
takes the slot adds to it, so every figure is a monotonic counter for the life of the
segment, summed per slot.

Lock timing (``time_lock=True``) uses the record the pool's lock keeps when asked to (the
C and the Python lock both append ``(wait_ns, hold_ns)`` for every outermost hold):
``sync()`` bins them into the row's histograms (vectorised) and empties the
record. ``add_prefix_cache``/``add_prefix_cache_stats``, ``row`` and ``close`` sync, so a
scheduler that adds its stats once per step needs nothing more; a process that times the
lock but never syncs grows the record by about 80 bytes per hold. Measured with
``benchmarks/bench_events.py``: a one-block ``get_new_blocks`` + ``free_blocks`` pair (two
holds) 2.0 us without, 3.6 us with, binning included (C kernel, loaded 2-core machine).
"""

from __future__ import annotations

import mmap
import os
from itertools import chain

import numpy as np
import posix_ipc

from shmkv.errors import LayoutMismatchError, UsageError
from shmkv.pool import layout as L
from shmkv.pool.segment import open_shm, reserve
from shmkv.pool.siblings import owner_record, write_owner

STATS_VERSION = L.STATS_VERSION
_MAGIC = L.STATS_MAGIC
_HEADER_BYTES = L.STATS_OWNER_OFFSET + 128

# Upper bounds of the lock-time histogram buckets, in seconds (a last bucket: +Inf).
LOCK_BUCKETS_S = (1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3,
                  5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_BOUNDS_NS = np.array([int(round(b * 1e9)) for b in LOCK_BUCKETS_S], dtype=np.int64)
NUM_BUCKETS = len(LOCK_BUCKETS_S) + 1

_HEADER_DTYPE = np.dtype([("magic", "<u8"), ("version", "<u4"), ("max_processes", "<u4"),
                          ("num_buckets", "<u4"), ("_pad", "V44"), ("owner", "V128")])
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


_OFF = {name: ROW_DTYPE.fields[name][1] // 8 for name in ROW_DTYPE.names}
_WORD = {what: (_OFF[f"{what}_count"], _OFF[f"{what}_sum_ns"], _OFF[f"{what}_buckets"])
         for what in ("lock_wait", "lock_hold")}


def stats_segment_name(pool_name: str) -> str:
    """``/shmkv_stats-<pool>-v<STATS_VERSION>``."""
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
        size = _size(max_processes) if create else 0
        # created exclusively with its pages reserved, or this user's with mode 0600
        shm = open_shm(name, "stats segment", create=create, size=size)
        try:
            if create and shm.size < size:  # another opener's, not sized yet
                os.ftruncate(shm.fd, size)  # zeros = empty rows
                reserve(shm.fd, size, f"stats segment {name}")
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
            write_owner(self.mem, L.STATS_OWNER_OFFSET, owner_record(pool_name, creator=False))
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
        # the hot path writes through a flat u64 view (a numpy field store costs ~1 us)
        start = _HEADER_BYTES + pool.slot * ROW_DTYPE.itemsize
        self._words = memoryview(seg.mem)[start:start + ROW_DTYPE.itemsize].cast("Q")
        self._timed = None  # the lock whose record this object drains

    @classmethod
    def open(cls, pool, time_lock: bool = False) -> PoolStats:
        """Opens (creating if needed) the stats segment of an attached pool, for this
        process's slot. ``time_lock`` times every hold of the pool lock from now on (open
        it at any time: it only asks the lock to keep a record)."""
        seg = _StatsSegment(pool.pool_name, pool.layout.config.max_processes, create=True)
        stats = cls(pool, seg)
        if time_lock:
            stats.time_lock()
        return stats

    def time_lock(self) -> None:
        """Times every hold of the pool lock from now on (idempotent)."""
        if self._timed is None:
            lock = self._pool.lock()
            if lock.record is not None:
                raise UsageError("the pool lock's record is in use already (another "
                                 "PoolStats, or a benchmark)")
            lock.record = []
            self._timed = lock

    def sync(self) -> None:
        """Bins the holds recorded since the last sync into the histograms."""
        lock = self._timed
        if lock is None or self._words is None:
            return
        record = lock.record
        if not record:
            return
        lock.record = []
        if record[-1][1] == 0 and lock.held:
            record, lock.record = record[:-1], record[-1:]  # a hold still going on
        if not record:
            return
        times = np.fromiter(chain.from_iterable(record), dtype=np.int64,
                            count=2 * len(record)).reshape(-1, 2)
        words = self._words
        for column, (count, total, buckets) in ((0, _WORD["lock_wait"]),
                                                (1, _WORD["lock_hold"])):
            values = times[:, column]
            words[count] += len(values)
            words[total] += int(values.sum())
            binned = np.bincount(np.searchsorted(_BOUNDS_NS, values), minlength=NUM_BUCKETS)
            for i in np.flatnonzero(binned).tolist():
                words[buckets + i] += int(binned[i])

    def add_prefix_cache(self, queries: int, hits: int, requests: int = 1,
                         preempted: bool = False) -> None:
        """Counts ``requests`` lookups of ``queries`` prompt tokens, ``hits`` of them hit."""
        self.sync()
        words = self._words
        prefix = "preempted_" if preempted else ""
        words[_OFF[f"{prefix}requests"]] += requests
        words[_OFF[f"{prefix}queries"]] += queries
        words[_OFF[f"{prefix}hits"]] += hits

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
        """A copy of this process's row (after a ``sync``)."""
        self.sync()
        return self._row.copy()

    def close(self) -> None:
        """Syncs, stops timing the lock and unmaps the row (the figures stay)."""
        self.sync()
        if self._timed is not None:
            try:
                self._timed.record = None
            except Exception:  # noqa: BLE001  (the pool was closed first)
                pass
        self._timed = None
        self._row = None
        if self._words is not None:
            self._words.release()
            self._words = None
        self._seg.close()
