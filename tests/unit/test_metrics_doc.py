"""docs/metrics.md names every metric shmkv exports: those `shmkv metrics` serves for a pool
(a tier pool with an event log and a stats segment, so that every family shows), and those
the vLLM tier declares for vLLM's own /metrics."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from shmkv import BlockPool
from shmkv.pool.siblings import unlink_pool_siblings
from shmkv.stats import PoolStats
from tests.conftest import unique_pool_name

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def _documented() -> set[str]:
    return set(re.findall(r"`([A-Za-z_:][A-Za-z0-9_:]*)`", DOC.read_text()))


def _assert_documented(names: set[str], label: str) -> None:
    missing = sorted(names - _documented())
    assert not missing, f"{label}: exported but not named in docs/metrics.md: {missing}"


def test_every_pool_metric_is_in_the_doc():
    """Every metric family `shmkv metrics` serves (as Prometheus names them: counters with
    `_total`) is named in docs/metrics.md."""
    prometheus_client = pytest.importorskip("prometheus_client")
    from shmkv.metrics import PoolMetrics
    from shmkv.sglang.store import PageStore

    name = unique_pool_name("mdoc")
    store = PageStore(name, 4 * 4096, 4096, {"model": "m"}, 4)
    stats = None
    try:
        stats = PoolStats.open(store.pool, time_lock=True)
        stats.add_prefix_cache(16, 8)
        registry = prometheus_client.CollectorRegistry(auto_describe=False)
        registry.register(PoolMetrics(store.pool))
        text = prometheus_client.generate_latest(registry).decode()
        names = set(re.findall(r"^# TYPE (\S+) ", text, re.MULTILINE))
        # the families that appear only for a pool with an event log, and for a tier
        assert {"shmkv_evictions_total", "shmkv_tier_chunks",
                "shmkv_tier_cross_replica_hit_chunks_total"} <= names, names
        _assert_documented(names, "shmkv metrics")
    finally:
        if stats is not None:
            stats.close()
        store.close()
        BlockPool.unlink(name)
        unlink_pool_siblings(name)


def test_every_vllm_tier_metric_is_in_the_doc():
    """Every metric the vLLM tier's spec declares for vLLM's /metrics is named in
    docs/metrics.md (vLLM's Prometheus names a counter `<name>_total`)."""
    pytest.importorskip("vllm.v1.kv_offload.base")
    from vllm.v1.kv_offload.base import OffloadingCounterMetadata

    from shmkv.vllm import SharedCPUOffloadingSpec

    definitions = SharedCPUOffloadingSpec.build_metric_definitions({})
    names = {name + ("_total" if isinstance(meta, OffloadingCounterMetadata) else "")
             for name, meta in definitions.items()}
    assert "shmkv_cross_replica_hit_chunks_total" in names, names
    _assert_documented(names, "vLLM /metrics")


def test_the_checker_sees_a_missing_name():
    """The check itself: a name the doc lacks is reported."""
    with pytest.raises(AssertionError, match="shmkv_not_a_metric_total"):
        _assert_documented({"shmkv_blocks", "shmkv_not_a_metric_total"}, "probe")
