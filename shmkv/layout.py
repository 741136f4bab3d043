"""The shared-memory layout of a shmkv pool: the single source of truth.

One POSIX shared-memory object per pool, named ``/shmkv-<pool name>-v<LAYOUT_VERSION>``.
It holds a fixed header followed by regions at 64-byte aligned offsets. ``REGIONS`` below is
the table in code; this docstring renders the same table, and a unit test checks that every
region and every field named in the code appears here.

Regions
-------

| # | region          | dtype         | shape                  | written by                 | read by | guarded by | invariants |
|---|-----------------|---------------|------------------------|----------------------------|---------|------------|------------|
| 0 | `header`        | HEADER_DTYPE  | `[1]` (192 B)          | creator; then the pool     | all     | pool lock (mutable part) | INV-HDR, INV-CONSERVE |
| 1 | `block_meta`    | BLOCK_DTYPE   | `[num_blocks + 2]`     | `BlockPool`, `FreeKVCacheBlockQueue` (links only), `BlockHashToBlockMap` (`index_next` only) | all | pool lock | INV-FREE, INV-QKEY, INV-REF, INV-HASH |
| 2 | `index_buckets` | int32         | `[num_index_buckets]`  | `BlockHashToBlockMap`      | all     | pool lock  | INV-HASH |

Header (little-endian; offsets in bytes)
----------------------------------------

Immutable after creation (the "config echo", validated by every attach, in this order):

- `magic` (u64, 0): ``MAGIC``; its bytes are all different, so a byte-swapped or foreign
  segment never passes. Written once by the creator.
- `layout_version` (u32, 8): ``LAYOUT_VERSION``; bumped on any change to this file's tables.
- `format_flags` (u32, 12): feature bits that change what the regions mean
  (``FLAG_PREFIX_CACHING``, ``FLAG_KV_EVENTS``).
- `header_bytes` (u32, 16): ``HEADER_DTYPE.itemsize``.
- `state` (u32, 20): ``STATE_INITIALIZING`` while the creator fills the segment, then
  ``STATE_READY``; ``STATE_POISONED`` once ``check_invariants`` has found corruption.
- `total_bytes` (u64, 24): the size the layout formula gives; the segment must be that big.
- `num_blocks` (u32, 32): ``num_gpu_blocks``; block 0 is the null block.
- `hash_block_size` (u32, 36): tokens per hash unit of ``request.block_hashes``.
- `num_index_buckets` (u32, 40): size of region 2, a power of two >= 2 * num_blocks.
- `block_hash_bytes` (u32, 44): ``BLOCK_HASH_BYTES`` (32: sha256 and sha256_cbor digests).
- `creator_pid` (u32, 48): the pid that created the segment.
- `medium` (S8, 56): the storage medium named in KV events (``"GPU"`` by default).

Mutable, written only under the pool lock:

- `epoch` (u64, 64): bumped whenever the pool is re-initialised or repaired.
- `num_free_blocks` (i64, 72): length of the free queue.
- `queue_head_key` (i64, 80): the smallest queue key handed out so far (``prepend_n``).
- `queue_tail_key` (i64, 88): the largest queue key handed out so far (``append_n``).
- `none_hash` (V32, 96): reserved for the NONE_HASH seed every process must share.
- 64 bytes of padding, reserved.

Block rows (``BLOCK_DTYPE``, 64 bytes, one per block plus two sentinel rows)
----------------------------------------------------------------------------

| field             | type | meaning |
|-------------------|------|---------|
| `ref_cnt`         | i32  | references held by requests; 0 means the block is in the free queue (except the null block, whose count is never maintained) |
| `prev`, `next`    | i32  | free-queue links: row indices, ``NO_BLOCK`` (-1) when the block is not queued. Only `FreeKVCacheBlockQueue` writes them. |
| `index_next`      | i32  | next block in the same prefix-index bucket chain, ``NO_BLOCK`` at the end. Only `BlockHashToBlockMap` writes it. |
| `group_id`        | u32  | KV-cache group of `block_hash` |
| `hash_num_tokens` | i32  | prefix tokens the hash covers; ``NO_HASH_TOKENS`` (0) means "no hash" |
| `queue_key`       | i64  | order key in the free queue: strictly increasing from head to tail, so the LRU order can be rebuilt by sorting |
| `block_hash`      | V32  | the 32-byte chained block hash (without the group id) |

Rows ``0 .. num_blocks - 1`` are blocks (row = block id). Row ``free_head = num_blocks`` and
row ``free_tail = num_blocks + 1`` are the free queue's sentinels: ``block_meta[free_head].next``
is the first free block and ``block_meta[free_tail].prev`` the last. An empty queue links the
two sentinels to each other.

The prefix-cache index (regions 1 and 2)
-----------------------------------------

A chained hash table keyed by ``(block_hash, group_id)``: ``index_buckets[b]`` is the first
block of bucket ``b`` and ``index_next`` links the rest. Several blocks may share one key
(vLLM never de-duplicates, so block tables stay append-only); a new block joins at the tail of
its chain, so the first block found for a key is the first inserted, which is vLLM's rule.
Bucket of a key: the first 8 hash bytes as a little-endian u64, xor ``group_id * GROUP_MIX``,
masked to the table size.

Write order
-----------

All writes happen under the pool lock, so no reader sees a half-done mutation while the
holder lives. Within a mutation the order is: unlink from the free queue, then change
``ref_cnt``; set a block's hash fields, then link it into its bucket chain; unlink from the
chain, then clear the hash fields. ``state`` turns ``READY`` only after everything else of a
new segment is written.

Crash caveats
-------------

A process killed mid-mutation leaves that mutation half done; what repairs it (an intent
record or a rebuild from ``ref_cnt``, ``block_hash`` and ``queue_key``) is the subject of the
crash-safety work. A creator killed before ``state`` turns ``READY`` leaves a segment that
``attach`` refuses with ``SegmentError``; ``BlockPool.unlink(name)`` removes it.

Changelog
---------

- v1: initial layout (header, block_meta, index_buckets).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from shmkv.errors import UsageError

LAYOUT_VERSION = 1
# Eight different bytes: a byte-swapped reader, or any other segment, never sees this value.
MAGIC = 0x1A5E_4B76_6D68_73F0
ALIGN_BYTES = 64
BLOCK_HASH_BYTES = 32

STATE_INITIALIZING = 1
STATE_READY = 2
STATE_POISONED = 3
STATE_NAMES = {
    STATE_INITIALIZING: "INITIALIZING",
    STATE_READY: "READY",
    STATE_POISONED: "POISONED",
}

FLAG_PREFIX_CACHING = 1 << 0
FLAG_KV_EVENTS = 1 << 1

NULL_BLOCK_ID = 0
NO_BLOCK = -1
NO_HASH_TOKENS = 0
GROUP_MIX = 0x9E37_79B9_7F4A_7C15
MAX_POOL_NAME_CHARS = 64
MAX_NUM_BLOCKS = (1 << 31) - 3  # row indices, sentinels included, must fit an int32

HEADER_DTYPE = np.dtype(
    {
        "names": [
            "magic", "layout_version", "format_flags", "header_bytes", "state",
            "total_bytes", "num_blocks", "hash_block_size", "num_index_buckets",
            "block_hash_bytes", "creator_pid", "medium",
            "epoch", "num_free_blocks", "queue_head_key", "queue_tail_key", "none_hash",
        ],
        "formats": [
            "<u8", "<u4", "<u4", "<u4", "<u4",
            "<u8", "<u4", "<u4", "<u4",
            "<u4", "<u4", "S8",
            "<u8", "<i8", "<i8", "<i8", "V32",
        ],
        "offsets": [0, 8, 12, 16, 20, 24, 32, 36, 40, 44, 48, 56, 64, 72, 80, 88, 96],
        "itemsize": 192,
    }
)

BLOCK_DTYPE = np.dtype(
    {
        "names": [
            "ref_cnt", "prev", "next", "index_next", "group_id", "hash_num_tokens",
            "queue_key", "block_hash",
        ],
        "formats": ["<i4", "<i4", "<i4", "<i4", "<u4", "<i4", "<i8", "V32"],
        "offsets": [0, 4, 8, 12, 16, 20, 24, 32],
        "itemsize": 64,
    }
)

# Hot paths read single fields through flat memoryviews over the block_meta region instead
# of numpy scalars (about half the cost). These are the field positions in those views.
ROW_I32 = BLOCK_DTYPE.itemsize // 4  # int32 words per row
ROW_I64 = BLOCK_DTYPE.itemsize // 8  # int64 words per row
F_REF = BLOCK_DTYPE.fields["ref_cnt"][1] // 4
F_PREV = BLOCK_DTYPE.fields["prev"][1] // 4
F_NEXT = BLOCK_DTYPE.fields["next"][1] // 4
F_INDEX_NEXT = BLOCK_DTYPE.fields["index_next"][1] // 4
F_GROUP = BLOCK_DTYPE.fields["group_id"][1] // 4
F_HASH_TOKENS = BLOCK_DTYPE.fields["hash_num_tokens"][1] // 4
F_QUEUE_KEY = BLOCK_DTYPE.fields["queue_key"][1] // 8
HASH_BYTE_OFFSET = BLOCK_DTYPE.fields["block_hash"][1]
# Header words, for the same flat-view access.
H_NUM_FREE = HEADER_DTYPE.fields["num_free_blocks"][1] // 8
H_QUEUE_HEAD_KEY = HEADER_DTYPE.fields["queue_head_key"][1] // 8
H_QUEUE_TAIL_KEY = HEADER_DTYPE.fields["queue_tail_key"][1] // 8

_POOL_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclass(frozen=True)
class PoolConfig:
    """Everything that fixes a pool's layout; echoed in the header and checked on attach."""

    num_blocks: int
    hash_block_size: int
    enable_caching: bool = True
    enable_kv_cache_events: bool = False
    medium: str = "GPU"

    @property
    def format_flags(self) -> int:
        return (FLAG_PREFIX_CACHING if self.enable_caching else 0) | (
            FLAG_KV_EVENTS if self.enable_kv_cache_events else 0
        )

    @property
    def num_index_buckets(self) -> int:
        return max(16, 1 << (2 * self.num_blocks - 1).bit_length())

    def validate(self) -> None:
        """Raises UsageError naming the first bad value."""
        if isinstance(self.num_blocks, bool) or not isinstance(self.num_blocks, int):
            raise UsageError(f"num_gpu_blocks must be an int, got {self.num_blocks!r}")
        if not 0 < self.num_blocks <= MAX_NUM_BLOCKS:
            raise UsageError(
                f"num_gpu_blocks must be in [1, {MAX_NUM_BLOCKS}], got {self.num_blocks}"
            )
        if isinstance(self.hash_block_size, bool) or not isinstance(self.hash_block_size, int):
            raise UsageError(f"hash_block_size must be an int, got {self.hash_block_size!r}")
        if self.hash_block_size <= 0:
            raise UsageError(f"hash_block_size must be positive, got {self.hash_block_size}")
        medium = self.medium.encode() if isinstance(self.medium, str) else None
        if medium is None or not 0 < len(medium) <= 8:
            raise UsageError(f"medium must be a str of 1 to 8 bytes, got {self.medium!r}")


@dataclass(frozen=True)
class Region:
    """One region of the segment: what it holds, who writes it, what guards it."""

    name: str
    dtype: np.dtype
    shape: Callable[[PoolConfig], tuple[int, ...]]
    writer: str
    guard: str
    invariants: str
    doc: str


REGIONS: tuple[Region, ...] = (
    Region(
        "header", HEADER_DTYPE, lambda c: (1,),
        writer="creator, then the pool under its lock", guard="pool lock (mutable part)",
        invariants="INV-HDR, INV-CONSERVE",
        doc="magic, version, config echo, free-queue counters",
    ),
    Region(
        "block_meta", BLOCK_DTYPE, lambda c: (c.num_blocks + 2,),
        writer="BlockPool; FreeKVCacheBlockQueue (prev/next/queue_key); "
        "BlockHashToBlockMap (index_next)",
        guard="pool lock", invariants="INV-FREE, INV-QKEY, INV-REF, INV-HASH",
        doc="one row per block, then the free queue's head and tail sentinel rows",
    ),
    Region(
        "index_buckets", np.dtype("<i4"), lambda c: (c.num_index_buckets,),
        writer="BlockHashToBlockMap", guard="pool lock", invariants="INV-HASH",
        doc="first block of each prefix-index bucket chain, NO_BLOCK when empty",
    ),
)


def _align(offset: int) -> int:
    return (offset + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


@dataclass(frozen=True)
class Layout:
    """Offsets and sizes of every region for one config."""

    config: PoolConfig
    offsets: dict[str, int]
    shapes: dict[str, tuple[int, ...]]
    total_bytes: int

    @classmethod
    def from_config(cls, config: PoolConfig) -> Layout:
        offsets: dict[str, int] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        offset = 0
        for region in REGIONS:
            offset = _align(offset)
            shape = region.shape(config)
            offsets[region.name] = offset
            shapes[region.name] = shape
            offset += region.dtype.itemsize * int(np.prod(shape))
        return cls(config, offsets, shapes, _align(offset))

    @property
    def free_head(self) -> int:
        """Row of the free queue's head sentinel."""
        return self.config.num_blocks

    @property
    def free_tail(self) -> int:
        """Row of the free queue's tail sentinel."""
        return self.config.num_blocks + 1

    def view(self, buf, name: str) -> np.ndarray:
        """A numpy view of region ``name`` over the segment buffer ``buf``."""
        region = next(r for r in REGIONS if r.name == name)
        return np.ndarray(
            self.shapes[name], dtype=region.dtype, buffer=buf, offset=self.offsets[name]
        )

    def describe(self) -> list[tuple[str, int, int, str]]:
        """(region, offset, bytes, dtype) rows, for inspection tools."""
        rows = []
        for region in REGIONS:
            nbytes = region.dtype.itemsize * int(np.prod(self.shapes[region.name]))
            rows.append((region.name, self.offsets[region.name], nbytes, str(region.dtype)))
        return rows


def validate_pool_name(name: object) -> str:
    """Checks a pool name and returns it. Raises UsageError saying what is wrong."""
    if not isinstance(name, str):
        raise UsageError(f"pool name must be a str, got {type(name).__name__}")
    if "/" in name:
        raise UsageError(f"pool name {name!r} contains '/'; use letters, digits, '.', '_', '-'")
    if not name:
        raise UsageError("pool name is empty")
    if len(name) > MAX_POOL_NAME_CHARS:
        raise UsageError(
            f"pool name is {len(name)} characters long; at most {MAX_POOL_NAME_CHARS} allowed"
        )
    if not _POOL_NAME_RE.fullmatch(name):
        raise UsageError(
            f"pool name {name!r} must start with a letter or digit and use only letters, "
            "digits, '.', '_' and '-'"
        )
    return name


def segment_name(pool_name: str) -> str:
    """The POSIX shared-memory name of a pool: ``/shmkv-<pool name>-v<LAYOUT_VERSION>``."""
    return f"/shmkv-{validate_pool_name(pool_name)}-v{LAYOUT_VERSION}"
