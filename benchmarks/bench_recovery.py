#!/usr/bin/env python
"""Crash recovery against the number of blocks: the take-over of a holder killed inside the
lock (detection and repair), and ``shmkv.pool.recovery.rebuild``, the fallback repair.

Take-over: a victim process holds half of the blocks, takes the pool lock, allocates 256
more inside it (journaled, not committed) and waits; the driver SIGKILLs it and at once
calls ``get_new_blocks(1)``, which waits, finds the holder dead, takes the lock over, rolls
the hold back from the undo journal and reaps the victim. ``detect+repair ms`` is the time
from the kill to that call's return (the wait slice is 20 ms); ``repair ms`` is the repair
alone (``pool.last_repair.seconds``: the rollback, the reap of the victim's references and
the epoch). ``no-holder`` kills the victim between taking the semaphore and recording
itself as holder (``SHMKV_FAULT``): the lock then looks merely stuck until
``stuck_after_s`` (2 s by default, 0.2 s here) has passed.

Rebuild: ref counts from the ledger, the free queue from the queue keys, the index chains
from the hash fields.

Each pool is first brought to a realistic state: half of the blocks held (in requests of
16), a quarter of all blocks cached, then the held blocks of every other request freed.
With ``--partial-keys`` the pool has alias rows (``partial_keys=True``) and every fourth
cached block also holds a partial key (an alias). The first rebuild of a pool renumbers
every free block's queue key; the repeats find a
rebuilt pool, with nothing to write back, and cost less: ``first`` is the former, the
median and min are over all repeats. Output: one JSON line per size, then a table.

    python benchmarks/bench_recovery.py [--sizes 1000,10000,100000,1000000] [--repeats 3]
                                        [--partial-keys]
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import statistics
import sys
import time

from shmkv import BlockPool
from shmkv.pool.recovery import check_invariants, rebuild

ALLOCATED_IN_HOLD = 256
STUCK_AFTER_S = 0.2


def _victim(name: str, num_held: int, die_after_semaphore: bool, ready) -> None:
    """Hold ``num_held`` blocks, then die inside the lock: killed by the driver half way
    through a hold, or (``die_after_semaphore``) by SHMKV_FAULT right after taking the
    semaphore, before recording itself as holder."""
    from shmkv.pool import fault

    pool = BlockPool.attach(name, label="victim")
    for start in range(0, num_held, 4096):
        pool.get_new_blocks(min(4096, num_held - start))
    if die_after_semaphore:
        ready.set()
        fault.arm("allocate", 2)  # store 1: lock_phase; store 2: the holder record
        pool.get_new_blocks(1)
        return
    pool.lock().acquire()
    pool.get_new_blocks(ALLOCATED_IN_HOLD)
    ready.set()
    time.sleep(600)


def takeover(num_blocks: int, repeats: int, no_holder: bool = False) -> dict:
    ctx = mp.get_context("spawn")
    latencies, repairs, undone = [], [], []
    for r in range(repeats):
        name = f"bench-takeover-{os.getpid()}-{num_blocks}-{r}"
        pool = BlockPool.create(name, num_blocks, max_processes=4, lock_timeout_s=60,
                                stuck_after_s=STUCK_AFTER_S)
        victim = None
        try:
            ready = ctx.Event()
            held = num_blocks // 2
            victim = ctx.Process(target=_victim, args=(name, held, no_holder, ready))
            victim.start()
            if not ready.wait(600):
                raise RuntimeError("the victim did not get ready")
            if no_holder:
                victim.join(60)
                t0 = time.perf_counter()
            else:
                t0 = time.perf_counter()
                victim.kill()
            pool.get_new_blocks(1)
            latencies.append(time.perf_counter() - t0)
            victim.join(60)
            if victim.exitcode != -9:
                raise RuntimeError(f"the victim ended with {victim.exitcode}, not SIGKILL")
            repair = pool.last_repair
            if not (repair and repair.took_over and repair.references_released == held):
                raise RuntimeError(f"no take-over, or not every reference back: {repair}")
            repairs.append(repair.seconds)
            undone.append(repair.journal_entries_undone)
            with pool.lock():
                check_invariants(pool)
        finally:
            if victim is not None and victim.is_alive():
                victim.kill()
                victim.join(10)
            pool.close()
            BlockPool.unlink(name)
    return {
        "bench": "takeover-no-holder" if no_holder else "takeover",
        "num_blocks": num_blocks,
        "victim_blocks": num_blocks // 2,
        "journal_entries_undone": int(statistics.median(undone)),
        "detect_repair_ms_median": round(statistics.median(latencies) * 1e3, 2),
        "detect_repair_ms_max": round(max(latencies) * 1e3, 2),
        "repair_ms_median": round(statistics.median(repairs) * 1e3, 2),
        "repeats": repeats,
    }


class _Request:
    def __init__(self, block_hashes: list[bytes]) -> None:
        self.block_hashes = block_hashes
        self.all_token_ids: list[int] = []


def run(num_blocks: int, repeats: int, partial_keys: bool = False) -> dict:
    name = f"bench-recovery-{os.getpid()}-{num_blocks}"
    pool = BlockPool.create(name, num_blocks, max_processes=4, partial_keys=partial_keys)
    try:
        held = []
        num_cached = num_aliases = 0
        for _ in range((num_blocks // 2) // 16):
            blocks = pool.get_new_blocks(16)
            if num_cached < num_blocks // 4:
                req = _Request([os.urandom(32) for _ in range(16)])
                pool.cache_full_blocks(req, blocks, 0, 16, 16, 0)
                num_cached += 16
                if partial_keys:  # a partial key, as if blocks were 32 tokens, in group 1
                    for i in range(1, 16, 4):
                        pool.cache_partial_block(req, blocks[i], 16 * i, 1, 32)
                        num_aliases += 1
            held.append(blocks)
        for blocks in held[::2]:
            pool.free_blocks(reversed(blocks))
        times = []
        for _ in range(repeats):
            with pool.lock():
                times.append(rebuild(pool).seconds)
        with pool.lock():
            check_invariants(pool)
    finally:
        pool.close()
        BlockPool.unlink(name)
    return {
        "bench": "recovery",
        "num_blocks": num_blocks,
        "cached_blocks": num_cached,
        "alias_keys": num_aliases,
        "rebuild_ms_median": round(statistics.median(times) * 1e3, 2),
        "rebuild_ms_min": round(min(times) * 1e3, 2),
        "rebuild_ms_first": round(times[0] * 1e3, 2),
        "repeats": repeats,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000,100000,1000000")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--partial-keys", action="store_true",
                        help="alias rows, and a partial key on every fourth cached block")
    args = parser.parse_args(argv)
    logging.getLogger("shmkv").setLevel(logging.ERROR)  # each take-over logs a warning
    rows, takeovers = [], []
    sizes = [int(x) for x in args.sizes.split(",")]
    steps = 2 * len(sizes) + 1
    for i, n in enumerate(sizes):
        print(f"[{2 * i + 1}/{steps}] take-over, {n:,} blocks ...", file=sys.stderr, flush=True)
        takeovers.append(takeover(n, args.repeats))
        print(json.dumps(takeovers[-1]), flush=True)
        print(f"[{2 * i + 2}/{steps}] rebuild, {n:,} blocks ...", file=sys.stderr, flush=True)
        rows.append(run(n, args.repeats, args.partial_keys))
        print(json.dumps(rows[-1]), flush=True)
    print(f"[{steps}/{steps}] take-over with no holder recorded ...", file=sys.stderr, flush=True)
    takeovers.append(takeover(sizes[0], args.repeats, no_holder=True))
    print(json.dumps(takeovers[-1]), flush=True)
    print()
    print(f"{'take-over':<19} {'blocks':>10} {'undone':>7} {'detect+repair ms':>17} "
          f"{'max':>8} {'repair ms':>10}")
    for t in takeovers:
        print(f"{t['bench']:<19} {t['num_blocks']:>10,} {t['journal_entries_undone']:>7,} "
              f"{t['detect_repair_ms_median']:>17.2f} {t['detect_repair_ms_max']:>8.2f} "
              f"{t['repair_ms_median']:>10.2f}")
    print()
    print(f"{'blocks':>10} {'cached':>10} {'aliases':>8} {'rebuild ms (median)':>20} "
          f"{'min':>8} {'first':>8}")
    for r in rows:
        print(f"{r['num_blocks']:>10,} {r['cached_blocks']:>10,} {r['alias_keys']:>8,} "
              f"{r['rebuild_ms_median']:>20.2f} {r['rebuild_ms_min']:>8.2f} "
              f"{r['rebuild_ms_first']:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
