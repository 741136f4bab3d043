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
               (65 rows of 64 bytes: to byte 8256)
    byte 8256  labels: LABEL_DTYPE [MAX_REPLICAS], 128 bytes each: replica row r's replica
               as vLLM names it (below)
    BODY_AT    (the next page: byte 20480) ranks: int64 [num_chunks + 1], one LRU rank per
               block (block 0 unused)
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

A replica's label (``LABEL_DTYPE``, laid out in ``shmkv/pool/tier_counters.py``, where
``shmkv inspect`` reads it without vLLM) names the row for operators, since its key is a
digest (``replicas.replica_key``):

    key        int64   the replica key the label belongs to; a reader shows the label only
                       for the row that key holds (a row another replica took reads as
                       unlabelled until that one's join writes its own)
    dp_rank    int32   vLLM's data-parallel rank of the engine (``data_parallel_index``, the
                       rank of ``EngineCore_DP<n>``: vLLM resets ``data_parallel_rank`` to 0
                       for each rank of a dense model, and keeps it in the index);
                       NO_DP_RANK (-1): not said
    core_pid   int32   the engine core's pid, in its own pid namespace; 0: no engine core
                       joined the row yet (its GPU workers join first)
    engine_id  112 B   vLLM's ``kv_transfer_config.engine_id`` (the string vLLM logs, with
                       the ``_dp<n>`` vLLM appends in each rank of a data-parallel engine),
                       UTF-8, NUL-padded; b"": not said. An id longer than 112 bytes
                       keeps its first whole characters that fit in 109 bytes and ends
                       with TRUNCATED_MARK ("…", 3 bytes)

Only ``replicas.join`` writes a label (:func:`write_label`, under the pool lock): every
process of a replica writes the fields it knows when it joins its row (its workers the engine
id and rank, its engine core those and its pid). Another replica's label is blanked first,
key included, and the key is written last, so a process killed half way leaves a label no
reader believes. A label is advice for people: the tier never reads one.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from shmkv.errors import UsageError
from shmkv.pool import layout as L
from shmkv.pool import lifecycle as LC
from shmkv.pool import tier_counters as TC
from shmkv.pool.segment import Segment

TIER_KIND = "offload"
TIER_VERSION = L.OFFLOAD_TIER_VERSION
TIER_MAGIC = L.OFFLOAD_TIER_MAGIC
HEADER_BYTES = 4096
MAX_REPLICAS = TC.OFFLOAD_MAX_REPLICAS  # one job bit per replica row in a uint64
COUNTERS_AT = TC.OFFLOAD_COUNTERS_OFFSET
PAGE_BYTES = 4096
LABELS_AT = TC.OFFLOAD_LABELS_OFFSET  # right after the counter block (v4's overran its page)
LABEL_DTYPE = TC.LABEL_DTYPE
ENGINE_ID_BYTES = TC.ENGINE_ID_BYTES
NO_DP_RANK = TC.NO_DP_RANK
TRUNCATED_MARK = "\u2026"  # "…": ends an engine id cut to fit ENGINE_ID_BYTES
MAX_DP_RANK = 2**31 - 1
# the labels, padded to a page
BODY_AT = -(-(LABELS_AT + MAX_REPLICAS * LABEL_DTYPE.itemsize) // PAGE_BYTES) * PAGE_BYTES

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


class ReplicaLabel(NamedTuple):
    """What a replica says of itself for its row's label (:func:`replica_label`)."""

    dp_rank: int  # NO_DP_RANK: not said
    engine_id: bytes  # UTF-8, cut to ENGINE_ID_BYTES with TRUNCATED_MARK; b"": not said


def replica_label(dp_rank: int | None, engine_id: str | None) -> ReplicaLabel:
    """Checks and encodes a replica's label: its data-parallel rank and vLLM's engine id
    (None: not said). An engine id longer than ENGINE_ID_BYTES in UTF-8 keeps its first
    whole characters and ends with TRUNCATED_MARK, within ENGINE_ID_BYTES.

    Raises:
        UsageError: ``dp_rank`` is not an int in [0, 2**31 - 1], or ``engine_id`` not a str.
    """
    if dp_rank is not None and (isinstance(dp_rank, bool) or not isinstance(dp_rank, int)
                                or not 0 <= dp_rank <= MAX_DP_RANK):
        raise UsageError(f"dp_rank must be an int in [0, {MAX_DP_RANK}] (vLLM's data-parallel "
                         f"rank of the engine) or None, got {dp_rank!r}")
    if engine_id is not None and not isinstance(engine_id, str):
        raise UsageError(f"engine_id must be a str (vLLM's kv_transfer_config.engine_id) or "
                         f"None, got {engine_id!r}")
    raw = (engine_id or "").encode("utf-8", "replace")
    if len(raw) > ENGINE_ID_BYTES:
        mark = TRUNCATED_MARK.encode()
        kept = raw[:ENGINE_ID_BYTES - len(mark)].decode("utf-8", "ignore")  # whole characters
        raw = kept.encode() + mark
    return ReplicaLabel(NO_DP_RANK if dp_rank is None else dp_rank, raw)


def write_label(tier: TierTable, row: int, key: int, label: ReplicaLabel | None,
                core_pid: int = 0) -> None:
    """Writes replica ``key``'s label of row ``row``: the fields ``label`` says and
    ``core_pid`` (0: not an engine core), over the row's label if it is ``key``'s, else over
    a blank one; the key last (caller holds the pool lock)."""
    rec = tier.labels[row:row + 1]  # a view: each store goes to the table
    if int(rec["key"][0]) != key:
        rec["key"] = 0
        rec["dp_rank"] = NO_DP_RANK
        rec["core_pid"] = 0
        rec["engine_id"] = b""
    if label is not None and label.dp_rank != NO_DP_RANK:
        rec["dp_rank"] = label.dp_rank
    if label is not None and label.engine_id:
        rec["engine_id"] = label.engine_id
    if core_pid:
        rec["core_pid"] = core_pid
    rec["key"] = key


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
        self.labels = np.ndarray((MAX_REPLICAS,), LABEL_DTYPE, buffer=buf, offset=LABELS_AT)
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
        del self.labels
        del self.heap_rank, self.heap_block, self.free_stack, self.producer
        self._seg.close()


