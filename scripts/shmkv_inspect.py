#!/usr/bin/env python3
"""Print a live pool's header, region table, block counts and invariant status (shmkv's
``mdb_stat``). Reads only; never marks the segment.

    python scripts/shmkv_inspect.py POOL_NAME
"""

from __future__ import annotations

import argparse
import sys

from shmkv import BlockPool, ShmKVError
from shmkv import layout as L
from shmkv.recovery import collect_violations


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", help="pool name (as given to BlockPool.create)")
    args = parser.parse_args(argv)
    try:
        pool = BlockPool.attach(args.name)
    except ShmKVError as exc:
        print(f"shmkv_inspect: {exc}", file=sys.stderr)
        return 2
    try:
        hdr = pool.layout.view(pool._segment.buf, "header")[0]
        print(f"pool {args.name}  segment {pool._segment.shm_name}  "
              f"({pool.layout.total_bytes:,} bytes)")
        for field in L.HEADER_DTYPE.names:
            value = hdr[field]
            if field == "state":
                value = L.STATE_NAMES.get(int(value), int(value))
            elif field == "magic":
                value = hex(int(value))
            elif field == "none_hash":
                value = bytes(value).hex()[:16] + "..."
            print(f"  {field:<18} {value}")
        print("regions:")
        for name, offset, nbytes, _ in pool.layout.describe():
            shape = pool.layout.shapes[name]
            print(f"  {name:<14} offset {offset:>12,}  {nbytes:>14,} B  shape {shape}")
        n = pool.num_gpu_blocks
        free = pool.get_num_free_blocks()
        cached = len(pool.cached_block_hash_to_block)
        print(f"blocks: {n} total, {free} free, {n - 1 - free} in use, "
              f"{cached} cached keys, usage {pool.get_usage():.1%}")
        violations = collect_violations(pool)
        print("invariants: " + ("OK" if not violations else f"{len(violations)} broken"))
        for v in violations:
            print(f"  {v}")
        return 0 if not violations else 1
    finally:
        pool.close()


if __name__ == "__main__":
    sys.exit(main())
