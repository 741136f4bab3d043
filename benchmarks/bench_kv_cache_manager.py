"""Continuous batching through a KVCacheManager: shmkv's (over a shared pool) and vLLM
0.33.0's, in the same run, on the same request stream.

Workload (issue 5): 1,000 requests of 512 prompt tokens that share a 256-token system prompt,
32 decode tokens each, at most 64 running. Each step admits waiting requests while fewer than
64 run (``get_computed_blocks`` + ``allocate_slots`` of the whole prompt), then gives every
running request one decode token (``allocate_slots(req, 1)``, timed on its own); a request
that has decoded 32 tokens is freed. Requests are built (and their prompts hashed) before the
clock starts; decode tokens are appended, and hashed, inside the timed loop on both sides.

Decode calls are timed one by one and also split by what they did: the ones that needed no
new block (the request's last block still had room: 15 of 16 decode tokens at block size 16)
and the ones that did. The whole stream is run ``--repeats`` times per implementation,
alternating which goes first, each run on a fresh pool and manager; the medians are reported.

Prints one JSON line per implementation and run kind (requests/s, ns per decode
``allocate_slots``, ns per decode ``allocate_slots`` that needed no new block, hit rate) and
a table with the vLLM/shmkv ratios (above 1: shmkv is faster).

    python benchmarks/bench_kv_cache_manager.py [--requests 1000] [--repeats 3] [--no-vllm]
        [--kernel c|python] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shmkv import BlockPool, KVCacheManager, Request  # noqa: E402
from shmkv.core import kv_cache_interface as shm_specs  # noqa: E402

BS = 16


class BenchRequest(Request):
    """shmkv's Request plus the scheduler fields vLLM's manager reads."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.status = None
        self.num_preemptions = 0
        self.num_in_flight_tokens = 0
        self.skip_reading_prefix_cache = False


def make_requests(args, hasher, seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    system = [rng.randrange(32_000) for _ in range(args.system_tokens)]
    reqs = []
    for i in range(args.requests):
        tail = [rng.randrange(32_000) for _ in range(args.prompt_tokens - args.system_tokens)]
        reqs.append(BenchRequest(f"r{i}", system + tail, block_hasher=hasher))
    return reqs


def run(manager, reqs, args, running_status) -> dict:
    waiting = list(reversed(reqs))
    running: list[BenchRequest] = []
    decoded: dict[str, int] = {}
    decode_ns = 0
    decode_calls = 0
    # Decode calls that got no new block (the request's blocks already had room).
    no_block_ns = 0
    no_block_calls = 0
    hit_tokens = prompt_tokens = 0
    perf = time.perf_counter_ns
    gc.collect()
    t0 = perf()
    token = 7
    while waiting or running:
        manager.new_step_starts()
        while waiting and len(running) < args.max_running:
            r = waiting[-1]
            hit, n, _ = manager.get_computed_blocks(r)
            if manager.allocate_slots(r, r.num_tokens - n, n, hit) is None:
                break
            waiting.pop()
            hit_tokens += n
            prompt_tokens += r.num_tokens
            r.num_computed_tokens = r.num_tokens
            r.status = running_status
            running.append(r)
            decoded[r.request_id] = 0
        still = []
        for r in running:
            r.append_output_token_ids(token)
            t = perf()
            new = manager.allocate_slots(r, 1)
            dt = perf() - t
            decode_ns += dt
            decode_calls += 1
            if new is None:
                raise RuntimeError("decode did not fit: raise --num-blocks")
            if not any(new.blocks):
                no_block_ns += dt
                no_block_calls += 1
            r.num_computed_tokens += 1
            decoded[r.request_id] += 1
            if decoded[r.request_id] >= args.decode_tokens:
                manager.free(r)
            else:
                still.append(r)
        running = still
    elapsed_s = (perf() - t0) / 1e9
    return {
        "requests": len(reqs),
        "seconds": round(elapsed_s, 4),
        "requests_per_s": round(len(reqs) / elapsed_s, 1),
        "ns_per_decode_allocate_slots": round(decode_ns / max(decode_calls, 1), 1),
        "ns_per_decode_no_new_block": round(no_block_ns / max(no_block_calls, 1), 1),
        "decode_calls": decode_calls,
        "decode_no_new_block_calls": no_block_calls,
        "hit_rate": round(hit_tokens / max(prompt_tokens, 1), 4),
    }


def config(mod, num_blocks, dtype):
    spec = mod.FullAttentionSpec(block_size=BS, num_kv_heads=8, head_size=128, dtype=dtype)
    return mod.KVCacheConfig(num_blocks, [], [mod.KVCacheGroupSpec(["layer0"], spec)])


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--system-tokens", type=int, default=256)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--max-running", type=int, default=64)
    p.add_argument("--num-blocks", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3,
                   help="runs per implementation, alternating (medians reported)")
    p.add_argument("--kernel", default=None, help="shmkv kernel: c or python")
    p.add_argument("--no-vllm", action="store_true", help="benchmark shmkv only")
    p.add_argument("--json", metavar="PATH", default=None)
    return p.parse_args(argv)


def run_shmkv(args, kernel_box: list) -> dict:
    """One run on a fresh shared pool and manager."""
    name = f"bench-kvm-{uuid.uuid4().hex[:10]}"
    pool = BlockPool.create(name, args.num_blocks, hash_block_size=BS, kernel=args.kernel,
                            label="bench")
    try:
        kernel_box[:] = [pool.kernel]
        hasher = pool.make_block_hasher()
        ours = KVCacheManager(config(shm_specs, args.num_blocks, "float16"), block_pool=pool,
                              **COMMON)
        return run(ours, make_requests(args, hasher, 0), args, "RUNNING")
    finally:
        pool.close()
        BlockPool.unlink(name)


COMMON = {"max_model_len": 4096, "scheduler_block_size": BS, "hash_block_size": BS}


def vllm_runner(args):
    """A callable doing one vLLM run, or None when vLLM is not importable."""
    try:
        import torch
        from vllm.v1 import kv_cache_interface as vllm_specs
        from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager
        from vllm.v1.request import RequestStatus
    except Exception as exc:  # noqa: BLE001
        print(f"vLLM not importable ({exc}); shmkv only", file=sys.stderr)
        return None
    # The requests' hashes must be the ones shmkv's pool uses (the same request stream):
    # shmkv's hasher is built from a throwaway pool, outside the timed region.
    name = f"bench-kvm-h-{uuid.uuid4().hex[:10]}"
    pool = BlockPool.create(name, 16, hash_block_size=BS, label="bench-hasher")
    try:
        hasher = pool.make_block_hasher()
    finally:
        pool.close()
        BlockPool.unlink(name)

    def one() -> dict:
        theirs = VllmManager(config(vllm_specs, args.num_blocks, torch.float16), **COMMON)
        return run(theirs, make_requests(args, hasher, 0), args, RequestStatus.RUNNING)
    return one


def median_row(impl: str, runs: list[dict]) -> dict:
    keys = ("seconds", "requests_per_s", "ns_per_decode_allocate_slots",
            "ns_per_decode_no_new_block")
    row = {"impl": impl, **runs[0], "repeats": len(runs)}
    for k in keys:
        row[k] = statistics.median(r[k] for r in runs)
    return row


FIGURES = (
    ("requests/s (whole stream)", "requests_per_s"),
    ("ns per decode allocate_slots", "ns_per_decode_allocate_slots"),
    ("ns per decode allocate_slots, no new block", "ns_per_decode_no_new_block"),
)


def main(argv=None) -> int:
    args = parse_args(argv)
    kernel_box: list = ["?"]
    vllm_one = None if args.no_vllm else vllm_runner(args)
    ours_runs: list[dict] = []
    vllm_runs: list[dict] = []
    for i in range(args.repeats):
        order = [("shmkv", None), ("vllm", vllm_one)]
        if i % 2:
            order.reverse()
        for impl, fn in order:
            if impl == "shmkv":
                ours_runs.append(run_shmkv(args, kernel_box))
            elif fn is not None:
                vllm_runs.append(fn())
    rows = [median_row(f"shmkv[{kernel_box[0]}]", ours_runs)]
    if vllm_runs:
        rows.append(median_row("vllm", vllm_runs))
    if len(rows) == 2:
        ours_row, vllm_row = rows
        # vLLM's time over shmkv's: above 1, shmkv is faster.
        ratios = {
            "requests_per_s": ours_row["requests_per_s"] / vllm_row["requests_per_s"],
            "ns_per_decode_allocate_slots": (vllm_row["ns_per_decode_allocate_slots"]
                                             / ours_row["ns_per_decode_allocate_slots"]),
            "ns_per_decode_no_new_block": (vllm_row["ns_per_decode_no_new_block"]
                                           / ours_row["ns_per_decode_no_new_block"]),
        }
        ours_row["ratio_vllm_time_over_shmkv"] = {k: round(v, 3) for k, v in ratios.items()}
    for r in rows:
        print(json.dumps(r), flush=True)
    if args.json:
        Path(args.json).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print()
    print(f"{args.requests} requests, {args.prompt_tokens} prompt tokens "
          f"({args.system_tokens} shared), {args.decode_tokens} decode tokens, "
          f"{args.max_running} running; median of {args.repeats} runs")
    head = f"{'figure':<44} {rows[0]['impl']:>12}"
    if len(rows) == 2:
        head += f" {'vllm':>12} {'vLLM/shmkv time':>16}"
    print(head)
    for label, key in FIGURES:
        line = f"{label:<44} {rows[0][key]:>12.1f}"
        if len(rows) == 2:
            line += f" {rows[1][key]:>12.1f} {ratios[key]:>15.2f}x"
        print(line)
    print(f"{'hit rate':<44} {rows[0]['hit_rate']:>12.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
