"""The offload tier's calls against the tier's size: vLLM 0.33.0's ``CPUOffloadingManager``
(LRU) and shmkv's ``SharedCPUOffloadingManager``, side by side in one run, at every size.

For each tier size the tier is filled (every chunk stored and ready), then each call is
timed on its own (wall clock around the call, one process, the pool lock uncontended),
with 16 keys per call as a scheduler step of one request would pass them:

- ``lookup``: one key that is stored (the mean of 16 lookups);
- ``lookup_walk``: a request's 16 stored keys looked up in order inside the manager's
  ``lock``, as vLLM's connector walks them in a scheduler step (the keys carry the request's
  positions; per key, the mean of the walk);
- ``prepare_store``: 16 new keys on a full tier (16 evictions), then ``complete_store``;
- ``prepare_load``: 16 stored keys, then ``complete_load``.

Every shmkv call takes the node-wide pool lock once and holds it for about the call's
length, so shmkv's column is also the lock held per call.

    python benchmarks/bench_vllm_tier_scale.py [--sizes 1024,16384,131072,524288]
        [--reps 200] [--quick]

Prints one JSON line per (size, call), then a table with vLLM's time over shmkv's (above
1: shmkv is faster).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm.v1.kv_offload.base import ReqContext, make_offload_key  # noqa: E402
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager  # noqa: E402

from shmkv.vllm import SharedCPUOffloadingManager  # noqa: E402

KEYS_PER_CALL = 16
FILL_BATCH = 4096
CALLS = ("lookup", "lookup_walk", "prepare_store", "complete_store", "prepare_load",
         "complete_load")


def offload_key(i: int) -> bytes:
    return make_offload_key(hashlib.sha256(i.to_bytes(8, "little")).digest(), 0)


def fill(manager, num_chunks: int) -> None:
    ctx = ReqContext("fill")
    for start in range(0, num_chunks, FILL_BATCH):
        keys = [offload_key(i) for i in range(start, min(start + FILL_BATCH, num_chunks))]
        out = manager.prepare_store(keys, ctx)
        manager.complete_store(out.keys_to_store, ctx)


def measure(manager, num_chunks: int, reps: int) -> dict[str, list[float]]:
    """Per-call times in microseconds; the tier is full, keys stored are 0..num_chunks-1
    at first, new keys count up from num_chunks."""
    times: dict[str, list[float]] = {call: [] for call in CALLS}
    ctx = ReqContext("bench")
    next_key = num_chunks
    stored = list(range(num_chunks))  # stored keys, oldest first (LRU evicts from the front)
    for rep in range(reps):
        probe = [offload_key(stored[-1 - (rep * KEYS_PER_CALL + j) % (num_chunks // 2)])
                 for j in range(KEYS_PER_CALL)]
        for key in probe:
            t0 = time.perf_counter_ns()
            manager.lookup(key, ctx)
            times["lookup"].append((time.perf_counter_ns() - t0) / 1e3)
        walker = ReqContext(f"walk-{rep}")
        walk = probe[::-1]  # oldest first, as a prompt's chunks
        for i, key in enumerate(walk):
            walker.set_offload_key_position(key, (i + 1) * 16)
        t0 = time.perf_counter_ns()
        with manager.lock:
            for key in walk:
                manager.lookup(key, walker)
        times["lookup_walk"].append((time.perf_counter_ns() - t0) / 1e3 / len(walk))
        t0 = time.perf_counter_ns()
        spec = manager.prepare_load(probe, ctx)
        times["prepare_load"].append((time.perf_counter_ns() - t0) / 1e3)
        t0 = time.perf_counter_ns()
        manager.complete_load(probe, ctx)
        times["complete_load"].append((time.perf_counter_ns() - t0) / 1e3)
        assert len(spec.block_ids) == KEYS_PER_CALL
        new = [offload_key(next_key + j) for j in range(KEYS_PER_CALL)]
        t0 = time.perf_counter_ns()
        out = manager.prepare_store(new, ctx)
        times["prepare_store"].append((time.perf_counter_ns() - t0) / 1e3)
        t0 = time.perf_counter_ns()
        manager.complete_store(out.keys_to_store, ctx)
        times["complete_store"].append((time.perf_counter_ns() - t0) / 1e3)
        assert len(out.evicted_keys) == KEYS_PER_CALL
        stored.extend(range(next_key, next_key + KEYS_PER_CALL))
        next_key += KEYS_PER_CALL
    return times


def run_size(num_chunks: int, reps: int) -> list[dict]:
    vllm = CPUOffloadingManager(num_chunks=num_chunks, cache_policy="lru")
    pool = f"bench-scale-{uuid.uuid4().hex[:8]}"
    shared = SharedCPUOffloadingManager(pool, num_chunks, event_log_bytes=0)
    try:
        rows = []
        results = {}
        for name, manager in (("vllm", vllm), ("shmkv", shared)):
            t0 = time.perf_counter()
            fill(manager, num_chunks)
            fill_s = time.perf_counter() - t0
            results[name] = (measure(manager, num_chunks, reps), fill_s)
        for call in CALLS:
            ours = statistics.median(results["shmkv"][0][call])
            theirs = statistics.median(results["vllm"][0][call])
            rows.append({"bench": "vllm_tier_scale", "num_chunks": num_chunks, "call": call,
                         "keys_per_call": 1 if call.startswith("lookup") else KEYS_PER_CALL,
                         "vllm_us": round(theirs, 2), "shmkv_us": round(ours, 2),
                         "vllm_over_shmkv": round(theirs / ours, 3),
                         "fill_s": {k: round(v[1], 2) for k, v in results.items()}})
        shared.pool.check_invariants()
        return rows
    finally:
        shared.close()
        SharedCPUOffloadingManager.unlink(pool)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1024,16384,131072,524288",
                   help="tier sizes in chunks, comma-separated")
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    args = p.parse_args()
    sizes = [256, 1024] if args.quick else [int(s) for s in args.sizes.split(",")]
    reps = 20 if args.quick else args.reps
    rows = []
    for size in sizes:
        for row in run_size(size, reps):
            print(json.dumps(row), flush=True)
            rows.append(row)
    print(f"\nmedian per call, us ({KEYS_PER_CALL} keys; lookup: one key; lookup_walk: per key "
          "of a step's walk), tier full")
    print(f"{'chunks':>8} {'call':<15} {'vLLM':>9} {'shmkv':>9} {'vLLM/shmkv':>11}")
    for r in rows:
        print(f"{r['num_chunks']:>8} {r['call']:<15} {r['vllm_us']:>9.1f} {r['shmkv_us']:>9.1f} "
              f"{r['vllm_over_shmkv']:>11.2f}")


if __name__ == "__main__":
    main()
