"""vLLM's CPU offloading spec and connector with one node-wide tier (imported on first use of
``shmkv.vllm.SharedCPUOffloadingSpec`` or ``SharedOffloadingConnector``: vLLM's connector and
CPU spec modules pull in its platform and worker code, which a process that only needs the
manager should not pay for)."""

from __future__ import annotations

import contextvars
import logging
import os
from typing import Any

from vllm import platforms
from vllm.config import get_current_vllm_config_or_none
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.v1.kv_offload.base import OffloadingCounterMetadata, OffloadingManager
from vllm.v1.kv_offload.cpu.gpu_worker import CPUOffloadingWorker
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from shmkv.errors import LayoutMismatchError, UsageError
from shmkv.pool import layout as L
from shmkv.vllm.compat import IMPLICIT_STEP_REGION, VLLM_RELEASE, spec_cpu_info
from shmkv.vllm.cpu_worker import CPUTransferWorker
from shmkv.vllm.identity import config_identity, platform_name, replica_identity
from shmkv.vllm.lifecycle import join_as_worker, refuse_foreign_replica
from shmkv.vllm.manager import (
    SHMKV_CROSS_REPLICA_HITS,
    SHMKV_LOCK_HOLD_S,
    SHMKV_LOCK_HOLDS,
    SHMKV_LOCK_WAIT_S,
    SharedCPUOffloadingManager,
)
from shmkv.vllm.region import RegionBinding, check_mapped, region_path
from shmkv.vllm.replicas import ReplicaLocks
from shmkv.vllm.sizing import check_room_after_tier, vllm_ipc_bytes
from shmkv.vllm.tier import ReplicaLabel, replica_label

#: ``kv_connector_extra_config`` keys vLLM 0.33.0's offloading connector and CPU spec read,
#: plus this spec's own.
KNOWN_EXTRA_CONFIG_KEYS = frozenset({
    "spec_name", "spec_module_path", "cpu_bytes_to_use", "eviction_policy",
    "cache_policy_module_path", "store_threshold", "max_tracker_size",
    "self_describing_kv_events", "offload_prompt_only", "block_size", "blocks_per_chunk",
    "canonical_layout", "sync_load_budget_bytes",
    "shmkv_pool", "shmkv_max_processes", "shmkv_scheduler_only",
})
DEFAULT_MAX_PROCESSES = 64
logger = logging.getLogger(__name__)

# vLLM's whole config while a SharedOffloadingConnector builds its spec: the spec is given
# only vLLM's OffloadingConfig, which lacks what the tier's identity needs.
_VLLM_CONFIG: contextvars.ContextVar[Any] = contextvars.ContextVar("shmkv_vllm_config",
                                                                   default=None)


class SharedOffloadingConnector(OffloadingConnector):
    """vLLM's ``OffloadingConnector``, unchanged, handing vLLM's whole config to the shmkv
    spec it builds (``kv_connector: SharedOffloadingConnector``,
    ``kv_connector_module_path: shmkv.vllm``).

    Two of vLLM's class-level calls on the connector check the replica before the spec is
    built, so a misconfigured replica is told what is wrong and what to do at the earliest
    point vLLM calls shmkv, once, instead of in every worker's traceback after the KV cache
    is sized:

    - ``requires_piecewise_for_cudagraph``: in the API server, while vLLM builds its config,
      before any engine starts (vLLM calls it where CUDA graphs are captured whole, the
      default on CUDA): the extra config alone (:func:`check_extra_config`);
    - ``get_required_kvcache_layout``: in each engine core, before vLLM profiles memory and
      sizes the KV cache, on every platform: the whole config (:func:`preflight`), the
      identity of an existing tier included.
    """

    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        token = _VLLM_CONFIG.set(vllm_config)
        try:
            super().__init__(vllm_config, *args, **kwargs)
        finally:
            _VLLM_CONFIG.reset(token)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        _said_once(check_extra_config, extra_config, connector=True)
        return super().requires_piecewise_for_cudagraph(extra_config)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        _said_once(preflight, vllm_config)
        return super().get_required_kvcache_layout(vllm_config)


def _said_once(check: Any, *args: Any, **kwargs: Any) -> None:
    """Runs ``check``; a refusal is logged as one line naming the problem and the fix (the
    head of vLLM's failure output), then raised for vLLM to stop the start."""
    try:
        check(*args, **kwargs)
    except (UsageError, LayoutMismatchError) as e:
        logger.error("shmkv refuses this replica before its KV cache is sized: %s", e)
        raise


def check_extra_config(extra: dict[str, Any], *, connector: bool = False) -> str:
    """Checks ``kv_connector_extra_config`` alone and returns the tier's pool name;
    ``connector``: called for SharedOffloadingConnector, so the spec must be shmkv's too.

    Raises:
        UsageError: an unknown key, ``shmkv_pool`` missing or not a pool name, a cache
            policy the shared tier does not offer, or vLLM's own spec under shmkv's
            connector (each named, with what to set).
    """
    if not isinstance(extra, dict):
        raise UsageError(f"kv_connector_extra_config must be a dict, got {type(extra).__name__}")
    unknown = sorted(set(extra) - KNOWN_EXTRA_CONFIG_KEYS)
    if unknown:
        raise UsageError(
            f"unknown kv_connector_extra_config keys {unknown}; "
            f"known: {sorted(KNOWN_EXTRA_CONFIG_KEYS)}"
        )
    if connector and (extra.get("spec_name"), extra.get("spec_module_path")) != (
            "SharedCPUOffloadingSpec", "shmkv.vllm"):
        raise UsageError(
            "SharedOffloadingConnector runs the shared tier's spec: set \"spec_name\": "
            "\"SharedCPUOffloadingSpec\" and \"spec_module_path\": \"shmkv.vllm\" in "
            f"kv_connector_extra_config (found spec_name={extra.get('spec_name')!r}, "
            f"spec_module_path={extra.get('spec_module_path')!r})"
        )
    pool = extra.get("shmkv_pool")
    if not pool:
        raise UsageError("kv_connector_extra_config needs 'shmkv_pool', the tier's name")
    L.validate_pool_name(pool)
    policy = extra.get("eviction_policy", "lru")
    if policy != "lru":
        raise UsageError(
            f"eviction_policy {policy!r} is not supported by the shared offload tier "
            "(ARC's ghost lists are not shared); use 'lru'"
        )
    return pool


def check_engine_config(vllm_config: Any) -> None:
    """Checks what vLLM's whole config decides of the tier: shmkv's connector, a parallel
    layout and a platform the tier supports.

    Raises:
        UsageError: each named, with what runs instead.
    """
    connector = getattr(getattr(vllm_config, "kv_transfer_config", None), "kv_connector",
                        None)
    if vllm_config is None or connector != SharedOffloadingConnector.__name__:
        raise UsageError(
            "SharedCPUOffloadingSpec needs vLLM's whole config to check that replicas "
            "sharing the tier hold the same KV: set \"kv_connector\": "
            "\"SharedOffloadingConnector\" and \"kv_connector_module_path\": "
            "\"shmkv.vllm\" in --kv-transfer-config"
        )
    refuse_unsupported_layout(vllm_config.parallel_config)
    if VLLM_RELEASE == (0, 32) and not platforms.current_platform.is_cpu():
        raise UsageError(
            "the shared offload tier runs on vLLM 0.32 as vLLM's CPU build only (it is "
            "tested there); on "
            f"{platform_name(platforms.current_platform)} use vLLM 0.33.0"
        )
    if platforms.current_platform.is_rocm():
        raise UsageError(
            "the shared offload tier needs vLLM's shared offload region, which vLLM does "
            "not use on ROCm (its workers would keep private buffers behind a shared "
            "manager); use vLLM's own CPUOffloadingSpec there"
        )


def preflight(vllm_config: Any) -> None:
    """Every check vLLM's config allows before the KV cache is sized: the extra config, the
    engine config, the block hash's seed, and this replica's model, weights, dtype,
    parallel layout and releases against the identity an existing tier recorded (the KV
    geometry is checked when the spec is built). Warns when /dev/shm, once the tier is
    made, keeps less than vLLM's own queues need (``shmkv/vllm/sizing.py``). Makes,
    records and sizes nothing.

    Raises:
        UsageError: a bad extra config, connector, layout, platform or hash seed.
        LayoutMismatchError: this replica differs from the tier's replicas (each field).
    """
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    extra = dict(getattr(transfer, "kv_connector_extra_config", None) or {})
    pool = check_extra_config(extra, connector=True)
    check_engine_config(vllm_config)
    refuse_foreign_replica(pool, config_identity(vllm_config), {"label": "vllm-preflight"},
                           partial=True)
    path = region_path(pool)
    tier_bytes = 0 if os.path.lexists(path) else int(extra.get("cpu_bytes_to_use", 0) or 0)
    check_room_after_tier(os.path.dirname(path), tier_bytes,
                          vllm_ipc_bytes(vllm_config.parallel_config))


def refuse_unsupported_layout(parallel: Any) -> None:
    """Refuses, before anything of the tier is made or sized, a parallel layout the shared
    tier does not support: pipeline parallelism. vLLM's CPU offloading sizes a chunk, and
    each worker's slot in it, from the worker's own stage's layers, so the stages of one
    engine (and its scheduler, which sees every layer) would disagree on the tier's chunk
    layout and chunk count, and an uneven split makes their slots differ in size.

    Raises:
        UsageError: naming the layout and what runs instead.
    """
    pp = int(getattr(parallel, "pipeline_parallel_size", 1) or 1)
    if pp > 1:
        raise UsageError(
            f"the shared offload tier does not support pipeline parallelism "
            f"(pipeline_parallel_size={pp}, tensor_parallel_size="
            f"{getattr(parallel, 'tensor_parallel_size', 1)}): vLLM's CPU offloading lays a "
            "chunk out from each stage's own layers, so the stages of one engine would "
            "disagree on the tier's chunk layout. Run the engine with "
            "pipeline_parallel_size=1 (tensor and data parallelism share the tier), or "
            "leave the shared tier out of this engine"
        )


class SharedCPUOffloadingSpec(CPUOffloadingSpec):
    """vLLM's CPU offloading spec with one node-wide tier: ``get_manager()`` returns a
    :class:`SharedCPUOffloadingManager` on the pool named by ``shmkv_pool``, and the worker
    side maps the data region bound to that pool (vLLM's own region and transfer code, with
    the pool's name as engine id and no unlink-after-barrier, so replicas that start later
    map the same bytes). The engine core and its workers join one replica row of the tier,
    keyed by vLLM's engine id.

    Raises (at construction):
        UsageError: ``shmkv_pool`` missing, an unknown ``kv_connector_extra_config`` key, a
            cache policy the shared tier does not offer, a platform where vLLM does not
            share its offload region (ROCm), or vLLM's whole config not at hand (the
            connector is not ``SharedOffloadingConnector``).
    """

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        """vLLM's CPU-tier metrics, and the shared tier's own: chunks a replica loaded that
        another stored, and its holds of the node-wide pool lock."""
        definitions = dict(super().build_metric_definitions(extra_config))
        for name, doc in (
            (SHMKV_CROSS_REPLICA_HITS, "Chunks this replica loaded from the shared tier that "
             "another replica stored."),
            (SHMKV_LOCK_HOLDS, "Holds of the shared tier's node-wide pool lock."),
            (SHMKV_LOCK_WAIT_S, "Seconds spent waiting for the node-wide pool lock."),
            (SHMKV_LOCK_HOLD_S, "Seconds the node-wide pool lock was held."),
        ):
            definitions[name] = OffloadingCounterMetadata(documentation=doc)
        return definitions

    def __init__(self, config: Any) -> None:
        extra = dict(config.extra_config)
        pool = check_extra_config(extra)
        # With vLLM's plain connector (whose workers have a current config too) a worker
        # would otherwise make the tier before its engine core is refused, leaving a
        # full-size region behind a crash-looping replica: every process refuses it.
        vllm_config = _VLLM_CONFIG.get() or get_current_vllm_config_or_none()
        check_engine_config(vllm_config)
        super().__init__(config)
        self.vllm_config = vllm_config
        self.shmkv_pool: str = pool
        self.shmkv_max_processes = int(extra.get("shmkv_max_processes",
                                                 DEFAULT_MAX_PROCESSES))
        self._worker_locks: ReplicaLocks | None = None
        self._binding: RegionBinding | None = None  # once this process joined as a worker

    @property
    def shmkv_replica_id(self) -> str:
        """This engine start's replica: vLLM's engine id (distinct per data-parallel rank)
        and its config's instance id (made once per engine start, and shared by the engine
        core and its workers, which get the core's config). An engine restarted under a
        user-fixed engine id so gets a replica row of its own, and the killed core's chunks
        come back once its last worker stops, not when the new incarnation does."""
        instance = getattr(self.vllm_config, "instance_id", "")
        return f"{self.config.engine_id}@{instance}" if instance else self.config.engine_id

    @property
    def shmkv_dp_rank(self) -> int:
        """This engine's data-parallel rank, for its row's label: vLLM's
        ``data_parallel_index`` (the n of ``EngineCore_DP<n>``; vLLM resets
        ``data_parallel_rank`` to 0 in each rank of a dense model and keeps the rank there)."""
        parallel = self.vllm_config.parallel_config
        return int(getattr(parallel, "data_parallel_index", parallel.data_parallel_rank))

    def replica_label(self) -> ReplicaLabel:
        """This replica's row label: its DP rank and vLLM's engine id (``tier.py``)."""
        return replica_label(self.shmkv_dp_rank, self.config.engine_id)

    def replica_identity(self) -> dict[str, Any]:
        """What every replica sharing the tier must agree on (``shmkv/vllm/identity.py``)."""
        return replica_identity(self, self.vllm_config)

    def get_manager(self) -> OffloadingManager:
        """The shared manager (made on first call), in this engine's replica row, after
        checking this replica's identity against the tier's.

        Raises:
            LayoutMismatchError: this replica's identity differs from the tier's (every
                differing field named), or ``num_chunks`` differs.
            UsageError: a block hash whose seed replicas cannot share.
        """
        if not self._manager:
            identity = self.replica_identity()
            refuse_foreign_replica(self.shmkv_pool, identity, {"label": "vllm-offload"})
            store_threshold = int(self.extra_config.get("store_threshold", 0))
            manager = SharedCPUOffloadingManager(
                self.shmkv_pool, self.num_chunks,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                store_threshold=min(store_threshold, 1) if store_threshold < 2
                else store_threshold,
                info=spec_cpu_info(self), max_processes=self.shmkv_max_processes,
                replica_id=self.shmkv_replica_id,
                implicit_step_region=IMPLICIT_STEP_REGION,
                # vLLM builds a replica's workers before its scheduler: an engine core whose
                # row no worker bound is cut off (its workers joined a removed tier). Only a
                # scheduler run without GPU workers (a simulation, the tests' schedulers)
                # says so, with shmkv_scheduler_only.
                expect_workers=not bool(self.extra_config.get("shmkv_scheduler_only", False)),
                dp_rank=self.shmkv_dp_rank, engine_id=self.config.engine_id,
            )
            try:
                manager.check_identity(identity)
            except BaseException:
                manager.close()
                raise
            self._manager = manager
        return self._manager

    def join_replica_as_worker(self) -> int:
        """Joins this engine's replica row as one of its workers, binds the data region to
        the pool (making it if needed) and returns the region's tag. The row is held until
        this process exits: a worker outlives a SIGKILLed engine core by a step, and its
        chunks stay out of other replicas' hands until then.

        Raises:
            LayoutMismatchError: this replica's identity differs from the tier's (nothing
                of the tier touched).
            SegmentError: a foreign or insecure region file, or no room in /dev/shm.
        """
        locks, binding = join_as_worker(
            self.shmkv_pool, self.num_chunks, self.shmkv_max_processes, self.shmkv_replica_id,
            self.num_chunks * self.kv_bytes_per_chunk, identity=self.replica_identity(),
            label=self.replica_label())
        if self._worker_locks is not None:
            self._worker_locks.close()
        self._worker_locks = locks
        self._binding = binding
        return binding.tag

    def open_data_region(self, rank: int | None) -> SharedOffloadRegion:
        """Joins the replica as a worker, binds the data region to the pool and maps it
        with vLLM's ``SharedOffloadRegion`` (which always joins it here, never makes or
        unlinks it).

        Args:
            rank: this worker's slot in each chunk (vLLM's worker rank), or None.

        Returns:
            vLLM's ``SharedOffloadRegion`` over the tier's bytes.

        Raises:
            SegmentError: a foreign or insecure region file, no room in /dev/shm, or the
                file replaced while it was being mapped.
        """
        self.join_replica_as_worker()
        region = SharedOffloadRegion(
            engine_id=L.offload_data_region_engine_id(self.shmkv_pool),
            num_chunks=self.num_chunks, rank=rank,
            kv_bytes_per_chunk=self.kv_bytes_per_chunk,
            cpu_page_size=self.cpu_page_size_per_worker,
            barrier=None,  # no unlink: replicas that start later map these bytes
        )
        try:
            check_mapped(region.fd, region_path(self.shmkv_pool),
                         self.num_chunks * self.kv_bytes_per_chunk, self._binding)
        except BaseException:
            region.cleanup()
            raise
        return region

    def _slot(self) -> int:
        return 0 if self.replicated_layout else self.config.parallel.rank

    def create_worker(self, kv_caches: Any) -> CPUOffloadingWorker | CPUTransferWorker:
        """The worker over the tier's one data region (:meth:`open_data_region`): vLLM's
        CPU worker on CUDA and XPU, shmkv's :class:`CPUTransferWorker` on vLLM's CPU
        platform (where vLLM's own refuses to run).

        Raises:
            UsageError: a platform where vLLM does not share its offload region and that is
                not vLLM's CPU platform.
            SegmentError: a foreign or insecure region file, or no room in /dev/shm.
        """
        on_cpu = platforms.current_platform.is_cpu()
        if not on_cpu and not self._uses_shared_region():
            raise UsageError(
                "the shared offload tier needs vLLM's shared offload region, which vLLM does "
                f"not use on this platform ({platform_name(platforms.current_platform)}); use "
                "vLLM's own CPUOffloadingSpec here"
            )
        if self.num_chunks <= 0:
            raise UsageError(
                f"cpu_bytes_to_use {self.extra_config.get('cpu_bytes_to_use')} holds no chunk "
                f"of {self.kv_bytes_per_chunk} bytes: give the tier at least one chunk"
            )
        mmap_region = self.open_data_region(self._slot())
        try:
            if on_cpu:
                return CPUTransferWorker(kv_caches, self.blocks_per_chunk, mmap_region)
            return CPUOffloadingWorker(
                kv_caches=kv_caches, blocks_per_chunk=self.blocks_per_chunk,
                num_cpu_chunks=self.num_chunks, mmap_region=mmap_region,
            )
        except BaseException:
            mmap_region.cleanup()
            raise

    def get_worker(self, kv_caches: Any) -> CPUOffloadingWorker | CPUTransferWorker:
        """The worker (made on first call, :meth:`create_worker`), on vLLM's CPU platform
        too: the spec decides, vLLM's platform check for its own worker does not apply."""
        if not self._worker:
            self._worker = self.create_worker(kv_caches)
        return self._worker


__all__ = ["KNOWN_EXTRA_CONFIG_KEYS", "SharedCPUOffloadingSpec",
           "SharedOffloadingConnector", "check_engine_config", "check_extra_config",
           "preflight"]
