"""``shmkv run``: serve a workload with scheduler processes and their model ranks on one
pool (or private pools), check the tokens, report."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from shmkv.cli.common import (EXIT_ERROR, EXIT_INTERRUPTED, EXIT_OK, EXIT_PROBLEM,
                               StopOnSignals)
from shmkv.plot import PlotUnavailable


def cmd_run(args: argparse.Namespace) -> int:
    if (args.schedulers < 1 or args.blocks < 16 or args.conversations < 1
            or args.max_num_seqs < 1 or args.max_num_batched_tokens < 1):
        print("shmkv run: --schedulers, --conversations, --max-num-seqs and "
              "--max-num-batched-tokens must be >= 1, --blocks >= 16", file=sys.stderr)
        return EXIT_ERROR
    try:
        import torch  # noqa: F401  (the model's ranks and the reference check need it)
    except ImportError:
        print("shmkv run: needs torch (pip install 'shmkv[torch]', or any torch 2.4..2.14)",
              file=sys.stderr)
        return EXIT_ERROR
    from shmkv.serve import report
    from shmkv.serve.model import TinyModelConfig
    from shmkv.serve.runner import RunConfig, Runner
    from shmkv.serve.workload import ChatWorkloadConfig, chat_workload, read_trace, write_trace

    model = TinyModelConfig()
    if args.trace:
        workload = read_trace(args.trace, vocab_size=model.vocab_size)
    else:
        workload = chat_workload(ChatWorkloadConfig(
            num_conversations=args.conversations, seed=args.seed,
            vocab_size=model.vocab_size))
    if args.write_trace:
        write_trace(args.write_trace, workload)
    cfg = RunConfig(num_schedulers=args.schedulers, pool=args.pool, routing=args.routing,
                    num_blocks=args.blocks, block_size=args.block_size,
                    max_num_seqs=args.max_num_seqs,
                    max_num_batched_tokens=args.max_num_batched_tokens,
                    max_model_len=args.max_model_len, concurrency=args.concurrency,
                    kill_one=args.kill_one,
                    check_tokens=not args.no_check, timeout_s=args.timeout, model=model)
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    # Between and after the runs (each takes the signals itself while it runs), a signal
    # only marks the command stopped: the report and the exit code are never cut short.
    stop = StopOnSignals()
    result = Runner(cfg, workload, progress=progress).run()
    if result.interrupted:
        stop.ignore()  # on its way out: later signals change neither the report nor the code
    f = result.figures
    print(report.report_text(f))
    results = [result]
    if args.compare and not result.interrupted and not stop.stopped:
        # The same workload on private pools of 1/N the blocks: with the same routing, and
        # with prefix-aware routing (the best a router can do for them).
        others = [("private", args.routing)]
        if args.routing != "prefix-aware":
            others.append(("private", "prefix-aware"))
        if args.pool == "private":
            others = [("shared", args.routing)]
        for pool, routing in others:
            print(f"\nthe same workload, {pool} pool(s), {routing}:", flush=True)
            other = Runner(dataclasses.replace(cfg, pool=pool, routing=routing, kill_one=False),
                           workload, progress=progress).run()
            results.append(other)
            print(report.report_text(other.figures))
            if other.interrupted or stop.stopped:
                stop.ignore()
                break
        print()
        print(report.comparison_text([r.figures for r in results]))
        f = dict(f, compare=[{k: v for k, v in r.figures.items() if k != "timeline"}
                             for r in results[1:]])
    if args.json:
        report.write_json(f, args.json)
        print(f"  figures: {args.json}")
    if args.plot:
        try:
            report.plot_timeline([r.figures for r in results], args.plot)
            print(f"  plot: {args.plot}")
        except PlotUnavailable as e:
            print(f"  plot: {e}")
    stopped = next((r.exit_signal for r in results if r.interrupted), None)
    if stopped is not None:
        return 128 + stopped  # 143 for SIGTERM, 130 for Ctrl-C: everything was removed
    if stop.stopped:
        return stop.exit_code
    if any(r.interrupted for r in results):
        return EXIT_INTERRUPTED
    bad = any(r.problems or r.figures["token_mismatches"]
              or r.figures["requests"] < r.figures["requests_total"]
              or not r.figures["pool_valid"] for r in results)
    return EXIT_PROBLEM if bad else EXIT_OK


def add_run_parser(sub) -> None:
    run = sub.add_parser(
        "run", help="serve a workload with several schedulers on one shared pool",
        description="Serves a chat workload (or a JSONL trace) with N scheduler processes, "
        "each with its KVCacheManager and a rank process running a tiny model, all on one "
        "shared shmkv pool; --pool private gives each scheduler a pool of 1/N the blocks "
        "instead (what vLLM, SGLang and TensorRT-LLM do per data-parallel rank). Every "
        "generated token is checked against the model's no-cache reference. Exit 1 if a "
        "request did not finish, a token differed or the pool is not valid afterwards.")
    run.add_argument("--pool", choices=["shared", "private"], default="shared",
                     help="one pool for all schedulers, or one private pool each (shared)")
    run.add_argument("--routing", choices=["round-robin", "least-loaded", "prefix-aware"],
                     default="round-robin", help="how the front end picks a scheduler "
                     "(round-robin)")
    run.add_argument("--schedulers", type=int, default=4, help="scheduler processes (4)")
    run.add_argument("--blocks", type=int, default=512,
                     help="KV-cache blocks in all, split evenly between private pools (512)")
    run.add_argument("--block-size", type=int, default=16, help="tokens per block (16)")
    run.add_argument("--max-num-seqs", type=int, default=8,
                     help="requests a scheduler runs at once (8)")
    run.add_argument("--max-num-batched-tokens", type=int, default=512,
                     help="tokens a scheduler step computes at most (512)")
    run.add_argument("--max-model-len", type=int, default=512,
                     help="longest prompt plus output, in tokens (512)")
    run.add_argument("--concurrency", type=int, default=16,
                     help="requests in flight at once, in all: the users waiting for an "
                     "answer (16)")
    run.add_argument("--trace", metavar="PATH", help="a JSONL workload (see "
                     "shmkv/serve/workload.py) instead of the built-in chat workload")
    run.add_argument("--write-trace", metavar="PATH", help="write the workload as JSONL")
    run.add_argument("--conversations", type=int, default=90,
                     help="conversations of the built-in workload (90: about 200 requests)")
    run.add_argument("--seed", type=int, default=0, help="workload seed (0)")
    run.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    run.add_argument("--plot", metavar="PATH", default="shmkv-run.png",
                     help="PNG of hit rate and pool usage over time (shmkv-run.png; '' for "
                     "none)")
    run.add_argument("--compare", action="store_true",
                     help="then run the same workload on private pools (1/N of the blocks "
                     "each; with this routing and with prefix-aware routing) and compare")
    run.add_argument("--kill-one", action="store_true",
                     help="SIGKILL one scheduler half way; the others carry on")
    run.add_argument("--no-check", action="store_true",
                     help="do not check the tokens against the no-cache reference")
    run.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                     help="progress bar on stderr (default: when stderr is a terminal)")
    run.add_argument("--timeout", type=float, default=300.0,
                     help="seconds before giving up on unfinished requests (300)")
    run.set_defaults(func=cmd_run)


COMMANDS = {
    "run": add_run_parser,
}
