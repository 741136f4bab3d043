"""Two processes, each with its own KVCacheManager on one pool: the second process's requests hit
the system-prompt blocks the first one cached (full attention, full + sliding window, full +
Mamba, full + Mamba under decode-context parallelism), and both serving at once keep every
invariant; sub-block hits across processes, and under DCP against vLLM's own manager."""

from __future__ import annotations

import pytest

from shmkv import BlockPool, Request
from shmkv.pool.block_pool import _ckernel
from tests.conftest import unique_pool_name
from tests.multiprocess import kv_manager_workers as manager_workers
from tests.multiprocess.conftest import join_processes, kill_processes, run_processes

pytestmark = pytest.mark.multiprocess

KERNELS = ["python"] + (["c"] if _ckernel is not None else [])
SYSTEM_HIT = len(manager_workers.SYSTEM_PROMPT)  # 64 tokens, block-aligned
BS = manager_workers.BS


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


KINDS = ["full", "full+swa", "full+mamba", "full+mamba-dcp2"]


def _pool_kw(kind: str) -> dict:
    # Under DCP the full-attention blocks are coarser than the hashes: partial-tail keys.
    return {"partial_keys": True} if kind.endswith("-dcp2") else {}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("kernel", KERNELS)
def test_second_process_hits_first_process_blocks(spawn_ctx, pool_factory, kernel, kind):
    pool = pool_factory(400, **_pool_kw(kind))
    first = run_processes(spawn_ctx, manager_workers.serve,
                          [(pool.pool_name, kernel, kind, 1, 6, 0, 60.0)])
    assert first == [0], "the first process failed (see stderr)"
    # The first process is gone; its system-prompt blocks stay cached in the shared pool.
    assert pool.get_num_free_blocks() == 399
    second = run_processes(spawn_ctx, manager_workers.serve,
                           [(pool.pool_name, kernel, kind, 2, 6, SYSTEM_HIT, 60.0)])
    assert second == [0], "the second process missed the first one's blocks (see stderr)"
    pool.check_invariants()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("kernel", KERNELS)
def test_two_managers_serving_at_once(spawn_ctx, pool_factory, kernel, kind):
    pool = pool_factory(120, **_pool_kw(kind))  # small: refusals and preemptions
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


class _VllmTwinRequest(Request):
    """shmkv's Request plus the scheduler fields vLLM's manager reads."""

    def __init__(self, *args, **kwargs):
        from vllm.v1.request import RequestStatus

        super().__init__(*args, **kwargs)
        self.status = RequestStatus.WAITING
        self.num_preemptions = 0
        self.num_in_flight_tokens = 0
        self.skip_reading_prefix_cache = False


@pytest.mark.parametrize("dcp,hbs", [(2, 4), (4, 4), (2, 2)])
@pytest.mark.parametrize("kernel", KERNELS)
def test_dcp_processes_match_vllm(spawn_ctx, kernel, dcp, hbs):
    """Decode-context parallelism on a hybrid model across processes, against vLLM: full
    attention (blocks of dcp x 4 tokens) + Mamba "align" (4, replicated). A producer process
    prefills a prompt stopping on its reusable boundary, inside a full-attention block; then
    two consumer processes share it up to there (one of them further): each hits the
    producer's blocks and snapshot, inside a sharded block, and copies its tail. vLLM's own
    KVCacheManager, given the same requests in the same order in this process, gives the
    same hits, copies, block tables and free-queue order; every block comes back."""
    pytest.importorskip("torch")
    pytest.importorskip("vllm.v1.core.kv_cache_manager")
    prompt = list(range(2000, 2015))  # 15 tokens
    boundary = (len(prompt) - 1) // hbs * hbs  # what a resend can reuse
    assert boundary % (BS * dcp) != 0  # inside a full-attention block
    runs = [("producer", prompt, [boundary]),
            ("consumer", prompt[:boundary] + [7, 8, 9, 10], []),
            ("longer", prompt + [11, 12, 13], [])]
    name = unique_pool_name("dcp")
    num_blocks = 48
    with BlockPool.create(name, num_blocks, hash_block_size=hbs, kernel=kernel,
                          partial_keys=True) as pool:
        try:
            results = spawn_ctx.Queue()
            ours = []
            for rid, tokens, stops in runs:  # one process after the other, each its own
                codes = run_processes(spawn_ctx, manager_workers.serve_dcp,
                                      [(name, kernel, dcp, rid, tokens, stops, results)])
                assert codes == [0], f"{rid} failed (see stderr)"
                ours.append(results.get(timeout=10))
            pool.check_invariants()
            theirs_m = manager_workers.make_dcp_manager("vllm", num_blocks, dcp, hbs)
            hasher = pool.make_block_hasher()
            theirs = [
                manager_workers.drive_dcp_request(
                    theirs_m, _VllmTwinRequest(rid, tokens, block_hasher=hasher), stops,
                    theirs_m.block_pool.free_blocks)
                for rid, tokens, stops in runs
            ]
            assert [tuple(o) for o in ours] == [tuple(t) for t in theirs]
            hits = [o[0] for o in ours]
            assert hits[0] == 0 and hits[1] == boundary and hits[2] >= boundary
            assert all(o[2] for o in ours[1:])  # the consumers copied a tail on write
            assert pool.get_free_block_ids() == [
                b.block_id for b in theirs_m.block_pool.free_block_queue.get_all_free_blocks()]
            assert pool.get_num_free_blocks() == num_blocks - 1
        finally:
            BlockPool.unlink(name)


@pytest.mark.parametrize("kernel", KERNELS)
def test_allocate_slots_short_of_blocks_reaps_a_dead_process_first(spawn_ctx, pool_factory,
                                                                   kernel):
    """A process SIGKILLed while it holds most of the pool: the survivor's allocate_slots,
    short of blocks, reaps it and allocates, where it returned None for ever before (a
    scheduler then preempts and waits; nothing else reaps a peer that died holding blocks).
    With nobody dead, a shortfall is still None, as in vLLM."""
    import signal

    from tests.multiprocess import workers

    pool = pool_factory(40, kernel=kernel)
    manager = manager_workers.make_manager(pool, "full")
    hasher = pool.make_block_hasher()
    too_big = Request("too-big", list(range(5000, 5000 + 4 * 40)), block_hasher=hasher)
    assert manager.allocate_slots(too_big, too_big.num_tokens) is None  # nobody to reap
    ready = spawn_ctx.Event()
    victim = spawn_ctx.Process(target=workers.take_blocks_then_sigkill,
                               args=(pool.pool_name, kernel, 36, ready))
    victim.start()
    assert join_processes([victim]) == [-signal.SIGKILL] and ready.is_set()
    assert pool.get_num_free_blocks() == 3
    request = Request("r", list(range(64)), block_hasher=hasher)  # 16 blocks of 4 tokens
    blocks = manager.allocate_slots(request, request.num_tokens)
    assert blocks is not None and len(blocks.get_block_ids()[0]) == 16
    assert [p["slot"] for p in pool.processes()] == [pool.slot]  # the victim was reaped
    assert pool.get_num_free_blocks() == 39 - 16
    pool.check_invariants()
    manager.free(request)
    assert pool.get_num_free_blocks() == 39
    pool.check_invariants()


@pytest.mark.parametrize("delay_s", [0.05, 0.5])
@pytest.mark.parametrize("kernel", KERNELS)
def test_dcp_manager_killed_mid_serve(spawn_ctx, pool_factory, kernel, delay_s):
    """kill -9 of one of two processes serving under DCP (full attention + Mamba "align",
    dcp 2), wherever it is (inside the pool lock or not, half way through a copy-on-write
    hit or a partial-tail key): the other finishes its requests, and after reap_dead every
    block is back and every invariant holds."""
    import os
    import signal
    import time

    pool = pool_factory(120, **_pool_kw("full+mamba-dcp2"))
    victim = spawn_ctx.Process(target=manager_workers.serve,
                               args=(pool.pool_name, kernel, "full+mamba-dcp2", 7, 10**6, 0,
                                     600.0))
    survivor = spawn_ctx.Process(target=manager_workers.serve,
                                 args=(pool.pool_name, kernel, "full+mamba-dcp2", 8, 150, 0,
                                       90.0))
    victim.start()
    survivor.start()
    try:
        deadline = time.monotonic() + 60
        while not any(p["label"] == "manager-7" and p["references"] > 0
                      for p in pool.processes()):  # the victim is serving
            assert time.monotonic() < deadline and victim.is_alive(), "the victim never served"
            time.sleep(0.01)
        time.sleep(delay_s)  # a moment into the victim's serving, not a timing assertion
        assert victim.is_alive()
        os.kill(victim.pid, signal.SIGKILL)
        codes = join_processes([victim, survivor])
        assert codes == [-signal.SIGKILL, 0], f"exit codes {codes} (see stderr)"
        pool.reap_dead()
        pool.check_invariants()
        assert pool.get_num_free_blocks() == 119
        assert [p["slot"] for p in pool.processes()] == [pool.slot]
    finally:
        kill_processes([victim, survivor])
