"""The seeded soak: many short recorded histories on fresh pools, each checked against
vLLM's BlockPool. Worker processes are spawned once and run one churn per history (a
SIGKILLed one is replaced), so a thousand histories take minutes, not hours."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import random
import signal
import tempfile
import time
from dataclasses import dataclass, field

from shmkv import BlockPool
from tests.conftest import unique_pool_name
from tests.linearizability import workers
from tests.linearizability.checker import FinalState, check
from tests.multiprocess.conftest import join_processes

NUM_BLOCKS = 40
TASK_TIMEOUT_S = 60


@dataclass
class SoakResult:
    histories: int = 0
    calls_replayed: int = 0
    switches: int = 0
    kills: int = 0
    rolled_back: int = 0
    ambiguous: int = 0
    differences: list[str] = field(default_factory=list)


class _Worker:
    def __init__(self, ctx, start) -> None:
        self.tasks = ctx.Queue()
        self.done = ctx.Queue()
        self.progress = ctx.Value("i", -1, lock=False)
        self.proc = ctx.Process(target=workers.soak_worker,
                                args=(self.tasks, self.done, self.progress, start))
        self.proc.start()

    def expect(self, what: str) -> None:
        deadline = time.monotonic() + TASK_TIMEOUT_S
        while True:
            try:
                kind, detail = self.done.get(timeout=0.5)
                break
            except queue.Empty:
                if not self.proc.is_alive() or time.monotonic() > deadline:
                    raise AssertionError(f"soak worker: no {what} (exit code "
                                         f"{self.proc.exitcode})") from None
        if kind != what:
            raise AssertionError(f"soak worker: expected {what}, got {kind}: {detail}")


def soak(num_histories: int, seed: int, *, num_workers: int = 4, num_ops: int = 30,
         kill_every: int = 10) -> SoakResult:
    """``num_histories`` histories of 2..``num_workers`` processes, kernels alternating;
    every ``kill_every``-th history SIGKILLs one process at a random step."""
    rng = random.Random(seed)
    ctx = mp.get_context("spawn")
    start = ctx.Value("q", 0, lock=False)
    pool_of = [_Worker(ctx, start) for _ in range(num_workers)]
    result = SoakResult()
    try:
        for h in range(num_histories):
            kernel = ("python", "c")[h % 2]
            active = rng.sample(range(num_workers), rng.randint(2, num_workers))
            name = unique_pool_name("soak")
            with tempfile.TemporaryDirectory(prefix="shmkv-soak-") as folder:
                pool = BlockPool.create(name, NUM_BLOCKS, enable_kv_cache_events=True,
                                        max_processes=num_workers + 2, kernel=kernel,
                                        stuck_after_s=0.5,
                                        record=os.path.join(folder, "creator.history"))
                try:
                    for i in active:
                        pool_of[i].progress.value = -1
                        pool_of[i].tasks.put((name, kernel, seed * 100_000 + h * 10 + i, h,
                                              num_ops, os.path.join(folder, f"w{i}.history"),
                                              h + 1))
                    for i in active:
                        pool_of[i].expect("ready")
                    start.value = h + 1
                    victim = rng.choice(active) if kill_every and h % kill_every == 0 else None
                    if victim is not None:
                        at, w = rng.randrange(1, num_ops), pool_of[victim]
                        deadline = time.monotonic() + TASK_TIMEOUT_S
                        while w.progress.value < at and w.proc.is_alive() \
                                and time.monotonic() < deadline:
                            time.sleep(0.0002)
                        os.kill(w.proc.pid, signal.SIGKILL)
                        join_processes([w.proc], timeout_s=10)
                        result.kills += 1
                        pool_of[victim] = _Worker(ctx, start)
                    for i in active:
                        if i != victim:
                            pool_of[i].expect("done")
                    pool.reap_dead()
                    final = FinalState.of(pool)
                    pool.check_invariants()
                finally:
                    pool.close()
                    BlockPool.unlink(name)
                report = check(folder, final)
            result.histories += 1
            result.calls_replayed += report.calls_replayed
            result.switches += report.switches
            result.rolled_back += report.holds_rolled_back
            result.ambiguous += report.holds_ambiguous
            if not report:
                result.differences.append(f"history {h} (seed {seed}): "
                                          f"{report.differences[0]}")
    finally:
        for w in pool_of:
            w.tasks.put(None)
        codes = join_processes([w.proc for w in pool_of], timeout_s=30)
    assert codes == [0] * num_workers, f"soak workers' exit codes {codes}"
    return result
