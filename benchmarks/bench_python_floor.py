#!/usr/bin/env python
"""Why the pure-Python kernel's one-block pair is far from vLLM's: its floor, in one run.

Issue 16 asks the pure-Python kernel's ``get_new_blocks(1)`` + ``free_blocks`` for at least
0.5x of vLLM's speed. A pair is two calls, so two holds of the cross-process lock. This
measures, in one process and one run, ns per pair of:

- ``vllm``: vLLM 0.33.0's ``BlockPool`` pair (no lock at all; skipped without vLLM);
- ``bare-holds``: two holds of nothing but the thread gate (``threading.RLock``) and the
  POSIX semaphore, no shared store and no work: what any cross-process lock in CPython costs;
- ``pool-lock-holds``: two empty holds of shmkv's pure-Python ``PoolLock`` (the crash
  protocol's stores: phase, holder record, lock_seq, commit);
- ``shmkv-py``: the pure-Python kernel's pair (the holds, the journal, the free queue).

Ratios are vLLM's time over each (0.5 is the aim's budget for the whole pair). Median of
``--repeats`` runs of ``--pairs`` pairs. Prints JSON lines, then a table.

    python benchmarks/bench_python_floor.py [--pairs 20000] [--repeats 7] [--no-vllm]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import posix_ipc  # noqa: E402

from shmkv import BlockPool  # noqa: E402


def timed(fn, pairs: int, repeats: int) -> float:
    """Median ns per pair of ``fn(pairs)`` over ``repeats`` runs (one warm-up)."""
    fn(pairs // 10)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        fn(pairs)
        samples.append((time.perf_counter_ns() - t0) / pairs)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=20_000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--no-vllm", action="store_true", help="skip vLLM even if importable")
    args = ap.parse_args(argv)
    results: dict[str, float] = {}
    try:
        if args.no_vllm:
            raise ImportError
        from vllm.v1.core.block_pool import BlockPool as VllmBlockPool
    except ImportError:
        VllmBlockPool = None
    if VllmBlockPool is not None:
        vpool = VllmBlockPool(4096, enable_caching=True, hash_block_size=16)

        def vllm_pairs(n: int) -> None:
            get, free = vpool.get_new_blocks, vpool.free_blocks
            for _ in range(n):
                free(get(1))

        results["vllm"] = timed(vllm_pairs, args.pairs, args.repeats)

    sem_name = f"/shmkv-floor-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    sem = posix_ipc.Semaphore(sem_name, posix_ipc.O_CREX, mode=0o600, initial_value=1)
    try:
        gate = threading.RLock()

        def bare_holds(n: int) -> None:
            take, give, enter, leave = sem.acquire, sem.release, gate.acquire, gate.release
            for _ in range(n):
                enter(False), take(0), give(), leave()
                enter(False), take(0), give(), leave()

        results["bare-holds"] = timed(bare_holds, args.pairs, args.repeats)
    finally:
        sem.unlink()
        sem.close()

    name = f"bench-floor-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    pool = BlockPool.create(name, 4096, kernel="python")
    try:
        lock = pool.lock()

        def pool_lock_holds(n: int) -> None:
            acquire, release = lock.acquire, lock.release
            for _ in range(n):
                acquire(), release()
                acquire(), release()

        def shmkv_py_pairs(n: int) -> None:
            get, free = pool.get_new_blocks, pool.free_blocks
            for _ in range(n):
                free(get(1))

        results["pool-lock-holds"] = timed(pool_lock_holds, args.pairs, args.repeats)
        results["shmkv-py"] = timed(shmkv_py_pairs, args.pairs, args.repeats)
        pool.check_invariants()
    finally:
        pool.close()
        BlockPool.unlink(name)

    vllm_ns = results.get("vllm")
    for impl, ns in results.items():
        print(json.dumps({"bench": "python_floor", "impl": impl, "ns_per_pair": round(ns, 1),
                          "ratio_vllm_time_over": round(vllm_ns / ns, 3) if vllm_ns else None}))
    print()
    print(f"one-block get_new_blocks + free_blocks, ns per pair, median of {args.repeats} x "
          f"{args.pairs:,}")
    print(f"{'impl':<16} {'ns/pair':>9} {'vLLM/this':>10}")
    for impl, ns in results.items():
        ratio = f"{vllm_ns / ns:.2f}x" if vllm_ns else "-"
        print(f"{impl:<16} {ns:>9,.0f} {ratio:>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
