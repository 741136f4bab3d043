"""The tier's figures for vLLM's connector stats: vLLM's CPU-tier gauges, node-wide, and
this replica's cross-replica hits and holds of the node-wide pool lock (declared by
``SharedCPUOffloadingSpec``'s metric definitions, so they show in vLLM's own metrics)."""

from __future__ import annotations

import time

from vllm.v1.kv_offload.cpu.common import CPUOffloadingMetrics

from shmkv.errors import PoolClosedError
from shmkv.pool import layout as L
from shmkv.vllm.tier import PENDING_BIT

GAUGE_INTERVAL_S = 1.0  # how often get_stats counts the held chunks (an O(chunks) pass)...
GAUGE_EXACT_CHUNKS = 1 << 16  # ... of a tier larger than this; a smaller one, every call
# get_stats' counters, beside vLLM's CPU-tier metrics (SharedCPUOffloadingSpec declares them)
SHMKV_CROSS_REPLICA_HITS = "shmkv_cross_replica_hit_chunks"
SHMKV_LOCK_HOLDS = "shmkv_pool_lock_holds"
SHMKV_LOCK_WAIT_S = "shmkv_pool_lock_wait_seconds"
SHMKV_LOCK_HOLD_S = "shmkv_pool_lock_hold_seconds"


class TierStats:
    """``get_stats`` (a mixin of ``SharedCPUOffloadingManager``: it reads the manager's
    pool, lock record and counters)."""

    def _fold_lock_record(self) -> None:
        """Adds the pool lock's record of (wait, hold) times to this process's totals."""
        record = self._lock.record
        if not record:
            return
        keep = record[-1:] if record[-1][1] == 0 else []  # a hold still going on
        done = record[:len(record) - len(keep)]
        self._lock.record = keep
        totals = self._lock_totals
        totals[0] += len(done)
        totals[1] += sum(w for w, _ in done)
        totals[2] += sum(h for _, h in done)

    def get_stats(self) -> OffloadingConnectorStats | None:  # noqa: F821
        """vLLM's CPU-tier gauges, node-wide: the fraction of chunks held (pinned or being
        stored) and of chunks being stored (an O(chunks) pass read without the lock: at most
        every ``GAUGE_INTERVAL_S`` on a tier of more than ``GAUGE_EXACT_CHUNKS``); this
        process's allocation sizes, the chunks it loaded that another replica stored, and
        its holds of the node-wide pool lock (count, wait and hold seconds), since the last
        call.

        Returns:
            an ``OffloadingConnectorStats``.
        """
        # NOTE: imported here: vllm.distributed costs a scheduler process seconds to import.
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
            OffloadingConnectorStats,
        )

        stats = OffloadingConnectorStats()
        if self._pool is None:
            raise PoolClosedError("the offload tier manager is closed; make a new one to attach")
        now = time.monotonic()
        if self._num_chunks <= GAUGE_EXACT_CHUNKS or now - self._gauges[0] >= GAUGE_INTERVAL_S:
            rows = self._pool.block_rows()
            held = rows["ref_cnt"][1:] > 0
            num_held = int(held.sum())
            num_pending = int((held & ((rows["group_id"][1:] & PENDING_BIT) != 0)
                               & (rows["hash_num_tokens"][1:] != L.NO_HASH_TOKENS)).sum())
            del rows, held
            self._gauges = (now, num_held / self._num_chunks, num_pending / self._num_chunks)
        _, usage, write_usage = self._gauges
        self._fold_lock_record()
        holds, wait_ns, hold_ns = self._lock_totals
        self._lock_totals = [0, 0, 0]
        stats.increase_counter(SHMKV_CROSS_REPLICA_HITS, self._cross_hits)
        stats.increase_counter(SHMKV_LOCK_HOLDS, holds)
        stats.increase_counter(SHMKV_LOCK_WAIT_S, wait_ns / 1e9)
        stats.increase_counter(SHMKV_LOCK_HOLD_S, hold_ns / 1e9)
        self._cross_hits = 0
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC, usage)
        for size in self._allocation_sizes:
            stats.observe_histogram(CPUOffloadingMetrics.CPU_ALLOCATION_SIZE, size)
        self._allocation_sizes.clear()
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC, write_usage)
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC,
                        max(usage - write_usage, 0.0))
        return stats
