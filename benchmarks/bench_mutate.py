#!/usr/bin/env python
"""What the one savepoint mechanism (``lock.mutate``) costs a pool call, against the inline
block every mutating method had before it (fault count, acquire, savepoint, the work,
undo on error, release), in the same process on the same pool, both kernels.

Measured: ``pool.touch([])`` (the lock and the savepoint, almost nothing else),
``get_new_blocks(1)`` + ``free_blocks`` of that block, ``evict_blocks([])`` (a Python body
called by ``mutate``), and an empty body of nine arguments (``cache_full_blocks``'s). The
``inline`` variants are the old method bodies, copied here; the calls alternate, and each
figure is the median over ``--repeats`` timings of ``--number`` calls. Prints one JSON line
per (kernel, call), with ``extra_ns`` = mutate - inline.

    python benchmarks/bench_mutate.py [--repeats 300] [--number 2000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import timeit

from shmkv import BlockPool
from shmkv.pool import fault as _fault
from shmkv.pool import layout as L

_H_JOURNAL_LEN = L.H_JOURNAL_LEN


def touch_inline(pool: BlockPool, blocks) -> None:
    """``BlockPool.touch`` before ``lock.mutate``."""
    counting = _fault.planned is not None and _fault.begin("touch")
    lock = pool._lock
    lock.acquire()
    mark = pool._hdr64[_H_JOURNAL_LEN], len(pool._event_queue)
    try:
        pool._kernel.touch(blocks)
    except BaseException:
        pool._undo_since(*mark)
        raise
    finally:
        lock.release()
        if counting:
            _fault.end()


def free_inline(pool: BlockPool, blocks) -> None:
    """``BlockPool.free_blocks`` before ``lock.mutate``."""
    counting = _fault.planned is not None and _fault.begin("free")
    lock = pool._lock
    lock.acquire()
    mark = pool._hdr64[_H_JOURNAL_LEN], len(pool._event_queue)
    try:
        pool._kernel.free(blocks, pool.enable_caching)
    except BaseException:
        pool._undo_since(*mark)
        raise
    finally:
        lock.release()
        if counting:
            _fault.end()


def allocate_inline(pool: BlockPool, num_blocks: int):
    """``BlockPool.get_new_blocks`` before ``lock.mutate`` (its argument checks included)."""
    if type(num_blocks) is not int:
        raise TypeError(num_blocks)
    if num_blocks < 0:
        raise ValueError(num_blocks)
    evicted = [] if pool.enable_kv_cache_events else None
    counting = _fault.planned is not None and _fault.begin("allocate")
    lock = pool._lock
    lock.acquire()
    mark = pool._hdr64[_H_JOURNAL_LEN], len(pool._event_queue)
    try:
        if num_blocks > pool._hdr64[L.H_NUM_FREE]:
            pool.process_table.reap_dead()
            mark = pool._hdr64[_H_JOURNAL_LEN], len(pool._event_queue)
        blocks = pool._kernel.allocate(
            num_blocks, pool.enable_caching, pool._handles, pool._handle, evicted
        )
        if evicted:
            pool._record_removed(evicted)
        return blocks
    except BaseException:
        pool._undo_since(*mark)
        raise
    finally:
        lock.release()
        if counting:
            _fault.end()


def evict_inline(pool: BlockPool, block_ids) -> None:
    """``BlockPool.evict_blocks`` before ``lock.mutate`` (its argument checks included)."""
    ids = list(block_ids)
    for block_id in ids:
        if isinstance(block_id, bool) or not isinstance(block_id, int):
            raise TypeError(block_id)
    counting = _fault.planned is not None and _fault.begin("evict")
    try:
        with pool._lock:
            mark = pool._hdr64[_H_JOURNAL_LEN], len(pool._event_queue)
            try:
                for block_id in ids:
                    pool._evict_cached(int(block_id))
            except BaseException:
                pool._undo_since(*mark)
                raise
    finally:
        if counting:
            _fault.end()


def nine_inline(pool: BlockPool, *args) -> None:
    """The old inline block around a body of nothing (as ``cache_full_blocks``'s body, which
    takes nine arguments through ``mutate``)."""
    counting = _fault.planned is not None and _fault.begin("cache")
    lock = pool._lock
    lock.acquire()
    mark = pool._hdr64[_H_JOURNAL_LEN], len(pool._event_queue)
    try:
        pass
    except BaseException:
        pool._undo_since(*mark)
        raise
    finally:
        lock.release()
        if counting:
            _fault.end()


def _nine(a, b, c, d, e, f, g, h, i) -> None:
    pass


def measure(kernel: str, repeats: int, number: int) -> list[dict]:
    name = f"bench-mutate-{os.getpid()}-{kernel}"
    with BlockPool.create(name, 64, kernel=kernel) as pool:
        none: list = []

        def alloc_free_mutate() -> None:
            pool.free_blocks(pool.get_new_blocks(1))

        def alloc_free_inline() -> None:
            free_inline(pool, allocate_inline(pool, 1))

        calls = {
            "touch([])": (lambda: pool.touch(none), lambda: touch_inline(pool, none)),
            "get_new_blocks(1)+free_blocks": (alloc_free_mutate, alloc_free_inline),
            "evict_blocks([])": (lambda: pool.evict_blocks(none),
                                 lambda: evict_inline(pool, none)),
            "a 9-argument Python body": (
                lambda: pool.lock().mutate("cache", _nine, 1, 2, 3, 4, 5, 6, 7, 8, 9),
                lambda: nine_inline(pool, 1, 2, 3, 4, 5, 6, 7, 8, 9)),
        }
        out = []
        for call, (new, old) in calls.items():
            times: dict[str, list[float]] = {"mutate": [], "inline": []}
            for _ in range(repeats):  # alternate, so drift hits both alike
                times["mutate"].append(timeit.timeit(new, number=number) / number * 1e9)
                times["inline"].append(timeit.timeit(old, number=number) / number * 1e9)
            med = {k: statistics.median(v) for k, v in times.items()}
            per_call = 2 if "+" in call else 1  # two pool calls per measured one
            out.append({
                "kernel": kernel, "call": call, "mutate_ns": round(med["mutate"], 1),
                "inline_ns": round(med["inline"], 1),
                "extra_ns_per_pool_call": round((med["mutate"] - med["inline"]) / per_call, 1),
            })
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--number", type=int, default=2000)
    args = parser.parse_args()
    for kernel in ("c", "python"):
        for row in measure(kernel, args.repeats, args.number):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
