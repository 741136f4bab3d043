"""``KVCacheManager``: the scheduler's view of the KV cache, with vLLM 0.33.0's names,
arguments and behaviour (``vllm/v1/core/kv_cache_manager.py``), over an attached shmkv pool.

Each scheduler process builds its own ``KVCacheManager`` (its own coordinator and per-request
block lists) on the one shared ``BlockPool``; a scheduler written for vLLM uses it by changing
its imports. Requests may be vLLM's own ``Request`` objects (duck typed) or ``shmkv.Request``:
``status``, ``num_preemptions`` and ``num_in_flight_tokens`` are read when present and default
to a fresh request's values otherwise.

How far a request may read the prefix cache follows the vLLM its request comes from: vLLM
0.34's ``prefix_cache_hit_limit`` (0: no lookup, e.g. prompt logprobs; n: at most n tokens;
None: unbounded) and ``get_max_cache_hit_length``, or, on a request of vLLM 0.33 or before,
``skip_reading_prefix_cache`` (True is a limit of 0). ``shmkv.Request`` carries the newest
form.

Cross-process atomicity (the choice, and why):

vLLM's scheduler looks a waiting request up with ``get_computed_blocks`` and, a few lines later
(after budget checks, connector queries, LoRA limits), hands the hit back to ``allocate_slots``,
which touches it. The hit blocks may have ``ref_cnt == 0`` (they sit in the free queue), so
another process's allocation in between could evict and reuse them. Therefore:

1. ``allocate_slots`` runs under one hold of the pool lock (its free-block check and its
   allocations can't be split by another process, so a fitting request never fails with
   ``OutOfBlocksError``), and so do ``free`` and ``get_computed_blocks``.
2. ``get_computed_blocks`` that finds a hit keeps the lock held after it returns (a "lookup
   hold"); it is released when ``allocate_slots`` returns, or at the next ``free``,
   ``new_step_starts``, ``take_events``, ``reset_prefix_cache``, ``make_prefix_cache_stats``,
   ``take_boundary_state_offloads``, ``take_kv_cache_block_copies``, ``take_new_block_ids``
   or ``release_lookup_hold()``. vLLM's scheduler drains the ``take_*`` calls right after its
   waiting loop every step, so a request it looked up and then skipped (token budget, encoder
   or connector waits) does not keep other processes waiting through the forward pass. The
   lock is re-entrant, so the pool calls in between take it at no cost.
3. If a lookup hold ends before the looked-up request is allocated, the keys of its hit
   blocks are recorded then (while still held); ``allocate_slots`` re-checks them and, if any
   hit block has since been evicted or re-keyed, returns None ("does not fit": vLLM's
   scheduler keeps the request waiting and looks it up afresh next step). Nothing is touched.

``step()`` holds the lock across a whole scheduler step for schedulers that prefer that.

Partial (sub-block) hits, copy-on-write copies (``take_kv_cache_block_copies``) and Mamba
partial-tail offloads (``take_boundary_state_offloads``, ``finalize_partial_tail_offloads``)
work as in vLLM when the groups' blocks are bigger than ``hash_block_size``; the pool should
then be created with ``partial_keys=True`` (see ``shmkv/pool/layout.py``).

Not ported: ``get_computed_blocks_for_connector`` (needs per-group divergent hits), reuse
events in "full" report mode and the metrics collector.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from shmkv.core.kv_cache_coordinator import get_kv_cache_coordinator
from shmkv.core.kv_cache_interface import (
    AttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    KVCacheConfig,
    MambaSpec,
    cdiv,
    get_kv_cache_spec_kind,
    get_kv_cache_spec_sliding_window,
)
from shmkv.core.single_type_kv_cache_manager import (
    FullAttentionManager,
    MambaManager,
    trim_null_head,
)
from shmkv.core.vllm_objects import from_vllm, is_vllm_object, to_vllm_events
from shmkv.errors import UsageError
from shmkv.events import BlockStored

logger = logging.getLogger(__name__)

__all__ = ["KVCacheBlockCopy", "KVCacheBlocks", "KVCacheManager", "PrefixCacheStats"]

Block = Any


class KVCacheBlockCopy(NamedTuple):
    """A block copy the worker must do (copy-on-write of a partial hit)."""

    src_block_id: int
    dst_block_id: int


@dataclass
class PrefixCacheStats:
    """Prefix-cache hit statistics since the last ``make_prefix_cache_stats`` (vLLM's
    ``vllm.v1.metrics.stats.PrefixCacheStats``): tokens queried and hit, new requests and
    previously preempted ones counted apart."""

    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    hits_by_source: dict = field(default_factory=dict)

    def record(self, num_tokens: int, num_hits: int, preempted: bool,
               hits_by_source: dict | None = None) -> None:
        """Adds one lookup."""
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
            return
        self.requests += 1
        self.queries += num_tokens
        self.hits += num_hits
        if hits_by_source and sum(hits_by_source.values()) == num_hits:
            for source, n in hits_by_source.items():
                self.hits_by_source[source] = self.hits_by_source.get(source, 0) + n


@dataclass
class KVCacheBlocks:
    """Blocks per KV-cache group (``blocks[group][i]``), what the scheduler sees of an
    allocation or a hit."""

    blocks: tuple[Sequence[Block], ...]

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        return KVCacheBlocks(tuple(
            list(itertools.chain(a, b)) for a, b in zip(self.blocks, other.blocks, strict=True)
        ))

    def get_block_ids(self, allow_none: bool = False, *,
                      group_ids: Sequence[int] | None = None) -> tuple[list[int], ...] | None:
        """Block ids per group (only ``group_ids`` if given); None instead of all-empty lists
        when ``allow_none``."""
        groups = self.blocks if group_ids is None else tuple(self.blocks[g] for g in group_ids)
        if allow_none and all(len(g) == 0 for g in groups):
            return None
        return tuple([b.block_id for b in g] for g in groups)

    def get_unhashed_block_ids(self) -> list[int]:
        """Ids of the blocks without a cache key (one group only)."""
        assert len(self.blocks) == 1, "Only one group is supported"
        return [b.block_id for b in self.blocks[0] if b.block_hash is None]

    def get_unhashed_block_ids_all_groups(self) -> list[list[int]]:
        """Per group, ids of the blocks without a cache key, null padding left out."""
        return [
            [b.block_id for b in trim_null_head(list(g)) if b.block_hash is None and not b.is_null]
            for g in self.blocks
        ]

    def new_empty(self) -> KVCacheBlocks:
        return KVCacheBlocks(tuple(() for _ in self.blocks))


def prefix_cache_hit_limit(request: Any) -> int | None:
    """How many leading tokens ``request`` may read from the prefix cache (None: no limit),
    from vLLM 0.34's ``prefix_cache_hit_limit`` or an older request's
    ``skip_reading_prefix_cache``."""
    if hasattr(request, "prefix_cache_hit_limit"):
        return request.prefix_cache_hit_limit
    return 0 if getattr(request, "skip_reading_prefix_cache", False) else None


def max_cache_hit_length_of(request: Any, bound: int | None = None) -> int:
    """The longest prefix-cache hit ``request`` may get: ``num_tokens - 1``, its hit limit
    and ``bound``, whichever is least (vLLM 0.34's ``Request.get_max_cache_hit_length``,
    called when the request has it)."""
    getter = getattr(request, "get_max_cache_hit_length", None)
    if getter is not None:
        return getter(bound)
    limits = (request.num_tokens - 1, prefix_cache_hit_limit(request), bound)
    return min(limit for limit in limits if limit is not None)


def _status_name(request: Any) -> str | None:
    status = getattr(request, "status", None)
    return getattr(status, "name", None) if status is not None else None


class KVCacheManager:
    """One scheduler process's KV-cache manager over a shared, attached ``BlockPool``."""

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        scheduler_block_size: int,
        hash_block_size: int,
        max_in_flight_tokens: int | None = None,
        enable_caching: bool = True,
        use_eagle: bool = False,
        num_hash_lookahead_tokens: int = 0,
        num_prefill_lookahead: int = 0,
        log_stats: bool = False,
        enable_kv_cache_events: bool = False,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
        metrics_collector: Any = None,
        watermark: float = 0.0,
        enable_mamba_shared_prefix_checkpoint: bool = False,
        *,
        block_pool: Any = None,
        prefix_cache_retention_interval: int | None = None,
    ) -> None:
        """
        Args:
            kv_cache_config .. enable_mamba_shared_prefix_checkpoint: as vLLM 0.33.0's.
            block_pool: the attached shmkv ``BlockPool`` (required).
            prefix_cache_retention_interval: overrides the config's / the environment's.

        Raises:
            UsageError: a refused configuration (see ``shmkv.core.kv_cache_coordinator``), or a
                negative watermark.
        """
        if watermark < 0.0:
            raise UsageError(f"watermark must be non-negative, got {watermark}")
        # Built from vLLM's own config (vllm_objects.py): its callers get vLLM's event classes.
        self._vllm_events = is_vllm_object(kv_cache_config)
        kv_cache_config = from_vllm(kv_cache_config)
        self.max_model_len = max_model_len
        if max_in_flight_tokens is None:
            max_in_flight_tokens = max_model_len
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.use_eagle = use_eagle
        self.log_stats = log_stats
        self.metrics_collector = metrics_collector
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None
        self.coordinator = get_kv_cache_coordinator(
            kv_cache_config=kv_cache_config,
            max_model_len=max_model_len,
            max_in_flight_tokens=max_in_flight_tokens,
            use_eagle=use_eagle,
            enable_caching=enable_caching,
            enable_kv_cache_events=enable_kv_cache_events,
            dcp_world_size=dcp_world_size,
            pcp_world_size=pcp_world_size,
            scheduler_block_size=scheduler_block_size,
            hash_block_size=hash_block_size,
            metrics_collector=metrics_collector,
            num_hash_lookahead_tokens=num_hash_lookahead_tokens,
            num_prefill_lookahead=num_prefill_lookahead,
            block_pool=block_pool,
            prefix_cache_retention_interval=prefix_cache_retention_interval,
        )
        # Only for EAGLE models with partial hash hits on (vLLM's rule).
        self.mamba_shared_prefix_checkpoint = (
            enable_mamba_shared_prefix_checkpoint
            and bool(self.coordinator.eagle_group_ids)
            and self.coordinator.enable_partial_hash_hits
            and self.coordinator.num_reprefillable_tokens == 0
        )
        if self.mamba_shared_prefix_checkpoint:
            for manager in self.coordinator.single_type_managers:
                if isinstance(manager, MambaManager):
                    manager.shared_prefix_checkpoint = True
        self.num_kv_cache_groups = len(kv_cache_config.kv_cache_groups)
        self.block_pool = self.coordinator.block_pool
        self.retained_hit_group_ids = tuple(
            m.kv_cache_group_id for m in self.coordinator.single_type_managers
            if m.retains_longer_hit
        )
        self.kv_cache_config = kv_cache_config
        self.watermark_blocks = int(watermark * kv_cache_config.num_blocks)
        self.kv_cache_event_metadata = tuple(
            (get_kv_cache_spec_kind(g.kv_cache_spec).value,
             get_kv_cache_spec_sliding_window(g.kv_cache_spec))
            for g in kv_cache_config.kv_cache_groups
        )
        self.empty_kv_cache_blocks = KVCacheBlocks(
            tuple(() for _ in range(self.num_kv_cache_groups)))
        self._lock = self.block_pool.lock()
        # The managers whose decode steps may take the no-pool path of ``allocate_slots``
        # (``_slots_already_allocated``), or () when some group may not: only plain full
        # attention, whose steps free nothing (no window) and, with blocks the size of the
        # hashes, key nothing but whole blocks.
        managers = self.coordinator.single_type_managers
        self._no_pool_decode_managers = managers if managers and all(
            type(m) is FullAttentionManager
            and (not m.enable_caching or m.block_size == self.block_pool.hash_block_size)
            for m in managers
        ) else ()
        self._hash_block_size = self.block_pool.hash_block_size
        self._lookup_hold = False
        # Requests looked up under the current lookup hold: request id -> hit blocks.
        self._pending_hits: dict[str, tuple[Sequence[Block], ...]] = {}
        # Requests whose lookup hold ended before allocation: id -> [(block, key)].
        self._hits_to_verify: dict[str, list[tuple[Block, bytes | None]]] = {}

    # ------------------------------------------------------------------ locking

    @contextlib.contextmanager
    def step(self) -> Iterator[KVCacheManager]:
        """Holds the pool lock for a whole scheduler step (re-entrant)."""
        with self._lock:
            yield self

    def _begin_lookup_hold(self) -> None:
        if not self._lookup_hold:
            self._lock.__enter__()
            self._lookup_hold = True

    def release_lookup_hold(self) -> None:
        """Ends the hold ``get_computed_blocks`` took; hits not yet allocated will be
        re-checked by ``allocate_slots``."""
        if not self._lookup_hold:
            return
        try:
            for rid, groups in self._pending_hits.items():
                self._hits_to_verify[rid] = [
                    (b, b.block_hash) for g in groups for b in g if not b.is_null
                ]
            self._pending_hits.clear()
        finally:
            self._lookup_hold = False
            self._lock.__exit__(None, None, None)

    def _hit_still_valid(self, request_id: str) -> bool:
        recorded = self._hits_to_verify.pop(request_id, None)
        if recorded is None:
            return True
        return all(b.block_hash == key and key is not None for b, key in recorded)

    # ------------------------------------------------------------------ stats

    @property
    def usage(self) -> float:
        """Fraction of the shared pool in use (0.0 to 1.0)."""
        return self.block_pool.get_usage()

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The stats since the last call (then reset), or None without ``log_stats``."""
        self.release_lookup_hold()
        if not self.log_stats:
            return None
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def prefix_cache_lookup_enabled(self, request: Any) -> bool:
        """Whether a prefix-cache lookup may run for ``request`` (its hit limit is not 0)."""
        return self.enable_caching and prefix_cache_hit_limit(request) != 0

    def get_num_cached_tokens(self, request: Any) -> int:
        """How many of ``request``'s tokens the prefix cache holds now (at most
        ``num_tokens - 1``), or 0 when it may not read the cache: a probe that takes no
        references, allocates nothing, emits no events and starts no lookup hold, for a
        request that may never be scheduled (vLLM 0.34's cache-aware admission)."""
        if not self.prefix_cache_lookup_enabled(request):
            return 0
        with self._lock:
            _, num_hit, _ = self.coordinator.find_longest_cache_hit(
                request.block_hashes, request.num_tokens - 1)
        return num_hit

    def record_prefix_cache_stats(self, request: Any, num_hits: int) -> None:
        """Counts one lookup (the scheduler calls it, as in vLLM)."""
        if not self.log_stats or not self.prefix_cache_lookup_enabled(request):
            return
        assert self.prefix_cache_stats is not None
        self.prefix_cache_stats.record(
            num_tokens=request.num_tokens, num_hits=num_hits,
            preempted=getattr(request, "num_preemptions", 0) > 0,
        )

    # ------------------------------------------------------------------ lookup

    def get_computed_blocks(
        self, request: Any, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlocks, int, int]:
        """The request's prefix-cache hit: (blocks, hit tokens, shared prefix boundary).

        The hit is at most ``num_tokens - 1`` tokens (the last token is always recomputed for
        its logits), the request's hit limit, and ``max_cache_hit_length`` if given. A
        non-empty hit starts a lookup hold (module docstring).
        """
        if not self.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0
        max_cache_hit_length = max_cache_hit_length_of(request, max_cache_hit_length)
        with self._lock:
            computed, num_hit, num_uncached = self.coordinator.find_longest_cache_hit(
                request.block_hashes, max_cache_hit_length)
            # vLLM's "full" report mode: the reused blocks are announced as stored too, so
            # an outside consumer (a router, the cluster index) learns of every hit.
            if (num_hit > 0 and self.enable_kv_cache_events
                    and getattr(request, "kv_cache_report_mode", "incremental") == "full"):
                self.coordinator.emit_cached_block_events(request, computed)
            if any(computed):
                self._begin_lookup_hold()
                self._pending_hits[request.request_id] = computed
                self._hits_to_verify.pop(request.request_id, None)
        boundary = num_hit + num_uncached if num_uncached else 0
        return self.create_kv_cache_blocks(computed), num_hit, boundary

    def get_computed_blocks_for_connector(
        self, request: Any, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlocks, int, int, bool]:
        """The local hit of a request scheduled with a KV connector: ``get_computed_blocks``'
        triple plus ``hit_diverged`` (vLLM 0.33.0's call).

        On a hybrid model with Mamba layers and a full-attention group, the full-attention
        group's own hit is the local prefix (the connector transfers the rest, Mamba state
        included), and ``hit_diverged`` says that some group's hit is shorter; when a group
        hit deeper than full attention (its full-attention blocks were evicted), or on any
        other model, it is ``get_computed_blocks`` with ``hit_diverged`` False. The
        per-group lookup reports no shared-prefix boundary (0).
        """
        coordinator = self.coordinator
        if not (self.kv_cache_config.has_mamba_layers
                and getattr(coordinator, "full_attention_group_id", None) is not None):
            return (*self.get_computed_blocks(request, max_cache_hit_length), False)
        if not self.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0, False
        max_cache_hit_length = max_cache_hit_length_of(request, max_cache_hit_length)
        fa_group_id = coordinator.full_attention_group_id
        with self._lock:
            computed, per_group = coordinator.find_longest_cache_hit_per_group(
                request.block_hashes, max_cache_hit_length)
            if any(hit > per_group[fa_group_id] for hit in per_group):
                return (*self.get_computed_blocks(request, max_cache_hit_length), False)
            if any(computed):
                self._begin_lookup_hold()
                self._pending_hits[request.request_id] = computed
                self._hits_to_verify.pop(request.request_id, None)
        num_local = per_group[fa_group_id]
        return (self.create_kv_cache_blocks(computed), num_local, 0,
                min(per_group) < num_local)

    # ------------------------------------------------------------------ allocation

    def allocate_slots(
        self,
        request: Any,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        skip_zeroing_group_ids: tuple[int, ...] = (),
    ) -> KVCacheBlocks | None:
        """Slots for ``num_new_tokens`` more tokens (plus lookahead), after adopting this
        step's prefix-cache hit and external tokens; returns the newly allocated blocks, or
        None when they do not fit (nothing changed then, except blocks the window no longer
        needs having been freed).

        Raises:
            ValueError: nothing to allocate and nothing to adopt.
        """
        if num_new_tokens == 0 and num_external_computed_tokens == 0 and (
            num_new_computed_tokens == 0
        ):
            raise ValueError(
                "num_new_tokens must be greater than 0 when there are no computed tokens "
                "to adopt"
            )
        if (new_computed_blocks is None and self._no_pool_decode_managers
                and num_new_computed_tokens == 0 and num_external_computed_tokens == 0
                and reserved_blocks == 0 and not full_sequence_must_fit
                and self._slots_already_allocated(request, num_new_tokens,
                                                  num_lookahead_tokens,
                                                  delay_cache_blocks, has_scheduled_reqs)):
            if self._lookup_hold or self._pending_hits or self._hits_to_verify:
                self._end_allocation(request.request_id)  # skipped when nothing is pending
            return self.empty_kv_cache_blocks
        try:
            with self._lock:
                return self._allocate_slots_locked(
                    request, num_new_tokens, num_new_computed_tokens, new_computed_blocks,
                    num_lookahead_tokens, num_external_computed_tokens, delay_cache_blocks,
                    num_encoder_tokens, full_sequence_must_fit, reserved_blocks,
                    has_scheduled_reqs, skip_zeroing_group_ids,
                )
        finally:
            self._end_allocation(request.request_id)

    def _end_allocation(self, request_id: str) -> None:
        """The end of every ``allocate_slots``: the request's lookup is spent, and the
        lookup hold goes once no lookup awaits its allocation."""
        self._pending_hits.pop(request_id, None)
        self._hits_to_verify.pop(request_id, None)
        if not self._pending_hits:
            self.release_lookup_hold()

    def _slots_already_allocated(self, request: Any, num_new_tokens: int,
                                 num_lookahead_tokens: int, delay_cache_blocks: bool,
                                 has_scheduled_reqs: bool) -> bool:
        """Whether this ``allocate_slots`` of a running request, with no hit to adopt, would
        change nothing and return no block: every group's blocks already hold the new slots
        and no block becomes full enough to cache (the decode step inside a block). Then
        the general path would only read the pool (free-block count: 0 needed always fits
        when nothing is reserved) and return the empty result, so the caller returns it
        without taking the lock or walking the coordinator. Reads only this process's state.

        Only for ``_no_pool_decode_managers`` (plain full attention): their
        ``remove_skipped_blocks`` frees nothing, their ``cache_blocks`` keys only blocks
        past ``num_cached_block``, and a pending copy-on-write (``_partial_hit_reqs``)
        sends the call to the general path.
        """
        if self.watermark_blocks and has_scheduled_reqs and self._is_waiting(request):
            return False
        request_id = request.request_id
        max_model_len = self.max_model_len
        total_computed = min(request.num_computed_tokens, max_model_len)
        num_need_slot = min(total_computed + num_new_tokens + num_lookahead_tokens,
                            max_model_len)
        # Tokens the general path would cache up to (a bound: coordinators may lower it).
        num_to_cache = 0
        if self.enable_caching and not delay_cache_blocks:
            num_to_cache = min(total_computed + num_new_tokens, request.num_tokens,
                               len(request.block_hashes) * self._hash_block_size)
        for manager in self._no_pool_decode_managers:
            num_cached = manager.num_cached_block.get(request_id)
            if num_cached is None:  # not running: the general path decides
                return False
            blocks = manager.req_to_blocks.get(request_id)
            block_size = manager.block_size
            if blocks is None or len(blocks) * block_size < num_need_slot:
                return False
            if num_to_cache // block_size > num_cached or request_id in (
                manager._partial_hit_reqs
            ):
                return False
        return True

    def _is_waiting(self, request: Any) -> bool:
        name = _status_name(request)
        if name is not None:
            return name in ("WAITING", "PREEMPTED")
        return not any(request.request_id in m.req_to_blocks
                       for m in self.coordinator.single_type_managers)

    def _allocate_slots_locked(
        self, request, num_new_tokens, num_new_computed_tokens, new_computed_blocks,
        num_lookahead_tokens, num_external_computed_tokens, delay_cache_blocks,
        num_encoder_tokens, full_sequence_must_fit, reserved_blocks, has_scheduled_reqs,
        skip_zeroing_group_ids,
    ) -> KVCacheBlocks | None:
        coordinator = self.coordinator
        request_id = request.request_id
        if new_computed_blocks is not None:
            hit = new_computed_blocks.blocks
            if any(hit) and not self._hit_still_valid(request_id):
                return None  # another process evicted part of the hit since the lookup
            if self.retained_hit_group_ids:
                reused = num_new_computed_tokens + num_external_computed_tokens
                groups = list(hit)
                for gid in self.retained_hit_group_ids:
                    bs = coordinator.single_type_managers[gid].block_size
                    groups[gid] = groups[gid][:cdiv(reused, bs)]
                hit = tuple(groups)
        else:
            hit = self.empty_kv_cache_blocks.blocks

        num_local_computed = request.num_computed_tokens + num_new_computed_tokens
        total_computed = min(num_local_computed + num_external_computed_tokens,
                             self.max_model_len)
        watermark_blocks = 0
        if has_scheduled_reqs and self.watermark_blocks and self._is_waiting(request):
            watermark_blocks = self.watermark_blocks
        num_prompt_tokens = request.num_prompt_tokens
        prefill_end = max(num_prompt_tokens, request.num_tokens - 1)
        fits = self.block_pool.has_free_blocks  # reaps the dead on a shortfall

        if full_sequence_must_fit:
            full = min(request.num_tokens, self.max_model_len)
            need = coordinator.get_num_blocks_to_allocate(
                request_id=request_id, num_tokens=full, new_computed_blocks=hit,
                num_encoder_tokens=num_encoder_tokens, total_computed_tokens=total_computed,
                num_local_computed_tokens=num_local_computed, num_tokens_main_model=full,
                apply_admission_cap=True, prefill_end=prefill_end,
            )
            if not fits(need + watermark_blocks):
                return None

        num_tokens_main_model = total_computed + num_new_tokens
        num_tokens_need_slot = min(num_tokens_main_model + num_lookahead_tokens,
                                   self.max_model_len)
        in_flight = getattr(request, "num_in_flight_tokens", 0)
        coordinator.remove_skipped_blocks(
            request_id, max(0, total_computed - in_flight), num_prompt_tokens=num_prompt_tokens)
        need = coordinator.get_num_blocks_to_allocate(
            request_id=request_id, num_tokens=num_tokens_need_slot, new_computed_blocks=hit,
            num_encoder_tokens=num_encoder_tokens,
            total_computed_tokens=num_local_computed + num_external_computed_tokens,
            num_local_computed_tokens=num_local_computed,
            num_tokens_main_model=num_tokens_main_model, prefill_end=prefill_end,
        )
        if not fits(need + watermark_blocks + reserved_blocks):
            return None
        if hit is not self.empty_kv_cache_blocks.blocks or num_external_computed_tokens > 0:
            coordinator.allocate_new_computed_blocks(
                request_id=request_id, new_computed_blocks=hit,
                num_local_computed_tokens=num_local_computed,
                num_external_computed_tokens=num_external_computed_tokens,
                skip_zeroing_group_ids=skip_zeroing_group_ids,
            )
        new_blocks = coordinator.allocate_new_blocks(
            request_id, num_tokens_need_slot, num_tokens_main_model, num_encoder_tokens)
        if delay_cache_blocks or not self.enable_caching:
            return self.create_kv_cache_blocks(new_blocks)
        coordinator.cache_blocks(request, min(total_computed + num_new_tokens,
                                              request.num_tokens))
        return self.create_kv_cache_blocks(new_blocks)

    # ------------------------------------------------------------------ release

    def free(self, request: Any) -> None:
        """Releases the request's blocks (reverse order, so tails are evicted first)."""
        self.release_lookup_hold()
        with self._lock:
            self.coordinator.free(request.request_id)

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        """Frees the blocks outside every group's window (replaced by the null block)."""
        with self._lock:
            self.coordinator.remove_skipped_blocks(request_id, processed_computed_tokens,
                                                   num_prompt_tokens)

    def pop_blocks_for_free(self, request: Any) -> list[Block]:
        """Forgets the request, returning its blocks for the caller to free (reversed)."""
        return self.coordinator.pop_blocks_for_free(request.request_id)

    def evict_blocks(self, block_ids: set[int]) -> None:
        """Drops these blocks' prefix-cache entries."""
        self.block_pool.evict_blocks(block_ids)

    def reset_prefix_cache(self) -> bool:
        """Drops the whole shared prefix cache; False (nothing done) if blocks are in use,
        in any process."""
        self.release_lookup_hold()
        if not self.coordinator.reset_prefix_cache():
            return False
        if self.log_stats:
            assert self.prefix_cache_stats is not None
            self.prefix_cache_stats.reset = True
        return True

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """Always 0 per group (cascade attention is gone in 0.33.0)."""
        return [0] * self.num_kv_cache_groups

    def take_events(self) -> list:
        """This process's KV events since the last call; ``BlockStored`` events are annotated
        with their group's spec kind and sliding window."""
        self.release_lookup_hold()
        events = self.block_pool.take_events()
        meta = self.kv_cache_event_metadata
        for event in events:
            if not isinstance(event, BlockStored) or event.group_idx is None:
                continue
            if not 0 <= event.group_idx < len(meta):
                # vLLM's warning, word for word; the event goes out unannotated.
                logger.warning("Group index `%s` not in KV cache metadata", event.group_idx)
                continue
            event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window = (
                meta[event.group_idx])
        return to_vllm_events(events) if self._vllm_events else events

    # ------------------------------------------------------------------ views

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return self.create_kv_cache_blocks(self.coordinator.get_blocks(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self.get_blocks(request_id).get_block_ids()

    def get_block_ids_for_computed_tokens(self, request_id: str,
                                          num_computed_tokens: int) -> tuple[list[int], ...]:
        """Block ids covering the computed tokens (attention groups clipped)."""
        out = []
        for group, ids in zip(self.kv_cache_config.kv_cache_groups,
                              self.get_block_ids(request_id), strict=True):
            spec = group.kv_cache_spec
            if not isinstance(spec, AttentionSpec) or isinstance(
                    spec, CrossAttentionSpec | EncoderOnlyAttentionSpec):
                out.append(ids)
            else:
                out.append(ids[:cdiv(num_computed_tokens, spec.block_size)])
        return tuple(out)

    def estimate_cached_tokens(self, request: Any) -> int:
        """The shortest, over cacheable groups, of the longest cached prefix the request's
        blocks cover."""
        cached: int | None = None
        for group, blocks in zip(self.kv_cache_config.kv_cache_groups,
                                 self.get_blocks(request.request_id).blocks, strict=True):
            spec = group.kv_cache_spec
            if not spec.prefix_cacheable or isinstance(
                    spec, CrossAttentionSpec | EncoderOnlyAttentionSpec):
                continue
            n = max((b.block_hash_num_tokens or 0 for b in blocks), default=0)
            cached = n if cached is None else min(cached, n)
        return cached or 0

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        """Caches the request's full blocks up to ``num_computed_tokens`` (caching on)."""
        if self.enable_caching:
            with self._lock:
                self.coordinator.cache_blocks(request, num_computed_tokens)

    def create_kv_cache_blocks(self, blocks: tuple[Sequence[Block], ...]) -> KVCacheBlocks:
        return KVCacheBlocks(blocks) if any(blocks) else self.empty_kv_cache_blocks

    def truncate_computed_blocks(self, blocks: KVCacheBlocks,
                                 num_computed_tokens: int) -> KVCacheBlocks:
        """The lookup result cut at an aligned token count (nothing touched)."""
        out: list[list[Block]] = []
        for group_blocks, manager, group in zip(
                blocks.blocks, self.coordinator.single_type_managers,
                self.kv_cache_config.kv_cache_groups, strict=True):
            if not group.kv_cache_spec.prefix_cacheable:
                assert not group_blocks
                out.append([])
                continue
            assert num_computed_tokens % manager.block_size == 0
            n = num_computed_tokens // manager.block_size
            if isinstance(group.kv_cache_spec, MambaSpec):
                n = min(n, len(group_blocks))
            else:
                assert n <= len(group_blocks)
            out.append(list(group_blocks[:n]))
        return self.create_kv_cache_blocks(tuple(out))

    def take_new_block_ids(self) -> list[int]:
        self.release_lookup_hold()
        ids: list[int] = []
        for manager in self.coordinator.single_type_managers:
            ids.extend(manager.take_new_block_ids())
        return ids

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        for manager in self.coordinator.single_type_managers:
            if manager.records_new_block_ids:
                assert start_token % manager.block_size == 0
                blocks = manager.req_to_blocks[request_id]
                manager.new_block_ids.extend(
                    b.block_id for b in blocks[start_token // manager.block_size:])

    def take_kv_cache_block_copies(self) -> tuple[list[KVCacheBlockCopy], list[Block]]:
        self.release_lookup_hold()
        pending = []
        for manager in self.coordinator.single_type_managers:
            pending.extend(manager.take_pending_cow_copies())
        copies = [KVCacheBlockCopy(src.block_id, dst.block_id) for src, dst in pending]
        return copies, [b for pair in pending for b in pair]

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        """Mamba "align" boundary states to hand to a KV connector; vLLM's scheduler drains
        this after its waiting loop every step, so a lookup hold left by a request it dropped
        ends here, before the forward pass."""
        self.release_lookup_hold()
        out: dict[str, list[tuple[int, int, int]]] = {}
        for manager in self.coordinator.single_type_managers:
            for rid, gid, block, boundary in manager.take_pending_boundary_state_offloads():
                out.setdefault(rid, []).append((gid, block.block_id, boundary))
        return out

    def finalize_partial_tail_offloads(self, request: Any) -> list[tuple[int, int, int]]:
        out = []
        for manager in self.coordinator.single_type_managers:
            done = manager.finalize_partial_tail_offload(
                request.request_id, request.num_computed_tokens,
                getattr(request, "num_in_flight_tokens", 0))
            if done is not None:
                gid, block, boundary = done
                out.append((gid, block.block_id, boundary))
        return out

    def new_step_starts(self) -> None:
        """Called at the start of each scheduler step; ends a leftover lookup hold."""
        self.release_lookup_hold()
        self.coordinator.new_step_starts()
