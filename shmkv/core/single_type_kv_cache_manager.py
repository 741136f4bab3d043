"""Single-type KV-cache managers: one per KV-cache group, with vLLM 0.33.0's names, arguments
and behaviour (``vllm/v1/core/single_type_kv_cache_manager.py``), over a shmkv ``BlockPool``.

A manager keeps the block list of each request of its group (``req_to_blocks``) and how many of
them are already in the prefix cache (``num_cached_block``). Each attention type differs in
which blocks a request still needs (``get_num_skipped_tokens``), how a prefix-cache hit is
searched (``find_longest_cache_hit``), and which blocks are worth caching
(``reachable_block_mask``)::

    FullAttentionManager          (full, MLA)  hit = longest cached run from block 0
    RSWAManager                   full, but frees the decode gap between prompt and window
    SinkFullAttentionManager      full, with attention-sink tokens
    SlidingWindowManager          hit = W-1 tokens of cached blocks ending at the hit,
                                  searched from the right; older blocks become the null block
    ChunkedLocalAttentionManager  hit = null blocks up to the current chunk, then a run
    MambaManager                  one state block per request ("none"/"all") or the states at
                                  block boundaries ("align", prefix caching)
    CrossAttentionManager         encoder KV, allocated once, never cached

NOTE: the pool is shared by several processes. A manager changes the pool only through the
``BlockPool`` API (``get_new_blocks``, ``touch``, ``free_blocks``, ``cache_full_blocks``,
``cache_partial_block``, ``move_block_hashes``, ``_maybe_evict_cached_block``) and never
writes a block's fields: where vLLM bumps ``ref_cnt`` by hand (the copy-on-write of a
partial hit), shmkv calls ``touch``. Its own state is private to the process. Lookups and the
touches that follow them are made atomic across processes by the caller (the coordinator), which
holds ``pool.lock()`` over a scheduler step; the lock is re-entrant.

Partial-block keys (groups whose blocks are bigger than the pool's ``hash_block_size``):
full attention and Mamba "align" key a prompt's last hash boundary inside a block
(``BlockPool.cache_partial_block``); a hit that ends inside a block (fine-grained lookups,
``alignment_tokens < block_size``) gives the request a private copy of that block
(copy-on-write: ``_partial_hit_reqs``, ``take_pending_cow_copies``), and a Mamba producer
still running on its boundary block moves the block's keys to a copy
(``BlockPool.move_block_hashes``). Mamba "align" prefill checkpoints
(``num_prefill_checkpoint_blocks > 0``) export the state at the prompt's boundary from a chunk
that crosses it into a block of its own, keyed there. A pool made without
``partial_keys=True`` keeps a block's own partial key but not a second one (see
``shmkv/pool/layout.py``). HiSparse's managers live in ``shmkv/core/hisparse.py``, which
registers them here (``spec_manager_map``, ``role_manager_map``).
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Sequence
from typing import Any, ClassVar

from shmkv.core.kv_cache_interface import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    HiSparseResidentSpec,
    KVCacheGroupRole,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    RSWASpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
    cdiv,
    get_mamba_prefill_checkpoint_position,
    is_mamba_prefill_checkpoint_valid,
)
from shmkv.core.vllm_objects import from_vllm
from shmkv.errors import UsageError
from shmkv.hashing import BlockHashListWithBlockSize

__all__ = [
    "ChunkedLocalAttentionManager",
    "CircularBufferManager",
    "CrossAttentionManager",
    "FullAttentionManager",
    "MambaManager",
    "RSWAManager",
    "SingleTypeKVCacheManager",
    "SinkFullAttentionManager",
    "SlidingWindowManager",
    "get_manager_for_kv_cache_spec",
    "resolve_block_hashes",
    "spec_manager_map",
    "trim_null_head",
]

# A block handle (shmkv.KVCacheBlock, or vLLM's when a vLLM pool is passed): duck typed.
Block = Any


def trim_null_head(blocks: list) -> list:
    """``blocks`` without its leading null blocks (a sliding window's skipped prefix)."""
    n = 0
    while n < len(blocks) and blocks[n].is_null:
        n += 1
    return blocks[n:] if n else blocks


def resolve_block_hashes(
    block_hashes: Sequence[bytes],
    hash_block_size: int,
    block_size: int,
    *,
    supports_fine_grained_hash_lookup: bool = False,
    alignment_tokens: int | None = None,
) -> Sequence[bytes]:
    """The request's hashes viewed at ``block_size``: the list itself when the sizes agree
    or when a fine-grained lookup wants the raw hashes, else a coarse view."""
    if block_size == hash_block_size:
        return block_hashes
    if isinstance(block_hashes, BlockHashListWithBlockSize):
        assert block_hashes.scale_factor == block_size // hash_block_size
        return block_hashes
    if (
        supports_fine_grained_hash_lookup
        and alignment_tokens is not None
        and alignment_tokens < block_size
        and block_size % alignment_tokens == 0
    ):
        return block_hashes
    assert block_size % hash_block_size == 0
    return BlockHashListWithBlockSize(block_hashes, hash_block_size, block_size)


class SingleTypeKVCacheManager(ABC):
    """The block lists of one KV-cache group's requests, over a shared ``BlockPool``.

    Ownership: ``req_to_blocks[req]`` is append-only except that blocks a request no longer
    needs are replaced, in place, by the pool's null block (so a position keeps its index);
    a request holds one reference on each non-null block in its list, taken by
    ``get_new_blocks`` or ``touch`` and dropped by ``free_blocks``. ``num_cached_block``
    tracks running requests only; its presence means "already allocated once".
    """

    supports_fine_grained_hash_lookup: ClassVar[bool] = False
    retains_longer_hit: bool = False

    @property
    def has_positionally_stable_blocks(self) -> bool:
        """Whether a block's index in a request's list always names the same tokens."""
        return True

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        block_pool: Any,
        enable_caching: bool,
        kv_cache_group_id: int,
        scheduler_block_size: int,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
        needs_kv_cache_zeroing: bool = False,
        max_admission_blocks_per_request: int | None = None,
    ) -> None:
        """
        Args:
            kv_cache_spec: the group's spec.
            block_pool: the (attached) shared pool.
            enable_caching: whether prefix caching is on.
            kv_cache_group_id: the group's id (part of every cache key).
            scheduler_block_size: the scheduling granularity, a multiple of ``block_size``;
                the default hit alignment.
            dcp_world_size: decode context parallelism (scales ``block_size`` of sharded specs).
            pcp_world_size: prefill context parallelism.
            needs_kv_cache_zeroing: record new block ids for the worker to zero
                (``take_new_block_ids``).
            max_admission_blocks_per_request: a per-request cap on the blocks reserved by
                ``get_num_blocks_to_allocate(apply_admission_cap=True)`` (sliding window and
                chunked local); None: no cap.
        """
        kv_cache_spec = from_vllm(kv_cache_spec)  # vLLM's spec, bridged (vllm_objects.py)
        self.scheduler_block_size = scheduler_block_size
        self.cache_hit_alignment_tokens = scheduler_block_size
        self.dcp_world_size = dcp_world_size if kv_cache_spec.dcp_sharded else 1
        self.pcp_world_size = pcp_world_size if kv_cache_spec.dcp_sharded else 1
        self.block_size = kv_cache_spec.block_size * self.dcp_world_size
        self.kv_cache_spec = kv_cache_spec
        self.block_pool = block_pool
        self.enable_caching = enable_caching
        self.max_admission_blocks_per_request = max_admission_blocks_per_request
        # The ring of a circular buffer is never zeroed by the worker (vLLM's rule).
        self._record_new_block_ids = (
            needs_kv_cache_zeroing and isinstance(kv_cache_spec, AttentionSpec)
            and not isinstance(kv_cache_spec, CircularBufferSpec)
        )
        self.new_block_ids: list[int] = []
        self.req_to_blocks: defaultdict[str, list[Block]] = defaultdict(list)
        self.num_cached_block: dict[str, int] = {}
        self.kv_cache_group_id = kv_cache_group_id
        self._null_block = block_pool.null_block
        # Set by the coordinator: whether this group's hits drop the EAGLE lookahead block.
        self.use_eagle = False
        self.shared_prefix_checkpoint = False
        # Copy-on-write of a hit that ends inside a block (never taken without partial keys).
        self._partial_hit_reqs: dict[str, tuple[int, Block]] = {}
        self._pending_cow_copies: list[tuple[Block, Block]] = []
        self._pending_boundary_state_offloads: list[tuple[str, int, Block, int]] = []

    # ------------------------------------------------------------------ allocation

    @classmethod
    def _get_num_evictable_blocks(cls, blocks: Sequence[Block]) -> int:
        """Hit blocks that sit in the free queue (touching them takes them out of it)."""
        return sum(b.ref_cnt == 0 and not b.is_null for b in blocks)

    def _has_partial_local_hit(
        self, new_computed_blocks: Sequence[Block], num_local_computed_tokens: int
    ) -> bool:
        return len(new_computed_blocks) > 0 and num_local_computed_tokens % self.block_size != 0

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[Block],
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
    ) -> int:
        """How many blocks the pool must give for the request to hold ``num_tokens`` slots:
        new blocks, plus hit blocks that ``touch`` will take out of the free queue.

        Args:
            request_id: the request.
            num_tokens: slots needed in all (already allocated ones included).
            new_computed_blocks: this step's prefix-cache hit (only for a new request).
            total_computed_tokens: local + external computed tokens.
            num_local_computed_tokens: tokens of the local prefix-cache hit.
            num_tokens_main_model: ``num_tokens`` without speculative lookahead.
            apply_admission_cap: clamp to ``max_admission_blocks_per_request``.
            prefill_end: where the prompt's prefill ends (Mamba checkpoints).

        Returns:
            the number of blocks.
        """
        num_required_blocks = cdiv(num_tokens, self.block_size)
        if apply_admission_cap and self.max_admission_blocks_per_request is not None:
            num_required_blocks = min(num_required_blocks, self.max_admission_blocks_per_request)
        num_req_blocks = len(self.req_to_blocks.get(request_id, ()))
        if request_id in self.num_cached_block:
            # A running request: no new hits; rejected drafts may leave it over-allocated.
            assert len(new_computed_blocks) == 0
            return max(num_required_blocks - num_req_blocks, 0)

        num_skipped_blocks = self.get_num_skipped_tokens(total_computed_tokens) // self.block_size
        num_local_blocks = len(new_computed_blocks) + num_req_blocks
        num_new_blocks = max(num_required_blocks - max(num_skipped_blocks, num_local_blocks), 0)
        # Hit blocks inside the skipped prefix are not touched, so they cost nothing.
        first_kept = max(0, num_skipped_blocks - num_req_blocks)
        num_evictable = self._get_num_evictable_blocks(new_computed_blocks[first_kept:])
        if self._has_partial_local_hit(new_computed_blocks, num_local_computed_tokens):
            num_new_blocks += 1  # the private copy of the shared tail block
        return num_new_blocks + num_evictable

    def add_local_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[Block],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        """Gives a new request its prefix-cache hit: blocks inside the skipped prefix become
        null blocks (and are not touched), the rest are touched and appended.

        Args:
            request_id: a request with no blocks yet.
            new_computed_blocks: the hit, one block per position (nulls allowed).
            num_local_computed_tokens: tokens of the hit.
            num_external_computed_tokens: tokens a KV connector will load after the hit.
        """
        req_blocks = self.req_to_blocks[request_id]
        assert len(req_blocks) == 0
        num_total = num_local_computed_tokens + num_external_computed_tokens
        num_skipped_blocks = self.get_num_skipped_tokens(num_total) // self.block_size
        if num_skipped_blocks > 0:
            new_computed_blocks = new_computed_blocks[num_skipped_blocks:]
        if self.enable_caching:
            self.block_pool.touch(new_computed_blocks)
        else:
            assert not any(new_computed_blocks), (
                "Computed blocks should be empty when prefix caching is disabled"
            )
        req_blocks.extend([self._null_block] * num_skipped_blocks)
        req_blocks.extend(new_computed_blocks)
        # Hit blocks (and the nulls before them) are cached already.
        self.num_cached_block[request_id] = len(req_blocks)
        if self._has_partial_local_hit(new_computed_blocks, num_local_computed_tokens):
            block_idx = num_local_computed_tokens // self.block_size
            self._partial_hit_reqs[request_id] = (block_idx, new_computed_blocks[-1])
            self.num_cached_block[request_id] = block_idx

    def allocate_external_computed_blocks(
        self,
        request_id: str,
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
        record_for_zeroing: bool = True,
    ) -> None:
        """Fresh blocks for tokens a KV connector loads, clipped to what the window keeps.
        Call it after every group's ``add_local_computed_blocks``, so that these allocations
        cannot evict another group's hit."""
        num_total = num_local_computed_tokens + num_external_computed_tokens
        num_skipped_tokens = self.get_num_skipped_tokens(num_total)
        if num_skipped_tokens > 0:
            num_external_computed_tokens = min(
                num_total - num_skipped_tokens, num_external_computed_tokens
            )
        if num_external_computed_tokens <= 0:
            return
        req_blocks = self.req_to_blocks[request_id]
        num_new = max(0, cdiv(num_total, self.block_size) - len(req_blocks))
        new_blocks = self.block_pool.get_new_blocks(num_new)
        req_blocks.extend(new_blocks)
        if self._record_new_block_ids and record_for_zeroing:
            self.new_block_ids.extend(b.block_id for b in new_blocks)

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int
    ) -> list[Block]:
        """Appends fresh blocks until the request has ``cdiv(num_tokens, block_size)``.

        Returns:
            the new blocks (a copy-on-write block first, if any).

        Raises:
            ValueError: the pool cannot give them (vLLM's message); nothing changes then.
        """
        cow_blocks: list[Block] = []
        if request_id in self._partial_hit_reqs:
            block_idx, source = self._partial_hit_reqs.pop(request_id)
            cow_block = self.block_pool.get_new_blocks(1)[0]
            self._apply_cow(request_id, block_idx, source, cow_block)
            self.new_block_ids.append(cow_block.block_id)
            cow_blocks.append(cow_block)
        req_blocks = self.req_to_blocks[request_id]
        num_new = cdiv(num_tokens, self.block_size) - len(req_blocks)
        if num_new <= 0:
            return cow_blocks
        new_blocks = self.block_pool.get_new_blocks(num_new)
        req_blocks.extend(new_blocks)
        if self._record_new_block_ids:
            self.new_block_ids.extend(b.block_id for b in new_blocks)
        return cow_blocks + new_blocks

    def _apply_cow(self, request_id: str, block_idx: int, source: Block, cow_block: Block) -> None:
        """Puts a private copy in place of a shared tail block. Both stay referenced until the
        worker has copied: the source keeps the hit's reference, the copy gets a second one
        (through ``touch``) that the consumer of ``take_pending_cow_copies`` drops."""
        req_blocks = self.req_to_blocks[request_id]
        assert req_blocks[block_idx] is source
        assert not source.is_null and source.ref_cnt > 0
        req_blocks[block_idx] = cow_block
        self._pending_cow_copies.append((source, cow_block))
        self.block_pool.touch([cow_block])

    @property
    def records_new_block_ids(self) -> bool:
        """Whether new block ids are recorded for the worker to zero."""
        return self._record_new_block_ids

    def take_new_block_ids(self) -> list[int]:
        """The ids of blocks allocated since the last call; clears them."""
        ids, self.new_block_ids = self.new_block_ids, []
        return ids

    def take_pending_cow_copies(self) -> list[tuple[Block, Block]]:
        """The (source, copy) pairs to copy on the worker since the last call; clears them."""
        pending, self._pending_cow_copies = self._pending_cow_copies, []
        return pending

    def take_pending_boundary_state_offloads(self) -> list[tuple[str, int, Block, int]]:
        """(request, group, block, boundary tokens) of committed Mamba "align" states."""
        pending, self._pending_boundary_state_offloads = self._pending_boundary_state_offloads, []
        return pending

    def finalize_partial_tail_offload(
        self, request_id: str, num_computed_tokens: int, num_in_flight_tokens: int
    ) -> tuple[int, Block, int] | None:
        return None

    # ------------------------------------------------------------------ caching

    def cache_blocks(
        self,
        request: Any,
        num_tokens: int,
        retention_interval: int | None = None,
        *,
        replay_boundaries: Sequence[int],
    ) -> None:
        """Puts the request's newly full blocks (up to ``num_tokens`` tokens) in the prefix
        cache, those of them ``reachable_block_mask`` keeps.

        Args:
            request: anything with ``request_id`` and ``block_hashes`` (``shmkv.Request`` or
                vLLM's); ``shared_prefix_boundary`` is read if present.
            num_tokens: tokens computed so far (cached ones included).
            retention_interval: sparse retention (sliding window, Mamba): None dense, 0 only
                the boundaries, > 0 one tail per interval.
            replay_boundaries: token positions a replay of this prompt can resume at.
        """
        if not self.kv_cache_spec.prefix_cacheable:
            return
        request_id = request.request_id
        num_cached_blocks = self.num_cached_block.get(request_id, 0)
        num_hashed_tokens = len(request.block_hashes) * self.block_pool.hash_block_size
        num_full_blocks = min(num_tokens, num_hashed_tokens) // self.block_size
        if num_cached_blocks >= num_full_blocks:
            return
        boundaries = list(replay_boundaries)
        shared_prefix_boundary = getattr(request, "shared_prefix_boundary", 0)
        if shared_prefix_boundary:
            boundaries.append(shared_prefix_boundary)
            if self.use_eagle:
                boundaries.append(shared_prefix_boundary - self.block_size)
        block_mask = self.reachable_block_mask(
            start_block=num_cached_blocks,
            end_block=num_full_blocks,
            alignment_tokens=self.cache_hit_alignment_tokens,
            kv_cache_spec=self.kv_cache_spec,
            use_eagle=self.use_eagle,
            retention_interval=retention_interval,
            reachable_boundaries=boundaries,
            dcp_world_size=self.dcp_world_size,
        )
        self.block_pool.cache_full_blocks(
            request=request,
            blocks=self.req_to_blocks[request_id],
            num_cached_blocks=num_cached_blocks,
            num_full_blocks=num_full_blocks,
            block_size=self.block_size,
            kv_cache_group_id=self.kv_cache_group_id,
            block_mask=block_mask,
        )
        self.num_cached_block[request_id] = num_full_blocks

    @classmethod
    def reachable_block_mask(
        cls,
        start_block: int,
        end_block: int,
        alignment_tokens: int | None,
        kv_cache_spec: KVCacheSpec,
        use_eagle: bool,
        retention_interval: int | None = None,
        reachable_boundaries: Sequence[int] = (),
        dcp_world_size: int = 1,
        final_segment_end_block: int | None = None,
    ) -> list[bool] | None:
        """Which of blocks ``[start_block, end_block)`` can ever serve a hit (one bool each),
        or None for all of them: the dense default."""
        return None

    # ------------------------------------------------------------------ freeing

    def pop_blocks_for_free(self, request_id: str) -> list[Block]:
        """Forgets the request and returns its blocks, leading nulls dropped, without freeing
        them; the caller frees them tail first. Unknown requests give []."""
        req_blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_block.pop(request_id, None)
        self._partial_hit_reqs.pop(request_id, None)
        return trim_null_head(req_blocks)

    def free(self, request_id: str) -> None:
        """Frees the request's blocks, last first, so a chain's tail is evicted before its
        head (the head is the likelier shared prefix)."""
        self.block_pool.free_blocks(reversed(self.pop_blocks_for_free(request_id)))

    def _remove_blocks_in_range(self, request_id: str, first_block: int, last_block: int) -> None:
        """Frees the blocks at ``[first_block, last_block)`` and puts null blocks in their
        place, walking backwards and stopping at the first null block (those before it were
        removed by an earlier call)."""
        if request_id not in self.req_to_blocks or first_block >= last_block:
            return
        blocks = self.req_to_blocks[request_id]
        last_block = min(last_block, len(blocks))
        freed = []
        for i in range(last_block - 1, first_block - 1, -1):
            if blocks[i] == self._null_block:
                break
            freed.append(blocks[i])
            blocks[i] = self._null_block
        if freed:
            self.block_pool.free_blocks(freed)

    def remove_skipped_blocks(
        self,
        request_id: str,
        processed_computed_tokens: int,
        num_prompt_tokens: int | None = None,
    ) -> None:
        """Frees the whole blocks that attention will never read again (see
        ``get_num_skipped_tokens``) and replaces them with the null block.

        Args:
            request_id: the request.
            processed_computed_tokens: tokens computed and committed (safe to drop).
            num_prompt_tokens: the prompt length, for managers that free a gap after it.
        """
        num_skipped_tokens = self.get_num_skipped_tokens(processed_computed_tokens)
        if num_skipped_tokens <= 0:
            return
        blocks = self.req_to_blocks[request_id]
        num_skipped_blocks = min(num_skipped_tokens // self.block_size, len(blocks))
        self._remove_blocks_in_range(request_id, 0, num_skipped_blocks)

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens, from the start, that the next token's attention does not read (0 here)."""
        return 0

    def new_step_starts(self) -> None:
        """Called at the start of each scheduler step."""
        return None

    # ------------------------------------------------------------------ hit search

    @classmethod
    @abstractmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[bytes],
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool: Any,
        kv_cache_spec: KVCacheSpec,
        drop_eagle_block: bool,
        alignment_tokens: int,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
    ) -> tuple[tuple[list[Block], ...], int]:
        """The longest prefix-cache hit of at most ``max_length`` tokens common to every group
        of ``kv_cache_group_ids``.

        Args:
            block_hashes: the request's hashes at the pool's ``hash_block_size``.
            max_length: the longest hit wanted, in tokens.
            kv_cache_group_ids: groups that must all hit.
            block_pool: the pool.
            kv_cache_spec: the groups' spec.
            drop_eagle_block: drop the last hit block (EAGLE recomputes it).
            alignment_tokens: the hit length is a multiple of this.
            dcp_world_size: decode context parallelism.
            pcp_world_size: prefill context parallelism.

        Returns:
            one block list per group (null blocks at skipped positions, e.g.
            ``[null, null, b7, b8]`` for window 8, block size 4), and the hit in tokens.
        """
        raise NotImplementedError


class FullAttentionManager(SingleTypeKVCacheManager):
    """Full attention (and MLA): keeps every block; a hit is the longest cached run from the
    first block, since a chained hash that misses makes every later one miss."""

    supports_fine_grained_hash_lookup: ClassVar[bool] = True

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[bytes],
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool: Any,
        kv_cache_spec: KVCacheSpec,
        drop_eagle_block: bool,
        alignment_tokens: int,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
    ) -> tuple[tuple[list[Block], ...], int]:
        assert isinstance(kv_cache_spec, FullAttentionSpec | ChunkedLocalAttentionSpec), (
            "FullAttentionManager can only be used for full attention and chunked local "
            "attention groups"
        )
        block_size = kv_cache_spec.block_size
        if dcp_world_size > 1:
            block_size *= dcp_world_size
        hashes = resolve_block_hashes(
            block_hashes, block_pool.hash_block_size, block_size,
            supports_fine_grained_hash_lookup=cls.supports_fine_grained_hash_lookup,
            alignment_tokens=alignment_tokens,
        )
        # Fine-grained: hits may end inside a block, on a hash boundary.
        fine_grained = alignment_tokens < block_size and block_size % alignment_tokens == 0
        full_hashes = (
            BlockHashListWithBlockSize(hashes, alignment_tokens, block_size)
            if fine_grained else hashes
        )
        computed: tuple[list[Block], ...] = tuple([] for _ in kv_cache_group_ids)
        max_blocks = max_length // block_size
        get_prefix = getattr(block_pool, "get_cached_prefix", None)
        if get_prefix is not None and len(kv_cache_group_ids) == 1:
            # shmkv: the same left-to-right scan in one call and one hold of the lock.
            computed[0].extend(get_prefix(list(full_hashes[:max_blocks]), kv_cache_group_ids[0]))
        else:
            for block_hash in itertools.islice(full_hashes, max_blocks):
                hit = block_pool.get_cached_block(block_hash, kv_cache_group_ids)
                if not hit:
                    break
                for blocks, block in zip(computed, hit, strict=True):
                    blocks.append(block)
        hit_length = len(computed[0]) * block_size

        if fine_grained:
            # Probe the next block's interior hash boundaries, the longest first.
            scale = block_size // alignment_tokens
            first = len(computed[0]) * scale
            last = min(first + scale - 1, max_length // alignment_tokens, len(hashes))
            for fine_idx in range(last - 1, first - 1, -1):
                hit = block_pool.get_cached_block(hashes[fine_idx], kv_cache_group_ids)
                if hit:
                    for blocks, block in zip(computed, hit, strict=True):
                        blocks.append(block)
                    hit_length = (fine_idx + 1) * alignment_tokens
                    break

        if drop_eagle_block and hit_length > 0:
            hit_length -= min(alignment_tokens, block_size)
        hit_length -= hit_length % alignment_tokens
        num_blocks = cdiv(hit_length, block_size)
        for blocks in computed:
            del blocks[num_blocks:]
        return computed, hit_length


    def cache_blocks(
        self,
        request: Any,
        num_tokens: int,
        retention_interval: int | None = None,
        *,
        replay_boundaries: Sequence[int],
    ) -> None:
        """Caches the newly full blocks, then, with blocks coarser than the hashes, keys the
        prompt's last hash boundary inside a block (``_cache_partial_tail_block``)."""
        super().cache_blocks(request, num_tokens, retention_interval,
                             replay_boundaries=replay_boundaries)
        if self.block_size != self.block_pool.hash_block_size:
            self._cache_partial_tail_block(request, num_tokens)

    def _cache_partial_tail_block(self, request: Any, num_tokens: int) -> None:
        """Keys the block holding the prompt's last hash boundary at that boundary
        (``BlockPool.cache_partial_block``), so that a later request sharing the prompt up
        to there hits inside the block. Only that boundary: the ones before it inside the
        same block are not keyed. Nothing when the boundary ends a block (the full key
        covers it) or lies beyond ``num_tokens``.

        The boundary: the longest run of whole hash units a resend of the prompt can hit,
        ``num_prompt_tokens - 1`` tokens (the last token is always recomputed), or the whole
        prompt with EAGLE (its lookup drops one unit afterwards)."""
        hbs = self.block_pool.hash_block_size
        limit = request.num_prompt_tokens if self.use_eagle else request.num_prompt_tokens - 1
        boundary = min(limit // hbs, len(request.block_hashes)) * hbs
        if boundary == 0 or boundary > num_tokens or boundary % self.block_size == 0:
            return
        blocks = self.req_to_blocks[request.request_id]
        block_idx = boundary // self.block_size
        if block_idx >= len(blocks):
            return
        self.block_pool.cache_partial_block(
            request=request,
            block=blocks[block_idx],
            num_tokens=boundary,
            kv_cache_group_id=self.kv_cache_group_id,
            block_size=self.block_size,
        )


class RSWAManager(FullAttentionManager):
    """Reference sliding window: the prompt stays visible, and of the generated tokens only
    the last ``rswa_window``; given ``num_prompt_tokens``, ``remove_skipped_blocks`` frees the
    whole blocks between the prompt and the window."""

    def __init__(self, kv_cache_spec: RSWASpec, **kwargs: Any) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        self.rswa_window: int = kv_cache_spec.rswa_window

    def remove_skipped_blocks(
        self,
        request_id: str,
        processed_computed_tokens: int,
        num_prompt_tokens: int | None = None,
    ) -> None:
        """Frees the gap blocks wholly inside ``[P, max(P, processed - rswa_window))``,
        P = ``num_prompt_tokens``; without P, as full attention (nothing)."""
        if num_prompt_tokens is None:
            super().remove_skipped_blocks(request_id, processed_computed_tokens)
            return
        first_gap_block = cdiv(num_prompt_tokens, self.block_size)
        window_start = max(num_prompt_tokens, processed_computed_tokens - self.rswa_window)
        self._remove_blocks_in_range(request_id, first_gap_block, window_start // self.block_size)


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Sliding window of W tokens: the next token reads the last W - 1 computed ones.

    Skipped blocks (all of whose tokens are older than the window) become null blocks. A hit
    of length L needs the ``cdiv(W - 1, block_size)`` blocks before L cached (one more with
    EAGLE, then dropped); the search runs from the right and stops at the first such run.
    """

    def __init__(self, kv_cache_spec: SlidingWindowSpec, **kwargs: Any) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        self.sliding_window = kv_cache_spec.sliding_window
        self.extra_retained_tokens = kv_cache_spec.extra_retained_tokens

    @classmethod
    def _contiguous_blocks_for_hit(cls, window_size: int, block_size: int, use_eagle: bool) -> int:
        return cdiv(window_size - 1, block_size) + int(use_eagle)

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[bytes],
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool: Any,
        kv_cache_spec: KVCacheSpec,
        drop_eagle_block: bool,
        alignment_tokens: int,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
    ) -> tuple[tuple[list[Block], ...], int]:
        assert isinstance(kv_cache_spec, SlidingWindowSpec), (
            "SlidingWindowManager can only be used for sliding window groups"
        )
        assert dcp_world_size == 1, "DCP not support sliding window attn now."
        assert pcp_world_size == 1, "PCP not support sliding window attn now."
        block_size = kv_cache_spec.block_size
        hashes = resolve_block_hashes(
            block_hashes, block_pool.hash_block_size, block_size,
            supports_fine_grained_hash_lookup=cls.supports_fine_grained_hash_lookup,
            alignment_tokens=alignment_tokens,
        )
        need = cls._contiguous_blocks_for_hit(
            kv_cache_spec.sliding_window, block_size, drop_eagle_block
        )
        max_blocks = max_length // block_size
        null = block_pool.null_block
        computed: tuple[list[Block], ...] = tuple([null] * max_blocks for _ in kv_cache_group_ids)
        run = 0
        found = False
        for i in range(max_blocks - 1, -1, -1):
            hit = block_pool.get_cached_block(hashes[i], kv_cache_group_ids)
            if not hit:
                run = 0
                continue
            if run == 0 and block_size != alignment_tokens:
                # A run must end where the (post-EAGLE) hit length is aligned.
                end_blocks = i if drop_eagle_block else i + 1
                if end_blocks * block_size % alignment_tokens:
                    continue
            for blocks, block in zip(computed, hit, strict=True):
                blocks[i] = block
            run += 1
            if run >= need:
                for blocks in computed:
                    del blocks[i + run:]
                found = True
                break
        if not found:
            # A run that reaches block 0 is a hit however short: early tokens need less.
            for blocks in computed:
                del blocks[run:]
            cls._trim_to_alignment(computed, block_size, alignment_tokens)
        if drop_eagle_block and computed[0]:
            for blocks in computed:
                blocks.pop()
            cls._trim_to_alignment(computed, block_size, alignment_tokens)
        return computed, len(computed[0]) * block_size

    @staticmethod
    def _trim_to_alignment(computed: tuple[list[Block], ...], block_size: int,
                           alignment_tokens: int) -> None:
        while block_size != alignment_tokens and len(computed[0]) * block_size % alignment_tokens:
            for blocks in computed:
                blocks.pop()

    @classmethod
    def reachable_block_mask(
        cls,
        start_block: int,
        end_block: int,
        alignment_tokens: int | None,
        kv_cache_spec: KVCacheSpec,
        use_eagle: bool,
        retention_interval: int | None = None,
        reachable_boundaries: Sequence[int] = (),
        dcp_world_size: int = 1,
        final_segment_end_block: int | None = None,
    ) -> list[bool] | None:
        """Only the ``need`` blocks before an aligned boundary can serve a hit: keeps those
        of every segment (``alignment_tokens`` long, or ``retention_interval`` when set; none
        when it is 0), of the final segment, and before each reachable boundary."""
        assert isinstance(kv_cache_spec, SlidingWindowSpec)
        if alignment_tokens is None:
            return None
        block_size = kv_cache_spec.block_size * dcp_world_size
        if alignment_tokens % block_size:
            return None  # not representable per block: keep everything
        need = cls._contiguous_blocks_for_hit(kv_cache_spec.sliding_window, block_size, use_eagle)
        # With EAGLE the run ends one block past the boundary (the dropped peek block).
        shift = int(use_eagle)
        mask = [False] * (end_block - start_block)
        if retention_interval is None:
            segment_tokens: int | None = alignment_tokens
        else:
            segment_tokens = retention_interval or None
        if segment_tokens is not None:
            per_segment = segment_tokens // block_size
            if need >= per_segment:
                return None
            for i in range(start_block, end_block):
                if i >= shift and (i - shift) % per_segment >= per_segment - need:
                    mask[i - start_block] = True
            if final_segment_end_block is not None and not use_eagle:
                tail = final_segment_end_block % per_segment
                if tail:
                    lo = max(final_segment_end_block - tail, final_segment_end_block - need)
                    hi = min(end_block, final_segment_end_block)
                    for i in range(max(start_block, lo), hi):
                        mask[i - start_block] = True
        if retention_interval is not None:
            for boundary in reachable_boundaries:
                end = boundary // alignment_tokens * alignment_tokens // block_size + shift
                for j in range(max(start_block, end - need), min(end_block, end)):
                    mask[j - start_block] = True
        return mask

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens before the window of the next token (and the extra retained ones).

        Window 4, 7 computed: the next token (7) reads 4..6 and itself, so 0..3 are skipped::

            tokens   0 1 2 3 | 4 5 6 | 7
                     skipped  window   next
        """
        return max(
            0, num_computed_tokens - self.sliding_window + 1 - self.extra_retained_tokens
        )


class ChunkedLocalAttentionManager(SingleTypeKVCacheManager):
    """Chunked local attention: a token reads only the tokens of its own chunk, so the
    blocks of earlier chunks are skipped (null) and a hit is null blocks up to the current
    chunk's start followed by a cached run from there."""

    def __init__(self, kv_cache_spec: ChunkedLocalAttentionSpec, **kwargs: Any) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        self.attention_chunk_size = kv_cache_spec.attention_chunk_size

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[bytes],
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool: Any,
        kv_cache_spec: KVCacheSpec,
        drop_eagle_block: bool,
        alignment_tokens: int,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
    ) -> tuple[tuple[list[Block], ...], int]:
        """Chunk 8, block 4: for max length 15 the window of token 15 starts at 8, so the hit
        is [null, null] plus block 2 if cached; for max length 16 it is four null blocks."""
        assert isinstance(kv_cache_spec, ChunkedLocalAttentionSpec), (
            "ChunkedLocalAttentionManager can only be used for chunked local attention groups"
        )
        assert drop_eagle_block is False, (
            "Hybrid KV cache is not supported for eagle + chunked local attention."
        )
        assert dcp_world_size == 1, "DCP not support chunked local attn now."
        assert pcp_world_size == 1, "PCP not support chunked local attn now."
        block_size = kv_cache_spec.block_size
        assert block_size == alignment_tokens, (
            "KV cache groups with different block sizes are not compatible with chunked "
            "local attention now"
        )
        hashes = resolve_block_hashes(
            block_hashes, block_pool.hash_block_size, block_size,
            supports_fine_grained_hash_lookup=cls.supports_fine_grained_hash_lookup,
            alignment_tokens=alignment_tokens,
        )
        chunk = kv_cache_spec.attention_chunk_size
        window_start_block = (max_length // chunk * chunk if max_length > 0 else 0) // block_size
        null = block_pool.null_block
        computed: tuple[list[Block], ...] = tuple(
            [null] * window_start_block for _ in kv_cache_group_ids
        )
        for i in range(window_start_block, max_length // block_size):
            hit = block_pool.get_cached_block(hashes[i], kv_cache_group_ids)
            if not hit:
                break
            for blocks, block in zip(computed, hit, strict=True):
                blocks.append(block)
        return computed, len(computed[0]) * block_size

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """The tokens of the chunks before the next token's chunk.

        Chunk 8: 13 computed -> 8 (token 13 reads 8..13); 8 -> 8; 7 -> 0.
        """
        return num_computed_tokens // self.attention_chunk_size * self.attention_chunk_size


class MambaManager(SingleTypeKVCacheManager):
    """Mamba state blocks. A request needs only its last state (``n - 1`` tokens skipped).

    Modes (``MambaSpec.mamba_cache_mode``): ``"none"`` and ``"all"`` hold one running block
    plus ``num_speculative_blocks`` and do no prefix caching; ``"align"`` keeps a state per
    block boundary for prefix caching: the first allocation gives one running block plus the
    speculative ones, later steps at most one new block, the speculative blocks moving to the
    new end; the block from two steps ago is freed once the computed tokens pass it. A hit is
    the rightmost cached state, padded on the left with null blocks. A state cached in the
    current step may not be written yet, so a request hitting one is deferred (its demand is
    ``num_gpu_blocks + 1``) until ``new_step_starts``.

    NOTE: ``cached_blocks_this_step`` is private to the process, as in vLLM, so it defers only
    hits on states this process cached. A state another process cached in its own current
    step is not deferred here; whether its data is written yet is for the layer above (the
    KVCacheManager / block-table handshake) to guarantee.
    """

    supports_fine_grained_hash_lookup: ClassVar[bool] = True

    @property
    def has_positionally_stable_blocks(self) -> bool:
        return self.mamba_cache_mode != "align"

    def __init__(self, kv_cache_spec: MambaSpec, block_pool: Any, **kwargs: Any) -> None:
        """
        Raises:
            AssertionError: prefix caching without ``mamba_cache_mode="align"``.
        """
        super().__init__(kv_cache_spec, block_pool, **kwargs)
        self.mamba_cache_mode = kv_cache_spec.mamba_cache_mode
        assert self.mamba_cache_mode == "align" or not self.enable_caching, (
            "Mamba prefix caching requires mamba_cache_mode='align'"
        )
        self.num_speculative_blocks: int = kv_cache_spec.num_speculative_blocks
        # "align" prefill checkpoints: a chunk that crosses the prompt's reusable boundary
        # exports the state there into a block of its own (the backend says it can, with
        # prefill_checkpoint_alignment), so the boundary is cached without a chunk ending on it.
        self.has_prefill_checkpoint_blocks = (
            self.mamba_cache_mode == "align" and kv_cache_spec.num_prefill_checkpoint_blocks > 0
        )
        self.drop_eagle_checkpoint_block = False
        self.cached_blocks_this_step: set[Any] = set()
        if self.mamba_cache_mode == "align":
            # Index of the state block allocated in the previous step, per request.
            self.last_state_block_idx: dict[str, int] = {}
            self._num_retired_blocks: dict[str, int] = {}
            self._allocated_block_reqs: set[str] = set()
            # This allocation's checkpoint: (token position, block index), per request.
            self._checkpoints: dict[str, tuple[int, int]] = {}
            self._producer_partial_tail_reqs: dict[str, tuple[Block, int]] = {}

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[bytes],
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool: Any,
        kv_cache_spec: KVCacheSpec,
        drop_eagle_block: bool,
        alignment_tokens: int,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
    ) -> tuple[tuple[list[Block], ...], int]:
        assert isinstance(kv_cache_spec, MambaSpec), (
            "MambaManager can only be used for mamba groups"
        )
        assert dcp_world_size == 1, "DCP not support mamba now."
        assert pcp_world_size == 1, "PCP not support mamba now."
        block_size = kv_cache_spec.block_size
        hashes = resolve_block_hashes(
            block_hashes, block_pool.hash_block_size, block_size,
            supports_fine_grained_hash_lookup=cls.supports_fine_grained_hash_lookup,
            alignment_tokens=alignment_tokens,
        )
        computed: tuple[list[Block], ...] = tuple([] for _ in kv_cache_group_ids)
        null = block_pool.null_block
        if alignment_tokens < block_size and block_size % alignment_tokens == 0:
            # Fine-grained: the rightmost cached hash unit, wherever it falls in its block.
            scale = block_size // alignment_tokens
            for fine_idx in range(min(max_length // alignment_tokens, len(hashes)) - 1, -1, -1):
                hit = block_pool.get_cached_block(hashes[fine_idx], kv_cache_group_ids)
                if hit:
                    for blocks, block in zip(computed, hit, strict=True):
                        blocks.extend([null] * (fine_idx // scale))
                        blocks.append(block)
                    return computed, (fine_idx + 1) * alignment_tokens
            return computed, 0
        for i in range(max_length // block_size - 1, -1, -1):
            hit = block_pool.get_cached_block(hashes[i], kv_cache_group_ids)
            if not hit:
                continue
            if block_size != alignment_tokens and (i + 1) * block_size % alignment_tokens:
                continue
            for blocks, block in zip(computed, hit, strict=True):
                blocks.extend([null] * i)
                blocks.append(block)
            return computed, (i + 1) * block_size
        return computed, 0

    @classmethod
    def reachable_block_mask(
        cls,
        start_block: int,
        end_block: int,
        alignment_tokens: int | None,
        kv_cache_spec: KVCacheSpec,
        use_eagle: bool,
        retention_interval: int | None = None,
        reachable_boundaries: Sequence[int] = (),
        dcp_world_size: int = 1,
        final_segment_end_block: int | None = None,
    ) -> list[bool] | None:
        """A Mamba hit needs just the state block ending on the boundary: keeps one per
        ``retention_interval`` (all when it is at most a block; none when 0) and the block
        ending on each reachable boundary. None (dense) when no interval is set."""
        if retention_interval is None or alignment_tokens is None:
            return None
        assert isinstance(kv_cache_spec, MambaSpec)
        block_size = kv_cache_spec.block_size
        mask = [False] * (end_block - start_block)
        if retention_interval:
            per_segment = retention_interval // block_size
            if per_segment <= 1:
                return None
            first = (start_block + per_segment) // per_segment * per_segment - 1
            for i in range(first - start_block, len(mask), per_segment):
                mask[i] = True
        for boundary in reachable_boundaries:
            block = boundary // alignment_tokens * alignment_tokens // block_size - 1
            if start_block <= block < end_block:
                mask[block - start_block] = True
        return mask

    def _remove_blocks_in_range(self, request_id: str, first_block: int, last_block: int) -> None:
        if self.mamba_cache_mode != "align":
            super()._remove_blocks_in_range(request_id, first_block, last_block)
            return
        blocks = self.req_to_blocks.get(request_id, [])
        first_block = max(first_block, self._num_retired_blocks.get(request_id, 0))
        last_block = min(last_block, len(blocks))
        if first_block >= last_block:
            return
        freed = []
        # Align-mode prefill leaves null gaps between states: skip them, do not stop.
        for i in range(last_block - 1, first_block - 1, -1):
            if blocks[i].is_null:
                continue
            freed.append(blocks[i])
            blocks[i] = self._null_block
        if freed:
            self.block_pool.free_blocks(freed)
        self._num_retired_blocks[request_id] = last_block

    def remove_skipped_blocks(
        self,
        request_id: str,
        processed_computed_tokens: int,
        num_prompt_tokens: int | None = None,
    ) -> None:
        super().remove_skipped_blocks(request_id, processed_computed_tokens, num_prompt_tokens)
        if self.mamba_cache_mode != "align":
            return
        # The previous step's state was copied into this step's block; the one before it is
        # not needed once the computed tokens are past it.
        idx = self.last_state_block_idx.get(request_id)
        if idx is not None and idx < cdiv(processed_computed_tokens, self.block_size) - 1:
            blocks = self.req_to_blocks[request_id]
            if blocks[idx] != self._null_block:
                self.block_pool.free_blocks([blocks[idx]])
                blocks[idx] = self._null_block

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[Block],
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
    ) -> int:
        if new_computed_blocks and new_computed_blocks[-1].block_hash in (
            self.cached_blocks_this_step
        ):
            # More than the pool holds: the request waits for the next step.
            return self.block_pool.num_gpu_blocks + 1
        if self.mamba_cache_mode != "align":
            num_tokens += self.kv_cache_spec.block_size * self.num_speculative_blocks
            return super().get_num_blocks_to_allocate(
                request_id, num_tokens, new_computed_blocks, total_computed_tokens,
                num_local_computed_tokens, num_tokens_main_model,
                apply_admission_cap=apply_admission_cap, prefill_end=prefill_end,
            )
        # Align: lookahead tokens get no blocks (draft models have no Mamba layers).
        num_required = cdiv(num_tokens_main_model, self.block_size) + self.num_speculative_blocks
        num_new = num_required - len(new_computed_blocks) - len(self.req_to_blocks[request_id])
        has_partial_hit = (
            self._has_partial_local_hit(new_computed_blocks, num_local_computed_tokens)
            or request_id in self._partial_hit_reqs
        )
        if has_partial_hit:
            num_new = max(num_new, 0) + 1
        # A checkpoint is keyed on the chunk's end, where the worker writes it; only the
        # chunk reaching prefill_end keeps one (prefill_end is 0 under dense retention:
        # every chunk may).
        checkpoint_position = get_mamba_prefill_checkpoint_position(
            num_tokens_main_model, self.cache_hit_alignment_tokens,
            self.drop_eagle_checkpoint_block,
            num_hash_lookahead_tokens=getattr(self.block_pool, "num_hash_lookahead_tokens", 0),
        )
        if not self._needs_internal_checkpoint(request_id, total_computed_tokens,
                                               num_tokens_main_model, checkpoint_position,
                                               prefill_end):
            checkpoint_position = 0
        checkpoint_block = int(checkpoint_position > 0)
        if not apply_admission_cap:
            if checkpoint_position > 0:
                self._checkpoints[request_id] = (
                    checkpoint_position, cdiv(num_tokens_main_model, self.block_size) - 2)
            else:
                self._checkpoints.pop(request_id, None)
        if num_new > 0:
            cap = 1 + int(has_partial_hit) + checkpoint_block
            if request_id not in self._allocated_block_reqs:
                cap += self.num_speculative_blocks
            num_new = min(num_new, cap)
        return num_new + self._get_num_evictable_blocks(new_computed_blocks)

    def _needs_internal_checkpoint(self, request_id: str, query_start: int, query_end: int,
                                   checkpoint_position: int, prefill_end: int) -> bool:
        """Whether this chunk ``[query_start, query_end)`` exports a prefill checkpoint: the
        spec has checkpoint blocks, the chunk reaches ``prefill_end``, the backend can export
        the state at ``checkpoint_position`` (``is_mamba_prefill_checkpoint_valid``), and the
        checkpoint's block index (the one before the running state's) is free to take: past
        the table, a null block, or a speculative block of a running request."""
        assert isinstance(self.kv_cache_spec, MambaSpec)
        checkpoint_idx = cdiv(query_end, self.block_size) - 2
        blocks = self.req_to_blocks[request_id]
        return (
            self.has_prefill_checkpoint_blocks
            and query_end >= prefill_end
            and is_mamba_prefill_checkpoint_valid(
                query_start, query_end, checkpoint_position, self.block_pool.hash_block_size,
                self.block_size, self.kv_cache_spec.prefill_checkpoint_alignment,
            )
            and checkpoint_idx >= 0
            and (
                checkpoint_idx >= len(blocks)
                or blocks[checkpoint_idx].is_null
                or (request_id in self._allocated_block_reqs
                    and checkpoint_idx >= len(blocks) - self.num_speculative_blocks)
            )
        )

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int
    ) -> list[Block]:
        if self.mamba_cache_mode != "align":
            num_tokens += self.block_size * self.num_speculative_blocks
            return super().allocate_new_blocks(request_id, num_tokens, num_tokens_main_model)
        req_blocks = self.req_to_blocks[request_id]
        num_required = cdiv(num_tokens_main_model, self.block_size) + self.num_speculative_blocks
        checkpoint_block = int(request_id in self._checkpoints)
        partial_hit = self._partial_hit_reqs.get(request_id)
        has_partial_hit = partial_hit is not None
        if num_required <= len(req_blocks) and not has_partial_hit and not checkpoint_block:
            self._allocated_block_reqs.add(request_id)
            return []
        prev_len = len(req_blocks)
        allocated_before = request_id in self._allocated_block_reqs
        if allocated_before:
            # The running state lives in the last (1 + num_speculative_blocks) blocks.
            self.last_state_block_idx[request_id] = prev_len - 1 - self.num_speculative_blocks
        elif prev_len > 0:
            self.last_state_block_idx[request_id] = prev_len - 1  # the hit's state
        num_skipped = num_required - self.num_speculative_blocks - 1
        if prev_len < num_skipped:
            # Null up to the checkpoint's block, if there is one: it gets a new block.
            req_blocks.extend([self._null_block] * (num_skipped - checkpoint_block - prev_len))
        if allocated_before:
            # Speculative blocks left behind by this step move to the new end; in a
            # checkpoint step one stays at the checkpoint index (the worker writes it there).
            for idx in range(prev_len - self.num_speculative_blocks, prev_len):
                if idx >= num_skipped - checkpoint_block:
                    break
                self._relocate_speculative_block(req_blocks, idx)
        num_new = max(num_required - len(req_blocks), 0) + int(has_partial_hit)
        assert num_new <= 1 + int(has_partial_hit) + checkpoint_block + (
            0 if allocated_before else self.num_speculative_blocks
        )
        new_blocks = self.block_pool.get_new_blocks(num_new)
        returned = req_blocks[prev_len:]
        if partial_hit is not None:
            block_idx, source = partial_hit
            cow_block, new_blocks = new_blocks[0], new_blocks[1:]
            if allocated_before:
                # A running request's block table only grows, so it stays on the source
                # block (its next forward overwrites that state); the cache's keys move to
                # the private copy, which the queued copy fills first. Both stay referenced
                # until the copy has run: the copy by its allocation, the source by one
                # more reference (``touch``), both given back by the consumer of
                # ``take_pending_cow_copies``.
                assert req_blocks[block_idx] is source
                self.block_pool.move_block_hashes(source, cow_block)
                self._pending_cow_copies.append((source, cow_block))
                self.block_pool.touch([source])
                producer_tail = self._producer_partial_tail_reqs.pop(request_id, None)
                if producer_tail is not None:
                    marker, boundary_tokens = producer_tail
                    assert marker is source
                    # The copy keeps the producer's boundary state: offer it for offload.
                    self._pending_boundary_state_offloads.append(
                        (request_id, self.kv_cache_group_id, cow_block, boundary_tokens)
                    )
                if cow_block.block_hash is not None:
                    # Filled only by this step's copy: same-step hits on it must wait.
                    self.cached_blocks_this_step.add(cow_block.block_hash)
            else:
                self._apply_cow(request_id, block_idx, source, cow_block)
                returned = [cow_block, *returned]
        req_blocks.extend(new_blocks)
        self._allocated_block_reqs.add(request_id)
        self._partial_hit_reqs.pop(request_id, None)
        returned.extend(new_blocks)
        return returned

    def _relocate_speculative_block(self, req_blocks: list[Block], block_idx: int) -> None:
        block = req_blocks[block_idx]
        assert block.ref_cnt == 1 and block.block_hash is None, (
            "Speculative Mamba blocks must be exclusively owned and unhashed before relocation"
        )
        req_blocks.append(block)
        req_blocks[block_idx] = self._null_block

    def pop_blocks_for_free(self, request_id: str) -> list[Block]:
        if self.mamba_cache_mode == "align":
            self._allocated_block_reqs.discard(request_id)
            self.last_state_block_idx.pop(request_id, None)
            self._num_retired_blocks.pop(request_id, None)
            self._checkpoints.pop(request_id, None)
            self._producer_partial_tail_reqs.pop(request_id, None)
            self._pending_boundary_state_offloads = [
                e for e in self._pending_boundary_state_offloads if e[0] != request_id
            ]
        return super().pop_blocks_for_free(request_id)

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Only the state after the last computed token is needed."""
        return num_computed_tokens - 1

    def cache_blocks(
        self,
        request: Any,
        num_tokens: int,
        retention_interval: int | None = None,
        *,
        replay_boundaries: Sequence[int],
    ) -> None:
        request_id = request.request_id
        before = self.num_cached_block.get(request_id, 0)
        super().cache_blocks(request, num_tokens, retention_interval,
                             replay_boundaries=replay_boundaries)
        after = self.num_cached_block.get(request_id, 0)
        if self.mamba_cache_mode == "align":
            partial_hash = self._cache_partial_tail_block(request, num_tokens,
                                                          retention_interval)
            if partial_hash is not None:
                self.cached_blocks_this_step.add(partial_hash)
        blocks = self.req_to_blocks[request_id]
        for idx in range(before, after):
            block = blocks[idx]
            if block.is_null:
                continue
            block_hash = block.block_hash
            if block_hash is None:  # left out by the retention mask
                continue
            self.cached_blocks_this_step.add(block_hash)
            if self.mamba_cache_mode == "align":
                self._pending_boundary_state_offloads.append(
                    (request_id, self.kv_cache_group_id, block, block.block_hash_num_tokens)
                )

    def new_step_starts(self) -> None:
        self.cached_blocks_this_step.clear()

    def _cache_partial_tail_block(self, request: Any, num_tokens: int,
                                  retention_interval: int | None = None) -> bytes | None:
        """Keys the state block at the prompt's reusable boundary, the last hash boundary a
        resend can hit (``get_mamba_prefill_checkpoint_position``), when this step's chunk
        ends exactly there; or at the shared-prefix junction, with
        ``shared_prefix_checkpoint``, while the prompt is being computed.

        In a checkpoint step, instead, re-keys the checkpoint block at its checkpoint (its
        old keys, a full-block key cached this step included, are dropped first: the block
        now holds that state), if the checkpoint is one a later request can hit (the
        prompt's boundary, a block end the retention keeps, or the shared-prefix junction);
        a transient checkpoint's block loses its keys instead.

        A boundary inside the block makes this request the producer of a partial tail: its
        next forward overwrites the state in place, so the block is marked for
        copy-on-write (``_partial_hit_reqs``; ``allocate_new_blocks`` moves the key to a
        private copy) and its cached-block count drops to the full blocks before it.

        Returns:
            the key registered, or None.
        """
        hbs = self.block_pool.hash_block_size
        request_id = request.request_id
        lookahead = getattr(self.block_pool, "num_hash_lookahead_tokens", 0)
        checkpoint = self._checkpoints.get(request_id)
        if checkpoint is not None:
            position, checkpoint_idx = checkpoint
            blocks = self.req_to_blocks[request_id]
            assert 0 <= checkpoint_idx < len(blocks)
            checkpoint_block = blocks[checkpoint_idx]
            # The prompt's last chunk caches only up to its last full block, so a checkpoint
            # at the prompt's boundary is the reusable one, not a transient one.
            is_prompt_checkpoint = position == get_mamba_prefill_checkpoint_position(
                request.num_prompt_tokens, self.cache_hit_alignment_tokens,
                self.drop_eagle_checkpoint_block, num_hash_lookahead_tokens=lookahead,
            )
            is_retained = False
            if position % self.block_size == 0:
                block_idx = position // self.block_size - 1
                mask = self.reachable_block_mask(
                    block_idx, block_idx + 1, self.cache_hit_alignment_tokens,
                    self.kv_cache_spec, self.drop_eagle_checkpoint_block,
                    retention_interval=retention_interval,
                )
                is_retained = mask is None or mask[0]
            if (not is_prompt_checkpoint and not is_retained
                    and position != getattr(request, "shared_prefix_boundary", 0)):
                # A transient state overwrites the block: none of its keys is true now.
                self.block_pool._maybe_evict_cached_block(checkpoint_block)
                return None
            if checkpoint_block.block_hash_num_tokens == position:
                return None
            return self.block_pool.cache_partial_block(
                request=request, block=checkpoint_block, num_tokens=position,
                kv_cache_group_id=self.kv_cache_group_id, block_size=self.block_size,
                replace_existing_hashes=True,
            )
        if num_tokens <= 0 or num_tokens % hbs:
            return None
        boundary = get_mamba_prefill_checkpoint_position(
            request.num_prompt_tokens, hbs, self.drop_eagle_checkpoint_block,
            num_hash_lookahead_tokens=lookahead,
        )
        if num_tokens != boundary:
            junction = getattr(request, "shared_prefix_boundary", 0)
            if not (self.shared_prefix_checkpoint and num_tokens == junction
                    and request.num_computed_tokens < num_tokens <= request.num_prompt_tokens):
                return None
        block_idx = cdiv(num_tokens, self.block_size) - 1
        blocks = self.req_to_blocks[request_id]
        if block_idx >= len(blocks):
            return None
        source = blocks[block_idx]
        if source.is_null or source.block_hash_num_tokens == num_tokens:
            return None  # keyed here already (a hit, or an earlier step)
        partial_hash = self.block_pool.cache_partial_block(
            request=request, block=source, num_tokens=num_tokens,
            kv_cache_group_id=self.kv_cache_group_id, block_size=self.block_size,
        )
        if partial_hash is not None and num_tokens % self.block_size:
            self._partial_hit_reqs[request_id] = (block_idx, source)
            self.num_cached_block[request_id] = block_idx
            self._producer_partial_tail_reqs[request_id] = (source, num_tokens)
        return partial_hash

    def finalize_partial_tail_offload(
        self, request_id: str, num_computed_tokens: int, num_in_flight_tokens: int
    ) -> tuple[int, Block, int] | None:
        """A producer finishing before its copy-on-write: its table block itself holds the
        boundary state, if the request stopped exactly there with nothing in flight.

        Returns:
            (group id, block, boundary tokens), or None.
        """
        if self.mamba_cache_mode != "align":
            return None
        producer_tail = self._producer_partial_tail_reqs.pop(request_id, None)
        if producer_tail is None:
            return None
        source, boundary_tokens = producer_tail
        if num_in_flight_tokens != 0 or num_computed_tokens != boundary_tokens:
            return None
        return self.kv_cache_group_id, source, boundary_tokens


class CircularBufferManager(FullAttentionManager):
    """A ``CircularBufferSpec`` group: claims the ring's one block when a request first
    allocates, keeps it until the request is freed; no prefix caching, nothing skipped, no
    worker zeroing (vLLM 0.33.0's)."""

    supports_fine_grained_hash_lookup: ClassVar[bool] = False

    def _claim_ring_block(self, request_id: str, record_for_zeroing: bool = True
                          ) -> list[Block]:
        req_blocks = self.req_to_blocks[request_id]
        if req_blocks:
            return []
        new_blocks = self.block_pool.get_new_blocks(1)
        req_blocks.extend(new_blocks)
        if self._record_new_block_ids and record_for_zeroing:
            self.new_block_ids.extend(block.block_id for block in new_blocks)
        return new_blocks

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[Block],
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
    ) -> int:
        return 0 if self.req_to_blocks.get(request_id) else 1

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int
    ) -> list[Block]:
        return self._claim_ring_block(request_id)

    def allocate_external_computed_blocks(
        self,
        request_id: str,
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
        record_for_zeroing: bool = True,
    ) -> None:
        self._claim_ring_block(request_id, record_for_zeroing)

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[bytes],
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool: Any,
        kv_cache_spec: KVCacheSpec,
        drop_eagle_block: bool,
        alignment_tokens: int,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
    ) -> tuple[tuple[list[Block], ...], int]:
        return tuple([] for _ in kv_cache_group_ids), 0

    def cache_blocks(
        self,
        request: Any,
        num_tokens: int,
        retention_interval: int | None = None,
        *,
        replay_boundaries: Sequence[int],
    ) -> None:
        return

    def add_local_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[Block],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        return

    def remove_skipped_blocks(
        self,
        request_id: str,
        processed_computed_tokens: int,
        num_prompt_tokens: int | None = None,
    ) -> None:
        return

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return 0


class CrossAttentionManager(SingleTypeKVCacheManager):
    """Cross attention of an encoder-decoder model: the encoder's KV is allocated once per
    request and never shared, so there are no hits and nothing is cached."""

    def add_local_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[Block],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        assert len(new_computed_blocks) == 0

    def allocate_external_computed_blocks(
        self,
        request_id: str,
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
        record_for_zeroing: bool = True,
    ) -> None:
        return

    def cache_blocks(
        self,
        request: Any,
        num_tokens: int,
        retention_interval: int | None = None,
        *,
        replay_boundaries: Sequence[int],
    ) -> None:
        """Raises:
            ValueError: always (cross-attention blocks are never cached)."""
        raise ValueError("Should not be called as prefix caching is disabled.")

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[bytes],
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool: Any,
        kv_cache_spec: KVCacheSpec,
        drop_eagle_block: bool,
        alignment_tokens: int,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
    ) -> tuple[tuple[list[Block], ...], int]:
        """Raises:
            NotImplementedError: always."""
        assert isinstance(kv_cache_spec, CrossAttentionSpec), (
            "CrossAttentionManager can only be used for cross-attention groups"
        )
        raise NotImplementedError("CrossAttentionManager does not support caching")


class SinkFullAttentionManager(FullAttentionManager):
    """Full attention with attention-sink tokens; ``sink_len`` must be a positive multiple
    of the block size."""

    def __init__(
        self,
        kv_cache_spec: SinkFullAttentionSpec,
        block_pool: Any,
        enable_caching: bool,
        kv_cache_group_id: int,
        scheduler_block_size: int,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
    ) -> None:
        super().__init__(
            kv_cache_spec=kv_cache_spec, block_pool=block_pool, enable_caching=enable_caching,
            kv_cache_group_id=kv_cache_group_id, scheduler_block_size=scheduler_block_size,
            dcp_world_size=dcp_world_size, pcp_world_size=pcp_world_size,
        )
        sink_len = kv_cache_spec.sink_len
        assert sink_len is not None and sink_len > 0 and sink_len % self.block_size == 0


# Spec type -> manager type. A spec's manager is that of the first type in its MRO found
# here, as vLLM's registry resolves it.
spec_manager_map: dict[type[KVCacheSpec], type[SingleTypeKVCacheManager]] = {
    FullAttentionSpec: FullAttentionManager,
    MLAAttentionSpec: FullAttentionManager,
    RSWASpec: RSWAManager,
    SinkFullAttentionSpec: SinkFullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
    ChunkedLocalAttentionSpec: ChunkedLocalAttentionManager,
    MambaSpec: MambaManager,
    CrossAttentionSpec: CrossAttentionManager,
    CircularBufferSpec: CircularBufferManager,
}


# Group role -> manager type, for roles that pick their manager whatever the spec (HiSparse's
# source group; shmkv/core/hisparse.py registers it, and its spec managers, in these maps).
# A role not listed here takes its spec's manager.
role_manager_map: dict[str, type[SingleTypeKVCacheManager]] = {}


def get_manager_for_kv_cache_spec(
    kv_cache_spec: KVCacheSpec,
    max_in_flight_tokens: int,
    max_model_len: int,
    role: str | None = None,
    **kwargs: Any,
) -> SingleTypeKVCacheManager:
    """The manager for ``kv_cache_spec``; sliding-window and chunked-local managers get the
    spec's admission cap (``max_admission_blocks_per_request``).

    Args:
        kv_cache_spec: the group's spec.
        max_in_flight_tokens: tokens scheduled but not yet settled (all concurrent batches).
        max_model_len: the longest context.
        role: the group's role (``KVCacheGroupRole``); a role in ``role_manager_map`` picks
            the manager, any other takes the spec's.
        **kwargs: the manager's constructor arguments (``block_pool``, ``enable_caching``,
            ``kv_cache_group_id``, ``scheduler_block_size``, ...).

    Raises:
        AssertionError: no manager for the spec type (as vLLM).
        UsageError: a role that is not a ``KVCacheGroupRole`` value.
    """
    kv_cache_spec = from_vllm(kv_cache_spec)  # vLLM's spec, bridged (vllm_objects.py)
    if role is not None:
        try:  # a str, or any str enum with these values (vLLM's KVCacheGroupRole)
            role = KVCacheGroupRole(role)
        except ValueError:
            raise UsageError(
                f"KV cache group role must be one of {[r.value for r in KVCacheGroupRole]}, "
                f"got {role!r}"
            ) from None
    manager_class = role_manager_map.get(role) if role is not None else None
    if manager_class is None:
        manager_class = next(
            (spec_manager_map[t] for t in type(kv_cache_spec).__mro__ if t in spec_manager_map),
            None,
        )
    assert manager_class is not None, (
        f"No manager registered for KVCacheSpec {type(kv_cache_spec)}"
    )
    if isinstance(kv_cache_spec,
                  SlidingWindowSpec | ChunkedLocalAttentionSpec | HiSparseResidentSpec):
        kwargs["max_admission_blocks_per_request"] = (
            kv_cache_spec.max_admission_blocks_per_request(
                max_in_flight_tokens=max_in_flight_tokens, max_model_len=max_model_len
            )
        )
    return manager_class(kv_cache_spec, **kwargs)
