"""How full a pool is, as ``shmkv stats``, ``shmkv inspect`` and ``shmkv metrics`` say it: a
tier whose chunks all hold data is full though no request holds any, and no figure is
exported under vLLM's own ``vllm:`` names."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from shmkv import BlockPool
from shmkv.cli import main
from shmkv.cli.pool import _format_snapshot
from shmkv.metrics import PoolMetrics
from shmkv.pool.siblings import unlink_pool_siblings
from tests.conftest import unique_pool_name

PAGE_BYTES = 4096


@pytest.fixture
def full_store():
    """An SGLang page store of 4 pages, each stored (complete, held by no one)."""
    from shmkv.sglang.store import PageStore

    name = unique_pool_name("full")
    store = PageStore(name, 4 * PAGE_BYTES, PAGE_BYTES, {"model": "m"}, 4)
    try:
        host = np.arange(4 * PAGE_BYTES, dtype=np.uint8).reshape(4, PAGE_BYTES)
        hashes = [hashlib.sha256(bytes([i])).digest() for i in range(4)]
        assert store.save(hashes, host, [0, 1, 2, 3]) == (4, [])
        yield store
    finally:
        store.close()
        BlockPool.unlink(name)
        unlink_pool_siblings(name)


def test_a_full_tier_is_shown_full(full_store, capsys):
    """4 of 4 pages with data and none held: stats and inspect say 100% holding data and 0%
    held (not "usage 0.0%"), the tier line 100% full."""
    s = PoolMetrics(full_store.pool).snapshot()
    assert (s.num_blocks, s.free, s.in_use, s.with_data) == (4, 4, 0, 4)
    assert (s.with_data_ratio, s.in_use_ratio) == (1.0, 0.0)
    lines = _format_snapshot(s, None, 0.0)
    assert lines[1].endswith("4 free, 0 in use, 4 cached keys; holding data 100.0%, held 0.0%")
    assert "usage" not in "\n".join(lines)
    assert ("tier     SGLang page store: 4 pages, 4 with data (100.0% full; 0 being stored), "
            "0 held") in "\n".join(lines)
    assert main(["inspect", full_store.pool_name]) == 0
    out = capsys.readouterr().out
    assert "4 free, 0 in use, 4 cached keys; holding data 100.0%, held 0.0%" in out


def test_metrics_say_how_full_under_shmkv_names(full_store):
    """The exposition has no ``vllm:`` name; the pool's fullness is
    ``shmkv_blocks_with_data_ratio`` 1 and what requests hold ``shmkv_blocks_in_use_ratio``
    0, with ``shmkv_blocks{state="with_data"}`` 4."""
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry(auto_describe=False)
    registry.register(PoolMetrics(full_store.pool))
    text = prometheus_client.generate_latest(registry).decode()
    assert "vllm:" not in text
    pool = f'pool="{full_store.pool_name}"'
    samples = text.splitlines()
    assert f"shmkv_blocks_with_data_ratio{{{pool}}} 1.0" in samples
    assert f"shmkv_blocks_in_use_ratio{{{pool}}} 0.0" in samples
    assert f'shmkv_blocks{{{pool},state="with_data"}} 4.0' in samples
