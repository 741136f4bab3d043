"""A pool holds one cache geometry across processes: scheduler processes whose blocks hold
KV laid out otherwise (another page size) are refused, one of the same layout is welcome,
and the binding outlives the process that made it (killed with SIGKILL)."""

from __future__ import annotations

import signal
import time

import pytest

from shmkv import BlockPool, UsageError, get_kv_cache_coordinator
from shmkv.core.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from tests.multiprocess.conftest import join_processes

pytestmark = pytest.mark.multiprocess
BS = 16
REFUSED, BOUND, HIT = 10, 11, 12  # exit codes of the worker


def _config(heads: int, head_size: int) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=heads, head_size=head_size,
                             dtype="float16")
    return KVCacheConfig(64, [], [KVCacheGroupSpec(["l0"], spec)])


def bind(name: str, heads: int, head_size: int, hold_forever: bool = False) -> None:
    """A scheduler process of a model with ``heads`` x ``head_size`` KV per token: attaches
    and builds its coordinator; exits REFUSED, or BOUND (or stays, bound, until killed)."""
    import time

    pool = BlockPool.attach(name, label=f"sched-{heads}x{head_size}")
    try:
        get_kv_cache_coordinator(_config(heads, head_size), 1024, 1024, False, True, False,
                                 1, 1, BS, BS, block_pool=pool)
    except UsageError as exc:
        assert "another KV-cache configuration" in str(exc), exc
        pool.close()
        raise SystemExit(REFUSED) from None
    if hold_forever:
        while True:
            time.sleep(1)
    pool.close()
    raise SystemExit(BOUND)


def test_processes_of_another_geometry_are_refused(spawn_ctx, pool_name):
    pool = BlockPool.create(pool_name, 64, hash_block_size=BS, partial_keys=True,
                            max_processes=8)
    try:
        first = spawn_ctx.Process(target=bind, args=(pool_name, 1, 8, True))
        first.start()
        deadline = time.monotonic() + 60
        while pool.cache_geometry == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        bound = pool.cache_geometry
        assert bound != 0
        first.kill()  # the binder dies: the binding stays
        assert join_processes([first], 30) == [-signal.SIGKILL]
        pool.reap_dead()
        procs = [spawn_ctx.Process(target=bind, args=(pool_name, heads, size))
                 for heads, size in ((1, 16), (2, 8), (1, 8))]
        for p in procs:
            p.start()
        assert join_processes(procs, 120) == [REFUSED, REFUSED, BOUND]
        assert pool.cache_geometry == bound
        assert pool.get_num_free_blocks() == 63
        pool.check_invariants()
    finally:
        pool.close()
