"""The shared pool against the routers users run: one workload, every configuration side
by side in one run of this script (model-free replay, times from the replay's cost model).

Rows (``--rows``): the shared pool with least-loaded, round-robin and prefix-aware routing;
private pools (1/N of the blocks each) with round-robin, least-loaded, the prefix-aware
oracle, SGLang's cache-aware router and llm-d's scorers. Prints one JSON line per row (the
figures of ``shmkv replay --json`` less the timeline and the per-scheduler lines), then a
Markdown table: hit rate, time to the first token p50 / p99, time queued p99, imbalance
(most / fewest requests per scheduler), the share of prompt tokens computed twice (another
request cached them while this one computed them), and each row against the best baseline router of
the same run (the private-pool row of SGLang's or llm-d's router with the lower TTFT p99):
hit rate in points, TTFT p99 as a ratio.

Workloads (``--workload``): ``hot-prompts`` (Zipf-popular system prompts, Poisson arrivals
at ``--request-rate``, honoured at ``--time-scale 1``), ``chat`` (the built-in chat
workload), ``mooncake`` (``--trace`` a Mooncake trace, its first ``--requests`` lines at
their own timestamps times ``--time-scale``). ``--restart one|rolling`` restarts schedulers
in every row (a private replica comes back with an empty pool).

    python benchmarks/bench_routers.py --workload hot-prompts --requests 3000 \\
        --request-rate 350 --time-scale 1 --blocks 1024
    python benchmarks/bench_routers.py --workload mooncake --trace conversation_trace.jsonl \\
        --requests 3000 --time-scale 0.03 --blocks 8192
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shmkv.serve.config import TinyModelConfig  # noqa: E402
from shmkv.serve.replay import CostModel  # noqa: E402
from shmkv.serve.report import best_baseline  # noqa: E402
from shmkv.serve.runner import RunConfig, Runner  # noqa: E402
from shmkv.serve.trace import read_mooncake  # noqa: E402
from shmkv.serve.workload import (  # noqa: E402
    ChatWorkloadConfig,
    HotPromptsConfig,
    chat_workload,
    hot_prompts_workload,
)

ROWS = ("shared:least-loaded,shared:round-robin,shared:prefix-aware,private:round-robin,"
        "private:least-loaded,private:prefix-aware,private:sglang-cache-aware,"
        "private:llm-d-scorer")
DROP = ("timeline", "per_scheduler", "processes", "pools_after", "model")


def make_workload(args, model):
    if args.workload == "hot-prompts":
        return hot_prompts_workload(HotPromptsConfig(
            num_requests=args.requests, request_rate=args.request_rate, zipf_s=args.zipf,
            seed=args.seed, vocab_size=model.vocab_size))
    if args.workload == "chat":
        return chat_workload(ChatWorkloadConfig(num_conversations=args.conversations,
                                                seed=args.seed, vocab_size=model.vocab_size))
    if not args.trace:
        raise SystemExit("--workload mooncake needs --trace PATH (docs/serving.md says where "
                         "to fetch the public traces)")
    workload, _ = read_mooncake(args.trace, block_size=16, vocab_size=model.vocab_size,
                                max_model_len=args.max_model_len)
    return workload[:args.requests] if args.requests else workload


def run_row(pool: str, routing: str, args, workload, model) -> dict:
    cfg = RunConfig(num_schedulers=args.schedulers, pool=pool, routing=routing,
                    num_blocks=args.blocks, max_model_len=args.max_model_len,
                    concurrency=args.concurrency, model=model, model_free=True,
                    time_scale=args.time_scale, timeout_s=args.timeout,
                    restart="" if args.restart == "none" else args.restart,
                    cost=CostModel(args.prefill_ms_per_token, args.decode_ms_per_step))
    result = Runner(cfg, workload, log=lambda _: None).run()
    f = {k: v for k, v in result.figures.items() if k not in DROP}
    f["workload"] = args.workload
    return f


def markdown_table(rows: list[dict]) -> str:
    base = best_baseline(rows)
    header = ["pool, routing", "hit rate", "TTFT p50 ms", "TTFT p99 ms", "queued p99 ms",
              "imbalance", "computed twice", "hit rate vs best baseline",
              "TTFT p99 vs best baseline"]
    body = []
    for f in rows:
        imb = f["imbalance"]
        vs_hit = vs_ttft = "-"
        if base is not None:
            vs_hit = f"{100 * (f['prefix_hit_rate'] - base['prefix_hit_rate']):+.1f} pt"
            vs_ttft = (f"{f['ttft_p99_s'] / base['ttft_p99_s']:.2f}x"
                       if base["ttft_p99_s"] > 0 else "-")
        name = f"{f['pool']}, {f['routing']}" + (" (best baseline)" if f is base else "")
        body.append([name, f"{f['prefix_hit_rate']:.1%}", f"{f['ttft_p50_s'] * 1e3:,.0f}",
                     f"{f['ttft_p99_s'] * 1e3:,.0f}", f"{f['queued_p99_s'] * 1e3:,.0f}",
                     "inf" if imb is None else f"{imb:.2f}x",
                     f"{f.get('duplicate_prefill_tokens', 0) / max(f['prompt_tokens'], 1):.1%}",
                     vs_hit, vs_ttft])
    widths = [max(len(x[i]) for x in [header, *body]) for i in range(len(header))]
    lines = ["| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths, strict=True))) + " |"
             for row in [header, *body]]
    lines.insert(1, "|" + "|".join("-" * (w + 1) + (":" if i else "-")
                                   for i, w in enumerate(widths)) + "|")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=["hot-prompts", "chat", "mooncake"],
                   default="hot-prompts")
    p.add_argument("--trace", help="mooncake: the trace file")
    p.add_argument("--requests", type=int, default=3000,
                   help="hot-prompts: requests; mooncake: the first N lines (0: all) (3000)")
    p.add_argument("--request-rate", type=float, default=350.0,
                   help="hot-prompts: arrivals a second at --time-scale 1 (350)")
    p.add_argument("--zipf", type=float, default=1.0, help="hot-prompts: Zipf exponent (1)")
    p.add_argument("--conversations", type=int, default=90, help="chat: conversations (90)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="arrivals at X times their timestamps (0: closed loop) (1)")
    p.add_argument("--schedulers", type=int, default=4)
    p.add_argument("--blocks", type=int, default=1024, help="in all (1024)")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--concurrency", type=int, default=256,
                   help="requests in flight at most, in all (256: arrivals decide)")
    p.add_argument("--prefill-ms-per-token", type=float, default=0.1)
    p.add_argument("--decode-ms-per-step", type=float, default=1.0)
    p.add_argument("--timeout", type=float, default=300.0, help="per row, seconds (300)")
    p.add_argument("--restart", choices=["none", "one", "rolling"], default="none",
                   help="in every row: restart the highest scheduler half way (one) or every "
                   "scheduler in turn (rolling); a private replica loses its cache (none)")
    p.add_argument("--rows", default=ROWS, help="pool:routing,... (all eight)")
    args = p.parse_args(argv)
    CostModel(args.prefill_ms_per_token, args.decode_ms_per_step).validate()
    model = TinyModelConfig()
    workload = make_workload(args, model)
    rows = []
    for item in args.rows.split(","):
        pool, _, routing = item.partition(":")
        f = run_row(pool, routing, args, workload, model)
        print(json.dumps(f), flush=True)
        rows.append(f)
        if f["problems"]:
            print(f"problems: {f['problems']}", file=sys.stderr)
            return 1
    cmd = "python benchmarks/bench_routers.py " + shlex.join(sys.argv[1:] if argv is None
                                                              else argv)
    print(f"\n{cmd}\n\n{args.workload}: {len(workload):,} requests, {args.schedulers} "
          f"schedulers, {args.blocks:,} blocks in all, cost model "
          f"{args.prefill_ms_per_token:g} ms per prefill token + {args.decode_ms_per_step:g} "
          "ms per step" + ("" if args.restart == "none" else f", restart: {args.restart}")
          + ":\n")
    print(markdown_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
