"""Four data-parallel replicas with vLLM's CPU offload tier: four private
``CPUOffloadingManager``s (vLLM 0.33.0, LRU) against ONE ``SharedCPUOffloadingManager`` of
the same total size, on the chat workload of ``shmkv run``, in the same run.

Each replica keeps a GPU prefix cache too small to hold the shared system prompts (an LRU
of ``--gpu-blocks`` blocks). A request goes to a random replica (a load balancer that does
not know the caches), as vLLM's scheduler with the ``OffloadingConnector`` handles it: the
leading blocks its GPU cache holds are hits; then the offload tier is looked up block by
block (``lookup``) and the leading tier hits are loaded (``prepare_load`` /
``complete_load``) instead of recomputed; the request's other full blocks are offloaded
(``prepare_store`` / ``complete_store``) and its GPU cache updated; ``on_request_finished``.
Keys are vLLM-style offload keys: chained sha256 block hashes (the tenant's salt in the
first block) with group 0; ``--block-size`` tokens per block, one block per chunk.

Reported per setup: the tier's hit rate (blocks found in the tier / blocks looked up
there), the prefill tokens the tier saved, and the mean cost of one call of ``lookup``,
``prepare_store`` and ``complete_store`` in ns (wall clock around each call). The shared
tier's four replicas are four managers attached to one pool in this process: calls of
several processes are serialised by the pool lock anyway, so one process shows the same
cache behaviour (the lock is uncontended here: see bench_contention.py for contention).

    python benchmarks/bench_vllm_offload.py [--conversations 240] [--tier-chunks 256]
        [--gpu-blocks 24] [--replicas 4] [--block-size 16] [--seed 0] [--quick]

Prints one JSON line per setup, then a table; ratios are shared over private for tokens
saved and hit rate, and vLLM's ns over shmkv's for the per-call costs (above 1: shmkv is
faster).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import time
import uuid
from collections import OrderedDict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key  # noqa: E402
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager  # noqa: E402

from shmkv.serve.workload import ChatWorkloadConfig, chat_workload  # noqa: E402
from shmkv.vllm import SharedCPUOffloadingManager  # noqa: E402

CALLS = ("lookup", "prepare_store", "complete_store")


def block_keys(tokens: list[int], block_size: int, salt: str | None) -> list[bytes]:
    """Offload keys of the full blocks of ``tokens``: chained sha256, salt in block 0."""
    keys, parent = [], (salt or "").encode()
    for start in range(0, len(tokens) - block_size + 1, block_size):
        digest = hashlib.sha256(parent + bytes(str(tokens[start:start + block_size]), "ascii"))
        parent = digest.digest()
        keys.append(make_offload_key(parent, 0))
    return keys


def make_requests(args) -> list[tuple[str, list[int], str | None]]:
    """(request id, full prompt tokens, salt) in arrival order: each turn resends its
    conversation's history (earlier prompts and generated tokens)."""
    cfg = ChatWorkloadConfig(num_conversations=args.conversations, seed=args.seed,
                             system_prompt_tokens=(96, 224))
    history: dict[str, list[int]] = {}
    rng = random.Random(args.seed + 1)
    out = []
    for req in chat_workload(cfg):
        prompt = history.get(req.conversation, []) + req.prompt_token_ids
        out.append((req.request_id, prompt, req.cache_salt))
        generated = [rng.randrange(1, cfg.vocab_size) for _ in range(req.max_tokens)]
        history[req.conversation] = prompt + generated
    return out


class Timer:
    def __init__(self) -> None:
        self.ns = dict.fromkeys(CALLS, 0)
        self.calls = dict.fromkeys(CALLS, 0)

    def add(self, what: str, t0: int) -> None:
        self.ns[what] += time.perf_counter_ns() - t0
        self.calls[what] += 1

    def mean_ns(self) -> dict[str, float]:
        return {c: self.ns[c] / self.calls[c] if self.calls[c] else 0.0 for c in CALLS}


def simulate(managers: list, requests, args, timer: Timer) -> dict:
    """Runs the workload over one manager per replica; returns the tier's figures."""
    rng = random.Random(args.seed + 2)
    gpu = [OrderedDict() for _ in managers]  # per replica: key -> None, LRU order
    looked_up = tier_hits = gpu_hits = total_blocks = 0
    for request_id, tokens, salt in requests:
        r = rng.randrange(len(managers))
        manager, cache = managers[r], gpu[r]
        keys = block_keys(tokens, args.block_size, salt)
        total_blocks += len(keys)
        ctx = ReqContext(request_id)
        for position, key in enumerate(keys):
            ctx.set_offload_key_position(key, (position + 1) * args.block_size)
        manager.on_new_request(ctx)
        num_gpu = 0
        while num_gpu < len(keys) and keys[num_gpu] in cache:
            num_gpu += 1
        gpu_hits += num_gpu
        hits = []
        with manager.lock:
            for key in keys[num_gpu:]:
                t0 = time.perf_counter_ns()
                result = manager.lookup(key, ctx)
                timer.add("lookup", t0)
                looked_up += 1
                if result != LookupResult.HIT:
                    break
                hits.append(key)
            if hits:
                manager.prepare_load(hits, ctx)
        tier_hits += len(hits)
        if keys[:num_gpu]:
            manager.touch(keys[:num_gpu], ctx)
        if hits:
            manager.complete_load(hits, ctx)
        new = keys[num_gpu + len(hits):]
        if new:
            t0 = time.perf_counter_ns()
            out = manager.prepare_store(new, ctx)
            timer.add("prepare_store", t0)
            if out is not None and out.keys_to_store:
                t0 = time.perf_counter_ns()
                manager.complete_store(out.keys_to_store, ctx)
                timer.add("complete_store", t0)
        manager.on_request_finished(ctx)
        for key in keys:
            cache[key] = None
            cache.move_to_end(key)
        while len(cache) > args.gpu_blocks:
            cache.popitem(last=False)
    return {
        "blocks": total_blocks,
        "gpu_hit_blocks": gpu_hits,
        "tier_lookups": looked_up,
        "tier_hit_blocks": tier_hits,
        "tier_hit_rate": tier_hits / looked_up if looked_up else 0.0,
        "prefill_tokens_saved": tier_hits * args.block_size,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=240)
    p.add_argument("--tier-chunks", type=int, default=256, help="total, all replicas")
    p.add_argument("--gpu-blocks", type=int, default=24, help="per replica")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    args = p.parse_args(argv)
    if args.quick:
        args.conversations, args.tier_chunks, args.gpu_blocks = 24, 64, 8
    if args.tier_chunks % args.replicas:
        p.error(f"--tier-chunks {args.tier_chunks} is not a multiple of --replicas "
                f"{args.replicas}")
    requests = make_requests(args)
    per_replica = args.tier_chunks // args.replicas
    rows = []

    timer = Timer()
    private = [CPUOffloadingManager(per_replica, cache_policy="lru")
               for _ in range(args.replicas)]
    figures = simulate(private, requests, args, timer)
    rows.append({"setup": "private", "impl": "vllm", "replicas": args.replicas,
                 "tier_chunks": args.tier_chunks, "chunks_per_tier": per_replica,
                 **figures, **{f"{c}_ns": round(v) for c, v in timer.mean_ns().items()}})

    name = f"bench-vo-{uuid.uuid4().hex[:8]}"
    shared = [SharedCPUOffloadingManager(name, args.tier_chunks, label=f"replica{i}")
              for i in range(args.replicas)]
    try:
        timer = Timer()
        figures = simulate(shared, requests, args, timer)
        shared[0].pool.check_invariants()
    finally:
        for manager in shared:
            manager.close()
        SharedCPUOffloadingManager.unlink(name)
    rows.append({"setup": "shared", "impl": "shmkv", "replicas": args.replicas,
                 "tier_chunks": args.tier_chunks, "chunks_per_tier": args.tier_chunks,
                 **figures, **{f"{c}_ns": round(v) for c, v in timer.mean_ns().items()}})

    for row in rows:
        print(json.dumps(row))
    priv, shar = rows
    print()
    print(f"{args.replicas} replicas, {len(requests)} requests, {priv['blocks']} blocks, "
          f"tier {args.tier_chunks} chunks in all, GPU cache {args.gpu_blocks} blocks each")
    header = f"{'':24}{'private (vLLM)':>16}{'shared (shmkv)':>16}{'ratio':>10}"
    print(header)
    print("-" * len(header))

    def line(label, a, b, ratio):
        print(f"{label:24}{a:>16}{b:>16}{ratio:>10}")

    def ratio(x, y):
        return f"{x / y:.2f}x" if y else "-"

    line("tier hit rate", f"{priv['tier_hit_rate']:.3f}", f"{shar['tier_hit_rate']:.3f}",
         ratio(shar["tier_hit_rate"], priv["tier_hit_rate"]))
    line("prefill tokens saved", f"{priv['prefill_tokens_saved']:,}",
         f"{shar['prefill_tokens_saved']:,}",
         ratio(shar["prefill_tokens_saved"], priv["prefill_tokens_saved"]))
    for call in CALLS:
        line(f"{call} ns/call", f"{priv[call + '_ns']:,}", f"{shar[call + '_ns']:,}",
             ratio(priv[call + "_ns"], shar[call + "_ns"]))
    print("(ratios: shared/private for hits and tokens; vLLM/shmkv for ns, above 1 = shmkv "
          "faster)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
