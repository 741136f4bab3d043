#!/usr/bin/env python
"""The pool lock's candidates, acquire + release, uncontended and with 2 processes.

DESIGN.md asks to measure the POSIX semaphore (shmkv's pool lock) against an OFD lock; this
prints ns per acquire+release for:

- ``posix_ipc``: ``posix_ipc.Semaphore.acquire(timeout)`` / ``release()`` from Python;
- ``clock``: shmkv's C fast path (``shmkv.pool._ckernel.CLock``: the same semaphore, plus the
  holder record and the fence check), when built;
- ``ofd``: ``fcntl(F_OFD_SETLKW)`` / ``F_UNLCK`` on a byte of a file in /dev/shm (released by
  the kernel when its holder dies, but a system call every time).

SysV semaphores with SEM_UNDO need ``sysv_ipc``, which is not among shmkv's dependencies,
so they are not measured here. Output: one JSON line per (lock, processes), then a table.

    python benchmarks/bench_locks.py [--iterations N]
"""

from __future__ import annotations

import argparse
import fcntl
import json
import multiprocessing as mp
import os
import struct
import sys
import time

import posix_ipc

_FLOCK = struct.Struct("hhqqi4x")


def _ofd(fd: int, lock_type: int) -> None:
    fcntl.fcntl(fd, fcntl.F_OFD_SETLKW, _FLOCK.pack(lock_type, os.SEEK_SET, 0, 1, 0))


def run_lock(kind: str, names: dict, iterations: int, start, results) -> None:
    if kind == "posix_ipc":
        sem = posix_ipc.Semaphore(names["sem"])

        def take():
            sem.acquire(10)

        give = sem.release
    elif kind == "clock":
        from shmkv import BlockPool

        pool = BlockPool.attach(names["pool"], kernel="c")
        lock = pool.lock()
        take, give = lock.acquire, lock.release
    else:
        fd = os.open(names["ofd"], os.O_RDWR)

        def take():
            _ofd(fd, fcntl.F_WRLCK)

        def give():
            _ofd(fd, fcntl.F_UNLCK)

    start.wait(30)
    t0 = time.perf_counter_ns()
    for _ in range(iterations):
        take()
        give()
    results.put((time.perf_counter_ns() - t0) / iterations)
    if kind == "clock":
        pool.close()


def measure(kind: str, names: dict, procs: int, iterations: int) -> float:
    ctx = mp.get_context("spawn")
    start, results = ctx.Event(), ctx.Queue()
    ps = [ctx.Process(target=run_lock, args=(kind, names, iterations, start, results))
          for _ in range(procs)]
    for p in ps:
        p.start()
    time.sleep(0.5)
    start.set()
    per_op = [results.get(timeout=120) for _ in ps]
    for p in ps:
        p.join(30)
    return sum(per_op) / len(per_op)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=200_000)
    args = parser.parse_args(argv)
    from shmkv import BlockPool
    from shmkv.pool.block_pool import _ckernel

    tag = f"bench-locks-{os.getpid()}"
    names = {"sem": f"/{tag}-sem", "ofd": f"/dev/shm/{tag}.ofd", "pool": tag}
    posix_ipc.Semaphore(names["sem"], posix_ipc.O_CREX, initial_value=1).close()
    open(names["ofd"], "wb").close()
    kinds = ["posix_ipc", "ofd"] + (["clock"] if _ckernel is not None else [])
    pool = BlockPool.create(tag, 16) if "clock" in kinds else None
    rows = []
    try:
        for kind in kinds:
            for procs in (1, 2):
                ns = measure(kind, names, procs, args.iterations)
                rows.append({"bench": "locks", "lock": kind, "processes": procs,
                             "ns_per_acquire_release": round(ns, 1)})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        posix_ipc.unlink_semaphore(names["sem"])
        os.unlink(names["ofd"])
        if pool is not None:
            pool.close()
            BlockPool.unlink(tag)
    print()
    print("ns per acquire + release (mean per process; with 2 processes both loop at once)")
    print(f"{'lock':<10} {'1 process':>10} {'2 processes':>12}")
    for kind in kinds:
        one, two = (r["ns_per_acquire_release"] for r in rows if r["lock"] == kind)
        print(f"{kind:<10} {one:>10,.0f} {two:>12,.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
