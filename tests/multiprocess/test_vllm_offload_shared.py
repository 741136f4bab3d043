"""The shared offload tier across real processes: one cache, in-flight dedup, pins that
hold off every process's eviction, and the dead's pins and stores released by survivors.

Real shared memory, spawn processes, a timeout on every join, every exit code checked,
real SIGKILL; the pool's invariants are checked at the end from a process that attaches
afresh.
"""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

pytest.importorskip("vllm.v1.kv_offload.cpu.manager")

from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key  # noqa: E402

from shmkv.vllm import REAP_INTERVAL_S, SharedCPUOffloadingManager  # noqa: E402
from tests.conftest import unique_pool_name  # noqa: E402
from tests.multiprocess.conftest import join_processes  # noqa: E402
from tests.multiprocess.offload_workers import (  # noqa: E402
    prompt_key,
    replica_zygote,
    scripted_peer,
)

pytestmark = [pytest.mark.multiprocess, pytest.mark.crash, pytest.mark.long]

SIGKILLED = -signal.SIGKILL


@pytest.fixture
def tier_name():
    name = unique_pool_name("vo")
    yield name
    SharedCPUOffloadingManager.unlink(name)


def _fresh_key(i: int):
    return make_offload_key(b"fresh" + i.to_bytes(4, "big"), 0)


def _assert_all_reusable(name: str, num_chunks: int, keys, label: str) -> None:
    """A fresh attacher finds nothing held, no store in flight, and can store a whole
    tier of new keys."""
    with SharedCPUOffloadingManager(name, num_chunks, label="checker") as fresh:
        fresh.pool.reap_dead()
        procs = fresh.pool.processes()
        assert [p["self"] for p in procs] == [True], f"{label}: {procs}"
        ctx = ReqContext("check")
        results = {fresh.lookup(k, ctx) for k in keys}
        assert LookupResult.HIT_PENDING not in results, f"{label}: a dead store still pending"
        rows = fresh.pool.block_rows()
        assert int(rows["ref_cnt"][1:].max()) == 0, f"{label}: a chunk is still held"
        del rows
        new = [_fresh_key(i) for i in range(num_chunks)]
        out = fresh.prepare_store(new, ctx)
        assert out is not None and out.keys_to_store == new, f"{label}: chunks not reusable"
        assert sorted(out.store_spec.block_ids.tolist()) == list(range(num_chunks))
        fresh.complete_store(new, ctx)
        assert all(fresh.lookup(k, ctx) == LookupResult.HIT for k in new)
        fresh.pool.check_invariants()


@pytest.mark.timeout(120)
def test_one_cache_dedup_pins_and_a_killed_peer(spawn_ctx, tier_name):
    """A peer's completed stores hit here, its in-flight store is HIT_PENDING and not stored
    twice, its pin survives our eviction pressure, and once it is SIGKILLed its pin and
    unfinished store are released."""
    num_chunks = 6
    manager = SharedCPUOffloadingManager(tier_name, num_chunks, enable_events=True)
    to_parent, from_parent = spawn_ctx.Queue(), spawn_ctx.Queue()
    peer = spawn_ctx.Process(target=scripted_peer,
                             args=(tier_name, num_chunks, to_parent, from_parent))
    peer.start()
    try:
        ctx = ReqContext("parent")
        manager.on_new_request(ctx)
        assert to_parent.get(timeout=60) == "stored"
        assert [manager.lookup(prompt_key(0, i), ctx) for i in range(3)] == [LookupResult.HIT] * 3
        assert to_parent.get(timeout=60) == "pending"
        assert manager.lookup(prompt_key(0, 3), ctx) == LookupResult.HIT_PENDING
        out = manager.prepare_store([prompt_key(0, 3), prompt_key(0, 4)], ctx)
        assert out.keys_to_store == [prompt_key(0, 4)]  # the peer's store is not repeated
        manager.complete_store(out.keys_to_store, ctx)
        from_parent.put("pin")
        assert to_parent.get(timeout=60) == "pinned"
        # 6 chunks: the peer's 3 ready (one pinned) and 1 pending, our 1 ready, 1 free:
        # 5 new keys would need 4 evictions, and only 3 chunks are idle.
        pressure = [_fresh_key(100 + i) for i in range(5)]
        assert manager.prepare_store(pressure, ctx) is None
        out = manager.prepare_store(pressure[:3], ctx)
        assert prompt_key(0, 0) not in out.evicted_keys
        assert set(out.evicted_keys) == {prompt_key(0, 1), prompt_key(0, 2)}
        manager.complete_store(out.keys_to_store, ctx)
        os.kill(peer.pid, signal.SIGKILL)
        assert join_processes([peer]) == [SIGKILLED]
        # The dead peer's store in flight is gone (at the first lookup after the reap
        # interval), and its pin no longer protects.
        time.sleep(2 * REAP_INTERVAL_S)
        assert manager.lookup(prompt_key(0, 3), ctx) == LookupResult.MISS
        out = manager.prepare_store([_fresh_key(200 + i) for i in range(2)], ctx)
        assert out is not None and prompt_key(0, 0) in out.evicted_keys
        manager.complete_store(out.keys_to_store, ctx)
        manager.pool.check_invariants()
    finally:
        if peer.is_alive():
            peer.kill()
            peer.join(10)
        manager.close()
    _assert_all_reusable(tier_name, num_chunks, [prompt_key(0, i) for i in range(5)], "peer")


@pytest.mark.timeout(180)
def test_four_replicas_with_random_sigkills(spawn_ctx, tier_name):
    """Four replica schedulers share one tier while two of them are SIGKILLed at random
    moments; the survivors finish, and afterwards nothing is pinned or pending and every
    chunk is reusable."""
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    num_chunks = 24
    SharedCPUOffloadingManager(tier_name, num_chunks).close()  # created, left for them
    to_parent, stop = spawn_ctx.Queue(), spawn_ctx.Event()
    zygote = spawn_ctx.Process(target=replica_zygote,
                               args=(tier_name, num_chunks, seed, 4, stop, to_parent))
    zygote.start()
    try:
        pids = to_parent.get(timeout=90)
        killed = rng.sample(pids, 2)
        for pid in killed:
            time.sleep(0.05 + rng.random() * 0.5)
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.3)  # the survivors go on a while without them
        stop.set()
        ends = to_parent.get(timeout=120)
        assert join_processes([zygote]) == [0]
    finally:
        if zygote.is_alive():
            zygote.kill()
            zygote.join(10)
    print(ends)
    for pid in pids:
        expected = f"signal:{signal.SIGKILL}" if pid in killed else "exit:0"
        assert ends[pid] == expected, (pid, ends[pid], killed)
    keys = [prompt_key(p, i) for p in range(4) for i in range(6)]
    _assert_all_reusable(tier_name, num_chunks, keys, f"seed {seed}")


@pytest.mark.timeout(120)
def test_a_step_region_holds_no_node_wide_lock_and_pins_its_hits(spawn_ctx, tier_name):
    """While replica A sits in its step region (vLLM's connector holding manager.lock)
    after a lookup HIT, replica B's calls go through at once (no node-wide lock across A's
    step) and B's evictions spare A's HIT; once A's step ends, B may evict it."""
    from tests.multiprocess.offload_workers import step_holder

    with SharedCPUOffloadingManager(tier_name, 4, lock_timeout_s=5.0) as manager:
        ctx = ReqContext("b")  # a lock held across A's step: LockTimeoutError after 5 s
        manager.prepare_store([prompt_key(0, 0)], ctx)
        manager.complete_store([prompt_key(0, 0)], ctx)
        to_parent, from_parent = spawn_ctx.Queue(), spawn_ctx.Queue()
        holder = spawn_ctx.Process(target=step_holder,
                                   args=(tier_name, 4, to_parent, from_parent))
        holder.start()
        try:
            assert to_parent.get(timeout=60) == "in step"
            fill = [prompt_key(1, i) for i in range(4)]
            out = manager.prepare_store(fill, ctx)  # needs 4 chunks: 3 free + A's HIT
            assert out is None  # A's HIT is pinned for its step: not evicted
            assert manager.lookup(prompt_key(0, 0), ctx) == LookupResult.HIT
            from_parent.put("end step")
            assert to_parent.get(timeout=60) == "step over"
            out = manager.prepare_store(fill, ctx)
            assert out is not None and out.evicted_keys == [prompt_key(0, 0)]
            from_parent.put("exit")
            assert join_processes([holder]) == [0]
            manager.pool.check_invariants()
        finally:
            if holder.is_alive():
                holder.kill()


@pytest.mark.timeout(180)
def test_replicas_starting_at_the_same_instant_all_open_the_tier(spawn_ctx, tier_name):
    """Four processes open a new tier at the same instant, 25 times: one creates it, the
    others attach while it is being made, and none is refused (an attacher that mapped the
    segment before its creator wrote the header used to get 'not a shmkv segment')."""
    from tests.multiprocess.offload_workers import start_together

    barrier, errors = spawn_ctx.Barrier(4), spawn_ctx.Queue()
    procs = [spawn_ctx.Process(target=start_together, args=(tier_name, 25, i, barrier, errors))
             for i in range(4)]
    for proc in procs:
        proc.start()
    assert join_processes(procs) == [0, 0, 0, 0]
    found = []
    while not errors.empty():
        found.append(errors.get(timeout=5))
    assert found == []
    assert not [e for e in os.listdir("/dev/shm") if tier_name in e]
