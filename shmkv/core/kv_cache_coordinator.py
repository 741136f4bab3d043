"""KV-cache coordinators: the per-group managers of one model, driven together, with vLLM 0.33.0's
names, arguments and behaviour (``vllm/v1/core/kv_cache_coordinator.py``).

A coordinator owns one single-type manager per KV-cache group and fans every call out to them.
What differs between the three kinds is the prefix-cache hit search:

    KVCacheCoordinatorNoPrefixCache  caching off: never a hit; any number of groups
    UnitaryKVCacheCoordinator        one group: its manager's own search
    HybridKVCacheCoordinator         several groups: identical specs are looked up once
                                     ("spec groups", full attention first), and the hit
                                     length is shrunk until every group accepts it (a
                                     fixed point; full attention, being downward-closed,
                                     is searched once and then only truncated)

shmkv differences from vLLM:

- The ``BlockPool`` is not built here: an attached shmkv pool is passed as ``block_pool=``
  (several processes share it). Its ``hash_block_size`` must equal the coordinator's and it
  must have caching on when the coordinator does. ``enable_kv_cache_events`` and
  ``metrics_collector`` are accepted for signature parity; events are the pool's setting.
- Refusals are :class:`~shmkv.errors.UsageError` (a ValueError) with a message, where vLLM
  asserts: Unitary with ``hash_block_size != block_size`` under caching; Hybrid with fewer
  than two KV-cache groups or no prefix-cacheable group; Hybrid with context parallelism
  over a group kind vLLM does not shard (``_check_context_parallel_groups``); an invalid
  retention interval.
- Context parallelism on a hybrid model (vLLM's per-group geometry): each manager's
  ``dcp_world_size`` is the coordinator's for a DCP-sharded spec (attention), 1 for a
  replicated one (Mamba, whose snapshots every rank keeps whole; a draft group with
  ``dcp_sharded=False``), and its ``block_size`` is the spec's times that. Each group is
  looked up at its own geometry, so a full-attention hit may end inside a sharded block
  (copied on write like any partial hit) while the Mamba snapshot it resumes on is a whole
  replicated block. Nothing of it is shared state: the pool holds blocks and keys as for
  any other geometry, and every process attached to one pool must use the same one.
- Partial (sub-block) hash hits are on, as in vLLM, when a Mamba "align" group's block is
  bigger than ``hash_block_size`` (under DCP: at least as big) and every other cacheable
  group's manager can look up hash boundaries inside its (DCP-scaled) block
  (``enable_partial_hash_hits``; the hit alignment is then ``hash_block_size``). They, and
  partial-tail keys in general, want a pool created with
  ``partial_keys=True`` (a block may then hold a second key, see ``shmkv/pool/layout.py``); a
  coordinator whose groups have blocks bigger than ``hash_block_size`` warns when its pool
  has none. Reuse events in "full" report mode are not emitted.

Retention interval (sparse caching of sliding-window and Mamba states): taken from the
``prefix_cache_retention_interval`` argument, else ``kv_cache_config``'s field of that name
(where 0.33.0 reads it), else ``$SHMKV_PREFIX_CACHE_RETENTION_INTERVAL``; None (unset) keeps
everything. As in 0.33.0 it must be >= 0 and a multiple of ``scheduler_block_size``, and a
model with no sliding-window or Mamba group accepts only 0.
"""

from __future__ import annotations

import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, NamedTuple

from shmkv.core.kv_cache_interface import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    cdiv,
)
from shmkv.core.single_type_kv_cache_manager import (
    CrossAttentionManager,
    MambaManager,
    SingleTypeKVCacheManager,
    get_manager_for_kv_cache_spec,
)
from shmkv.core.vllm_objects import from_vllm
from shmkv.errors import UsageError

__all__ = [
    "RETENTION_INTERVAL_ENV",
    "HybridKVCacheCoordinator",
    "KVCacheCoordinator",
    "KVCacheCoordinatorNoPrefixCache",
    "SpecGroup",
    "UnitaryKVCacheCoordinator",
    "get_kv_cache_coordinator",
    "replay_boundaries",
    "resolve_prefix_cache_retention_interval",
]

RETENTION_INTERVAL_ENV = "SHMKV_PREFIX_CACHE_RETENTION_INTERVAL"

Block = Any  # a shmkv KVCacheBlock handle

logger = logging.getLogger(__name__)


def resolve_prefix_cache_retention_interval(
    explicit: int | None,
    kv_cache_config: KVCacheConfig,
    scheduler_block_size: int,
) -> int | None:
    """The retention interval in force, validated.

    Args:
        explicit: the constructor argument (wins when not None).
        kv_cache_config: its ``prefix_cache_retention_interval`` is next.
        scheduler_block_size: the interval must be a multiple of it.

    Returns:
        None (dense caching), 0 (boundaries only) or a positive multiple of the block size.

    Raises:
        UsageError: not an integer, negative, not a multiple of ``scheduler_block_size``, or
            non-zero on a model without sliding-window or Mamba groups.
    """
    value: Any = explicit
    source = "prefix_cache_retention_interval"
    if value is None:
        value = getattr(kv_cache_config, "prefix_cache_retention_interval", None)
        source = "kv_cache_config.prefix_cache_retention_interval"
    if value is None:
        raw = os.environ.get(RETENTION_INTERVAL_ENV, "").strip()
        if raw:
            source = f"${RETENTION_INTERVAL_ENV}"
            try:
                value = int(raw)
            except ValueError:
                raise UsageError(f"{source}={raw!r} is not an integer") from None
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise UsageError(f"{source} must be an int or None, got {value!r}")
    sparse_groups = any(
        isinstance(g.kv_cache_spec, SlidingWindowSpec | MambaSpec)
        for g in kv_cache_config.kv_cache_groups
    )
    if not sparse_groups:
        if value == 0:
            return 0
        raise UsageError(
            f"{source}={value}, but the model has no sliding-window or Mamba KV-cache group, "
            "the only ones retention thins out; leave it unset or set it to 0"
        )
    if value < 0 or value % scheduler_block_size != 0:
        raise UsageError(
            f"prefix_cache_retention_interval ({value}) must be non-negative and a multiple "
            f"of scheduler_block_size ({scheduler_block_size}) (from {source})"
        )
    return value


def replay_boundaries(
    num_prompt_tokens: int, scheduler_block_size: int, use_eagle: bool
) -> tuple[int, ...]:
    """Token positions where a later request replaying this prompt can resume: the resend of
    the same prompt (capped at ``num_prompt_tokens - 1``); with EAGLE, the aligned positions
    one block below the resend and below a longer sibling's last full block."""
    if not use_eagle:
        return (num_prompt_tokens - 1,)
    bs = scheduler_block_size
    resend = (num_prompt_tokens - 1) // bs * bs
    sibling = num_prompt_tokens // bs * bs
    return tuple(sorted({max(resend - bs, 0), max(sibling - bs, 0)}))


def _eagle_margin(block_size: int, hash_block_size: int, fine_grained: bool) -> int:
    """Tokens an EAGLE group searches past the candidate before dropping its last unit."""
    return hash_block_size if fine_grained and block_size > hash_block_size else block_size


def group_geometry(spec: KVCacheSpec, manager: SingleTypeKVCacheManager, **extra: object) -> str:
    """One group's part of a cache geometry (``KVCacheCoordinator.cache_geometry``): its
    spec class (shmkv's, also for a bridged vLLM spec), the block size its manager uses, its
    page size and context parallelism, then ``extra`` as ``name=value``."""
    kind = next(c.__name__ for c in type(spec).__mro__
                if c.__module__.startswith("shmkv.") or c is object)
    try:
        page = spec.page_size_bytes
    except Exception:  # noqa: BLE001  (a spec without a page size of its own)
        page = "?"
    fields = {"block_size": manager.block_size, "page_size_bytes": page,
              "dcp": manager.dcp_world_size, "pcp": manager.pcp_world_size, **extra}
    return f"{kind}({', '.join(f'{k}={v}' for k, v in fields.items())})"


class KVCacheCoordinator(ABC):
    """Drives one single-type manager per KV-cache group over a shared, attached pool."""

    enable_partial_hash_hits = False

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        max_in_flight_tokens: int,
        use_eagle: bool,
        enable_caching: bool,
        enable_kv_cache_events: bool,
        dcp_world_size: int,
        pcp_world_size: int,
        scheduler_block_size: int,
        hash_block_size: int,
        metrics_collector: Any = None,
        num_prefill_lookahead: int = 0,
        num_hash_lookahead_tokens: int = 0,
        *,
        block_pool: Any = None,
        prefix_cache_retention_interval: int | None = None,
    ) -> None:
        """
        Args:
            kv_cache_config: the model's groups (the pool's size is the pool's own).
            max_model_len: the longest context.
            max_in_flight_tokens: tokens in flight (admission caps of windowed groups).
            use_eagle: EAGLE/MTP drafting: hits drop the last block of eagle groups.
            enable_caching: prefix caching on.
            enable_kv_cache_events: accepted for parity; the pool's setting decides.
            dcp_world_size: decode context parallelism.
            pcp_world_size: prefill context parallelism.
            scheduler_block_size: the scheduling granularity (a multiple of every group's
                block size and of ``hash_block_size``).
            hash_block_size: tokens per request block hash; must be the pool's.
            metrics_collector: accepted for parity, unused.
            num_prefill_lookahead: prefill lookahead tokens of multi-module MTP.
            num_hash_lookahead_tokens: tokens after each block its hash covers; must be the
                pool's (``BlockPool.create(num_hash_lookahead_tokens=...)``), which every
                process hashes with.
            block_pool: the attached shmkv ``BlockPool`` all groups share (required).
            prefix_cache_retention_interval: see the module docstring.

        Raises:
            UsageError: no pool, a pool that does not match, inconsistent block sizes, an
                invalid retention interval.
        """
        kv_cache_config = from_vllm(kv_cache_config)  # vLLM's config as shmkv's
        if block_pool is None:
            raise UsageError(
                "a shmkv coordinator needs block_pool=<an attached shmkv BlockPool>; it does "
                "not create one (the pool is shared by several processes)"
            )
        if block_pool.hash_block_size != hash_block_size:
            raise UsageError(
                f"hash_block_size={hash_block_size} but the pool hashes "
                f"{block_pool.hash_block_size}-token blocks"
            )
        pool_lookahead = getattr(block_pool, "num_hash_lookahead_tokens", 0)
        if num_hash_lookahead_tokens != pool_lookahead:
            raise UsageError(
                f"num_hash_lookahead_tokens={num_hash_lookahead_tokens!r} but the pool's block "
                f"hashes cover {pool_lookahead} lookahead tokens (BlockPool.create("
                f"num_hash_lookahead_tokens=...))"
            )
        if enable_caching and not block_pool.enable_caching:
            raise UsageError("enable_caching=True but the pool was created without caching")
        groups = kv_cache_config.kv_cache_groups
        if scheduler_block_size % hash_block_size != 0 or any(
            scheduler_block_size % g.kv_cache_spec.block_size != 0 for g in groups
        ):
            raise UsageError(
                f"scheduler_block_size={scheduler_block_size} must be a multiple of "
                f"hash_block_size={hash_block_size} and of every group's block size "
                f"{[g.kv_cache_spec.block_size for g in groups]}"
            )
        self.kv_cache_config = kv_cache_config
        self.scheduler_block_size = scheduler_block_size
        self.hash_block_size = hash_block_size
        self.num_reprefillable_tokens = max(0, num_prefill_lookahead - 1)
        self.block_pool = block_pool
        self.enable_caching = enable_caching

        self.eagle_group_ids: set[int] = {i for i, g in enumerate(groups) if g.is_eagle_group}
        if use_eagle and not self.eagle_group_ids:
            self.eagle_group_ids = set(range(len(groups)))
        self.drop_eagle_group_ids = self.eagle_group_ids if use_eagle else set()
        if enable_caching and self.eagle_group_ids and scheduler_block_size < (
            num_prefill_lookahead
        ):
            raise UsageError(
                f"multi-module MTP with prefix caching needs scheduler_block_size "
                f"({scheduler_block_size}) >= num_speculative_tokens ({num_prefill_lookahead})"
            )

        self.single_type_managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            get_manager_for_kv_cache_spec(
                kv_cache_spec=g.kv_cache_spec,
                max_in_flight_tokens=max_in_flight_tokens,
                max_model_len=max_model_len,
                block_pool=block_pool,
                role=getattr(g, "role", None),
                enable_caching=enable_caching,
                kv_cache_group_id=i,
                dcp_world_size=dcp_world_size,
                pcp_world_size=pcp_world_size,
                scheduler_block_size=scheduler_block_size,
                needs_kv_cache_zeroing=kv_cache_config.needs_kv_cache_zeroing,
            )
            for i, g in enumerate(groups)
        )
        layout = getattr(block_pool, "layout", None)
        if enable_caching and layout is not None and not layout.config.partial_keys and any(
            g.kv_cache_spec.prefix_cacheable and m.block_size > hash_block_size
            for g, m in zip(groups, self.single_type_managers, strict=True)
        ):
            logger.warning(
                "KV-cache groups with blocks bigger than hash_block_size=%d key partial "
                "blocks; pool %s was created without partial_keys=True, so a block cannot "
                "hold a partial key besides its own and such keys are dropped (hits may be "
                "shorter than vLLM's)", hash_block_size, block_pool.pool_name,
            )
        if use_eagle:
            for manager in self.single_type_managers:
                if isinstance(manager, MambaManager):
                    manager.drop_eagle_checkpoint_block = True
        self.group_block_sizes = tuple(m.block_size for m in self.single_type_managers)
        self.retention_interval = resolve_prefix_cache_retention_interval(
            prefix_cache_retention_interval, kv_cache_config, scheduler_block_size
        )

    def cache_geometry(self) -> str:
        """How this coordinator's blocks hold KV, canonically: the hash block size, then per
        group its spec class (shmkv's), block size, page size and context parallelism.
        Processes whose descriptions differ must not share cached blocks
        (``BlockPool.claim_cache_geometry``)."""
        parts = [f"hash_block_size={self.hash_block_size}"]
        for i, (group, manager) in enumerate(zip(self.kv_cache_config.kv_cache_groups,
                                                 self.single_type_managers, strict=True)):
            parts.append(f"{i}:{group_geometry(group.kv_cache_spec, manager)}")
        return "; ".join(parts)

    def _bind_pool_geometry(self) -> None:
        """With prefix caching, binds the pool to this geometry or refuses it (UsageError).
        The last step of a coordinator's construction, so a refused one changes nothing."""
        if self.enable_caching:
            self.block_pool.claim_cache_geometry(self.cache_geometry())

    # ------------------------------------------------------------------ allocation

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: tuple[Sequence[Block], ...],
        num_encoder_tokens: int,
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
    ) -> int:
        """Blocks the pool must supply (summed over groups) for ``num_tokens`` slots;
        cross-attention groups count the encoder tokens once."""
        if self.retention_interval != 0:
            prefill_end = 0
        total = 0
        for i, manager in enumerate(self.single_type_managers):
            if isinstance(manager, CrossAttentionManager):
                total += manager.get_num_blocks_to_allocate(
                    request_id, num_encoder_tokens, [], 0, 0, num_encoder_tokens,
                    apply_admission_cap=apply_admission_cap,
                )
            else:
                total += manager.get_num_blocks_to_allocate(
                    request_id, num_tokens, new_computed_blocks[i], total_computed_tokens,
                    num_local_computed_tokens, num_tokens_main_model,
                    apply_admission_cap=apply_admission_cap, prefill_end=prefill_end,
                )
        return total

    def allocate_new_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: tuple[Sequence[Block], ...],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
        skip_zeroing_group_ids: tuple[int, ...] = (),
    ) -> None:
        """Gives a new request its hit: every group's hit blocks are touched first, then the
        external (connector) blocks are allocated, so no group's allocation can evict
        another group's untouched hit. A no-op for a running request."""
        managers = self.single_type_managers
        if any(request_id in m.num_cached_block for m in managers):
            assert all(len(blocks) == 0 for blocks in new_computed_blocks)
            return
        for i, manager in enumerate(managers):
            manager.add_local_computed_blocks(
                request_id, new_computed_blocks[i], num_local_computed_tokens,
                num_external_computed_tokens,
            )
        if num_external_computed_tokens > 0:
            for i, manager in enumerate(managers):
                manager.allocate_external_computed_blocks(
                    request_id, num_local_computed_tokens, num_external_computed_tokens,
                    record_for_zeroing=i not in skip_zeroing_group_ids,
                )

    def allocate_new_blocks(
        self,
        request_id: str,
        num_tokens: int,
        num_tokens_main_model: int,
        num_encoder_tokens: int = 0,
    ) -> tuple[list[Block], ...]:
        """New blocks so that every group holds ``num_tokens`` slots (cross-attention:
        ``num_encoder_tokens``)."""
        return tuple(
            m.allocate_new_blocks(
                request_id,
                num_encoder_tokens if isinstance(m, CrossAttentionManager) else num_tokens,
                num_tokens_main_model,
            )
            for m in self.single_type_managers
        )

    def get_num_cacheable_tokens(self, num_computed_tokens: int, kv_cache_group_id: int) -> int:
        """The prefix of ``num_computed_tokens`` this group may cache (multi-module MTP's
        re-prefillable tail excluded)."""
        return max(0, num_computed_tokens - self.num_reprefillable_tokens)

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        """Caches every group's newly full blocks up to ``num_computed_tokens``."""
        boundaries = replay_boundaries(
            request.num_prompt_tokens, self.scheduler_block_size,
            use_eagle=bool(self.drop_eagle_group_ids),
        )
        for group_id, manager in enumerate(self.single_type_managers):
            if not manager.enable_caching:
                continue
            manager.cache_blocks(
                request,
                self.get_num_cacheable_tokens(num_computed_tokens, group_id),
                retention_interval=self.retention_interval,
                replay_boundaries=boundaries,
            )

    def emit_cached_block_events(self, request: Any,
                                 computed_blocks: Sequence[Sequence[Block]]) -> None:
        """One ``BlockStored`` per group with a hit, for blocks reused from the prefix cache
        (``BlockPool.emit_cached_block_events``; nothing in the pool changes)."""
        for group_id, group_blocks in enumerate(computed_blocks):
            if group_blocks:
                spec = self.kv_cache_config.kv_cache_groups[group_id].kv_cache_spec
                # A group's own pool: HiSparse's source group takes its blocks from the host tier.
                self.single_type_managers[group_id].block_pool.emit_cached_block_events(
                    request, len(group_blocks), spec.block_size, group_id)

    def reset_prefix_cache(self) -> bool:
        """Drops the whole prefix cache of each pool the groups use, once each (the device
        pool, and HiSparse's host tier); False if one of them has blocks in use (that one does
        not change)."""
        pools = dict.fromkeys(m.block_pool for m in self.single_type_managers)
        # A list, not a generator: every pool is reset even after one refuses.
        return all([pool.reset_prefix_cache() for pool in pools])  # noqa: C419

    def free(self, request_id: str) -> None:
        """Releases the request's blocks in every group (each in reverse order)."""
        for manager in self.single_type_managers:
            manager.free(request_id)

    def pop_blocks_for_free(self, request_id: str) -> list[Block]:
        """Forgets the request and returns its blocks (allocation order) without freeing them;
        the caller frees them later, in reverse order."""
        blocks: list[Block] = []
        for manager in self.single_type_managers:
            blocks.extend(manager.pop_blocks_for_free(request_id))
        return blocks

    def remove_skipped_blocks(
        self, request_id: str, processed_computed_tokens: int,
        num_prompt_tokens: int | None = None,
    ) -> None:
        """Replaces the blocks no group needs any more with the null block, freeing them."""
        for manager in self.single_type_managers:
            manager.remove_skipped_blocks(request_id, processed_computed_tokens,
                                          num_prompt_tokens)

    def get_blocks(self, request_id: str) -> tuple[list[Block], ...]:
        """The request's block list in every group (empty lists for an unknown request)."""
        return tuple(m.req_to_blocks.get(request_id) or [] for m in self.single_type_managers)

    @abstractmethod
    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_cache_hit_length: int
    ) -> tuple[tuple[list[Block], ...], int, int]:
        """(hit blocks per group, hit tokens, uncached common-prefix tokens)."""
        raise NotImplementedError

    def new_step_starts(self) -> None:
        """Tells every manager a scheduler step begins."""
        for manager in self.single_type_managers:
            manager.new_step_starts()


class KVCacheCoordinatorNoPrefixCache(KVCacheCoordinator):
    """Prefix caching off: any number of groups (zero included), never a hit."""

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        max_in_flight_tokens: int,
        use_eagle: bool,
        enable_kv_cache_events: bool,
        dcp_world_size: int,
        pcp_world_size: int,
        scheduler_block_size: int,
        hash_block_size: int,
        metrics_collector: Any = None,
        num_hash_lookahead_tokens: int = 0,
        num_prefill_lookahead: int = 0,
        *,
        block_pool: Any = None,
        prefix_cache_retention_interval: int | None = None,
    ) -> None:
        super().__init__(
            kv_cache_config, max_model_len, max_in_flight_tokens, use_eagle, False,
            enable_kv_cache_events, dcp_world_size, pcp_world_size, scheduler_block_size,
            hash_block_size, metrics_collector, num_prefill_lookahead,
            num_hash_lookahead_tokens, block_pool=block_pool,
            prefix_cache_retention_interval=prefix_cache_retention_interval,
        )
        self.num_single_type_manager = len(self.single_type_managers)

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_cache_hit_length: int
    ) -> tuple[tuple[list[Block], ...], int, int]:
        return tuple([] for _ in range(self.num_single_type_manager)), 0, 0


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    """Exactly one KV-cache group: its manager's hit search, aligned to its block size."""

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        max_in_flight_tokens: int,
        use_eagle: bool,
        enable_caching: bool,
        enable_kv_cache_events: bool,
        dcp_world_size: int,
        pcp_world_size: int,
        scheduler_block_size: int,
        hash_block_size: int,
        metrics_collector: Any = None,
        num_hash_lookahead_tokens: int = 0,
        num_prefill_lookahead: int = 0,
        *,
        block_pool: Any = None,
        prefix_cache_retention_interval: int | None = None,
    ) -> None:
        if len(kv_cache_config.kv_cache_groups) != 1:
            raise UsageError(
                "UnitaryKVCacheCoordinator needs exactly one KV-cache group, got "
                f"{len(kv_cache_config.kv_cache_groups)}"
            )
        super().__init__(
            kv_cache_config, max_model_len, max_in_flight_tokens, use_eagle, enable_caching,
            enable_kv_cache_events, dcp_world_size, pcp_world_size, scheduler_block_size,
            hash_block_size, metrics_collector, num_prefill_lookahead,
            num_hash_lookahead_tokens, block_pool=block_pool,
            prefix_cache_retention_interval=prefix_cache_retention_interval,
        )
        manager = self.single_type_managers[0]
        self.kv_cache_spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        self.dcp_world_size = manager.dcp_world_size
        self.pcp_world_size = pcp_world_size
        self.block_size = manager.block_size
        if enable_caching and hash_block_size != self.block_size:
            raise UsageError(
                f"UnitaryKVCacheCoordinator with prefix caching needs hash_block_size "
                f"({hash_block_size}) == the group's block size ({self.block_size})"
            )
        manager.use_eagle = 0 in self.drop_eagle_group_ids
        self._bind_pool_geometry()

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_cache_hit_length: int
    ) -> tuple[tuple[list[Block], ...], int, int]:
        blocks, length = self.single_type_managers[0].find_longest_cache_hit(
            block_hashes=block_hashes,
            max_length=max_cache_hit_length,
            kv_cache_group_ids=[0],
            block_pool=self.block_pool,
            kv_cache_spec=self.kv_cache_spec,
            drop_eagle_block=0 in self.drop_eagle_group_ids,
            alignment_tokens=self.block_size,
            dcp_world_size=self.dcp_world_size,
            pcp_world_size=self.pcp_world_size,
        )
        return blocks, length, 0


class SpecGroup(NamedTuple):
    """KV-cache groups with one identical spec, looked up together."""

    spec: KVCacheSpec
    group_ids: list[int]
    manager_cls: type[SingleTypeKVCacheManager]
    use_eagle: bool


def dcp_block_size(spec: Any, dcp_world_size: int) -> int:
    """Tokens one block of ``spec`` spans under decode-context parallelism: a DCP-sharded
    spec (attention) splits each block's tokens over the ranks, so the block covers
    ``dcp_world_size`` times more; a replicated one (Mamba, an opted-out draft) keeps its
    size (vLLM's ``resolve_dcp_kv_block_size``)."""
    return spec.block_size * (dcp_world_size if spec.dcp_sharded else 1)


def partial_hash_hits_enabled(kv_cache_groups: Sequence[Any], hash_block_size: int,
                              dcp_world_size: int = 1,
                              manager_classes: Sequence[type] | None = None) -> bool:
    """Whether a model's prefix-cache hits may end inside a block (vLLM's rule): some Mamba
    "align" group has blocks bigger than ``hash_block_size`` (or, under DCP, at least as
    big: DCP makes the full-attention blocks coarser than the hashes instead), and (given
    ``manager_classes``, one per group) every cacheable group whose DCP-scaled block is not
    ``hash_block_size`` has a manager that can look up the hash boundaries inside a block
    (``supports_fine_grained_hash_lookup``); else a warning says which do not, and hits stay
    block aligned."""
    def layer_specs(spec: Any) -> list[Any]:
        inner = getattr(spec, "kv_cache_specs", None)
        return list(inner.values()) if isinstance(inner, dict) else [spec]

    def finer_than_mamba(spec: Any) -> bool:
        if dcp_world_size > 1:
            return spec.block_size >= hash_block_size
        return spec.block_size > hash_block_size

    if not any(
        isinstance(spec, MambaSpec) and spec.mamba_cache_mode == "align"
        and finer_than_mamba(spec)
        for group in kv_cache_groups for spec in layer_specs(group.kv_cache_spec)
    ):
        return False
    if manager_classes is None:
        return True
    unsupported = sorted({
        cls.__name__
        for group, cls in zip(kv_cache_groups, manager_classes, strict=True)
        if group.kv_cache_spec.prefix_cacheable and not cls.supports_fine_grained_hash_lookup
        and dcp_block_size(group.kv_cache_spec, dcp_world_size) != hash_block_size
    })
    if unsupported:
        logger.warning("Disabling fine-grained prefix-cache hits because these KV cache managers "
                       "require block-aligned lookups: %s.", ", ".join(unsupported))
        return False
    return True


def _check_context_parallel_groups(kv_cache_config: KVCacheConfig, dcp_world_size: int,
                                   pcp_world_size: int) -> None:
    """The group kinds context parallelism can serve (vLLM's rule), checked before anything
    is built: under PCP, full attention or a replicated attention group (a draft); under
    DCP, full attention or any replicated group (Mamba keeps its whole state on every rank,
    so its blocks and snapshots are not sharded)."""
    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        replicated = not spec.dcp_sharded
        if pcp_world_size > 1 and not (
            isinstance(spec, FullAttentionSpec) or (isinstance(spec, AttentionSpec) and replicated)
        ):
            raise UsageError(
                f"prefill-context parallelism (pcp_world_size={pcp_world_size}) supports only "
                f"full attention and replicated draft groups; group {i} is "
                f"{type(spec).__name__}"
            )
        if dcp_world_size > 1 and not (isinstance(spec, FullAttentionSpec) or replicated):
            raise UsageError(
                f"decode-context parallelism (dcp_world_size={dcp_world_size}) on a hybrid "
                "model supports only full-attention, Mamba and replicated draft groups; "
                f"group {i} is {type(spec).__name__}"
            )


class HybridKVCacheCoordinator(KVCacheCoordinator):
    """Several KV-cache groups (e.g. full attention + sliding window, or + Mamba): the hit
    is the longest length every group accepts, found by a shrinking fixed point."""

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        max_in_flight_tokens: int,
        use_eagle: bool,
        enable_caching: bool,
        enable_kv_cache_events: bool,
        dcp_world_size: int,
        pcp_world_size: int,
        scheduler_block_size: int,
        hash_block_size: int,
        metrics_collector: Any = None,
        num_hash_lookahead_tokens: int = 0,
        num_prefill_lookahead: int = 0,
        allow_partial_hash_hits: bool = True,
        *,
        block_pool: Any = None,
        prefix_cache_retention_interval: int | None = None,
    ) -> None:
        num_groups = len(kv_cache_config.kv_cache_groups)
        if num_groups < 2:
            raise UsageError(
                f"HybridKVCacheCoordinator needs at least two KV-cache groups, got {num_groups}"
                " (use UnitaryKVCacheCoordinator, or get_kv_cache_coordinator)"
            )
        _check_context_parallel_groups(kv_cache_config, dcp_world_size, pcp_world_size)
        super().__init__(
            kv_cache_config, max_model_len, max_in_flight_tokens, use_eagle, enable_caching,
            enable_kv_cache_events, dcp_world_size, pcp_world_size, scheduler_block_size,
            hash_block_size, metrics_collector, num_prefill_lookahead,
            num_hash_lookahead_tokens, block_pool=block_pool,
            prefix_cache_retention_interval=prefix_cache_retention_interval,
        )
        self.dcp_world_size = dcp_world_size
        bad = [
            m.block_size
            for m, g in zip(self.single_type_managers, kv_cache_config.kv_cache_groups,
                            strict=True)
            if g.kv_cache_spec.prefix_cacheable and m.block_size % hash_block_size != 0
        ]
        if bad:
            raise UsageError(
                f"every cacheable group's block size must be a multiple of hash_block_size "
                f"({hash_block_size}); these are not: {bad}"
            )
        # Sub-block hits need Mamba "align" blocks finer-hashed than they are big, and every
        # other cacheable group able to probe inside a block.
        self.enable_partial_hash_hits = bool(allow_partial_hash_hits) and partial_hash_hits_enabled(
            kv_cache_config.kv_cache_groups, hash_block_size, dcp_world_size,
            [type(m) for m in self.single_type_managers],
        )
        for manager in self.single_type_managers:
            manager.cache_hit_alignment_tokens = self._cache_hit_alignment_tokens
        self.verify_and_split_kv_cache_groups()
        self._bind_pool_geometry()

    @property
    def _cache_hit_alignment_tokens(self) -> int:
        return self.hash_block_size if self.enable_partial_hash_hits else (
            self.scheduler_block_size)

    def verify_and_split_kv_cache_groups(self) -> None:
        """Builds ``attention_groups``: cacheable groups merged by identical spec and manager
        class, full attention first; sets ``full_attention_group_id`` and the eagle bits."""
        self.attention_groups: list[SpecGroup] = []
        for i, g in enumerate(self.kv_cache_config.kv_cache_groups):
            spec = g.kv_cache_spec
            if not spec.prefix_cacheable:
                continue
            manager_cls = type(self.single_type_managers[i])
            use_eagle = i in self.drop_eagle_group_ids
            for idx, group in enumerate(self.attention_groups):
                if group.spec == spec and group.manager_cls is manager_cls:
                    group.group_ids.append(i)
                    if use_eagle and not group.use_eagle:
                        self.attention_groups[idx] = group._replace(use_eagle=True)
                    break
            else:
                self.attention_groups.append(SpecGroup(spec, [i], manager_cls, use_eagle))
        if not self.attention_groups:
            raise UsageError("HybridKVCacheCoordinator needs at least one prefix-cacheable group")
        self.attention_groups.sort(key=lambda g: not isinstance(g.spec, FullAttentionSpec))
        first = self.attention_groups[0]
        self.full_attention_group_id: int | None = (
            first.group_ids[0] if isinstance(first.spec, FullAttentionSpec) else None
        )
        for group in self.attention_groups:
            if group.use_eagle:
                for gid in group.group_ids:
                    self.single_type_managers[gid].use_eagle = True

    def _align_cacheable(self, num_tokens: int) -> int:
        if self.enable_partial_hash_hits:
            return num_tokens
        return num_tokens // self.scheduler_block_size * self.scheduler_block_size

    def get_num_cacheable_tokens(self, num_computed_tokens: int, kv_cache_group_id: int) -> int:
        """Only the scheduler-aligned prefix can ever be a hit; EAGLE groups keep one block
        more (they match it, then drop it)."""
        aligned = self._align_cacheable(num_computed_tokens)
        manager = self.single_type_managers[kv_cache_group_id]
        if manager.use_eagle and aligned > 0:
            finalized = max(0, num_computed_tokens - self.num_reprefillable_tokens)
            return min(finalized, self._align_cacheable(finalized) + manager.block_size)
        return aligned

    def _lookup(self, group: SpecGroup, block_hashes: Sequence[bytes], max_length: int,
                drop_eagle_block: bool) -> tuple[tuple[list[Block], ...], int]:
        manager = self.single_type_managers[group.group_ids[0]]
        return group.manager_cls.find_longest_cache_hit(
            block_hashes=block_hashes,
            max_length=max_length,
            kv_cache_group_ids=group.group_ids,
            block_pool=manager.block_pool,
            kv_cache_spec=group.spec,
            drop_eagle_block=drop_eagle_block,
            alignment_tokens=self._cache_hit_alignment_tokens,
            dcp_world_size=manager.dcp_world_size,
            pcp_world_size=manager.pcp_world_size,
        )

    def _search_length(self, group: SpecGroup, candidate: int, num_hashed: int,
                       drop_eagle_block: bool) -> int:
        if not drop_eagle_block or isinstance(group.spec, MambaSpec):
            return candidate
        manager = self.single_type_managers[group.group_ids[0]]
        margin = _eagle_margin(
            manager.block_size, self.hash_block_size,
            self.enable_partial_hash_hits and group.manager_cls.supports_fine_grained_hash_lookup,
        )
        return min(candidate + margin, num_hashed)

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_cache_hit_length: int
    ) -> tuple[tuple[list[Block], ...], int, int]:
        """The fixed point: each spec group in turn may shorten the candidate length; a pass
        that shortens nothing ends the search (one pass for full attention + one other).

        Returns:
            (blocks per group, empty for groups never looked up), the hit in tokens, and the
            longest single-group hit minus the hit (a shared prefix a sparse group lacks).
        """
        num_groups = len(self.kv_cache_config.kv_cache_groups)
        num_hashed = len(block_hashes) * self.hash_block_size
        hit_length = max_cache_hit_length
        longest = 0
        blocks_by_group: list[list[Block] | None] = [None] * num_groups
        length_by_group = [0] * num_groups
        simple = len(self.attention_groups) == 2 and isinstance(
            self.attention_groups[0].spec, FullAttentionSpec)
        eagle_verified: set[int] = set()
        while True:
            candidate = hit_length
            for idx, group in enumerate(self.attention_groups):
                first = group.group_ids[0]
                if isinstance(group.spec, FullAttentionSpec) and blocks_by_group[first] is not None:
                    # Searched already: a shorter prefix of a full-attention hit is a hit.
                    candidate = min(candidate, length_by_group[first])
                    continue
                drop = group.use_eagle and idx not in eagle_verified
                found_blocks, found = self._lookup(
                    group, block_hashes, self._search_length(group, candidate, num_hashed, drop),
                    drop,
                )
                if drop:
                    eagle_verified.add(idx)
                elif found < candidate:
                    eagle_verified.clear()
                candidate = found
                for gid, blocks in zip(group.group_ids, found_blocks, strict=True):
                    blocks_by_group[gid] = blocks
                    length_by_group[gid] = found
                longest = max(longest, candidate)
            if candidate >= hit_length:
                break
            hit_length = candidate
            if simple:
                break
        for group in self.attention_groups:
            if not isinstance(group.spec, FullAttentionSpec):
                continue
            manager = self.single_type_managers[group.group_ids[0]]
            if manager.retains_longer_hit:
                continue
            keep = cdiv(hit_length, manager.block_size)
            for gid in group.group_ids:
                blocks = blocks_by_group[gid]
                if blocks is not None:
                    del blocks[keep:]
                    length_by_group[gid] = hit_length
        result = tuple(b if b is not None else [] for b in blocks_by_group)
        return result, hit_length, longest - hit_length

    def find_longest_cache_hit_per_group(
        self, block_hashes: Sequence[bytes], max_cache_hit_length: int
    ) -> tuple[tuple[list[Block], ...], tuple[int, ...]]:
        """Each spec group's own longest hit, not reconciled."""
        num_groups = len(self.kv_cache_config.kv_cache_groups)
        num_hashed = len(block_hashes) * self.hash_block_size
        hit_blocks: list[list[Block]] = [[] for _ in range(num_groups)]
        hit_lengths = [0] * num_groups
        for group in self.attention_groups:
            length = self._search_length(group, max_cache_hit_length, num_hashed,
                                         group.use_eagle)
            blocks, found = self._lookup(group, block_hashes, length, group.use_eagle)
            for gid, blks in zip(group.group_ids, blocks, strict=True):
                hit_blocks[gid] = blks
                hit_lengths[gid] = found
        return tuple(hit_blocks), tuple(hit_lengths)


def get_kv_cache_coordinator(
    kv_cache_config: KVCacheConfig,
    max_model_len: int,
    max_in_flight_tokens: int,
    use_eagle: bool,
    enable_caching: bool,
    enable_kv_cache_events: bool,
    dcp_world_size: int,
    pcp_world_size: int,
    scheduler_block_size: int,
    hash_block_size: int,
    metrics_collector: Any = None,
    num_hash_lookahead_tokens: int = 0,
    num_prefill_lookahead: int = 0,
    allow_partial_hash_hits: bool = True,
    *,
    block_pool: Any = None,
    prefix_cache_retention_interval: int | None = None,
) -> KVCacheCoordinator:
    """NoPrefixCache when caching is off, Unitary for one group, Hybrid otherwise.

    Raises:
        UsageError: the chosen coordinator refuses the configuration (see the module doc).
    """
    kv_cache_config = from_vllm(kv_cache_config)  # vLLM's config as shmkv's (vllm_objects.py)
    common = {
        "dcp_world_size": dcp_world_size,
        "pcp_world_size": pcp_world_size,
        "scheduler_block_size": scheduler_block_size,
        "hash_block_size": hash_block_size,
        "metrics_collector": metrics_collector,
        "num_hash_lookahead_tokens": num_hash_lookahead_tokens,
        "num_prefill_lookahead": num_prefill_lookahead,
        "block_pool": block_pool,
        "prefix_cache_retention_interval": prefix_cache_retention_interval,
    }
    if not enable_caching:
        return KVCacheCoordinatorNoPrefixCache(
            kv_cache_config, max_model_len, max_in_flight_tokens, use_eagle,
            enable_kv_cache_events, **common,
        )
    if len(kv_cache_config.kv_cache_groups) == 1:
        return UnitaryKVCacheCoordinator(
            kv_cache_config, max_model_len, max_in_flight_tokens, use_eagle, enable_caching,
            enable_kv_cache_events, **common,
        )
    return HybridKVCacheCoordinator(
        kv_cache_config, max_model_len, max_in_flight_tokens, use_eagle, enable_caching,
        enable_kv_cache_events, allow_partial_hash_hits=allow_partial_hash_hits, **common,
    )
