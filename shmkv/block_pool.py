"""BlockPool: vLLM's ``vllm.v1.core.block_pool.BlockPool`` with its block metadata in POSIX
shared memory.

Used by one process, it gives the same answers as vLLM 0.33.0's BlockPool call for call: the
same block ids, the same hits, the same free-queue order, the same usage and the same events.
What differs is where the state lives: every block's ``ref_cnt``, free-queue links and prefix
hash sit in the segment described in ``shmkv/layout.py``, so another process that attaches
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

import logging
import operator
import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from shmkv import layout as L
from shmkv.errors import InvariantViolation, OutOfBlocksError, PoolClosedError, UsageError
from shmkv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    external_block_hash,
    use_int_block_hashes,
)
from shmkv._pykernel import PyKernel
from shmkv.free_queue import FreeKVCacheBlockQueue
from shmkv.hashing import generate_block_hash_extra_keys, to_event_extra_keys
from shmkv.prefix_index import BlockHashToBlockMap
from shmkv.segment import Segment, read_config, write_header

logger = logging.getLogger(__name__)

try:
    from shmkv import _ckernel
except ImportError:  # not built (no compiler at install time): the Python kernel serves
    _ckernel = None
else:
    _ckernel.set_errors(UsageError, OutOfBlocksError, InvariantViolation)

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


class _Closed:
    """Stands in for the shared-memory views once the pool is closed."""

    def __getitem__(self, _):
        raise PoolClosedError("the pool is closed; attach again to use it")

    __setitem__ = __getitem__

    def __getattr__(self, _):
        raise PoolClosedError("the pool is closed; attach again to use it")


_CLOSED = _Closed()

# The layout constants the C kernel is compiled with; it refuses to run if they differ.
_C_GEOMETRY = (
    L.ROW_I32, L.ROW_I64, L.F_REF, L.F_PREV, L.F_NEXT, L.F_INDEX_NEXT, L.F_GROUP,
    L.F_HASH_TOKENS, L.F_QUEUE_KEY, L.HASH_BYTE_OFFSET, L.BLOCK_HASH_BYTES, L.H_NUM_FREE,
    L.H_QUEUE_HEAD_KEY, L.H_QUEUE_TAIL_KEY, L.GROUP_MIX,
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


class BlockPool:
    """A KV-cache block pool whose metadata lives in one POSIX shared-memory segment.

    Build one with :meth:`create` (a new segment) or :meth:`attach` (an existing one); both
    are usable as context managers. The creator's ``with`` block unlinks the segment on exit.

    NOTE: one process at a time. Cross-process locking is not part of this layer yet, so two
    processes mutating one pool concurrently corrupt it.
    """

    def __init__(self, segment: Segment, layout: L.Layout, *, owner: bool,
                 kernel: str | None = None) -> None:
        self.kernel = kernel or default_kernel()
        if self.kernel not in KERNELS:
            raise UsageError(f"kernel must be one of {KERNELS}, got {self.kernel!r}")
        if self.kernel == "c" and _ckernel is None:
            raise UsageError("the C kernel (shmkv._ckernel) is not built; use kernel='python'")
        self._segment = segment
        self._layout = layout
        self._owner = owner
        cfg = layout.config
        self.num_gpu_blocks = cfg.num_blocks
        self.enable_caching = cfg.enable_caching
        self.hash_block_size = cfg.hash_block_size
        self.enable_kv_cache_events = cfg.enable_kv_cache_events
        self.medium = cfg.medium
        self.pool_name = segment.shm_name.split("-", 1)[1].rsplit("-v", 1)[0]

        buf = segment.buf
        mem = memoryview(buf)
        meta_off = layout.offsets["block_meta"]
        meta_bytes = L.BLOCK_DTYPE.itemsize * (cfg.num_blocks + 2)
        idx_off = layout.offsets["index_buckets"]
        idx_bytes = 4 * cfg.num_index_buckets
        self._views = [
            mem,
            mem[0:L.HEADER_DTYPE.itemsize].cast("q"),
            mem[meta_off:meta_off + meta_bytes].cast("i"),
            mem[meta_off:meta_off + meta_bytes].cast("q"),
            mem[idx_off:idx_off + idx_bytes].cast("i"),
        ]
        _, self._hdr64, self._i32, self._i64, buckets = self._views
        self._blocks = layout.view(buf, "block_meta")
        self._ref_col = self._blocks["ref_cnt"]
        self._htok_col = self._blocks["hash_num_tokens"]
        self.free_block_queue = FreeKVCacheBlockQueue(
            self._i32, self._i64, self._hdr64, self._blocks, layout
        )
        self._index = BlockHashToBlockMap(
            buf, self._i32, buckets, self._blocks, layout.view(buf, "index_buckets"), layout
        )
        if self.kernel == "c":
            self._kernel = _ckernel.Kernel(
                buf, meta_off, idx_off, cfg.num_blocks, cfg.num_index_buckets, _C_GEOMETRY
            )
        else:
            self._kernel = PyKernel(
                self._i32, self.free_block_queue, self._index, self._blocks, cfg.num_blocks
            )
        # Handles are made on first use: a million up front would cost a second per attach.
        self._handles: list[KVCacheBlock | None] = [None] * cfg.num_blocks
        self.blocks = BlockHandles(self)
        self.null_block = self._handle(_NULL)
        self._event_queue: list[KVCacheEvent] = []

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
        kernel: str | None = None,
    ) -> BlockPool:
        """Creates a pool in a new shared-memory segment.

        Args:
            name: the pool's name (letters, digits, '.', '_', '-'; at most 64 characters).
            num_gpu_blocks: blocks in the pool, the null block included.
            enable_caching: keep a prefix cache of full blocks.
            hash_block_size: tokens per hash unit of ``request.block_hashes``.
            enable_kv_cache_events: record events for :meth:`take_events`.
            medium: the storage medium named in events.
            kernel: "c" or "python", this process's implementation of the hot loops
                (default: ``$SHMKV_KERNEL``, else C when built). Both behave identically.

        Raises:
            UsageError: a bad name or config value.
            SegmentExistsError: a pool of that name exists already.
        """
        config = L.PoolConfig(
            num_blocks=num_gpu_blocks,
            hash_block_size=hash_block_size,
            enable_caching=bool(enable_caching),
            enable_kv_cache_events=bool(enable_kv_cache_events),
            medium=medium,
        )
        config.validate()
        layout = L.Layout.from_config(config)
        shm_name = L.segment_name(name)
        segment = Segment.create(shm_name, layout.total_bytes)
        try:
            write_header(segment.buf, layout)
            pool = cls(segment, layout, owner=True, kernel=kernel)
            pool._initialize()
        except BaseException:
            segment.close()
            Segment.unlink(shm_name)
            raise
        return pool

    def _initialize(self) -> None:
        n = self.num_gpu_blocks
        self._ref_col[:] = 0
        self._blocks["prev"] = _NO_BLOCK
        self._blocks["next"] = _NO_BLOCK
        self._index.initialize()
        # Block 0 is the null block, taken out of the queue for good (vLLM pops it first).
        self.free_block_queue.initialize(range(1, n))
        self._layout.view(self._segment.buf, "header")["state"] = L.STATE_READY

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
    ) -> BlockPool:
        """Attaches to an existing pool. Any config value given must match the segment's.

        Raises:
            UsageError: a bad name.
            SegmentNotFoundError: no pool of that name.
            LayoutMismatchError: not a shmkv segment, another layout version, a size or a
                config value that differs (the message names the field).
            SegmentError: the segment is not READY (still initialising, or poisoned).
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
            layout = read_config(segment, expected)
            return cls(segment, layout, owner=False, kernel=kernel)
        except BaseException:
            segment.close()
            raise

    def close(self) -> None:
        """Unmaps the segment. Handles of this pool raise PoolClosedError afterwards."""
        if self._segment.buf is None:
            return
        self._kernel.release()
        self._kernel = _CLOSED  # type: ignore[assignment]
        self._i32 = self._i64 = self._hdr64 = _CLOSED
        self.free_block_queue = self._index = _CLOSED  # type: ignore[assignment]
        self._blocks = self._ref_col = self._htok_col = _CLOSED  # type: ignore[assignment]
        for view in reversed(self._views):
            view.release()
        self._views = []
        self._segment.close()

    @staticmethod
    def unlink(name: str) -> bool:
        """Removes a pool's segment name. Returns False if there was none.

        Processes that have it mapped keep working until they close it.
        """
        return Segment.unlink(L.segment_name(name))

    def __enter__(self) -> BlockPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        if self._owner:
            Segment.unlink(self._segment.shm_name)

    # ------------------------------------------------------------------ helpers

    def _block_ids(self, blocks: Iterable[KVCacheBlock], what: str) -> list[int]:
        try:
            ids = [b.block_id for b in blocks]
        except AttributeError as exc:
            raise UsageError(f"{what}() takes KVCacheBlock handles: {exc}") from None
        if ids and (min(ids) < 0 or max(ids) >= self.num_gpu_blocks):
            bad = next(b for b in ids if not 0 <= b < self.num_gpu_blocks)
            raise UsageError(
                f"{what}(): block id {bad} is out of range [0, {self.num_gpu_blocks})"
            )
        return ids

    def _handle(self, block_id: int) -> KVCacheBlock:
        handle = self._handles[block_id]
        if handle is None:
            handle = self._handles[block_id] = KVCacheBlock(self, block_id)
        return handle

    def _evict_cached(self, block_id: int) -> bool:
        key = self._kernel.evict(block_id)
        if key is None:
            return False
        if self.enable_kv_cache_events:
            self._record_removed([key])
        return True

    def _record_removed(self, keys: list[tuple[bytes, int]]) -> None:
        as_int = use_int_block_hashes()
        self._event_queue.extend(
            BlockRemoved(
                block_hashes=[external_block_hash(h, as_int)], medium=self.medium, group_idx=g
            )
            for h, g in keys
        )

    # ------------------------------------------------------------------ vLLM API

    def get_cached_block(
        self, block_hash: bytes, kv_cache_group_ids: Sequence[int]
    ) -> list[KVCacheBlock] | None:
        """The cached block of ``block_hash`` in every group of ``kv_cache_group_ids``, or
        None if any group misses. Of several blocks with one key, the first cached wins.

        Raises:
            UsageError: the hash is not 32 bytes.
        """
        return self._kernel.get_cached(
            block_hash, kv_cache_group_ids, self._handles, self._handle
        )

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
        if num_cached_blocks >= num_full_blocks:
            return
        for label, value in (("num_cached_blocks", num_cached_blocks),
                             ("num_full_blocks", num_full_blocks),
                             ("block_size", block_size),
                             ("kv_cache_group_id", kv_cache_group_id)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise UsageError(f"cache_full_blocks(): {label} must be an int >= 0, got {value!r}")
        if kv_cache_group_id >= 1 << 32:
            raise UsageError(f"cache_full_blocks(): kv_cache_group_id {kv_cache_group_id} >= 2**32")
        hbs = self.hash_block_size
        if block_size == 0 or block_size % hbs:
            raise UsageError(
                f"cache_full_blocks(): block_size {block_size} is not a positive multiple of "
                f"hash_block_size {hbs}"
            )
        new_full = list(blocks[num_cached_blocks:num_full_blocks])
        num_new = num_full_blocks - num_cached_blocks
        if len(new_full) != num_new:
            raise UsageError(
                f"cache_full_blocks(): blocks has {len(blocks)} entries, fewer than "
                f"num_full_blocks {num_full_blocks}"
            )
        if block_mask is not None and len(block_mask) != num_new:
            raise UsageError(
                f"cache_full_blocks(): block_mask has {len(block_mask)} entries for {num_new} blocks"
            )
        ratio = block_size // hbs
        fine_hashes = request.block_hashes
        if len(fine_hashes) // ratio < num_full_blocks:
            raise UsageError(
                f"cache_full_blocks(): the request has {len(fine_hashes)} block hashes at "
                f"{hbs} tokens, {len(fine_hashes) // ratio} at block size {block_size}; "
                f"{num_full_blocks} are needed"
            )
        evicted: list[tuple[bytes, int]] | None = [] if self.enable_kv_cache_events else None
        cached = self._kernel.cache(
            new_full, fine_hashes, num_cached_blocks, ratio, block_size, kv_cache_group_id,
            block_mask, evicted,
        )
        if evicted:  # shorter keys the blocks held gave way to the full ones
            self._record_removed(evicted)

        if self.enable_kv_cache_events:
            self._event_queue.append(
                self._block_stored_event(
                    request, cached, num_cached_blocks, num_full_blocks, block_size,
                    kv_cache_group_id, fine_hashes, ratio,
                )
            )

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
        mm_idx = 0
        for position, _ in cached:
            keys, mm_idx = generate_block_hash_extra_keys(
                request, position * block_size, (position + 1) * block_size, mm_idx
            )
            block_keys.append(keys)
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
        )

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pops ``num_blocks`` blocks from the head of the free queue, evicting their hashes.

        Returns:
            the blocks, each with ``ref_cnt == 1``, in queue order.

        Raises:
            OutOfBlocksError: (a ValueError) "Cannot get N free blocks from the pool".
            UsageError: ``num_blocks`` is not an int >= 0.
        """
        if type(num_blocks) is not int:
            if isinstance(num_blocks, bool):
                raise UsageError(f"get_new_blocks(): num_blocks must be an int, got {num_blocks!r}")
            try:
                num_blocks = operator.index(num_blocks)
            except TypeError:
                raise UsageError(
                    f"get_new_blocks(): num_blocks must be an int, got {num_blocks!r}"
                ) from None
        if num_blocks < 0:
            raise UsageError(f"get_new_blocks(): num_blocks must be >= 0, got {num_blocks}")
        if not self.enable_kv_cache_events:
            return self._kernel.allocate(
                num_blocks, self.enable_caching, self._handles, self._handle, None
            )
        evicted: list[tuple[bytes, int]] = []
        blocks = self._kernel.allocate(
            num_blocks, self.enable_caching, self._handles, self._handle, evicted
        )
        self._record_removed(evicted)
        return blocks

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Adds a reference to each block (a prefix-cache hit), taking blocks with
        ``ref_cnt == 0`` out of the free queue. The null block is skipped.

        Raises:
            UsageError: a block id out of range.
        """
        self._kernel.touch(blocks)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drops one reference from each block, given in eviction order (first evicted
        first). Blocks reaching zero go back to the free queue: unhashed ones to the front,
        hashed ones to the back. The null block is skipped.

        Raises:
            UsageError: a block id out of range, or a block freed more times than it is
                referenced (a double free). Nothing is changed then.
        """
        self._kernel.free(ordered_blocks, self.enable_caching)

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
        for block_id in ids:
            self._evict_cached(int(block_id))

    def reset_prefix_cache(self) -> bool:
        """Empties the prefix cache, if no block but the null block is in use.

        Returns:
            True on success (an ``AllBlocksCleared`` event is recorded), False otherwise.
        """
        num_used = self.num_gpu_blocks - self.get_num_free_blocks()
        if num_used != 1:
            logger.warning(
                "Failed to reset prefix cache because some blocks (%d) are not freed yet",
                num_used - 1,
            )
            return False
        self._index.initialize()
        if self.enable_kv_cache_events:
            self._event_queue.append(AllBlocksCleared())
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
        events, self._event_queue = self._event_queue, []
        return events

    # ------------------------------------------------------------------ shmkv extras

    @property
    def cached_block_hash_to_block(self) -> BlockHashToBlockMap:
        return self._index

    @property
    def layout(self) -> L.Layout:
        return self._layout

    def get_free_block_ids(self) -> list[int]:
        """The free queue, head (evicted first) to tail."""
        return self.free_block_queue.get_all_free_block_ids()

    def check_invariants(self) -> None:
        """Checks every invariant of the shared state.

        Raises:
            InvariantViolation: listing every broken invariant (the segment is then marked
                POISONED).
        """
        from shmkv.recovery import check_invariants

        if self._segment.buf is None:
            raise PoolClosedError("the pool is closed; attach again to use it")
        check_invariants(self)
