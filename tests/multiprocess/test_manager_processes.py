"""Two processes, each with its own KVCacheManager on one pool: the second process's requests hit
the system-prompt blocks the first one cached (full attention, full + sliding window, full +
Mamba), and both serving at once keep every invariant."""

from __future__ import annotations

import pytest

from shmkv import BlockPool
from shmkv.pool.block_pool import _ckernel
from tests.conftest import unique_pool_name
from tests.multiprocess import kv_manager_workers as manager_workers
from tests.multiprocess.conftest import run_processes

pytestmark = pytest.mark.multiprocess

KERNELS = ["python"] + (["c"] if _ckernel is not None else [])
SYSTEM_HIT = len(manager_workers.SYSTEM_PROMPT)  # 64 tokens, block-aligned


@pytest.fixture
def pool_factory():
    made = []

    def factory(num_blocks: int, **kw) -> BlockPool:
        pool = BlockPool.create(unique_pool_name("mgr"), num_blocks,
                                hash_block_size=manager_workers.BS, **kw)
        made.append(pool)
        return pool

    yield factory
    for pool in made:
        name = pool.pool_name
        pool.close()
        BlockPool.unlink(name)


@pytest.mark.parametrize("kind", ["full", "full+swa", "full+mamba"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_second_process_hits_first_process_blocks(spawn_ctx, pool_factory, kernel, kind):
    pool = pool_factory(400)
    first = run_processes(spawn_ctx, manager_workers.serve,
                          [(pool.pool_name, kernel, kind, 1, 6, 0, 60.0)])
    assert first == [0], "the first process failed (see stderr)"
    # The first process is gone; its system-prompt blocks stay cached in the shared pool.
    assert pool.get_num_free_blocks() == 399
    second = run_processes(spawn_ctx, manager_workers.serve,
                           [(pool.pool_name, kernel, kind, 2, 6, SYSTEM_HIT, 60.0)])
    assert second == [0], "the second process missed the first one's blocks (see stderr)"
    pool.check_invariants()


@pytest.mark.parametrize("kind", ["full", "full+swa", "full+mamba"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_two_managers_serving_at_once(spawn_ctx, pool_factory, kernel, kind):
    pool = pool_factory(120)  # small: admissions are refused and requests preempted
    codes = run_processes(spawn_ctx, manager_workers.serve,
                          [(pool.pool_name, kernel, kind, seed, 150, 0, 90.0)
                           for seed in (3, 4)])
    assert codes == [0, 0], f"worker exit codes {codes} (see stderr)"
    pool.check_invariants()
    assert pool.get_num_free_blocks() == 119
    assert [p["slot"] for p in pool.processes()] == [pool.slot]


@pytest.mark.parametrize("kernel", KERNELS)
def test_second_process_hits_inside_a_block_the_first_one_keyed(spawn_ctx, kernel):
    """Sub-block hits across processes: the producer's partial-tail keys (full attention's
    own partial key, Mamba's state moved to a copy) are hits for another process's request
    that shares the prompt up to 14 tokens, half way into a 4-token block; the consumer
    then copies both tail blocks (copy-on-write) and every block comes back."""
    name = unique_pool_name("partial")
    with BlockPool.create(name, 48, hash_block_size=2, kernel=kernel, partial_keys=True) as pool:
        try:
            results = spawn_ctx.Queue()
            codes = run_processes(spawn_ctx, manager_workers.serve_partial,
                                  [(name, kernel, "producer", results)])
            assert codes == [0]
            hit_p, copies_p, _ = results.get(timeout=10)
            codes = run_processes(spawn_ctx, manager_workers.serve_partial,
                                  [(name, kernel, "consumer", results)])
            assert codes == [0]
            hit_c, copies_c, tables_c = results.get(timeout=10)
            assert hit_p == 0 and copies_p == 1  # the producer's Mamba key moved to a copy
            assert hit_c == 14 and copies_c == 2  # one copy per group
            assert pool.get_num_free_blocks() == 47
            pool.check_invariants()
        finally:
            BlockPool.unlink(name)
