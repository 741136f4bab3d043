"""HiSparse's host pages are pool state: the host tier (``BlockPool.tier("host")``) is one
shared segment for every scheduler process. A prefix one process published on the host is a
hit for another, and the host and device blocks of a process killed with SIGKILL mid-request
come back when a survivor reaps it."""

from __future__ import annotations

import signal

import pytest

from shmkv import BlockPool
from tests.conftest import unique_pool_name
from tests.multiprocess import hisparse_workers as W
from tests.multiprocess.conftest import join_processes, run_processes

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("kernel", ["python", "c"])
def test_host_tier_is_shared_and_survives_a_kill(spawn_ctx, kernel):
    from shmkv.pool.block_pool import _ckernel

    if kernel == "c" and _ckernel is None:
        pytest.skip("shmkv.pool._ckernel is not built")
    name = unique_pool_name("hisp")
    prompt = list(range(100, 100 + 4 * W.BS)) + [1, 2]
    with BlockPool.create(name, 40, hash_block_size=W.BS, kernel=kernel) as pool:
        results = spawn_ctx.Queue()
        assert run_processes(spawn_ctx, W.serve, [(name, "a", prompt, results, False)]) == [0]
        hit_a, host_free_a, _ = results.get(timeout=10)
        # b, another process, hits a's published host pages (4 sealed pages).
        assert run_processes(spawn_ctx, W.serve, [(name, "b", prompt, results, False)]) == [0]
        hit_b, host_free_b, _ = results.get(timeout=10)
        assert (hit_a, hit_b) == (0, 4 * W.BS)
        assert host_free_b == host_free_a
        # c dies holding blocks of both pools.
        codes = run_processes(spawn_ctx, W.serve,
                              [(name, "c", prompt[:-2] + [7] * 9, results, True)])
        assert codes == [-signal.SIGKILL]
        _, host_free_c, device_free_c = results.get(timeout=10)
        host = pool.tier("host", W.HOST_BLOCKS, enable_caching=True)
        assert host.pool_name == f"{name}.host"
        assert host.get_num_free_blocks() == host_free_c < host_free_a
        assert pool.get_num_free_blocks() == device_free_c < pool.num_gpu_blocks - 1
        assert host.reap_dead() == 1 and pool.reap_dead() == 1
        assert host.get_num_free_blocks() == host_free_a
        assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
        pool.check_invariants()
        host.check_invariants()


@pytest.mark.parametrize("kernel", ["python", "c"])
def test_a_copy_another_process_reuses_becomes_host_only(spawn_ctx, kernel):
    """The reader's unpinned clean pages (all but the two tail pages) are taken by another
    process, which gives them back at once; the reader's next step sees them gone (the
    worker is told to read them from the host) and keeps the pinned tail."""
    from shmkv.pool.block_pool import _ckernel

    if kernel == "c" and _ckernel is None:
        pytest.skip("shmkv.pool._ckernel is not built")
    name = unique_pool_name("hisr")
    with BlockPool.create(name, 40, hash_block_size=W.BS, kernel=kernel) as pool:
        ready, taken, results = spawn_ctx.Event(), spawn_ctx.Event(), spawn_ctx.Queue()
        procs = [spawn_ctx.Process(target=W.read_then_lose, args=(name, ready, taken, results)),
                 spawn_ctx.Process(target=W.take_everything, args=(name, ready, taken))]
        for p in procs:
            p.start()
        before, after, sent = results.get(timeout=60)
        assert join_processes(procs) == [0, 0]
        assert 0 not in before and len(before) == 6
        assert after == [0, 0, 0, 0] + before[4:] and sent == after
        assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
        pool.check_invariants()
