#!/usr/bin/env python
"""Time of ``shmkv.recovery.rebuild`` (ref counts from the ledger, the free queue from the
queue keys, the index chains from the hash fields) against the number of blocks.

Each pool is first brought to a realistic state: half of the blocks held (in requests of
16), a quarter of all blocks cached, then the held blocks of every other request freed.
The first rebuild of a pool renumbers every free block's queue key; the repeats find a
rebuilt pool, with nothing to write back, and cost less: ``first`` is the former, the
median and min are over all repeats. Output: one JSON line per size, then a table.

    python benchmarks/bench_recovery.py [--sizes 1000,10000,100000,1000000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from shmkv import BlockPool
from shmkv.recovery import check_invariants, rebuild


class _Request:
    def __init__(self, block_hashes: list[bytes]) -> None:
        self.block_hashes = block_hashes
        self.all_token_ids: list[int] = []


def run(num_blocks: int, repeats: int) -> dict:
    name = f"bench-recovery-{os.getpid()}-{num_blocks}"
    pool = BlockPool.create(name, num_blocks, max_processes=4)
    try:
        held = []
        num_cached = 0
        for _ in range((num_blocks // 2) // 16):
            blocks = pool.get_new_blocks(16)
            if num_cached < num_blocks // 4:
                hashes = [os.urandom(32) for _ in range(16)]
                pool.cache_full_blocks(_Request(hashes), blocks, 0, 16, 16, 0)
                num_cached += 16
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
        "rebuild_ms_median": round(statistics.median(times) * 1e3, 2),
        "rebuild_ms_min": round(min(times) * 1e3, 2),
        "rebuild_ms_first": round(times[0] * 1e3, 2),
        "repeats": repeats,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000,100000,1000000")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    rows = []
    sizes = [int(x) for x in args.sizes.split(",")]
    for i, n in enumerate(sizes):
        print(f"[{i + 1}/{len(sizes)}] {n:,} blocks ...", file=sys.stderr, flush=True)
        rows.append(run(n, args.repeats))
        print(json.dumps(rows[-1]), flush=True)
    print()
    print(f"{'blocks':>10} {'cached':>10} {'rebuild ms (median)':>20} {'min':>8} {'first':>8}")
    for r in rows:
        print(f"{r['num_blocks']:>10,} {r['cached_blocks']:>10,} "
              f"{r['rebuild_ms_median']:>20.2f} {r['rebuild_ms_min']:>8.2f} "
              f"{r['rebuild_ms_first']:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
