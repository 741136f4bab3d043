"""SGLang instances sharing shmkv's L3 page store, model-free.

N instance processes replay one trace (a Mooncake conversation trace read by ``shmkv
replay``'s reader, or a built-in synthetic one), requests dealt round-robin. Each instance
keeps a private L2 (an LRU of host pages, as SGLang's host pool); a page missing from it is
recomputed. Phase ``l2``: private L2 only. Phase ``l3``: the same, with the shared store
(``shmkv.sglang.SharedHostStorage`` built by SGLang's factory) below: a page another
instance stored is loaded (``batch_get_v1``) instead of recomputed, and recomputed pages
are written through (``batch_set_v1``). Reported: pages recomputed, pages served from L3,
hit rates, and get/set GB/s against a plain memcpy of the same bytes in the same process.

Each get/set call is timed whole (hashing, the pool's lock holds, the copies). The memcpy
baseline (``memcpy_gbps``) copies the same number of pages of the same size right after
each call, in the same process, one ``memcpy`` each between two buffers already written
(so faulted in) as large as the store, timed the same way: the ratios compare like
with like under the same moment's load. ``memcpy_best_gbps`` is the same volume again
after the replay, best of three. The load average is printed with each row, since the
figures of a shared box move with it. Phase ``l2`` needs no store and runs in the main
process.

    python benchmarks/bench_sglang_l3.py [--trace FILE] [--instances 4] [--quick]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import random
import sys
import tempfile
import time
from collections import OrderedDict

import numpy as np

BASELINE_REPEATS = 3
BASELINE_MAX_BYTES = 256 << 20  # the baseline's buffers: larger than any CPU cache


def synthetic_trace(path: str, num_requests: int, seed: int) -> None:
    """Mooncake-format conversations: shared system prompts, multi-turn sessions."""
    rng = random.Random(seed)
    sessions: list[list[int]] = []
    next_id = 1000
    with open(path, "w") as f:
        for i in range(num_requests):
            if sessions and rng.random() < 0.6:
                ids = rng.choice(sessions)
            else:
                ids = list(range(rng.randrange(4) * 8, rng.randrange(4) * 8 + 8))  # system
                sessions.append(ids)
            ids += list(range(next_id, next_id + rng.randint(2, 6)))  # the new turn
            next_id += 6
            f.write(json.dumps({"timestamp": i, "input_length": len(ids) * 512,
                                "output_length": 16, "hash_ids": list(ids)}) + "\n")


def page_keys(tokens: list[int], page_size: int) -> list[str]:
    keys, prev = [], b""
    for i in range(len(tokens) // page_size):
        prev = hashlib.sha256(prev + repr(tokens[i * page_size:(i + 1) * page_size]).encode()
                              ).digest()
        keys.append(prev.hex())
    return keys


class Memcpy:
    """The baseline: ``n`` pages of ``page_bytes`` copied one memcpy (``np.copyto``) each
    between two buffers written beforehand (so faulted in), each as large as the store (at
    most BASELINE_MAX_BYTES), walked round-robin."""

    def __init__(self, page_bytes: int, store_bytes: int) -> None:
        span = max(1, min(store_bytes, BASELINE_MAX_BYTES) // page_bytes)
        self.src = np.full((span, page_bytes), 1, np.uint8)
        self.dst = np.zeros_like(self.src)
        self.next = 0

    def seconds(self, n: int) -> float:
        """The time of one batch of ``n`` page copies, timed whole."""
        span, i = len(self.src), self.next
        t = time.perf_counter()
        for k in range(i, i + n):
            np.copyto(self.dst[k % span], self.src[k % span])
        self.next = (i + n) % span
        return time.perf_counter() - t

    def best_seconds(self, n: int) -> float:
        """``n`` pages in batches of at most 64, best of BASELINE_REPEATS."""
        best = float("inf")
        for _ in range(BASELINE_REPEATS):
            best = min(best, sum(self.seconds(min(64, n - d)) for d in range(0, n, 64)))
        return best


def instance(rank: int, args, requests: list[list[str]], use_l3: bool, out) -> None:
    if use_l3:
        from tests.sglang_helpers import make_backend
    from tests.sglang_host import HostBuffer, page_indices
    host = HostBuffer("page_first_direct", page_size=args.page_size, num_pages=args.l2_pages,
                      layers=args.layers, heads=args.heads, dim=args.head_dim, seed=rank)
    backend = make_backend(args.pool, host, store_bytes=args.store_bytes) if use_l3 else None
    l2: OrderedDict[str, int] = OrderedDict()
    free = list(range(args.l2_pages))
    stats = {"pages": 0, "l2_hits": 0, "l3_hits": 0, "recomputed": 0, "get_s": 0.0,
             "set_s": 0.0, "get_bytes": 0, "set_bytes": 0, "memcpy_s": 0.0, "memcpy_bytes": 0}
    memcpy = Memcpy(backend.store.page_bytes, args.store_bytes) if backend is not None else None
    ps = args.page_size

    def slot_for(key: str) -> int:
        if free:
            p = free.pop()
        else:
            _, p = l2.popitem(last=False)
        l2[key] = p
        return p

    for keys in requests:
        stats["pages"] += len(keys)
        n = 0
        while n < len(keys) and keys[n] in l2:
            l2.move_to_end(keys[n])
            n += 1
        stats["l2_hits"] += n
        rest = keys[n:]
        if backend is not None and rest:
            hit = backend.batch_exists(rest)
            if hit:
                indices = page_indices([slot_for(k) for k in rest[:hit]], ps)
                t = time.perf_counter()
                got = backend.batch_get_v1(rest[:hit], indices)
                stats["get_s"] += time.perf_counter() - t
                stats["get_bytes"] += sum(got) * backend.store.page_bytes
                # the same pages memcpy'd right after, as one batch: the same moment's load
                stats["memcpy_s"] += memcpy.seconds(sum(got))
                stats["memcpy_bytes"] += sum(got) * backend.store.page_bytes
                hit = got.index(False) if False in got else hit
                for k in rest[hit:len(got)]:
                    free.append(l2.pop(k))
            stats["l3_hits"] += hit
            rest = rest[hit:]
        stats["recomputed"] += len(rest)
        slots = [slot_for(k) for k in rest]
        if backend is not None and rest:
            indices = page_indices(slots, ps)
            t = time.perf_counter()
            backend.batch_set_v1(rest, indices)
            stats["set_s"] += time.perf_counter() - t
            stats["set_bytes"] += len(rest) * backend.store.page_bytes
            stats["memcpy_s"] += memcpy.seconds(len(rest))
            stats["memcpy_bytes"] += len(rest) * backend.store.page_bytes
    if backend is not None:
        pages = stats["memcpy_bytes"] // backend.store.page_bytes
        stats["memcpy_best_s"] = memcpy.best_seconds(pages) if pages else 0.0
        stats.update(backend.counters())
        backend.close()
    out.put((rank, stats))


class _Box:
    """A queue's ``put`` for an instance run in this process."""

    def __init__(self) -> None:
        self.items: list = []

    def put(self, item) -> None:
        self.items.append(item)


def run_phase(args, per_instance, use_l3: bool) -> dict:
    load = os.getloadavg()[0]
    if not use_l3:  # private L2 only: nothing is shared, the instances need no processes
        box = _Box()
        for r in range(args.instances):
            instance(r, args, per_instance[r], False, box)
        results = box.items
    else:
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        procs = [ctx.Process(target=instance, args=(r, args, per_instance[r], True, out))
                 for r in range(args.instances)]
        for p in procs:
            p.start()
        results = [out.get(timeout=600) for _ in procs]
        for p in procs:
            p.join(60)
            if p.exitcode != 0:
                raise SystemExit(f"instance exited with {p.exitcode}")
    tot = {k: sum(s.get(k, 0) for _, s in results) for k in results[0][1]}
    memcpy = tot["memcpy_bytes"] / tot["memcpy_s"] / 1e9 if tot["memcpy_s"] else 0.0
    best = tot["memcpy_bytes"] / tot["memcpy_best_s"] / 1e9 if tot.get("memcpy_best_s") else 0.0
    get_gbps = tot["get_bytes"] / tot["get_s"] / 1e9 if tot["get_s"] else 0.0
    set_gbps = tot["set_bytes"] / tot["set_s"] / 1e9 if tot["set_s"] else 0.0
    return {"phase": "l3" if use_l3 else "l2", "instances": args.instances,
            "pages": tot["pages"], "l2_hits": tot["l2_hits"], "l3_hits": tot["l3_hits"],
            "recomputed": tot["recomputed"],
            "hit_rate": round((tot["l2_hits"] + tot["l3_hits"]) / tot["pages"], 4),
            "get_gbps": round(get_gbps, 3), "set_gbps": round(set_gbps, 3),
            "memcpy_gbps": round(memcpy, 3), "memcpy_best_gbps": round(best, 3),
            "get_vs_memcpy": round(get_gbps / memcpy, 3) if memcpy else 0.0,
            "set_vs_memcpy": round(set_gbps / memcpy, 3) if memcpy else 0.0,
            "stored_pages": tot.get("stored_pages", 0),
            "loadavg_1m": round((load + os.getloadavg()[0]) / 2, 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", help="a Mooncake trace (JSONL); default: a synthetic one")
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--l2-pages", type=int, default=256)
    ap.add_argument("--store-bytes", type=int, default=1 << 30)
    ap.add_argument("--quick", action="store_true", help="a small run for CI (~20 s)")
    args = ap.parse_args(argv)
    if args.quick:
        args.instances, args.requests, args.layers, args.l2_pages = 2, 60, 2, 64
        args.store_bytes = 64 << 20
    from shmkv.serve.trace import read_mooncake
    args.pool = f"bench-sgl-{os.getpid()}"
    with tempfile.TemporaryDirectory() as tmp:
        path = args.trace
        if path is None:
            path = os.path.join(tmp, "synthetic.jsonl")
            synthetic_trace(path, args.requests, seed=0)
        reqs, _ = read_mooncake(path, block_size=args.page_size, vocab_size=32000,
                                max_model_len=1 << 20)
    reqs = reqs[:args.requests]
    per = [[] for _ in range(args.instances)]
    for i, r in enumerate(reqs):
        per[i % args.instances].append(page_keys(list(r.prompt_token_ids), args.page_size))
    from tests.sglang_host import remove_store
    rows = []
    try:
        for use_l3 in (False, True):
            row = run_phase(args, per, use_l3)
            row.update(trace=args.trace or "synthetic", requests=len(reqs))
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:
        remove_store(args.pool)
    cols = ["phase", "pages", "l2_hits", "l3_hits", "recomputed", "hit_rate", "get_gbps",
            "set_gbps", "memcpy_gbps", "get_vs_memcpy", "set_vs_memcpy", "memcpy_best_gbps",
            "loadavg_1m"]
    print(" | ".join(cols))
    for row in rows:
        print(" | ".join(str(row[c]) for c in cols))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
