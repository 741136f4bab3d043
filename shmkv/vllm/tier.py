"""The tier table: what the offload tier keeps beside its pool, in one sibling segment
``/shmkv_offload-<pool>-v<TIER_VERSION>``.

Layout (int64 words unless said otherwise; written under the pool lock, by any process of
the tier):

    word 0     magic (last word written at creation: the table is complete)
    word 1     TIER_VERSION | num_chunks << 32
    word 2     the LRU rank counter (vLLM's request-scoped ranks, manager.py)
    word 3     the generation, bumped by every reset_cache
    word 4     length of the identity (JSON) at byte IDENTITY_OFFSET; 0: none recorded yet
    word 5     the data region's tag: a random non-zero word written into the region's
               trailer when a worker makes the region; 0: no region bound yet (region.py)
    words 6-9  the eviction heap's size, the free stack's top, the LRU's dirty flag, the
               pool's reap count the orphans were last collected at (lru.py)
    word 10    the inode of the replica lock file the tier's rows are held on (replicas.py);
               0: none recorded yet
    word 11    the inode of the bound data region (region.py): a copy renamed over it,
               trailer and all, is another file, never the bound region
    words 12-13 the tier's generation: the pool_id of the pool the table was made with
               (``shmkv/pool/lifecycle.py``); a table of another generation is never used
    words 16.. MAX_REPLICAS replica keys, one per replica row (0: the row is free)
    words 80.. MAX_REPLICAS region tags: the region the row's workers mapped (0: no worker;
               REGION_MIXED: its workers mapped different regions, region.py)
    byte 1152  the identity of the tier's first replica (identity.py), up to the owner record
    byte 3968  the owner record that tells ``shmkv cleanup`` the table goes with its pool
    byte 4096  the counter block (``shmkv/pool/tier_counters.py``): the node's row, then one
               per replica row: chunks stored, loaded, loaded from another replica's stores
    byte 8192  ranks: int64 [num_chunks + 1], one LRU rank per block (block 0 unused)
    then       jobs: uint64 [num_chunks + 1], bit r set while replica row r has a store, a
               load or an unflushed reset on the block (replicas.py)
    then       heap_rank: int64 [heap_capacity], heap_block: int32 [heap_capacity] and
               free_stack: int32 [num_chunks + 1 + 64]: the eviction heap and the free
               chunks (lru.py), with heap_capacity = 4 * (num_chunks + 1) + 64
    then       producer: int32 [num_chunks + 1], 1 + the replica row whose store made the
               chunk ready (for the cross-replica hit count; advice only)

A rank is advice, never an invariant: a word left behind by a killed process still orders
chunks validly, so the table needs no journal. A job bit left behind by a killed process
keeps its chunk out of use until every process of its replica is gone, which is the point.
"""

from __future__ import annotations

import time

import numpy as np

from shmkv.errors import (
    LayoutMismatchError,
    SegmentError,
    SegmentExistsError,
    SegmentNotFoundError,
)
from shmkv.pool import layout as L
from shmkv.pool import lifecycle as LC
from shmkv.pool import tier_counters as TC
from shmkv.pool.block_pool import BlockPool
from shmkv.pool.segment import Segment
from shmkv.pool.siblings import owner_record, write_owner

TIER_KIND = "offload"
TIER_VERSION = L.OFFLOAD_TIER_VERSION
TIER_MAGIC = L.OFFLOAD_TIER_MAGIC
HEADER_BYTES = 4096
MAX_REPLICAS = TC.OFFLOAD_MAX_REPLICAS  # one job bit per replica row in a uint64
COUNTERS_AT = TC.OFFLOAD_COUNTERS_OFFSET
BODY_AT = COUNTERS_AT + 4096  # the counter block, padded to a page

W_MAGIC, W_VERSION_CHUNKS, W_NEXT_RANK, W_GENERATION, W_IDENTITY_LEN, W_REGION_TAG = range(6)
W_HEAP_SIZE, W_FREE_TOP, W_LRU_DIRTY, W_REAPED_SEEN = range(6, 10)  # lru.py
W_REPLICA_FILE = 10  # replicas.py
W_REGION_INODE = 11  # region.py
W_GENERATION_TIER = LC.TABLE_GENERATION_WORD  # words 12-13: the pool's pool_id
REGION_MIXED = -1  # a row whose workers mapped different regions: never the tier's tag
PENDING_BIT = L.PENDING_GROUP_BIT  # the group-id bit of a chunk whose store is in flight
W_REPLICA_KEYS = TC.OFFLOAD_REPLICA_KEYS_WORD
W_REPLICA_REGION = W_REPLICA_KEYS + MAX_REPLICAS
IDENTITY_OFFSET = 8 * (W_REPLICA_REGION + MAX_REPLICAS)
IDENTITY_MAX = L.OFFLOAD_TIER_OWNER_OFFSET - IDENTITY_OFFSET


def tier_table_name(pool: str) -> str:
    """The POSIX name of a pool's tier table: ``/shmkv_offload-<pool>-v<TIER_VERSION>``."""
    return L.sibling_segment_name(TIER_KIND, pool, TIER_VERSION)


def heap_capacity(num_chunks: int) -> int:
    return 4 * (num_chunks + 1) + 64


def table_bytes(num_chunks: int) -> int:
    cap = heap_capacity(num_chunks)
    return BODY_AT + 16 * (num_chunks + 1) + 12 * cap + 4 * (num_chunks + 1 + 64) \
        + 4 * (num_chunks + 1)


class TierTable:
    """One process's mapping of the tier table, with numpy views of its parts."""

    def __init__(self, seg: Segment, num_chunks: int) -> None:
        self._seg = seg
        n = num_chunks + 1
        buf = seg.buf
        self.header = np.frombuffer(buf, np.int64, HEADER_BYTES // 8)
        self.ranks = np.frombuffer(buf, np.int64, n, BODY_AT)
        self.jobs = np.frombuffer(buf, np.uint64, n, BODY_AT + 8 * n)
        cap = heap_capacity(num_chunks)
        heap_at = BODY_AT + 16 * n
        self.heap_rank = np.frombuffer(buf, np.int64, cap, heap_at)
        self.heap_block = np.frombuffer(buf, np.int32, cap, heap_at + 8 * cap)
        self.free_stack = np.frombuffer(buf, np.int32, n + 64, heap_at + 12 * cap)
        self.producer = np.frombuffer(buf, np.int32, n, heap_at + 12 * cap + 4 * (n + 64))
        self.replica_keys = self.header[W_REPLICA_KEYS:W_REPLICA_KEYS + MAX_REPLICAS]
        self.replica_region = self.header[W_REPLICA_REGION:W_REPLICA_REGION + MAX_REPLICAS]
        # A memoryview of the header words: a scalar store through it costs a fraction of
        # numpy's, and the rank counter is bumped on every store and lookup hit.
        self._mv = memoryview(buf)
        self.words = self._mv[:HEADER_BYTES].cast("q")
        self.counter_words = self._mv[COUNTERS_AT:COUNTERS_AT + TC.block_bytes(
            MAX_REPLICAS)].cast("q")  # tier_counters.py: row 0 the node, r + 1 replica r
        self.rank_words = self._mv[BODY_AT:BODY_AT + 8 * n].cast("q")
        self.job_words = self._mv[BODY_AT + 8 * n:BODY_AT + 16 * n].cast("Q")
        self.heap_rank_words = self._mv[heap_at:heap_at + 8 * cap].cast("q")
        self.heap_block_words = self._mv[heap_at + 8 * cap:heap_at + 12 * cap].cast("i")
        free_at = heap_at + 12 * cap
        self.free_words = self._mv[free_at:free_at + 4 * (n + 64)].cast("i")
        producer_at = free_at + 4 * (n + 64)
        self.producer_words = self._mv[producer_at:producer_at + 4 * n].cast("i")

    def read_identity(self) -> bytes:
        size = int(self.header[W_IDENTITY_LEN])
        return bytes(self._seg.buf[IDENTITY_OFFSET:IDENTITY_OFFSET + size])

    def write_identity(self, blob: bytes) -> None:
        self._seg.buf[IDENTITY_OFFSET:IDENTITY_OFFSET + len(blob)] = blob
        self.header[W_IDENTITY_LEN] = len(blob)

    def close(self) -> None:
        for view in (self.words, self.counter_words, self.rank_words, self.job_words,
                     self.heap_rank_words, self.heap_block_words, self.free_words,
                     self.producer_words):
            view.release()
        self._mv.release()
        del self.header, self.ranks, self.jobs, self.replica_keys, self.replica_region
        del self.heap_rank, self.heap_block, self.free_stack, self.producer
        self._seg.close()


def open_tier_table(pool: BlockPool, pool_name: str, num_chunks: int,
                    created: bool) -> TierTable:
    """Opens (or makes) the tier table of ``pool`` under its lock, so that one process
    initialises it; ``created``: this process just made the pool, so any table found is
    of an earlier generation. A table recording another generation than the pool's is
    never used (``shmkv/pool/lifecycle.py``, rules 1 and 3).

    Raises:
        LayoutMismatchError: the table is foreign, of another version or chunk count; or
            the pool lost its table while other processes hold the tier.
    """
    name = tier_table_name(pool_name)
    size = table_bytes(num_chunks)
    generation = pool.generation
    with pool.lock():
        seg = _open_table(name)
        if seg is not None and not created:
            found = _recorded_generation(seg)
            if found is not None and found != generation:  # a removed tier's table
                seg.close()
                seg = None
        if seg is not None and created and len(seg.buf) != size:
            seg.close()
            seg = None
        if seg is None:
            if not created:
                _forget_for_new_table(pool, pool_name)
            Segment.unlink(name)  # an earlier generation's, if any (nobody believes it)
            seg = Segment.create(name, size)
            created = True
        try:
            hdr = np.frombuffer(seg.buf, np.int64, 16)
            if len(seg.buf) < size and not created:
                raise LayoutMismatchError(
                    f"tier table {name} is {len(seg.buf)} bytes; {num_chunks} chunks need "
                    f"{size}"
                )
            magic = int(hdr[W_MAGIC]) & 0xFFFF_FFFF_FFFF_FFFF
            if created or magic == 0:  # ours to fill (or its filler died half way)
                seg.buf[:size] = bytes(size)
                write_owner(seg.buf, L.OFFLOAD_TIER_OWNER_OFFSET,
                            owner_record(pool_name, creator=False))
                at = 8 * W_GENERATION_TIER
                seg.buf[at:at + LC.GENERATION_BYTES] = generation
                hdr[W_VERSION_CHUNKS] = (num_chunks << 32) | TIER_VERSION
                hdr[W_LRU_DIRTY] = 1  # the first holder builds the free stack (lru.py)
                hdr[W_MAGIC] = np.int64(TIER_MAGIC)  # last: the table is complete
            elif magic != TIER_MAGIC:
                raise LayoutMismatchError(
                    f"tier table {name}: magic expected {TIER_MAGIC:#x}, found {magic:#x}: "
                    "not a shmkv offload tier table"
                )
            else:
                word = int(hdr[W_VERSION_CHUNKS])
                if word & 0xFFFF_FFFF != TIER_VERSION or word >> 32 != num_chunks:
                    raise LayoutMismatchError(
                        f"tier table {name}: version {word & 0xFFFF_FFFF} with {word >> 32} "
                        f"chunks, expected version {TIER_VERSION} with {num_chunks}"
                    )
            del hdr
            return TierTable(seg, num_chunks)
        except BaseException:
            seg.close()
            raise


def _open_table(name: str) -> Segment | None:
    try:
        return Segment.open(name)
    except SegmentNotFoundError:
        return None


def _recorded_generation(seg: Segment) -> bytes | None:
    """The generation a complete table records; None for one whose filler has not
    finished (or died half way): it is filled again, with the pool's."""
    if len(seg.buf) < HEADER_BYTES or not int.from_bytes(seg.buf[:8], "little"):
        return None
    at = 8 * W_GENERATION_TIER
    return bytes(seg.buf[at:at + LC.GENERATION_BYTES])


def _forget_for_new_table(pool: BlockPool, pool_name: str) -> None:
    """Before a table is made again for a pool that outlived its own (removed alone, by
    hand or a tmp cleaner): refuses while any other process holds the tier, since they keep
    using the old table; else forgets every key of the pool, whose bytes no table vouches
    for now (caller holds the pool lock).

    Raises:
        LayoutMismatchError: other processes hold the tier (each reason named).
    """
    pool.reap_dead()
    others = [p for p in pool.processes() if not p["self"] and p["alive"]]
    reasons = LC.holders(pool_name)
    if others:
        reasons.insert(0, f"{len(others)} process(es) attached to the pool (pid "
                          f"{', '.join(str(p['pid']) for p in others)})")
    if reasons:
        raise LayoutMismatchError(
            f"pool {pool_name!r}: its tier table {tier_table_name(pool_name)} was removed "
            f"while the tier is in use ({'; '.join(reasons)}): the pool's keys name bytes "
            "that no table vouches for. Stop every replica of the tier and start them "
            f"again (`shmkv unlink --force {pool_name}` removes the tier), or use another "
            "shmkv_pool"
        )
    rows = pool.block_rows()
    keyed = np.flatnonzero(rows["hash_num_tokens"] != L.NO_HASH_TOKENS)
    del rows
    keyed = keyed[keyed > 0].tolist()
    if keyed:
        pool.evict_blocks(keyed)


MEDIUM = "CPU"
ATTACH_TIMEOUT_S = 10.0  # how long an attacher waits for the pool's creator to finish


def open_pool(pool: str, num_chunks: int, max_processes: int, event_log_bytes: int | None,
              process: dict) -> tuple[BlockPool, bool]:
    """Creates the tier's pool (``num_chunks + 1`` blocks, medium CPU, one token per hash),
    or attaches to it; returns (pool, created). ``process``: ``label`` and lock settings.

    Raises:
        LayoutMismatchError: the pool is not an offload tier, or holds another number of
            chunks (both named).
        SegmentError: the pool belongs to another user, or is not READY in time.
    """
    if event_log_bytes is None:
        event_log_bytes = L.DEFAULT_EVENT_LOG_BYTES
    deadline = time.monotonic() + ATTACH_TIMEOUT_S
    while True:
        try:
            return BlockPool.create(
                pool, num_chunks + 1, enable_caching=True, hash_block_size=1,
                enable_kv_cache_events=False, medium=MEDIUM, max_processes=max_processes,
                event_log_bytes=event_log_bytes, **process,
            ), True
        except SegmentExistsError:
            pass
        try:
            bp = BlockPool.attach(pool, **process)
        except SegmentNotFoundError:
            continue  # its creator failed and removed it: create it ourselves
        except SegmentError as exc:
            if _being_made(exc) and time.monotonic() < deadline:
                time.sleep(0.01)
                continue
            raise
        try:
            _check_pool(bp, pool, num_chunks)
        except BaseException:
            bp.close()
            raise
        return bp, False


def _being_made(exc: SegmentError) -> bool:
    """Whether an attach failed because the pool's creator has not finished it: replicas
    start together, and an attacher can map the segment before its creator sized it, wrote
    its header or marked it READY."""
    text = str(exc)
    return ("INITIALIZING" in text or "smaller than a shmkv header" in text
            or "header field magic is '0x0'" in text)


def _check_pool(bp: BlockPool, pool: str, num_chunks: int) -> None:
    if bp.medium != MEDIUM or bp.hash_block_size != 1 or not bp.enable_caching:
        raise LayoutMismatchError(
            f"pool {pool!r} is not an offload tier (medium {bp.medium!r}, hash_block_size "
            f"{bp.hash_block_size}; a tier has medium {MEDIUM!r}, hash_block_size 1)"
        )
    if bp.num_gpu_blocks - 1 != num_chunks:
        raise LayoutMismatchError(
            f"pool {pool!r} holds {bp.num_gpu_blocks - 1} chunks, this replica has "
            f"num_chunks={num_chunks}: every replica must use the same cpu_bytes_to_use and "
            f"KV layout. To start the tier afresh, stop every replica using it and run "
            f"`shmkv unlink {pool}`"
        )
