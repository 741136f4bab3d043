"""Processes of the linearizability tests: seeded random churn on one recorded pool."""

from __future__ import annotations

import contextlib
import logging
import random
import sys
import time
import traceback

from shmkv import BlockPool
from tests.helpers import FakeRequest

BS = 16
NUM_PROMPTS = 4


def prompts(shared_seed: int) -> list[list[int]]:
    """System prompts every process of a run shares (so one's cache is the others' hit)."""
    rng = random.Random(shared_seed)
    return [[rng.randrange(50_000) for _ in range(64)] for _ in range(NUM_PROMPTS)]


def churn_steps(pool: BlockPool, rng: random.Random, shared: list[list[int]],
                num_ops: int, progress=None) -> list[tuple[FakeRequest, list]]:
    """``num_ops`` random steps: admit (prefix lookup, touch, allocate, cache: in one hold
    or call by call), finish (free), lookup, evict, reset, most after a short sleep (so the
    processes' calls interleave, not run one process after another). Returns what is still
    held; ``progress.value`` (a shared int, if given) counts the steps begun."""
    running: list[tuple[FakeRequest, list]] = []
    for step in range(num_ops):
        if progress is not None:
            progress.value = step
        if rng.random() < 0.7:  # let the others run: the processes' holds interleave
            time.sleep(rng.uniform(0, 0.0003))
        roll = rng.random()
        if roll < 0.45 or not running:
            prompt = rng.choice(shared)[: rng.choice([16, 32, 48, 64])]
            tokens = prompt + [rng.randrange(50_000) for _ in range(rng.randint(1, 40))]
            req = FakeRequest(tokens)
            with pool.lock() if rng.random() < 0.5 else contextlib.nullcontext():
                if step % 2:
                    hits = pool.get_cached_prefix(req.block_hashes)
                else:
                    hits = []
                    for h in req.block_hashes:
                        found = pool.get_cached_block(h, [0])
                        if found is None:
                            break
                        hits.append(found[0])
                pool.touch(hits)
                need = -(-len(tokens) // BS) - len(hits)
                try:
                    blocks = hits + pool.get_new_blocks(need)
                except ValueError:
                    pool.free_blocks(list(reversed(hits)))
                    continue
                pool.cache_full_blocks(req, blocks, len(hits), len(tokens) // BS, BS, 0)
            running.append((req, blocks))
        elif roll < 0.85:
            _, blocks = running.pop(rng.randrange(len(running)))
            pool.free_blocks(list(reversed(blocks)))
        elif roll < 0.92:
            req = rng.choice(running)[0]
            if req.block_hashes:
                pool.get_cached_block(rng.choice(req.block_hashes), [0])
        elif roll < 0.97:
            ids = rng.sample(range(pool.num_gpu_blocks), rng.randint(1, 4))
            pool.evict_blocks(ids)
        else:
            pool.reset_prefix_cache()
    return running


def churn(name: str, kernel: str, seed: int, shared_seed: int, num_ops: int, record: str,
          lock_enabled: bool, ready, go, progress) -> None:
    """Attach recording, say ``ready``, wait for ``go`` (every process starts at once), run
    the churn, free part of what is held, close (which gives back the rest)."""
    logging.disable(logging.WARNING)  # failed resets log a line each
    try:
        pool = BlockPool.attach(name, kernel=kernel, label=f"churn-{seed}", record=record,
                                stuck_after_s=0.5, _lock_enabled=lock_enabled)
        ready.set()
        if not go.wait(60):
            raise TimeoutError("no go from the test within 60 s")
        rng = random.Random(seed)
        running = churn_steps(pool, rng, prompts(shared_seed), num_ops, progress)
        for _, blocks in running:
            if rng.random() < 0.5:  # the rest is given back by close()
                pool.free_blocks(list(reversed(blocks)))
        pool.close()
    except BaseException:  # noqa: BLE001  (report anything, then fail)
        traceback.print_exc()
        sys.exit(1)


def soak_worker(tasks, done, progress, start) -> None:
    """Runs churn tasks until told to stop (None): attach recording, wait until ``start``
    reaches the task's generation (all workers of a history begin together), churn, close."""
    logging.disable(logging.WARNING)  # failed resets log a line each
    while True:
        task = tasks.get()
        if task is None:
            return
        name, kernel, seed, shared_seed, num_ops, record, generation = task
        try:
            pool = BlockPool.attach(name, kernel=kernel, record=record, stuck_after_s=0.5)
            done.put(("ready", seed))
            while start.value < generation:
                time.sleep(0.0002)
            rng = random.Random(seed)
            held = churn_steps(pool, rng, prompts(shared_seed), num_ops, progress)
            for _, blocks in held[: len(held) // 2]:
                pool.free_blocks(list(reversed(blocks)))
            pool.close()
            done.put(("done", seed))
        except BaseException:  # noqa: BLE001  (reported to the driver, which fails)
            done.put(("error", traceback.format_exc()))
            return


def die_in_allocation(name: str, kernel: str, record: str, store: int) -> None:
    """Allocates and frees a little, then is SIGKILLed before the ``store``-th store of an
    allocation (``shmkv/pool/fault.py``); exits 0 if the allocation completed first."""
    from shmkv.pool import fault

    try:
        pool = BlockPool.attach(name, kernel=kernel, record=record)
        blocks = pool.get_new_blocks(3)
        pool.free_blocks(blocks[:1])
        fault.arm("allocate", store)
        pool.get_new_blocks(2)
        pool.close()
    except BaseException:  # noqa: BLE001  (report anything, then fail)
        traceback.print_exc()
        sys.exit(1)
