"""``shmkv run``: serve a workload with scheduler processes and their model ranks on one
pool (or private pools), check the tokens, report. ``shmkv replay`` (``shmkv run --model
none``): the same without ranks or a model (``shmkv/serve/replay.py``). ``--blocks
A,B,C``: a capacity sweep (``shmkv/serve/sweep.py``). ``--trace-format mooncake``: the
Mooncake traces (``shmkv/serve/trace.py``)."""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys

from shmkv.cli.common import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_OK, EXIT_PROBLEM, StopOnSignals
from shmkv.plot import PlotUnavailable


def _capacities(text: str) -> list[int] | None:
    try:
        caps = [int(c) for c in str(text).split(",") if c.strip()]
    except ValueError:
        return None
    return caps or None


def cmd_run(args: argparse.Namespace) -> int:
    name = "shmkv replay" if args.model == "none" else "shmkv run"
    caps = _capacities(args.blocks)
    if (caps is None or args.schedulers < 1 or min(caps) < 16 or args.conversations < 1
            or args.max_num_seqs < 1 or args.max_num_batched_tokens < 1
            or args.trace_block_tokens < 1 or not 0 <= args.time_scale < math.inf
            or not 0 <= args.rank_nice <= 19):
        print(f"{name}: --schedulers, --conversations, --max-num-seqs, "
              "--max-num-batched-tokens and --trace-block-tokens must be >= 1, --blocks a "
              "number >= 16 (or several, comma-separated), --time-scale a finite number >= 0, "
              "--rank-nice 0 to 19", file=sys.stderr)
        return EXIT_ERROR
    if args.trace_format and not args.trace:
        print(f"{name}: --trace-format needs --trace", file=sys.stderr)
        return EXIT_ERROR
    model_free = args.model == "none"
    if not model_free:
        try:
            import torch  # noqa: F401  (the model's ranks and the reference check need it)
        except ImportError:
            print("shmkv run: needs torch (pip install 'shmkv[torch]', or any torch "
                  "2.4..2.14); shmkv replay (--model none) does not", file=sys.stderr)
            return EXIT_ERROR
    from shmkv.serve import report
    from shmkv.serve.config import TinyModelConfig
    from shmkv.serve.device import resolve_run_device
    from shmkv.serve.runner import RunConfig, Runner
    from shmkv.serve.small_model import model_config_for
    from shmkv.serve.trace import load_trace
    from shmkv.serve.workload import ChatWorkloadConfig, chat_workload, write_trace

    # --device / --kv / --dtype with the model, checked before anything starts.
    run_device = resolve_run_device(args.device, args.kv, args.dtype, args.model)
    model = TinyModelConfig() if model_free else model_config_for(args.model)
    trace_info = None
    if args.trace:
        workload, trace_info = load_trace(
            args.trace, args.trace_format, block_size=args.block_size,
            vocab_size=model.vocab_size, max_model_len=args.max_model_len,
            trace_block_tokens=args.trace_block_tokens)
        if len(caps) > 1:  # (a single run's report says it)
            print(f"trace: {trace_info.text()}", flush=True)
    else:
        workload = chat_workload(ChatWorkloadConfig(
            num_conversations=args.conversations, seed=args.seed,
            vocab_size=model.vocab_size))
    if args.write_trace:
        write_trace(args.write_trace, workload)
    cfg = RunConfig(num_schedulers=args.schedulers, pool=args.pool, routing=args.routing,
                    num_blocks=caps[0], block_size=args.block_size,
                    max_num_seqs=args.max_num_seqs,
                    max_num_batched_tokens=args.max_num_batched_tokens,
                    max_model_len=args.max_model_len, concurrency=args.concurrency,
                    kill_one=args.kill_one, rank_nice=args.rank_nice,
                    check_tokens=not args.no_check, timeout_s=args.timeout, model=model,
                    model_free=model_free, time_scale=args.time_scale,
                    run_device=run_device)
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    trace = None if trace_info is None else dict(trace_info.to_dict(),
                                                 summary=trace_info.text())
    # Between and after the runs (each takes the signals itself while it runs), a signal
    # only marks the command stopped: the report and the exit code are never cut short.
    stop = StopOnSignals()
    if len(caps) > 1:
        return _sweep(args, cfg, workload, caps, trace, progress, stop)
    result = Runner(cfg, workload, progress=progress).run()
    if result.interrupted:
        stop.ignore()  # on its way out: later signals change neither the report nor the code
    f = result.figures
    if trace:
        f["trace"] = trace
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
    return _exit_code(results, stop)


def _exit_code(results, stop) -> int:
    stopped = next((r.exit_signal for r in results if r.interrupted), None)
    if stopped is not None:
        return 128 + stopped  # 143 for SIGTERM, 130 for Ctrl-C: everything was removed
    if stop.stopped:
        return stop.exit_code
    if any(r.interrupted for r in results):
        return EXIT_INTERRUPTED
    bad = any(r.problems
              or r.figures["requests"] < r.figures["requests_total"]
              or not r.figures["pool_valid"] for r in results)
    bad = bad or any(r.figures["token_mismatches"] and r.figures.get("exact_tokens", True)
                     for r in results)
    return EXIT_PROBLEM if bad else EXIT_OK


def _sweep(args, cfg, workload, caps: list[int], trace: dict | None, progress: bool,
           stop) -> int:
    """``--blocks A,B,C``: every configuration at every capacity, one table, the bound,
    the plot and the JSON (shmkv/serve/sweep.py)."""
    from shmkv.serve import report, sweep
    from shmkv.serve.runner import Runner

    configs = sweep.configurations(args.pool, args.routing)
    for pool, routing in configs:  # refuse a capacity too small before anything starts
        for c in caps:
            sweep.with_capacity(cfg, pool, routing, c).validate()
    results, rows, bound = [], [], None
    for c in caps:
        for pool, routing in configs:
            print(f"\n{pool} pool(s), {routing}, {c:,} blocks:", flush=True)
            runner = Runner(sweep.with_capacity(cfg, pool, routing, c), workload,
                            progress=progress)
            result = runner.run()
            results.append(result)
            print(report.report_text(result.figures), flush=True)
            if result.interrupted or stop.stopped:
                stop.ignore()  # on its way out: the table and the code are not cut short
                break
            if bound is None:
                bound = sweep.bound_for(workload, cfg.block_size,
                                        getattr(runner, "records", None))
            rows.append(sweep.row(result.figures, bound))
        if results[-1].interrupted or stop.stopped:
            break
    if rows:
        print()
        print(sweep.sweep_table(rows, bound))
        if args.json:
            sweep.sweep_json(rows, bound, trace, args.json)
            print(f"  figures: {args.json}")
        if args.plot:
            try:
                sweep.plot_sweep(rows, bound, args.plot)
                print(f"  plot: {args.plot}")
            except PlotUnavailable as e:
                print(f"  plot: {e}")
    return _exit_code(results, stop)


def add_run_parser(sub) -> None:
    run = sub.add_parser(
        "run", help="serve a workload with several schedulers on one shared pool",
        description="Serves a chat workload (or a JSONL trace) with N scheduler processes, "
        "each with its KVCacheManager and a rank process running a tiny model, all on one "
        "shared shmkv pool; --pool private gives each scheduler a pool of 1/N the blocks "
        "instead (what vLLM, SGLang and TensorRT-LLM do per data-parallel rank). Every "
        "generated token is checked against the model's no-cache reference. Exit 1 if a "
        "request did not finish, a token differed or the pool is not valid afterwards.")
    _add_run_arguments(run, replay=False)


def add_replay_parser(sub) -> None:
    replay = sub.add_parser(
        "replay", help="replay a trace on the KV-cache layer alone (no model)",
        description="shmkv run --model none: the same front end, routing, scheduler "
        "processes, KVCacheManagers and pool(s), but no rank processes and no model (a "
        "step's tokens are a deterministic function of the request), so what is measured "
        "is the KV-cache layer alone. --blocks A,B,C sweeps capacities. Exit 1 if a "
        "request did not finish or the pool is not valid afterwards.")
    _add_run_arguments(replay, replay=True)


def _add_run_arguments(run, replay: bool) -> None:
    run.add_argument("--model", choices=["tiny", "small", "none"],
                     default="none" if replay else "tiny",
                     help="the model on the rank processes: tiny (3 layers, for the CPU), "
                     "small (a Llama-like shape of 0.6 B parameters, random weights, for a "
                     "GPU), or none: a model-free replay "
                     f"({'none' if replay else 'tiny'})")
    run.add_argument("--device", default=None if replay else "cpu",
                     help="where the ranks run the model and the reference check runs: cpu, "
                     "cuda, cuda:N or auto (a GPU when torch sees one) (cpu)")
    run.add_argument("--kv", default=None,
                     help="where the KV cache lives: device (one tensor per pool that every "
                     "rank attends over in place; on a GPU shared through CUDA IPC) or host "
                     "(the node-wide store in shared memory, each rank copying its requests' "
                     "blocks to and from its device) (device)")
    run.add_argument("--dtype", default=None,
                     help="float32 or bfloat16, the model's and the KV cache's (bfloat16 for "
                     "--model small on a GPU, float32 otherwise); in bfloat16 greedy flips "
                     "against the reference are reported, not failed")
    run.add_argument("--pool", choices=["shared", "private"], default="shared",
                     help="one pool for all schedulers, or one private pool each (shared)")
    run.add_argument("--routing", choices=["round-robin", "least-loaded", "prefix-aware"],
                     default="round-robin", help="how the front end picks a scheduler "
                     "(round-robin)")
    run.add_argument("--schedulers", type=int, default=4, help="scheduler processes (4)")
    run.add_argument("--blocks", default="512", metavar="N[,N...]",
                     help="KV-cache blocks in all, split evenly between private pools "
                     "(512); several (2048,8192,32768): run every configuration (as "
                     "--compare) at each, one table with the infinite-cache bound, the plot "
                     "of hit rate against capacity, --json of every run")
    run.add_argument("--block-size", type=int, default=16, help="tokens per block (16)")
    run.add_argument("--max-num-seqs", type=int, default=8,
                     help="requests a scheduler runs at once (8)")
    run.add_argument("--max-num-batched-tokens", type=int, default=512,
                     help="tokens a scheduler step computes at most (512)")
    run.add_argument("--rank-nice", type=int, default=10, metavar="N",
                     help="how much nicer (lower priority) the rank processes run than the "
                     "schedulers, so that a rank does not preempt a scheduler holding the "
                     "pool lock (0 to 19; 10)")
    run.add_argument("--max-model-len", type=int, default=512,
                     help="longest prompt plus output, in tokens (512)")
    run.add_argument("--concurrency", type=int, default=16,
                     help="requests in flight at once, in all: the users waiting for an "
                     "answer (16)")
    run.add_argument("--trace", metavar="PATH", help="a JSONL workload (see "
                     "shmkv/serve/workload.py and shmkv/serve/trace.py) instead of the "
                     "built-in chat workload")
    run.add_argument("--trace-format", choices=["shmkv", "mooncake"], default=None,
                     help="the trace's format (default: from its first line)")
    run.add_argument("--trace-block-tokens", type=int, default=512,
                     help="mooncake: tokens per hash id in the trace; each id becomes one "
                     "--block-size block, lengths scale by block size / this (512)")
    run.add_argument("--time-scale", type=float, default=0.0, metavar="X",
                     help="send a request no sooner than X times its trace timestamp after "
                     "the first (1: real time, 0.1: ten times faster; 0: as fast as "
                     "--concurrency allows) (0)")
    run.add_argument("--write-trace", metavar="PATH", help="write the workload as JSONL")
    run.add_argument("--conversations", type=int, default=90,
                     help="conversations of the built-in workload (90: about 200 requests)")
    run.add_argument("--seed", type=int, default=0, help="workload seed (0)")
    run.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    run.add_argument("--plot", metavar="PATH",
                     default="shmkv-replay.png" if replay else "shmkv-run.png",
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
                     help="seconds before giving up on unfinished requests (300; with "
                     "--time-scale, after the last arrival)")
    run.set_defaults(func=cmd_run)


COMMANDS = {
    "run": add_run_parser,
    "replay": add_replay_parser,
}
