"""A chunk a replica is storing, loading or resetting is never handed to another replica
until that replica reported the job done, or every process of it (engine core AND GPU
workers) is gone: real vLLM 0.33.0 Schedulers in separate processes, a real worker process
holding its replica's row, real SIGKILLs.

The tier has 12 chunks, so the second replica is short of chunks exactly when the first
one's chunks are out of its hands."""

from __future__ import annotations

import os
import signal

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")
pytest.importorskip("einops")  # vLLM's model inspection imports it (vllm_peer/requirements)

from shmkv.vllm import SharedCPUOffloadingManager  # noqa: E402
from tests.conftest import unique_pool_name  # noqa: E402
from tests.multiprocess.conftest import join_processes  # noqa: E402
from tests.multiprocess.vllm_scheduler_driver import (  # noqa: E402
    BLOCK_SIZE,
    make_scheduler,
    replica_worker,
    report_jobs_done,
    step_until_jobs,
    step_until_stores,
    storing_replica,
    write_model_dir,
)

pytestmark = [pytest.mark.multiprocess, pytest.mark.crash, pytest.mark.long]

CHUNK_BYTES = 2 * 2 * BLOCK_SIZE * 4 * 16 * 2  # 2 layers x K/V, one block per chunk
TIER_BYTES = 12 * CHUNK_BYTES  # 12 chunks
SIGKILLED = -signal.SIGKILL


def prompt(seed: int) -> list[int]:
    """Six full blocks and a tail: six chunks to store."""
    return [1 + (seed * 131 + i * 7) % 900 for i in range(6 * BLOCK_SIZE + 5)]


class Replica:
    """A replica's process (engine core or worker) driven through two queues."""

    def __init__(self, ctx, target, *args, **kwargs) -> None:
        self.to_parent, self.from_parent = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=target, args=(*args, self.to_parent, self.from_parent),
                                kwargs=kwargs)
        self.proc.start()

    def get(self):
        return self.to_parent.get(timeout=150)

    def send(self, command) -> None:
        self.from_parent.put(command)

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        assert join_processes([self.proc]) == [SIGKILLED]

    def stop(self) -> None:
        if self.proc.is_alive():
            self.send("exit")
        assert join_processes([self.proc]) in ([0], [SIGKILLED])


def _check_clean(pool: str) -> None:
    with SharedCPUOffloadingManager(pool, 12) as fresh:
        fresh.pool.reap_dead()
        fresh.pool.check_invariants()


@pytest.fixture
def tier(tmp_path):
    pool = unique_pool_name("own")
    yield pool, write_model_dir(str(tmp_path / "model"))
    SharedCPUOffloadingManager.unlink(pool)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("job", ["store", "load"])
def test_a_killed_engine_cores_chunks_wait_for_its_workers(spawn_ctx, tier, job):
    """Replica A's engine core is SIGKILLed with a store (or a load) in flight while A's
    GPU worker lives: replica B never gets those chunks for its stores; once the worker is
    SIGKILLed too, B gets exactly them."""
    pool, model_dir = tier
    worker = Replica(spawn_ctx, replica_worker, pool, model_dir, "A", TIER_BYTES)
    worker_b = Replica(spawn_ctx, replica_worker, pool, model_dir, "B", TIER_BYTES)
    core = None
    assert worker.get()[0] == "ready" and worker_b.get()[0] == "ready"
    scheduler = make_scheduler(pool, model_dir, TIER_BYTES, engine_id="B")
    try:
        if job == "load":  # B stores the prompt A will load
            stored, jobs = step_until_stores(scheduler, "b-0", prompt(0))
            report_jobs_done(scheduler, jobs)
        core = Replica(spawn_ctx, storing_replica, pool, model_dir, "A", prompt(0), job,
                       TIER_BYTES)
        a_chunks = core.get()
        assert len(a_chunks) == 6
        core.kill()

        b_chunks, _ = step_until_stores(scheduler, "b-1", prompt(1 if job == "load" else 0))
        assert not set(b_chunks) & set(a_chunks), (a_chunks, b_chunks)
        more, _ = step_until_jobs(scheduler, "b-2", prompt(2), "store", max_steps=4)
        assert more == [], "B was handed chunks A's worker may still be moving"

        worker.kill()
        b_after, _ = step_until_jobs(scheduler, None, want="store", max_steps=8)
        assert sorted(b_after) == sorted(a_chunks)
    finally:
        scheduler.connector.shutdown()
        if core is not None:
            core.stop()
        worker.stop()
        worker_b.stop()
    _check_clean(pool)


@pytest.mark.timeout(240)
def test_a_restart_under_the_same_engine_id_gets_a_row_of_its_own(spawn_ctx, tier):
    """Replica A runs with a user-fixed engine id: its engine core is SIGKILLed with a store
    in flight, and A restarts (new worker, new core, same engine id) while the old worker
    still lives. The old core's chunks stay out of every hand while the old worker lives,
    and come back to the new incarnation as soon as that worker stops, not when the new
    incarnation does."""
    pool, model_dir = tier
    old_worker = Replica(spawn_ctx, replica_worker, pool, model_dir, "A", TIER_BYTES)
    new_worker = old_core = scheduler = None
    try:
        assert old_worker.get()[0] == "ready"
        old_core = Replica(spawn_ctx, storing_replica, pool, model_dir, "A", prompt(0),
                           "store", TIER_BYTES)
        a_chunks = old_core.get()
        assert len(a_chunks) == 6
        old_core.kill()

        new_worker = Replica(spawn_ctx, replica_worker, pool, model_dir, "A", TIER_BYTES,
                             start="1")
        assert new_worker.get()[0] == "ready"
        scheduler = make_scheduler(pool, model_dir, TIER_BYTES, engine_id="A", start="1")
        stored, jobs = step_until_stores(scheduler, "a1-0", prompt(1))
        assert not set(stored) & set(a_chunks), (a_chunks, stored)
        report_jobs_done(scheduler, jobs)
        more, _ = step_until_jobs(scheduler, "a1-1", prompt(2), "store", max_steps=4)
        assert not set(more) & set(a_chunks), "handed out while the old worker may write"

        old_worker.stop()  # it ends its step and exits, as vLLM's worker of a dead core
        after, _ = step_until_jobs(scheduler, "a1-2", prompt(3), "store", max_steps=8)
        assert set(a_chunks) <= set(more) | set(after), (a_chunks, more, after)
    finally:
        if scheduler is not None:
            scheduler.connector.shutdown()
        for replica in (old_core, new_worker, old_worker):
            if replica is not None:
                replica.stop()
    _check_clean(pool)


@pytest.mark.timeout(240)
def test_a_reset_keeps_the_chunks_of_jobs_in_flight_until_they_are_flushed(spawn_ctx, tier):
    """Replica A resets its prefix cache (connector included) with a store in flight: B,
    storing the same prompt, gets other chunks; once A's workers report the job done
    (vLLM's on_reset_flushed), B gets exactly A's chunks."""
    pool, model_dir = tier
    core = Replica(spawn_ctx, storing_replica, pool, model_dir, "A", prompt(0), "store",
                   TIER_BYTES)
    scheduler = make_scheduler(pool, model_dir, TIER_BYTES, engine_id="B")
    try:
        a_chunks = core.get()
        core.send("reset")
        core.get()  # vLLM's answer: False while A's request still holds GPU blocks
        b_chunks, _ = step_until_stores(scheduler, "b-0", prompt(0))
        assert not set(b_chunks) & set(a_chunks), (a_chunks, b_chunks)
        more, _ = step_until_jobs(scheduler, "b-1", prompt(1), "store", max_steps=4)
        assert more == [], "B was handed chunks A's reset had not flushed"

        core.send("done")
        assert core.get() == "done"
        b_after, _ = step_until_jobs(scheduler, None, want="store", max_steps=8)
        assert sorted(b_after) == sorted(a_chunks)
    finally:
        scheduler.connector.shutdown()
        core.stop()
    _check_clean(pool)
