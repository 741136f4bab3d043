#!/usr/bin/env python3
"""Chaos run: worker processes serve on one pool while this driver SIGKILLs random ones
(half of the kills aimed at the lock holder) and starts replacements; prints a table and a
JSON line (kills survived, take-overs, longest stall, leaked blocks, invariant violations).
Exits 1 if the run found a problem. See ``tests/crash/chaos.py``.

By default each worker also runs a publisher thread beside its main thread, forks now and
then (os.fork and libc fork(), see ``--fork-p``), and the driver injects looping
prefix-index chains (``--corrupt-p``); ``--plain`` turns all three off.

    python scripts/shmkv_chaos.py --workers 4 --kills 200 --kernel c
    python scripts/shmkv_chaos.py --seconds 600 --kills 1000000
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.crash.chaos import ChaosConfig, run_chaos  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--kills", type=int, default=100, help="stop after this many kills")
    parser.add_argument("--seconds", type=float, default=None,
                        help="or after this long, whichever comes first")
    parser.add_argument("--kernel", choices=("c", "python"), default=None)
    parser.add_argument("--blocks", type=int, default=64, help="blocks in the pool")
    parser.add_argument("--lock-timeout", type=float, default=10.0)
    parser.add_argument("--stuck-after", type=float, default=0.2)
    parser.add_argument("--interval", type=float, nargs=2, default=(0.05, 0.3),
                        metavar=("MIN", "MAX"), help="seconds between kills (uniform)")
    parser.add_argument("--holder-bias", type=float, default=0.5,
                        help="share of kills aimed at the lock holder")
    parser.add_argument("--spare-attach-close", action="store_true",
                        help="let victims caught inside attach() or close() go instead of "
                        "killing them")
    parser.add_argument("--fork-p", type=float, default=0.01,
                        help="share of a worker's steps that fork a child")
    parser.add_argument("--corrupt-p", type=float, default=0.1,
                        help="share of kill rounds that inject a looping index chain")
    parser.add_argument("--plain", action="store_true",
                        help="no publisher threads, forks or injected corruption")
    parser.add_argument("--max-stall", type=float, default=1.0,
                        help="a worker stall longer than this (s) fails the run")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)
    report = run_chaos(ChaosConfig(
        workers=args.workers, kills=args.kills, seconds=args.seconds, kernel=args.kernel,
        num_blocks=args.blocks, lock_timeout_s=args.lock_timeout,
        stuck_after_s=args.stuck_after, kill_interval_s=tuple(args.interval),
        holder_bias=args.holder_bias, seed=args.seed,
        kill_in_attach_close=not args.spare_attach_close,
        threads=not args.plain, fork_p=0.0 if args.plain else args.fork_p,
        corrupt_p=0.0 if args.plain else args.corrupt_p,
    ))
    print(report.table())
    print(report.to_json())
    healthy = (not report.errors and not report.worker_failures
               and report.kills_survived == report.kills and report.leaked_blocks == 0
               and report.invariant_violations == 0
               and report.longest_stall_s < args.max_stall)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
