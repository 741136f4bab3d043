"""Removing a pool removes what it owns, and only that: its tiers by their header's
``tier_of``, never a pool of its own that merely has a tier's name; its stats and publisher
position with the creator's with-block, not only with ``shmkv unlink``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from shmkv import BlockPool, SegmentError
from shmkv.pool import layout as L
from shmkv.pool import siblings
from shmkv.publisher import KVEventPublisher, state_segment_name
from shmkv.stats import PoolStats, stats_segment_name
from tests.conftest import unique_pool_name

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _shmkv_unlink(name: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shmkv.cli", "unlink", name],
                          capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=ROOT))


def _left(name: str) -> list[str]:
    """What /dev/shm holds under ``name`` (pool, lock, lock file, siblings, tiers)."""
    return sorted(e for e in os.listdir("/dev/shm")
                  if f"-{name}-v" in e or f"-{name}." in e or f"_{name}" in e)


def test_a_pool_named_like_a_tier_survives_the_other_pool(kernel):
    """A pool of its own named "X.host" is not X's host tier: creating X, X.tier("host"),
    X's with-block, BlockPool.unlink("X") and `shmkv unlink X` all leave it, and its
    blocks, alone."""
    name = unique_pool_name("own")
    other = BlockPool.create(f"{name}.host", 8, kernel=kernel)
    try:
        held = other.get_new_blocks(3)
        assert siblings.tier_of(f"{name}.host") is None
        with BlockPool.create(name, 8, kernel=kernel) as pool:
            with pytest.raises(SegmentError, match=f"pool {name}.host is not the host tier"):
                pool.tier("host", 8, enable_caching=True)  # its config fits, not its header
            pool.check_invariants()
        assert not BlockPool.unlink(name)
        run = _shmkv_unlink(name)
        assert run.returncode == 2 and f"no pool named {name}" in run.stderr, run
        witness = BlockPool.attach(f"{name}.host", kernel=kernel)
        assert witness.get_num_free_blocks() == 8 - 1 - 3
        witness.check_invariants()
        witness.close()
        other.free_blocks(held)
        other.check_invariants()
    finally:
        other.close()
        BlockPool.unlink(f"{name}.host")
    assert _left(name) == []


def test_a_pools_tier_goes_with_it_by_its_header(kernel):
    """A tier records the pool_id of the pool that made it; BlockPool.unlink and `shmkv
    unlink` remove it with that pool."""
    name = unique_pool_name("tier")
    for remove in (BlockPool.unlink, _shmkv_unlink):
        pool = BlockPool.create(name, 8, kernel=kernel)
        host = pool.tier("host", 6, enable_caching=True)
        assert siblings.tier_of(f"{name}.host") == bytes(pool.header_snapshot()["pool_id"])
        host.check_invariants()
        pool.check_invariants()
        pool.close()
        result = remove(name)
        if remove is _shmkv_unlink:
            assert result.returncode == 0 and "host tier" in result.stdout, result
        assert _left(name) == [], remove


def test_the_creators_with_block_removes_every_sibling(kernel):
    """After the creator's with-block nothing of the pool is left in /dev/shm: its stats,
    publisher position and host tier go with its segment, lock and lock file."""
    name = unique_pool_name("sib")
    with BlockPool.create(name, 8, kernel=kernel, enable_kv_cache_events=True) as pool:
        PoolStats.open(pool).close()
        KVEventPublisher(pool, "tcp://127.0.0.1:0").close()
        pool.tier("host", 6, enable_caching=True)
        expected = {L.segment_name(name)[1:], stats_segment_name(name)[1:],
                    state_segment_name(name)[1:], L.segment_name(f"{name}.host")[1:]}
        assert expected <= set(_left(name)), _left(name)
        pool.check_invariants()
    assert _left(name) == []
