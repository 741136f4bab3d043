"""HiSparse on the shared pool: vLLM 0.33.0's HiSparse groups (``vllm/v1/hisparse/`` and the
HiSparse managers of ``single_type_kv_cache_manager.py``), behaviour for behaviour.

A HiSparse model keeps every page of its sparse-attention KV in a host tier and only some
pages on the GPU. Its KV-cache config has four kinds of group:

- the *source* group (role ``HISPARSE_SOURCE``, ``host_resident=True``): one host block per
  page, allocated for every page a request computes; it alone owns prefix caching, and
  publishes a page's hash only once the page's host copy is durable. Its blocks come from the
  pool's host tier (``BlockPool.tier("host")``: shared, crash-safe, both kernels);
- the *indexer* group (role ``HISPARSE_INDEXER``): ordinary full attention on the device pool;
- *resident* groups (``HiSparseResidentSpec``): the GPU copy of each page, a write-back cache
  of the host page. A page whose host copy is complete is *clean*; once its request can read
  from the host, a clean page is *unpinned* (``BlockPool.unpin_blocks``): it counts as free
  and the pool may hand it out, at which point the request stops reading it (the page
  becomes host-only, its row entry the null block);
- *hot* groups (``HiSparseHotSpec``): ``blocks_per_request`` blocks a request needs before it
  may read host-only pages.

:class:`HiSparseCoordinator` holds the per-request residency state; like every manager's
request state it is private to the scheduler process that runs the request. What is shared
is pool state: the host and device blocks, their references and the host tier's prefix index.

Invariant (one name, "resident-row"): a resident manager's row for a request is append-only
in ``req_to_blocks``; residency changes (a page adopted from a published copy, or dropped
when the pool reused its block) live in ``residency_changes`` and are applied on read
(``get_residency_row`` / ``get_resident_page``), so the block table the worker got stays valid.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from shmkv.core.kv_cache_coordinator import group_geometry
from shmkv.core.kv_cache_interface import (
    HiSparseHotSpec,
    HiSparseResidentSpec,
    KVCacheConfig,
    KVCacheGroupRole,
    cdiv,
)
from shmkv.core.kv_cache_manager import KVCacheBlockCopy
from shmkv.core.single_type_kv_cache_manager import (
    Block,
    FullAttentionManager,
    SingleTypeKVCacheManager,
    role_manager_map,
    spec_manager_map,
    trim_null_head,
)
from shmkv.errors import UsageError
from shmkv.events import MEDIUM_CPU

if TYPE_CHECKING:
    from shmkv.core.kv_cache_manager import KVCacheManager

__all__ = [
    "ACTIVE_TAIL_PAGES",
    "HiSparseCoordinator",
    "HiSparseHotManager",
    "HiSparseResidentManager",
    "HiSparseSourceManager",
    "SparseKVOffloadCommand",
    "SparseKVPageTransfer",
    "SparseKVResidencyUpdate",
    "SparseKVRowMirror",
    "get_hisparse_coordinator",
]

# A sealed page this close to the end of a resident row stays pinned: a step still in flight
# may be writing it, and an unpinned page can be handed out under the writer.
ACTIVE_TAIL_PAGES = 2


# --------------------------------------------------------------------------- worker messages


@dataclass(frozen=True)
class SparseKVPageTransfer:
    """One page copied between the host tier and its GPU copies (a spill, or a restore)."""

    transfer_id: int
    host_block_id: int
    resident_block_ids: tuple[int, ...]
    after_forward: bool
    restore: bool = False


@dataclass(frozen=True)
class SparseKVRowMirror:
    """A run of rows of one page, mirrored from its GPU copies into its host block."""

    source_starts: tuple[int, ...]
    destination_start: int
    num_rows: int


@dataclass(frozen=True)
class SparseKVResidencyUpdate:
    """The GPU block of some pages of a request, per resident group (the null block's id:
    the page is read from the host)."""

    pages: list[int]
    block_ids: tuple[list[int], ...]


@dataclass
class SparseKVOffloadCommand:
    """The page transfers of one model step, for the worker."""

    page_transfers: list[SparseKVPageTransfer]


# --------------------------------------------------------------------------- managers


def _bound(manager: Any) -> HiSparseCoordinator:
    """The coordinator a HiSparse manager is bound to (by get_hisparse_coordinator)."""
    if manager.coordinator is None:
        raise UsageError(
            f"{type(manager).__name__} (group {manager.kv_cache_group_id}) has no HiSparse "
            "coordinator: call get_hisparse_coordinator(kv_cache_manager) before the first "
            "request is admitted"
        )
    return manager.coordinator



class HiSparseSourceManager(FullAttentionManager):
    """The source group: full attention whose blocks are host pages from the pool's host tier.
    A request gets a host block for every page (admission fails when the tier is full), and
    its hashes are published through the coordinator once the host copies are durable."""

    coordinator: HiSparseCoordinator | None = None
    # The host tier still holds prefixes the device groups have lost.
    retains_longer_hit = True

    @property
    def records_new_block_ids(self) -> bool:
        return False

    def take_new_block_ids(self) -> list[int]:
        self.new_block_ids = []
        return []

    def bind_host_pool(self, num_blocks: int) -> None:
        """Takes this group's blocks from the device pool's host tier from now on."""
        self.block_pool = self.block_pool.tier(
            "host", num_blocks,
            enable_caching=self.enable_caching and self.kv_cache_spec.prefix_cacheable,
            medium=MEDIUM_CPU,
        )
        self._null_block = self.block_pool.null_block

    def take_pending_cow_copies(self) -> list[tuple[Block, Block]]:
        """Host copy-on-write goes to the HiSparse connector, not the worker's block copies."""
        return []

    def take_host_cow_copies(self) -> list[tuple[Block, Block]]:
        pending, self._pending_cow_copies = self._pending_cow_copies, []
        return pending

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
        """0 when the host tier can give the blocks (they never count against the device
        pool), else more blocks than the device pool has: admission fails."""
        coordinator = _bound(self)  # before anything is allocated
        needed = super().get_num_blocks_to_allocate(
            request_id, num_tokens, new_computed_blocks, total_computed_tokens,
            num_local_computed_tokens, num_tokens_main_model,
        )
        if self.block_pool.has_free_blocks(needed):  # the host tier; reaps its dead if short
            return 0
        if coordinator.gpu_pool is None:
            raise UsageError("a HiSparse host group needs resident groups to admit requests")
        return coordinator.gpu_pool.num_gpu_blocks + 1

    def allocate_external_computed_blocks(
        self,
        request_id: str,
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
        record_for_zeroing: bool = True,
    ) -> None:
        if num_external_computed_tokens <= 0:
            return
        # The connector fills these pages; they become readable when the load completes.
        _bound(self).record_pending_host_import(
            request_id, num_local_computed_tokens + num_external_computed_tokens
        )
        super().allocate_external_computed_blocks(
            request_id, num_local_computed_tokens, num_external_computed_tokens,
            record_for_zeroing,
        )

    def cache_blocks(self, request: Any, num_tokens: int, retention_interval: int | None = None,
                     *, replay_boundaries: Sequence[int]) -> None:
        """Deferred: the coordinator publishes the pages whose host copies are durable."""
        _bound(self).publish_when_ready(
            request, num_tokens, retention_interval, replay_boundaries=replay_boundaries
        )

    def publish_blocks(self, request: Any, num_tokens: int,
                       retention_interval: int | None = None, *,
                       replay_boundaries: Sequence[int]) -> None:
        """Puts the durable pages (up to ``num_tokens``) in the host tier's prefix cache."""
        super().cache_blocks(request, num_tokens, retention_interval=retention_interval,
                             replay_boundaries=replay_boundaries)

    def pop_blocks_for_free(self, request_id: str) -> list[Block]:
        _bound(self).free(request_id)
        return super().pop_blocks_for_free(request_id)


class _HiSparseAuxiliaryManager(SingleTypeKVCacheManager):
    """Resident and hot groups: per-request device blocks, never prefix-cached (the source
    group owns the prefix)."""

    coordinator: HiSparseCoordinator | None = None

    def cache_blocks(self, request: Any, num_tokens: int, retention_interval: int | None = None,
                     *, replay_boundaries: Sequence[int]) -> None:
        return None

    @classmethod
    def find_longest_cache_hit(cls, block_hashes, max_length, kv_cache_group_ids, block_pool,
                               kv_cache_spec, drop_eagle_block, alignment_tokens,
                               dcp_world_size=1, pcp_world_size=1):
        return tuple([] for _ in kv_cache_group_ids), 0


class HiSparseHotManager(_HiSparseAuxiliaryManager):
    """The hot region: allocated (all ``blocks_per_request`` at once) only once a request has
    history that is on the host only, or was asked to move there (``require_hot``)."""

    def __init__(self, kv_cache_spec: HiSparseHotSpec, **kwargs: Any) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        self.blocks_per_request = kv_cache_spec.blocks_per_request
        self.hot_required: set[str] = set()

    def require_hot(self, request_id: str) -> None:
        self.hot_required.add(request_id)

    def has_hot(self, request_id: str) -> bool:
        return len(self.req_to_blocks.get(request_id, ())) == self.blocks_per_request

    def get_num_required_blocks(self, request_id: str) -> int:
        return max(self.blocks_per_request - len(self.req_to_blocks.get(request_id, ())), 0)

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
        assert not new_computed_blocks
        # Host-backed history to read: an external import, a new request resuming a host
        # prefix, or a request already asked to move. A running request keeps its answer.
        host_import = total_computed_tokens > num_local_computed_tokens
        resumes_host_prefix = (
            num_local_computed_tokens > 0 and request_id not in self.num_cached_block
        )
        if host_import or resumes_host_prefix or request_id in self.hot_required:
            return self.get_num_required_blocks(request_id)
        return 0

    def add_local_computed_blocks(self, request_id: str, new_computed_blocks: Sequence[Block],
                                  num_local_computed_tokens: int,
                                  num_external_computed_tokens: int) -> None:
        assert not new_computed_blocks
        self.num_cached_block[request_id] = 0
        if num_local_computed_tokens > 0 or not _bound(self).resident_managers:
            self.require_hot(request_id)

    def allocate_external_computed_blocks(self, request_id: str, num_local_computed_tokens: int,
                                          num_external_computed_tokens: int,
                                          record_for_zeroing: bool = True) -> None:
        self.require_hot(request_id)

    def allocate_new_blocks(self, request_id: str, num_tokens: int,
                            num_tokens_main_model: int) -> list[Block]:
        # A cold admission may come here without add_local_computed_blocks.
        self.num_cached_block[request_id] = 0
        if request_id not in self.hot_required:
            return []
        req_blocks = self.req_to_blocks[request_id]
        missing = self.blocks_per_request - len(req_blocks)
        if missing <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(missing)
        req_blocks.extend(new_blocks)
        return new_blocks

    def pop_blocks_for_free(self, request_id: str) -> list[Block]:
        self.hot_required.discard(request_id)
        return super().pop_blocks_for_free(request_id)


class HiSparseResidentManager(_HiSparseAuxiliaryManager):
    """A resident group: the GPU copy of each page of a request, or the null block for a
    page read from the host (invariant "resident-row", module docstring)."""

    max_admission_blocks_per_request: int

    def __init__(self, kv_cache_spec: HiSparseResidentSpec, **kwargs: Any) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        self.residency_changes: dict[str, dict[int, Block]] = {}

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
        assert not new_computed_blocks
        existing = len(self.req_to_blocks.get(request_id, ()))
        if total_computed_tokens > num_local_computed_tokens:
            # An import: only its last page needs a GPU block (it stays writable, for the
            # replay of the last token of a full prompt hit); the others stay on the host.
            imported_pages = cdiv(total_computed_tokens, self.block_size)
            needs_tail = self.get_resident_page(request_id, imported_pages - 1) is None
            return int(needs_tail) + max(
                cdiv(num_tokens, self.block_size) - max(imported_pages, existing), 0
            )
        host_pages = cdiv(num_local_computed_tokens, self.block_size)
        required = cdiv(num_tokens, self.block_size)
        if apply_admission_cap:
            required = min(required, self.max_admission_blocks_per_request)
        return max(required - max(existing, host_pages), 0)

    def allocate_external_computed_blocks(self, request_id: str, num_local_computed_tokens: int,
                                          num_external_computed_tokens: int,
                                          record_for_zeroing: bool = True) -> None:
        """A writable GPU block for the import's last page; earlier pages stay host-only."""
        assert num_external_computed_tokens > 0
        num_tokens = num_local_computed_tokens + num_external_computed_tokens
        blocks = self.req_to_blocks[request_id]
        tail_page = (num_tokens - 1) // self.block_size
        if len(blocks) <= tail_page:
            blocks.extend([self._null_block] * (tail_page + 1 - len(blocks)))
        if self.get_resident_page(request_id, tail_page) is None:
            blocks[tail_page] = self.block_pool.get_new_blocks(1)[0]

    def add_local_computed_blocks(self, request_id: str, new_computed_blocks: Sequence[Block],
                                  num_local_computed_tokens: int,
                                  num_external_computed_tokens: int) -> None:
        """A prefix hit is on the host: its pages start host-only (null blocks); the
        coordinator may later adopt published GPU copies of them."""
        assert not new_computed_blocks
        req_blocks = self.req_to_blocks[request_id]
        assert not req_blocks
        num_host_pages = cdiv(num_local_computed_tokens, self.block_size)
        req_blocks.extend([self._null_block] * num_host_pages)
        self.num_cached_block[request_id] = 0
        _bound(self).commit_computed_blocks(request_id, num_host_pages)

    def allocate_new_blocks(self, request_id: str, num_tokens: int,
                            num_tokens_main_model: int) -> list[Block]:
        req_blocks = self.req_to_blocks[request_id]
        missing = cdiv(num_tokens, self.block_size) - len(req_blocks)
        if missing <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(missing)
        req_blocks.extend(new_blocks)
        return new_blocks

    def pop_blocks_for_free(self, request_id: str) -> list[Block]:
        """The blocks the request still pins (residency applied); the coordinator has
        already released the clean ones."""
        _bound(self).free(request_id)
        blocks = self.get_residency_row(request_id)
        self.residency_changes.pop(request_id, None)
        super().pop_blocks_for_free(request_id)
        return trim_null_head(blocks)

    def adopt_resident_page(self, request_id: str, block_idx: int, block: Block) -> bool:
        """Reads a host-only page from ``block``, a GPU copy of it; False if the page is not
        host-only (or not the request's)."""
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None or block_idx >= len(blocks):
            return False
        if self.get_resident_page(request_id, block_idx) is not None:
            return False
        self.residency_changes.setdefault(request_id, {})[block_idx] = block
        return True

    def drop_resident_page(self, request_id: str, block_idx: int) -> Block | None:
        """Makes a page host-only; returns the GPU block it was read from (None: it was)."""
        block = self.get_resident_page(request_id, block_idx)
        if block is not None:
            self.residency_changes.setdefault(request_id, {})[block_idx] = self._null_block
        return block

    def get_resident_page(self, request_id: str, block_idx: int) -> Block | None:
        """The GPU block a page is read from, None if it is host-only."""
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None or block_idx >= len(blocks):
            return None
        block = blocks[block_idx]
        changes = self.residency_changes.get(request_id)
        if changes:
            block = changes.get(block_idx, block)
        return None if block.is_null else block

    def get_residency_row(self, request_id: str, start: int = 0) -> list[Block]:
        """The request's row from ``start``, residency changes applied (host-only pages are
        the null block)."""
        blocks = self.req_to_blocks.get(request_id, [])[start:]
        changes = self.residency_changes.get(request_id)
        if not changes:
            return blocks
        return [changes.get(i, b) for i, b in enumerate(blocks, start)]


# Registered with the single-type managers' lookup (get_manager_for_kv_cache_spec), which
# sits below this module.
spec_manager_map[HiSparseHotSpec] = HiSparseHotManager
spec_manager_map[HiSparseResidentSpec] = HiSparseResidentManager
role_manager_map[KVCacheGroupRole.HISPARSE_SOURCE] = HiSparseSourceManager


# --------------------------------------------------------------------------- coordinator


@dataclass
class _Publication:
    """A source-group ``cache_blocks`` call waiting for its pages' host copies."""

    request: Any
    num_computed_tokens: int
    num_pages: int
    retention_interval: int | None
    replay_boundaries: Sequence[int]
    # Set when the request finished with copies still running: its host blocks, held here.
    detached_blocks: list[Block] | None = None
    num_cached_blocks: int = 0


@dataclass
class _RequestState:
    """One request's residency. A resident page is dirty (GPU copy only), then clean
    (``valid_pages``: the host copy is complete), then unpinned (``unpinned_pages``: its
    reference given back with ``unpin_blocks``). ``pinned_clean``: clean pages still
    referenced, kept while the request cannot read from the host."""

    valid_pages: set[int] = field(default_factory=set)
    ready_prefix_pages: int = 0  # pages [0, n) are all clean
    pending_pages: dict[int, int] = field(default_factory=dict)  # page -> transfer id
    publication: _Publication | None = None
    copies_recorded_blocks: int = 0
    pinned_clean: set[int] = field(default_factory=set)
    unpinned_pages: set[int] = field(default_factory=set)
    # Prefix pages whose published GPU copies are adopted after the admitting allocation.
    pages_to_adopt: int = 0
    # The worker knows this request's residency below synced_pages, but for stale_pages.
    synced_pages: int = 0
    stale_pages: set[int] = field(default_factory=set)


@dataclass
class _Transfer:
    """A planned page transfer until every worker has reported it done."""

    transfer_id: int
    page: tuple[str, int]
    request_state: _RequestState
    host_block: Block
    resident_blocks: tuple[Block, ...]
    restore: bool = False
    expected_worker_completions: int = 0
    worker_completions: int = 0
    enqueue_applied: bool = False


class HiSparseCoordinator:
    """Host allocation, host publication, spills and GPU residency of one KVCacheManager's
    HiSparse groups (vLLM's HiSparseCoordinator). Residency changes reach the worker through
    ``take_residency_updates``; the block table itself stays append-only."""

    def __init__(self, kv_cache_config: KVCacheConfig,
                 managers: tuple[SingleTypeKVCacheManager, ...], max_model_len: int, *,
                 num_reprefillable_tokens: int) -> None:
        self.managers = managers
        self.max_model_len = max_model_len
        self.num_reprefillable_tokens = num_reprefillable_tokens
        groups = kv_cache_config.kv_cache_groups
        resident: list[HiSparseResidentManager] = []
        hot: list[HiSparseHotManager] = []
        resident_group_ids: list[int] = []
        for group_id, (group, manager) in enumerate(zip(groups, managers, strict=True)):
            if isinstance(group.kv_cache_spec, HiSparseResidentSpec):
                if not isinstance(manager, HiSparseResidentManager):
                    raise TypeError("HiSparse resident specs require resident cache managers.")
                if group.host_resident:
                    raise UsageError("a HiSparse resident group cannot be host_resident")
                resident.append(manager)
                resident_group_ids.append(group_id)
            if isinstance(manager, HiSparseHotManager):
                if group.host_resident:
                    raise UsageError("a HiSparse hot group cannot be host_resident")
                hot.append(manager)
            if isinstance(manager, (HiSparseHotManager, HiSparseResidentManager)):
                manager.coordinator = self
        self.resident_managers = tuple(resident)
        self.hot_managers = tuple(hot)
        self.host_manager: HiSparseSourceManager | None = None
        self.host_group_id: int | None = None
        self.max_spill_pages = 0
        for group_id, manager in enumerate(managers):
            if isinstance(manager, HiSparseSourceManager):
                if self.host_manager is not None:
                    raise UsageError("Only one HiSparse host group is supported.")
                num_host_blocks = kv_cache_config.hisparse_host_num_blocks
                if num_host_blocks is None:
                    raise UsageError("HiSparse host group needs host capacity.")
                self.host_group_id = group_id
                self.host_manager = manager
                manager.coordinator = self
                unbound = (manager.block_pool, manager._null_block)
                manager.bind_host_pool(num_host_blocks)
        self.has_host_cache = self.host_manager is not None
        self.gpu_pool: Any = None
        self.transition_watermark = 0
        if self.resident_managers:
            if self.host_manager is None or self.host_group_id is None:
                raise UsageError("HiSparse resident groups need a HiSparse host group.")
            if self.host_group_id > min(resident_group_ids):
                raise UsageError("HiSparse host group must precede resident groups.")
            sizes = {m.block_size for m in self.resident_managers}
            if len(sizes) != 1:
                raise UsageError("HiSparse resident cache groups must use one block size.")
            resident_block_size = sizes.pop()
            if self.host_manager.block_size != resident_block_size:
                raise UsageError("HiSparse host and resident block sizes must match.")
            self.max_spill_pages = max_model_len // resident_block_size
            self.gpu_pool = self.resident_managers[0].block_pool
            # Requests move to reading from the host once the pool is this low, so that
            # admissions find unpinned (reusable) pages rather than pinned ones.
            hot_cost = sum(m.blocks_per_request for m in hot)
            self.transition_watermark = max(hot_cost, kv_cache_config.num_blocks // 10)

        # Host copy-on-write pairs handed to the worker, by destination block id, held until
        # it reports them done.
        self._retained_copies: dict[int, tuple[Block, Block]] = {}
        # request -> prefix length an external load is still writing into host pages.
        self._pending_imports: dict[str, int] = {}
        # Requests whose resident pages were all on the GPU at the last scan; a page only
        # turns host-only at admission, import (before the first scan) or in _lose_page.
        self._resident_requests: set[str] = set()
        self.spills_to_send: list[SparseKVPageTransfer] = []
        self.pending_spills: dict[int, _Transfer] = {}
        self.request_states: dict[str, _RequestState] = {}
        self.next_spill_id = 0
        # Published host block hash -> the GPU copies of that page, readable until the pool
        # reuses them: a host prefix hit can come back GPU-resident.
        self.copies: dict[Any, tuple[Block, ...]] = {}
        self._copy_by_block: dict[int, Any] = {}
        # Unpinned GPU block id -> the (request, page) pairs still reading it.
        self._owners: dict[int, set[tuple[str, int]]] = {}
        self.host_block_stride = kv_cache_config.hisparse_host_block_stride
        try:
            self._bind_pool_geometry()
        except UsageError:  # refused: the managers are left as they were
            for manager in managers:
                if getattr(manager, "coordinator", None) is self:
                    manager.coordinator = None
            if self.host_manager is not None:
                self.host_manager.block_pool, self.host_manager._null_block = unbound
            raise

    def cache_geometry(self) -> str:
        """How the host tier's blocks hold KV: its hash block size and the source group's
        spec class, block size, page size, context parallelism and host block stride. The
        device pool is bound by the KVCacheManager's coordinator (its groups include this
        one); the host tier is a pool of its own, with its own header."""
        manager = self.host_manager
        assert manager is not None
        geometry = group_geometry(manager.kv_cache_spec, manager,
                                  host_block_stride=self.host_block_stride)
        return (f"hisparse-host; hash_block_size={manager.block_pool.hash_block_size}; "
                f"{self.host_group_id}:{geometry}")

    def _bind_pool_geometry(self) -> None:
        """With prefix caching on the host tier, binds it to this geometry or refuses it
        (UsageError), as the KV-cache coordinators bind the device pool: a process whose
        host pages are laid out otherwise (another block size, page size or stride) must
        not take this tier's host prefix hits. The last step of the construction."""
        manager = self.host_manager
        if manager is not None and manager.block_pool.enable_caching:
            manager.block_pool.claim_cache_geometry(self.cache_geometry())

    def _poll_reuse(self) -> None:
        """Pages whose unpinned GPU copy another scheduler process has taken become
        host-only now (this process's own allocations report theirs at once)."""
        if self.gpu_pool is not None:
            self.gpu_pool.poll_reuse()

    def _state(self, request_id: str) -> _RequestState:
        state = self.request_states.get(request_id)
        if state is None:
            state = self.request_states[request_id] = _RequestState()
        return state

    # ------------------------------------------------------------------ host pages

    def commit_computed_blocks(self, request_id: str, num_host_pages: int) -> None:
        """A prefix hit on host pages the request now references: they are clean."""
        self._resident_requests.discard(request_id)
        if not self.resident_managers or self.host_manager is None:
            return
        host_blocks = self.host_manager.req_to_blocks.get(request_id, ())
        num_host_pages = min(num_host_pages, len(host_blocks))
        if num_host_pages == 0:
            return
        state = self._state(request_id)
        state.valid_pages.update(range(num_host_pages))
        state.ready_prefix_pages = max(num_host_pages, state.ready_prefix_pages)
        # Adopting copies takes them out of the free queue: only after the allocation that
        # admission counted on (update_residency).
        state.pages_to_adopt = max(state.pages_to_adopt, num_host_pages)
        state.copies_recorded_blocks = max(state.copies_recorded_blocks, num_host_pages)

    def take_host_block_copies(self) -> tuple[KVCacheBlockCopy, ...]:
        """The host copy-on-write work to run this step; both ends stay referenced until
        ``release_completed_host_copies``."""
        if self.host_manager is None:
            return ()
        pairs = self.host_manager.take_host_cow_copies()
        for source, copy in pairs:
            self._retained_copies[copy.block_id] = (source, copy)
        return tuple(KVCacheBlockCopy(s.block_id, c.block_id) for s, c in pairs)

    def release_completed_host_copies(self, dst_block_ids: Iterable[int]) -> None:
        blocks: list[Block] = []
        for dst in dst_block_ids:
            pair = self._retained_copies.pop(dst, None)
            if pair is not None:
                blocks.extend(pair)
        if blocks:
            assert self.host_manager is not None
            self.host_manager.block_pool.free_blocks(reversed(blocks))

    def get_host_block_pool(self) -> Any:
        return self.host_manager.block_pool if self.host_manager is not None else None

    # ------------------------------------------------------------------ published GPU copies

    def _adopt_copies(self, request_id: str, state: _RequestState,
                      host_blocks: Sequence[Block]) -> None:
        """Points host-only prefix pages at GPU copies of their contents, page by page."""
        if not self.copies:
            return
        for page_idx, host_block in enumerate(host_blocks):
            if host_block.is_null or host_block.block_hash is None:
                continue
            blocks = self.copies.get(host_block.block_hash)
            if blocks is None:
                continue
            for manager, block in zip(self.resident_managers, blocks, strict=True):
                if manager.adopt_resident_page(request_id, page_idx, block):
                    manager.block_pool.touch([block])
                    state.pinned_clean.add(page_idx)
                    if page_idx < state.synced_pages:
                        state.stale_pages.add(page_idx)

    def _record_copies(self, request_id: str, num_computed_tokens: int) -> None:
        if not self.resident_managers:
            return
        assert self.host_manager is not None
        host_blocks = self.host_manager.req_to_blocks.get(request_id)
        if not host_blocks:
            return
        state = self._state(request_id)
        num_pages = min(num_computed_tokens // self.host_manager.block_size, len(host_blocks))
        for page_idx in range(state.copies_recorded_blocks, num_pages):
            if page_idx not in state.pending_pages:
                self._record_copy(request_id, page_idx, host_blocks[page_idx])
        state.copies_recorded_blocks = max(state.copies_recorded_blocks, num_pages)

    def _record_copy(self, request_id: str, page_idx: int, host_block: Block) -> None:
        if host_block.is_null or host_block.block_hash is None:
            return
        blocks = []
        for manager in self.resident_managers:
            block = manager.get_resident_page(request_id, page_idx)
            if block is None:
                return
            blocks.append(block)
        self._drop_copy(host_block.block_hash)
        self.copies[host_block.block_hash] = tuple(blocks)
        for block in blocks:
            self._copy_by_block[block.block_id] = host_block.block_hash

    def _drop_copy(self, host_hash: Any) -> None:
        for block in self.copies.pop(host_hash, ()):
            self._copy_by_block.pop(block.block_id, None)

    # ------------------------------------------------------------------ residency

    def _can_read_from_host(self, request_id: str) -> bool:
        return bool(self.hot_managers) and all(m.has_hot(request_id) for m in self.hot_managers)

    def _fills_admission_window(self, request_id: str) -> bool:
        """Whether the request holds as many resident pages as admission reserved for it
        (more would let a chunked prefill outgrow the pool it was admitted into)."""
        return any(
            len(m.req_to_blocks.get(request_id, ())) >= m.max_admission_blocks_per_request
            for m in self.resident_managers
        )

    def _resident_page_blocks(self, request_id: str, page_idx: int) -> list[Block] | None:
        blocks = []
        for manager in self.resident_managers:
            num_pages = len(manager.req_to_blocks.get(request_id, ()))
            block = manager.get_resident_page(request_id, page_idx)
            if page_idx >= num_pages - ACTIVE_TAIL_PAGES or block is None:
                return None
            blocks.append(block)
        return blocks

    def _unpin_page(self, request_id: str, state: _RequestState, page_idx: int) -> bool:
        if page_idx in state.pending_pages or page_idx not in state.valid_pages:
            return False
        blocks = self._resident_page_blocks(request_id, page_idx)
        if blocks is None:
            return False
        for manager, block in zip(self.resident_managers, blocks, strict=True):
            self._owners.setdefault(block.block_id, set()).add((request_id, page_idx))
            manager.block_pool.unpin_blocks([block], self._on_block_reused)
        state.pinned_clean.discard(page_idx)
        state.unpinned_pages.add(page_idx)
        return True

    def _unpin_clean_pages(self, request_id: str, state: _RequestState) -> None:
        # The tail first: a prefix loses its tail before its head.
        for page_idx in sorted(state.pinned_clean, reverse=True):
            self._unpin_page(request_id, state, page_idx)

    def _page_became_clean(self, request_id: str, state: _RequestState, page_idx: int) -> None:
        state.pinned_clean.add(page_idx)
        if self._can_read_from_host(request_id):
            self._unpin_page(request_id, state, page_idx)

    def _on_block_reused(self, block: Block) -> None:
        host_hash = self._copy_by_block.get(block.block_id)
        if host_hash is not None:
            self._drop_copy(host_hash)
        for request_id, page_idx in self._owners.pop(block.block_id, ()):
            self._lose_page(request_id, page_idx)

    def _lose_page(self, request_id: str, page_idx: int) -> None:
        self._resident_requests.discard(request_id)
        state = self.request_states.get(request_id)
        if state is None:
            return
        for manager in self.resident_managers:
            block = manager.drop_resident_page(request_id, page_idx)
            if block is not None:
                owners = self._owners.get(block.block_id)
                if owners is not None:
                    owners.discard((request_id, page_idx))
        state.unpinned_pages.discard(page_idx)
        if page_idx < state.synced_pages:
            state.stale_pages.add(page_idx)
        for manager in self.hot_managers:
            manager.require_hot(request_id)

    def update_residency(self, request_id: str) -> None:
        """One step's residency policy for a scheduled request: one that can read from the
        host unpins its clean pages; one that cannot keeps them until the pool runs low or it
        fills its admission window, then asks for a hot region (allocated at a later pass)."""
        if not self.resident_managers:
            return
        state = self._state(request_id)
        if state.pages_to_adopt:
            assert self.host_manager is not None
            host_blocks = self.host_manager.req_to_blocks.get(request_id, ())
            self._adopt_copies(request_id, state, host_blocks[:state.pages_to_adopt])
            state.pages_to_adopt = 0
        if not self._can_read_from_host(request_id):
            if (self.gpu_pool.get_num_free_blocks() >= self.transition_watermark
                    and not self._fills_admission_window(request_id)):
                return
            for manager in self.hot_managers:
                manager.require_hot(request_id)
            return
        self._unpin_clean_pages(request_id, state)

    # ------------------------------------------------------------------ publication, spills

    def advance_scheduled(self, requests: Iterable[tuple[str, int]]) -> None:
        """Per-step work for scheduled (request id, tokens computed once the step ends): the
        last ``num_reprefillable_tokens`` are not final, so they are not written back."""
        self._poll_reuse()
        if not self.resident_managers:
            return
        for request_id, num_tokens in requests:
            self.plan_prefix_materialization(
                request_id, max(0, num_tokens - self.num_reprefillable_tokens)
            )
            self.update_residency(request_id)

    def plan_prefix_materialization(self, request_id: str, num_computed_tokens: int) -> None:
        """Plans the write-back of every sealed page without a host copy, within the
        per-step budget (``max_spill_pages`` transfers queued at once)."""
        if not self.resident_managers:
            return
        assert self.host_manager is not None
        block_size = self.host_manager.block_size
        num_pages = num_computed_tokens // block_size
        importing_pages = cdiv(self._pending_imports.get(request_id, 0), block_size)
        state = self._state(request_id)
        budget = max(self.max_spill_pages - len(self.spills_to_send), 0)
        for page_idx in range(max(state.ready_prefix_pages, importing_pages), num_pages):
            if budget == 0:
                break
            if page_idx in state.pending_pages or page_idx in state.valid_pages:
                continue
            if any(m.get_resident_page(request_id, page_idx) is None
                   for m in self.resident_managers):
                continue
            if self._plan_page_transfer(request_id, page_idx, after_forward=True):
                budget -= 1

    def publish_when_ready(self, request: Any, num_computed_tokens: int,
                           retention_interval: int | None, *,
                           replay_boundaries: Sequence[int]) -> None:
        """Publishes the source group's hashes of the pages already durable on the host; the
        rest follow as their copies complete."""
        manager = self.host_manager
        if manager is None:
            return
        self._state(request.request_id).publication = _Publication(
            request=request,
            num_computed_tokens=num_computed_tokens,
            num_pages=num_computed_tokens // manager.block_size,
            retention_interval=retention_interval,
            replay_boundaries=replay_boundaries,
        )
        self._publish_host_blocks_if_ready(request.request_id)

    def _publish_host_blocks_if_ready(self, request_id: str) -> None:
        # Host writes trail a long prefill by about a chunk: publishing the durable prefix
        # now (not the whole one at the end) lets a preempted prefill resume from it.
        state = self.request_states.get(request_id)
        if state is None or state.publication is None:
            return
        publication = state.publication
        assert self.host_manager is not None
        num_tokens = min(publication.num_computed_tokens,
                         state.ready_prefix_pages * self.host_manager.block_size)
        self.host_manager.publish_blocks(
            publication.request, num_tokens,
            retention_interval=publication.retention_interval,
            replay_boundaries=publication.replay_boundaries,
        )
        self._record_copies(request_id, num_tokens)
        if state.ready_prefix_pages >= publication.num_pages:
            state.publication = None

    def record_pending_host_import(self, request_id: str, num_tokens: int) -> None:
        self._resident_requests.discard(request_id)
        self._pending_imports[request_id] = num_tokens

    def finish_host_import(self, request_id: str, *, failed: bool) -> None:
        num_tokens = self._pending_imports.pop(request_id, None)
        if num_tokens is not None and not failed:
            self.complete_host_import(request_id, num_tokens)

    def complete_host_import(self, request_id: str, num_computed_tokens: int) -> None:
        """An external load filled host pages: they are clean; the last one is restored to
        its GPU block, and the prefix is published."""
        if not self.resident_managers:
            return
        block_size = self.resident_managers[0].block_size
        num_pages = num_computed_tokens // block_size
        state = self._state(request_id)
        state.valid_pages = set(range(num_pages))
        state.ready_prefix_pages = num_pages
        if num_computed_tokens:
            self._plan_page_transfer(request_id, (num_computed_tokens - 1) // block_size,
                                     after_forward=False, restore=True)
        self._publish_host_blocks_if_ready(request_id)

    def _plan_page_transfer(self, request_id: str, page_idx: int, *, after_forward: bool,
                            restore: bool = False) -> bool:
        assert self.host_manager is not None
        state = self._state(request_id)
        if page_idx in state.pending_pages:
            return False
        host_blocks = self.host_manager.req_to_blocks.get(request_id)
        if host_blocks is None or page_idx >= len(host_blocks):
            return False
        host_block = host_blocks[page_idx]
        if host_block.is_null:
            return False
        blocks = []
        for manager in self.resident_managers:
            block = manager.get_resident_page(request_id, page_idx)
            if block is None:
                return False
            blocks.append(block)
        # Both ends stay referenced until the transfer completes (update_spills).
        self.host_manager.block_pool.touch([host_block])
        for manager, block in zip(self.resident_managers, blocks, strict=True):
            manager.block_pool.touch([block])
        transfer_id = self.next_spill_id
        self.next_spill_id += 1
        self.pending_spills[transfer_id] = _Transfer(
            transfer_id=transfer_id, page=(request_id, page_idx), request_state=state,
            host_block=host_block, resident_blocks=tuple(blocks), restore=restore,
        )
        state.pending_pages[page_idx] = transfer_id
        self.spills_to_send.append(SparseKVPageTransfer(
            transfer_id=transfer_id, host_block_id=host_block.block_id,
            resident_block_ids=tuple(b.block_id for b in blocks),
            after_forward=after_forward, restore=restore,
        ))
        return True

    # ------------------------------------------------------------------ worker-facing views

    def build_row_mirrors(self, requests: Iterable[tuple[str, int, int]]
                          ) -> tuple[SparseKVRowMirror, ...]:
        """The row runs to mirror into host blocks for scheduled (request, computed tokens,
        scheduled tokens). A page without a GPU copy or without a host block is skipped
        alone: its neighbours are still mirrored (a window only moves forward, so skipping
        them would leave their host rows stale for good)."""
        self._poll_reuse()
        if not self.resident_managers or self.host_manager is None:
            return ()
        block_size = self.resident_managers[0].block_size
        mirrors: list[SparseKVRowMirror] = []
        for request_id, num_computed, num_scheduled in requests:
            host_blocks = self.host_manager.req_to_blocks.get(request_id)
            if host_blocks is None or any(request_id not in m.req_to_blocks
                                          for m in self.resident_managers):
                continue
            pos, end = num_computed, num_computed + num_scheduled
            while pos < end:
                page_idx, offset = divmod(pos, block_size)
                num_rows = min(block_size - offset, end - pos)
                pos += num_rows
                starts = []
                for manager in self.resident_managers:
                    block = manager.get_resident_page(request_id, page_idx)
                    if block is None:
                        break
                    starts.append(block.block_id * block_size + offset)
                if len(starts) != len(self.resident_managers) or page_idx >= len(host_blocks):
                    continue
                host_block = host_blocks[page_idx]
                if host_block.is_null:
                    continue
                mirrors.append(SparseKVRowMirror(
                    source_starts=tuple(starts),
                    destination_start=host_block.block_id * block_size + offset,
                    num_rows=num_rows,
                ))
        return tuple(mirrors)

    def all_context_pages_resident(self, requests: Iterable[tuple[str, int, int]]) -> bool:
        """Whether every scheduled request reads only GPU-resident KV."""
        self._poll_reuse()
        if not self.resident_managers:
            return False
        first = self.resident_managers[0]
        for request_id, num_computed, num_scheduled in requests:
            if len(first.req_to_blocks.get(request_id, ())) < cdiv(num_computed + num_scheduled,
                                                                   first.block_size):
                return False
            if request_id in self._resident_requests:
                continue
            if any(block.is_null for m in self.resident_managers
                   for block in m.get_residency_row(request_id)):
                return False
            self._resident_requests.add(request_id)
        return True

    def take_residency_updates(self, request_ids: Iterable[str]
                               ) -> dict[str, SparseKVResidencyUpdate]:
        """For the scheduled requests, the GPU blocks the worker does not know yet: stale
        pages, then pages appended since the last update. Unscheduled requests keep theirs."""
        self._poll_reuse()
        updates: dict[str, SparseKVResidencyUpdate] = {}
        if not self.resident_managers:
            return updates
        first = self.resident_managers[0]
        for request_id in request_ids:
            state = self._state(request_id)
            num_pages = len(first.req_to_blocks.get(request_id, ()))
            start = state.synced_pages
            if not state.stale_pages and start >= num_pages:
                continue
            stale = sorted(state.stale_pages)
            block_ids: list[list[int]] = []
            for manager in self.resident_managers:
                null_id = manager.block_pool.null_block.block_id
                ids = []
                for page_idx in stale:
                    block = manager.get_resident_page(request_id, page_idx)
                    ids.append(null_id if block is None else block.block_id)
                ids.extend(b.block_id for b in manager.get_residency_row(request_id, start))
                block_ids.append(ids)
            updates[request_id] = SparseKVResidencyUpdate(
                pages=[*stale, *range(start, num_pages)], block_ids=tuple(block_ids)
            )
            state.stale_pages.clear()
            state.synced_pages = num_pages
        return updates

    def build_offload_command(self) -> SparseKVOffloadCommand | None:
        if not self.resident_managers:
            return None
        command = SparseKVOffloadCommand(page_transfers=self.spills_to_send)
        self.spills_to_send = []
        return command

    def has_pending_reclamation(self) -> bool:
        """Whether a transfer in flight frees a GPU or host block when it completes."""
        return any(
            pending.host_block.ref_cnt == 1
            or (pending.page[0] in self.request_states
                and self._can_read_from_host(pending.page[0]))
            for pending in self.pending_spills.values()
        )

    def has_pending_work(self) -> bool:
        return bool(self.spills_to_send or self.pending_spills or self._retained_copies)

    def update_spills(self, enqueued_counts: Mapping[int, int],
                      completed_counts: Mapping[int, int]) -> None:
        """Workers report transfers enqueued (how many workers run each) and completed."""
        for transfer_id, count in enqueued_counts.items():
            pending = self.pending_spills.get(transfer_id)
            if pending is not None and pending.expected_worker_completions == 0:
                pending.expected_worker_completions = count
        for transfer_id, count in completed_counts.items():
            pending = self.pending_spills.get(transfer_id)
            if pending is not None:
                pending.worker_completions += count
        self._apply_enqueued_spills()
        self._complete_host_writes()

    @staticmethod
    def _done(pending: _Transfer) -> bool:
        return bool(pending.expected_worker_completions) and (
            pending.worker_completions >= pending.expected_worker_completions
        )

    def _apply_enqueued_spills(self) -> None:
        """Gives back the GPU ends' transfer references once every worker is done."""
        for pending in self.pending_spills.values():
            if pending.enqueue_applied or not self._done(pending):
                continue
            for manager, block in zip(self.resident_managers, pending.resident_blocks, strict=True):
                manager.block_pool.free_blocks([block])
            pending.enqueue_applied = True

    def _complete_host_writes(self) -> None:
        completed = [p for p in self.pending_spills.values()
                     if p.enqueue_applied and self._done(p)]
        touched_requests: set[str] = set()
        assert self.host_manager is not None or not completed
        for pending in completed:
            self.pending_spills.pop(pending.transfer_id, None)
            request_id, page_idx = pending.page
            state = pending.request_state
            state.pending_pages.pop(page_idx, None)
            if self.request_states.get(request_id) is state:
                if not pending.restore:
                    state.valid_pages.add(page_idx)
                if page_idx in state.valid_pages:
                    self._page_became_clean(request_id, state, page_idx)
                    if pending.restore:
                        self._record_copy(request_id, page_idx, pending.host_block)
                touched_requests.add(request_id)
            elif state.publication is not None:
                if not pending.restore:
                    state.valid_pages.add(page_idx)
                self._publish_detached_blocks(state)
            self.host_manager.block_pool.free_blocks([pending.host_block])
        for request_id in touched_requests:
            state = self.request_states[request_id]
            while state.ready_prefix_pages in state.valid_pages:
                state.ready_prefix_pages += 1
            self._publish_host_blocks_if_ready(request_id)

    def _publish_detached_blocks(self, state: _RequestState) -> None:
        publication = state.publication
        if publication is None or state.pending_pages or publication.detached_blocks is None:
            return
        assert self.host_manager is not None
        while state.ready_prefix_pages in state.valid_pages:
            state.ready_prefix_pages += 1
        blocks = publication.detached_blocks
        # Only sealed pages with completed copies outlive the request (dense retention).
        self.host_manager.block_pool.cache_full_blocks(
            request=publication.request,
            blocks=blocks,
            num_cached_blocks=publication.num_cached_blocks,
            num_full_blocks=min(state.ready_prefix_pages, publication.num_pages),
            block_size=self.host_manager.block_size,
            kv_cache_group_id=self.host_manager.kv_cache_group_id,
        )
        self.host_manager.block_pool.free_blocks(reversed(blocks))
        state.publication = None

    def free(self, request_id: str) -> None:
        """Detaches the request; its clean GPU pages stay in the pool as readable copies."""
        self._resident_requests.discard(request_id)
        self._pending_imports.pop(request_id, None)
        state = self.request_states.pop(request_id, None)
        if state is None:
            return
        publication = state.publication
        if publication is not None and _is_finished(publication.request) and state.pending_pages:
            assert self.host_manager is not None
            publication.detached_blocks = (
                self.host_manager.req_to_blocks[request_id][:publication.num_pages]
            )
            publication.num_cached_blocks = self.host_manager.num_cached_block.get(request_id, 0)
            # Completed pages need references too, or an allocation could evict them before
            # the remaining copies finish and the prefix is published.
            self.host_manager.block_pool.touch(publication.detached_blocks)
        else:
            # A preempted request's planned spills do not prove its KV was computed.
            state.publication = None
        for manager in self.resident_managers:
            row = manager.get_residency_row(request_id)
            for page_idx in reversed(range(len(row))):  # the tail first
                block = row[page_idx]
                if block.is_null:
                    continue
                if page_idx in state.unpinned_pages:
                    owners = self._owners.get(block.block_id)
                    if owners is not None:
                        owners.discard((request_id, page_idx))
                elif page_idx in state.valid_pages and page_idx not in state.pending_pages:
                    manager.block_pool.unpin_blocks([block], self._on_block_reused)
                else:
                    continue
                manager.drop_resident_page(request_id, page_idx)


def _is_finished(request: Any) -> bool:
    """vLLM's ``Request.is_finished()``. A request without it (``shmkv.Request`` has no
    status) counts as preempted: its pages with copies still running are not published,
    which costs only cache hits, never correctness."""
    is_finished = getattr(request, "is_finished", None)
    return bool(is_finished()) if callable(is_finished) else False


def get_hisparse_coordinator(kv_cache_manager: KVCacheManager) -> HiSparseCoordinator:
    """The coordinator of a KVCacheManager's HiSparse groups: made on the first call (before
    the first request is admitted), then found on the managers it binds.

    Raises:
        UsageError: (a ValueError, as vLLM's) the config has no HiSparse host group, or an
            inconsistent one (vLLM's messages).
    """
    managers = tuple(kv_cache_manager.coordinator.single_type_managers)
    for manager in managers:
        coordinator = getattr(manager, "coordinator", None)
        if isinstance(coordinator, HiSparseCoordinator):
            return coordinator
    coordinator = HiSparseCoordinator(
        kv_cache_manager.kv_cache_config, managers, kv_cache_manager.max_model_len,
        num_reprefillable_tokens=kv_cache_manager.coordinator.num_reprefillable_tokens,
    )
    if coordinator.host_manager is None:
        raise UsageError("No HiSparse cache group is configured.")
    return coordinator
