"""One recorded multi-process run on a fresh pool, checked against vLLM's BlockPool."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import tempfile
import time

from shmkv import BlockPool
from shmkv.errors import ShmKVError
from tests.conftest import unique_pool_name
from tests.linearizability import manager_workers, workers
from tests.linearizability.checker import FinalState, Report, check
from tests.multiprocess.conftest import join_processes

NUM_BLOCKS = 40  # small: allocations evict, and run short of blocks now and then


def run_history(kernel: str, num_procs: int, seed: int, *, num_ops: int = 60,
                num_kills: int = 0, lock_enabled: bool = True, events: bool = True,
                managers: bool = False) -> tuple[Report, list[int | None]]:
    """Spawns ``num_procs`` churn processes on a new recorded pool (``num_kills`` of them
    SIGKILLed at random steps), reaps, takes the final state, and checks every history.
    ``managers``: the processes drive ``KVCacheManager``s (``manager_workers.py``), and the
    histories are checked at both levels (the report is the manager level's, after the pool
    level passed). Returns the checker's report and the exit codes (-9 for the killed)."""
    rng = random.Random(seed)
    ctx = mp.get_context("spawn")
    name = unique_pool_name("lin")
    with tempfile.TemporaryDirectory(prefix="shmkv-lin-") as folder:
        pool = BlockPool.create(name, NUM_BLOCKS, enable_kv_cache_events=events,
                                max_processes=num_procs + 2, kernel=kernel,
                                stuck_after_s=0.5, record=os.path.join(folder, "creator.history"))
        try:
            ready = [ctx.Event() for _ in range(num_procs)]
            go = ctx.Event()
            progress = [ctx.Value("i", -1, lock=False) for _ in range(num_procs)]
            if managers:
                target = manager_workers.manager_churn
                extra: tuple = ()
            else:
                target, extra = workers.churn, (lock_enabled,)
            procs = [ctx.Process(target=target, args=(
                name, kernel, seed * 1000 + i, seed, num_ops,
                os.path.join(folder, f"w{i}.history"), *extra, ready[i], go,
                progress[i])) for i in range(num_procs)]
            for p in procs:
                p.start()
            for p, r in zip(procs, ready, strict=True):
                while not r.wait(0.1) and p.is_alive():
                    pass
            go.set()
            # Each victim is killed once it has begun a random step of its churn.
            plan = sorted((rng.randrange(1, num_ops), i)
                          for i in rng.sample(range(num_procs), num_kills))
            deadline = time.monotonic() + 60
            while plan and time.monotonic() < deadline:
                for at, i in list(plan):
                    if progress[i].value >= at or not procs[i].is_alive():
                        if procs[i].is_alive():
                            os.kill(procs[i].pid, signal.SIGKILL)
                        plan.remove((at, i))
                time.sleep(0.0002)
            codes = join_processes(procs, timeout_s=60)
            try:
                pool.reap_dead()
                final = FinalState.of(pool)
                pool.check_invariants()
            except ShmKVError:
                if lock_enabled:
                    raise
                final = None  # without the lock the pool may be corrupt: the histories tell
        finally:
            pool.close()
            BlockPool.unlink(name)
        report = check(folder, final)
        if managers and report:
            report = check(folder, final, level="manager")
    return report, codes


def run_interleaved(kernel: str, num_procs: int, *, attempts: int = 3, num_kills: int = 0,
                    **kwargs) -> Report:
    """``run_history`` with a fresh seed until a history interleaves (more than five
    switches between processes per process; an early kill or a slow start can leave fewer),
    at most ``attempts`` runs. EVERY run must exit as planned (all but the killed with 0)
    and replay as vLLM's; the test then has judged at least one well-interleaved history.
    Returns the last report."""
    import pytest

    for _ in range(attempts):
        seed = random.randrange(1 << 30)
        report, codes = run_history(kernel, num_procs, seed, num_kills=num_kills, **kwargs)
        assert sorted(codes)[num_kills:] == [0] * (num_procs - num_kills), f"seed={seed}: {codes}"
        if num_kills:
            assert codes.count(-9) >= 1, f"seed={seed}: nobody was killed ({codes})"
        assert report, f"seed={seed}: {report}"
        if report.switches > 5 * num_procs:
            return report
    pytest.fail(f"{attempts} histories did not interleave (last: seed={seed}, {report})")
