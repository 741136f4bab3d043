"""``shmkv run`` on a device: the shared device placement against private pools of the same
blocks in all, and the host placement, on one workload with the same model.

Rows (each one ``Runner`` run, the figures of ``shmkv run --json``):

- ``device, shared``: one KV tensor per GPU for the pool, every rank attending over it in
  place (opened through CUDA IPC);
- ``device, private``: one pool and one tensor per scheduler, 1/N of the blocks each (what
  vLLM, SGLang and TensorRT-LLM do per data-parallel rank);
- ``host, shared``: the node-wide store in pinned shared memory, each rank keeping a cache
  of its running requests' blocks on the GPU and copying hits in and completed blocks out.

Columns: requests/s, TTFT p50 and p99, prefill tokens computed (prompt tokens less those a
prefix hit covered), the most GPU memory in use by every process (sampled by the front end
every 0.1 s; '-' on the CPU), and the token check (mismatches against the no-cache
reference; in bfloat16 greedy flips are reported with the reference's logit gap).

Prints one JSON line per row, then a table. The serve part of ``bench_gpu.py``, standalone:

    python benchmarks/bench_gpu_serve.py                  # --device cuda --model small
    python benchmarks/bench_gpu_serve.py --quick          # CPU, tiny model, seconds
    python benchmarks/bench_gpu_serve.py --device cuda --model small --dtype float32 \\
        --schedulers 4 --conversations 90 --blocks 2048 --json out.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_serve import markdown_table  # noqa: E402

from shmkv.serve.device import resolve_run_device  # noqa: E402
from shmkv.serve.runner import RunConfig, Runner  # noqa: E402
from shmkv.serve.small_model import model_config_for  # noqa: E402
from shmkv.serve.workload import ChatWorkloadConfig, chat_workload  # noqa: E402

ROWS = (("device", "shared"), ("device", "private"), ("host", "shared"))
KEEP = ("device", "kv", "dtype", "pool", "schedulers", "num_blocks", "requests",
        "requests_total", "requests_per_s", "ttft_p50_s", "ttft_p99_s", "prompt_tokens",
        "prefill_tokens_saved", "prefill_tokens_computed", "prefix_hit_rate",
        "peak_device_memory_bytes", "tokens_checked", "token_mismatches", "exact_tokens",
        "max_logit_gap", "wall_s", "startup_s", "problems")


def run_row(kv: str, pool: str, args, workload) -> dict:
    run = resolve_run_device(args.device, kv, args.dtype, args.model)
    cfg = RunConfig(num_schedulers=args.schedulers, pool=pool, routing="round-robin",
                    num_blocks=args.blocks,
                    max_model_len=args.max_model_len, concurrency=args.concurrency,
                    model=model_config_for(args.model), run_device=run,
                    startup_timeout_s=args.startup_timeout)
    result = Runner(cfg, workload, log=lambda _: None).run()
    f = {k: result.figures.get(k) for k in KEEP}
    f["row"] = f"{kv}, {pool}"
    f["bench"] = "gpu_serve"
    f["model"] = args.model
    return f


def _gib(n) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def table(rows: list[dict]) -> str:
    header = ["kv, pool", "req/s", "TTFT p50 ms", "TTFT p99 ms", "prefill computed",
              "hit rate", "GPU GiB", "mismatches", "wall s"]
    body = [[r["row"], f"{r['requests_per_s']:.2f}", f"{r['ttft_p50_s'] * 1e3:.0f}",
             f"{r['ttft_p99_s'] * 1e3:.0f}",
             f"{r['prefill_tokens_computed']:,} of {r['prompt_tokens']:,}",
             f"{r['prefix_hit_rate']:.1%}", _gib(r["peak_device_memory_bytes"]),
             f"{r['token_mismatches']}" + ("" if r["exact_tokens"] else " (bf16, reported)"),
             f"{r['wall_s']:.1f}"] for r in rows]
    return markdown_table(header, body)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default="small", choices=["tiny", "small"])
    p.add_argument("--dtype", default=None, help="float32 or bfloat16 (bf16 for small on "
                   "a GPU, float32 otherwise)")
    p.add_argument("--schedulers", type=int, default=4)
    p.add_argument("--conversations", type=int, default=60)
    p.add_argument("--blocks", type=int, default=1024,
                   help="KV blocks in all (private pools: 1/N each)")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--quick", action="store_true",
                   help="CPU, tiny model, 2 schedulers, 6 conversations (a smoke run)")
    p.add_argument("--json", metavar="PATH", help="also write the JSON lines here")
    args = p.parse_args(argv)
    if args.quick:
        args.device, args.model, args.schedulers = "cpu", "tiny", 2
        args.conversations, args.blocks = 6, 256
    model = model_config_for(args.model)
    resolve_run_device(args.device, None, args.dtype, args.model)  # refuse before any run
    workload = chat_workload(ChatWorkloadConfig(num_conversations=args.conversations,
                                                vocab_size=model.vocab_size))
    rows = []
    for kv, pool in ROWS:
        rows.append(run_row(kv, pool, args, workload))
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        Path(args.json).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print()
    print(f"shmkv run --device {rows[0]['device']} --model {args.model} --dtype "
          f"{rows[0]['dtype']}: {args.schedulers} schedulers, {args.blocks:,} blocks in all, "
          f"{len(workload)} requests")
    print(table(rows))
    bad = [r["row"] for r in rows if r["problems"] or r["requests"] < r["requests_total"]
           or (r["exact_tokens"] and r["token_mismatches"])]
    if bad:
        print(f"problems in: {', '.join(bad)}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
