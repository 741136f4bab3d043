"""What sharing one pool buys: ``shmkv run`` on one workload, shared pool against private
pools (one per scheduler, 1/N of the blocks: what vLLM, SGLang and TensorRT-LLM do per
data-parallel rank), under each routing policy, and against one scheduler with one pool
serving everything. Same workload, same total number of blocks, same model in every row.

Prints one JSON line per run (the figures of ``shmkv run --json`` less the timeline), then a
table (with ``--repeats N``: each row's median hit rate over N runs, and its range; the
schedulers' timing makes a shared pool's hits vary by a point or two between runs);
``--plot`` draws the hit rates as bars (with matplotlib; without it, one line says so).

    python benchmarks/bench_serve.py [--schedulers 4] [--blocks 512] [--conversations 90]
        [--rows shared:round-robin,private:prefix-aware,...] [--repeats N] [--plot PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shmkv.plot import PlotUnavailable  # noqa: E402
from shmkv.serve.model import TinyModelConfig  # noqa: E402
from shmkv.serve.runner import RunConfig, Runner  # noqa: E402
from shmkv.serve.workload import ChatWorkloadConfig, chat_workload  # noqa: E402

ROWS = ("shared:round-robin,shared:least-loaded,shared:prefix-aware,private:round-robin,"
        "private:least-loaded,private:prefix-aware,single:round-robin")


def run_row(pool: str, routing: str, args, workload) -> dict:
    single = pool == "single"
    cfg = RunConfig(num_schedulers=1 if single else args.schedulers,
                    pool="shared" if single else pool, routing=routing,
                    num_blocks=args.blocks, max_model_len=args.max_model_len,
                    concurrency=args.concurrency,
                    check_tokens=not args.no_check, model=TinyModelConfig())
    result = Runner(cfg, workload, log=lambda _: None).run()
    f = {k: v for k, v in result.figures.items() if k not in ("timeline", "model")}
    f["row"] = "single pool, 1 scheduler" if single else f"{pool}, {routing}"
    return f


def median_row(runs: list[dict]) -> dict:
    """The run with the median hit rate, with the range of all of them."""
    ordered = sorted(runs, key=lambda r: r["prefix_hit_rate"])
    row = dict(ordered[len(ordered) // 2])
    row["hit_rate_range"] = (ordered[0]["prefix_hit_rate"], ordered[-1]["prefix_hit_rate"])
    row["token_mismatches_all"] = sum(r["token_mismatches"] for r in runs)
    row["repeats"] = len(runs)
    return row


def markdown_table(header: list[str], body: list[list[str]]) -> str:
    """A Markdown table: the first column left-aligned, the others right-aligned."""
    widths = [max(len(x[i]) for x in [header, *body]) for i in range(len(header))]
    lines = ["| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths, strict=True))) + " |"
             for row in [header, *body]]
    lines.insert(1, "|" + "|".join("-" * (w + 1) + ("-" if i == 0 else ":")
                                   for i, w in enumerate(widths)) + "|")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    header = ["pool, routing", "schedulers", "hit rate", "range", "prefill tokens saved",
              "evictions", "mismatches", "wall s"]
    body = [[r["row"], str(r["schedulers"]), f"{r['prefix_hit_rate']:.1%}",
             "{:.1%}..{:.1%}".format(*r["hit_rate_range"]),
             f"{r['prefill_tokens_saved']:,} of {r['prompt_tokens']:,}", f"{r['evictions']:,}",
             str(r["token_mismatches_all"]), f"{r['wall_s']:.1f}"] for r in rows]
    return markdown_table(header, body)


_SHORT = {"round-robin": "RR", "least-loaded": "LL", "prefix-aware": "PA"}


def plot(rows: list[dict], path: str) -> None:
    """Bars of the hit rates, one per row (RR round robin, LL least loaded, PA
    prefix-aware). Raises :class:`shmkv.plot.PlotUnavailable` without matplotlib."""
    from shmkv.plot import bar_chart

    groups = ["single pool" if r["schedulers"] == 1 and r["row"].startswith("single")
              else f"{r['pool']} {_SHORT.get(r['routing'], r['routing'])}" for r in rows]
    bar_chart(path, title=f"prefix hit rate: {rows[0]['schedulers']} schedulers, "
              f"{rows[0]['num_blocks']} blocks in all, the same chat workload",
              y_label="prefix hit rate (%)",
              x_label="pool, routing (RR round robin, LL least loaded, PA prefix-aware)",
              groups=groups, value_format="{:.1f}%",
              series={"prefix hit rate": [100 * r["prefix_hit_rate"] for r in rows]})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedulers", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=512, help="in all (512)")
    parser.add_argument("--conversations", type=int, default=90)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=16,
                        help="requests in flight in all, whatever the schedulers (16)")
    parser.add_argument("--rows", default=ROWS, help="pool:routing,... (pool: shared, "
                        "private or single)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per row (1)")
    parser.add_argument("--no-check", action="store_true", help="skip the reference check")
    parser.add_argument("--plot", metavar="PATH", help="bar chart of the hit rates")
    args = parser.parse_args()
    workload = chat_workload(ChatWorkloadConfig(
        num_conversations=args.conversations, seed=args.seed,
        vocab_size=TinyModelConfig().vocab_size))
    specs = [spec.split(":") for spec in args.rows.split(",")]
    runs: dict[int, list[dict]] = {k: [] for k in range(len(specs))}
    for rep in range(args.repeats):  # interleaved: a slow minute spreads over every row
        for k, (pool, routing) in enumerate(specs):
            print(f"running {pool}:{routing} ({rep + 1}/{args.repeats}) ...", file=sys.stderr,
                  flush=True)
            runs[k].append(run_row(pool, routing, args, workload))
            print(json.dumps(runs[k][-1]), flush=True)
    rows = [median_row(runs[k]) for k in range(len(specs))]
    print(table(rows))
    if args.plot:
        try:
            plot(rows, args.plot)
            print(f"plot: {args.plot}")
        except PlotUnavailable as e:
            print(f"plot: {e}")
    return 0 if all(r["token_mismatches"] == 0 and r["requests"] == r["requests_total"]
                    for rs in runs.values() for r in rs) else 1


if __name__ == "__main__":
    sys.exit(main())
