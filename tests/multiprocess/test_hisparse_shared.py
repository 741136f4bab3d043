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

pytestmark = [pytest.mark.multiprocess, pytest.mark.long]


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
def test_admission_short_of_host_blocks_reaps_a_dead_process_first(spawn_ctx, kernel):
    """A process SIGKILLed while it holds most of the host tier: a survivor's admission,
    short of host blocks, reaps it and admits, where allocate_slots returned None for ever
    before (the host tier's check only counted). With nobody dead, a shortfall is None."""
    from shmkv import KVCacheManager, Request, get_hisparse_coordinator
    from shmkv.pool.block_pool import _ckernel

    if kernel == "c" and _ckernel is None:
        pytest.skip("shmkv.pool._ckernel is not built")
    name = unique_pool_name("hisp")
    with BlockPool.create(name, 40, hash_block_size=W.BS, kernel=kernel) as pool:
        manager = KVCacheManager(W.hisparse_config(pool.num_gpu_blocks), max_model_len=64,
                                 scheduler_block_size=W.BS, hash_block_size=W.BS,
                                 enable_caching=True, block_pool=pool)
        host = get_hisparse_coordinator(manager).get_host_block_pool()
        hasher = pool.make_block_hasher()
        assert host is pool.tier("host", W.HOST_BLOCKS, enable_caching=True)
        assert host.get_num_free_blocks() == W.HOST_BLOCKS - 1  # (the null block)
        ready = spawn_ctx.Event()
        assert run_processes(spawn_ctx, W.take_host_blocks_then_sigkill,
                             [(name, W.HOST_BLOCKS - 4, ready)]) == [-signal.SIGKILL]
        assert ready.is_set() and host.get_num_free_blocks() == 3
        request = Request("r", list(range(6 * W.BS)), block_hasher=hasher)  # 6 host pages
        blocks = manager.allocate_slots(request, request.num_tokens)
        assert blocks is not None
        assert [p["slot"] for p in host.processes()] == [host.slot]  # the victim was reaped
        assert host.get_num_free_blocks() == W.HOST_BLOCKS - 1 - 6
        host.check_invariants()
        pool.check_invariants()
        too_big = Request("too-big", list(range(1000, 1000 + 20 * W.BS)), block_hasher=hasher)
        assert manager.allocate_slots(too_big, too_big.num_tokens) is None  # nobody dead
        manager.free(request)
        assert host.get_num_free_blocks() == W.HOST_BLOCKS - 1
        pool.reap_dead()  # the victim's device slot, if no shortfall reaped it yet
        assert [p["slot"] for p in pool.processes()] == [pool.slot]
        assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
        host.check_invariants()
        pool.check_invariants()


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
