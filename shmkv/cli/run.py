"""``shmkv run``: serve a workload with scheduler processes and their model ranks on one
shared pool (prefix-aware routing, which follows the pool's event log), then on private
pools with the routers users run (SGLang's cache-aware router, llm-d's scorers) and
round-robin, check the
tokens, compare (``--no-compare``: one configuration). ``shmkv replay``: the same without
ranks or a model (``shmkv/serve/replay.py``). ``--blocks A,B,C``: a capacity sweep
(``shmkv/serve/sweep.py``). ``--trace-format mooncake``: the Mooncake traces
(``shmkv/serve/trace.py``). Every argument is checked first (``shmkv/cli/run_args.py``)."""

from __future__ import annotations

import argparse
import sys

from shmkv.cli import run_args
from shmkv.cli.common import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_OK, EXIT_PROBLEM, StopOnSignals
from shmkv.plot import PlotUnavailable
from shmkv.serve.routing import ROUTING_POLICIES
from shmkv.serve.workload import WORKLOADS


def cmd_run(args: argparse.Namespace) -> int:
    replay = args.model == "none"
    caps = run_args.check_arguments(args)  # every argument, before anything starts
    router_config = run_args.router_config(args)
    if not replay:
        try:
            import torch  # noqa: F401  (the model's ranks and the reference check need it)
        except ImportError:
            print("shmkv run: needs torch (pip install 'shmkv[torch]', or any torch "
                  "2.4..2.14); shmkv replay does not", file=sys.stderr)
            return EXIT_ERROR
    from shmkv.serve import report, sweep
    from shmkv.serve.config import TinyModelConfig
    from shmkv.serve.device import resolve_run_device
    from shmkv.serve.runner import RunConfig, check_arrivals
    from shmkv.serve.small_model import model_config_for
    from shmkv.serve.trace import load_trace
    from shmkv.serve.workload import (
        ChatWorkloadConfig,
        HotPromptsConfig,
        chat_workload,
        hot_prompts_workload,
        write_trace,
    )

    # --device / --kv / --dtype with the model, checked before anything starts.
    run_device = resolve_run_device(args.device, args.kv, args.dtype, args.model)
    model = TinyModelConfig() if replay else model_config_for(args.model)
    trace_info = None
    if args.trace:
        workload, trace_info = load_trace(
            args.trace, args.trace_format, block_size=args.block_size,
            vocab_size=model.vocab_size, max_model_len=args.max_model_len,
            trace_block_tokens=args.trace_block_tokens)
    elif args.workload == "hot-prompts":
        workload = hot_prompts_workload(HotPromptsConfig(
            num_requests=args.requests, zipf_s=args.zipf, request_rate=args.request_rate,
            seed=args.seed, vocab_size=model.vocab_size))
    else:
        workload = chat_workload(ChatWorkloadConfig(
            num_conversations=args.conversations, seed=args.seed,
            vocab_size=model.vocab_size))
    compare = len(caps) > 1 or not args.no_compare
    configs = (sweep.configurations(args.pool, args.routing) if compare
               else [(args.pool, args.routing)])
    run_args.check_fits(workload, args.max_model_len, args.block_size, caps,
                        args.schedulers, [p for p, _ in configs],
                        len(model.group_windows()))
    if args.write_trace:
        write_trace(args.write_trace, workload)
    cfg = RunConfig(num_schedulers=args.schedulers, pool=args.pool, routing=args.routing,
                    num_blocks=caps[0], block_size=args.block_size,
                    max_num_seqs=args.max_num_seqs,
                    max_num_batched_tokens=args.max_num_batched_tokens,
                    max_model_len=args.max_model_len, concurrency=args.concurrency,
                    router=router_config,
                    kill_one=args.kill_one,
                    restart="one" if args.restart_one else "rolling" if args.rolling_restart
                    else "",
                    rank_nice=getattr(args, "rank_nice", 10),
                    check_tokens=not args.no_check, timeout_s=args.timeout, model=model,
                    model_free=replay, time_scale=args.time_scale, cost=_cost(args, replay),
                    run_device=run_device)
    for c in caps:  # refuse a configuration the runner would, before anything starts
        for pool, routing in configs:
            sweep.with_capacity(cfg, pool, routing, c).validate()
    check_arrivals(workload, cfg.time_scale)
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    trace = None if trace_info is None else dict(trace_info.to_dict(),
                                                 summary=trace_info.text())
    # Between and after the runs (each takes the signals itself while it runs), a signal
    # only marks the command stopped: the report and the exit code are never cut short.
    stop = StopOnSignals()
    if len(caps) > 1:
        return _sweep(args, cfg, workload, caps, configs, trace, progress, stop)
    if not compare:
        return _single(args, cfg, workload, trace, progress, stop)
    print(report.intro_text({
        "model_free": replay, "requests_total": len(workload), "schedulers": cfg.num_schedulers,
        "num_blocks": cfg.num_blocks, "kv_cache_groups": len(model.group_windows()),
        "trace": trace, "model_name": None if replay else args.model}, configs), flush=True)
    results, _ = _runs(args, cfg, workload, [(caps[0], p, r) for p, r in configs],
                       progress, stop, first_as_asked=True)
    figs = [r.figures for r in results]
    print()
    print(report.comparison_text(figs))
    f = dict(figs[0], compare=[{k: v for k, v in g.items() if k != "timeline"}
                               for g in figs[1:]])
    if trace:
        f["trace"] = trace
    f["model_name"] = None if replay else args.model  # (the intro line names it)
    _write_outputs(args, f, lambda path: report.plot_timeline(figs, path))
    if not args.verbose:
        print(report.COMPARE_HINT)
    return _exit_code(results, stop)


def _cost(args, replay: bool):
    """A replay's cost model from its flags (``shmkv run --model none``: the defaults)."""
    from shmkv.serve.replay import CostModel

    if not replay:
        return CostModel(0.0, 0.0)
    cost = CostModel(getattr(args, "prefill_ms_per_token", CostModel.prefill_ms_per_token),
                     getattr(args, "decode_ms_per_step", CostModel.decode_ms_per_step))
    cost.validate()
    return cost


def _runs(args, cfg, workload, plan, progress: bool, stop,
          first_as_asked: bool = False) -> tuple[list, list]:
    """Runs ``plan`` ((capacity, pool, routing) each) one after the other: a "run k of n"
    line each (the progress bar says it too), the full report with ``--verbose``; stops
    after a run that was interrupted. The first run is ``cfg`` itself (``--kill-one``
    included) if ``first_as_asked``. Returns (results, runners)."""
    from shmkv.serve import report, sweep
    from shmkv.serve.runner import Runner

    results, runners = [], []
    for k, (c, pool, routing) in enumerate(plan, 1):
        run_cfg = (cfg if first_as_asked and k == 1
                   else sweep.with_capacity(cfg, pool, routing, c))
        runner = Runner(run_cfg, workload, progress=progress,
                        progress_label=f"run {k} of {len(plan)}")
        result = runner.run(signalled=lambda: stop.signum)
        runners.append(runner)
        results.append(result)
        if args.verbose:
            print(f"\nrun {k} of {len(plan)}:")
            print(report.report_text(result.figures), flush=True)
        else:
            print(report.run_summary(result.figures, k, len(plan)), flush=True)
        if result.interrupted or stop.stopped:
            stop.ignore()  # on its way out: the table and the code are not cut short
            break
    return results, runners


def _single(args, cfg, workload, trace, progress: bool, stop) -> int:
    """``--no-compare``: one configuration, its full report."""
    from shmkv.serve import report
    from shmkv.serve.runner import Runner

    result = Runner(cfg, workload, progress=progress).run(signalled=lambda: stop.signum)
    if result.interrupted:
        stop.ignore()  # on its way out: later signals change neither the report nor the code
    f = result.figures
    if trace:
        f["trace"] = trace
    print(report.report_text(f))
    _write_outputs(args, f, lambda path: report.plot_timeline([f], path))
    return _exit_code([result], stop)


def _write_outputs(args, f: dict, plot) -> None:
    from shmkv.serve import report

    if args.json:
        report.write_json(f, args.json)
        print(f"  figures: {args.json}")
    if args.plot:
        try:
            plot(args.plot)
            print(f"  plot: {args.plot}")
        except PlotUnavailable as e:
            print(f"  plot: {e}")


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


def _sweep(args, cfg, workload, caps: list[int], configs, trace: dict | None,
           progress: bool, stop) -> int:
    """``--blocks A,B,C``: every configuration at every capacity ("run k of n", one line
    each), one table, the bound, the plot and the JSON (shmkv/serve/sweep.py)."""
    from shmkv.serve import sweep

    if trace:
        print(f"trace: {trace['summary']}", flush=True)
    plan = [(c, pool, routing) for c in caps for pool, routing in configs]
    results, runners = _runs(args, cfg, workload, plan, progress, stop)
    rows, bound = [], None
    for result, runner in zip(results, runners, strict=True):
        if result.interrupted:
            break
        if bound is None:
            bound = sweep.bound_for(workload, cfg.block_size,
                                    getattr(runner, "records", None))
        rows.append(sweep.row(result.figures, bound))
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
        "run", help="serve a workload on one shared pool and on private pools, compared",
        description="Serves a chat workload (or a JSONL trace) with N scheduler processes, "
        "each with its KVCacheManager and a rank process running a tiny model, four ways: "
        "on one shared shmkv pool (prefix-aware routing), then on private pools of 1/N the "
        "blocks each (what vLLM, SGLang and TensorRT-LLM do per data-parallel rank) with "
        "SGLang's cache-aware router, llm-d's scorers and round-robin; one table and one "
        "plot compare them (--no-compare: the --pool/--routing configuration alone). Every "
        "generated token is checked against the model's no-cache reference. Exit 1 if a "
        "request did not finish, a token differed or a pool is not valid afterwards.")
    _add_run_arguments(run, replay=False)


def add_replay_parser(sub) -> None:
    replay = sub.add_parser(
        "replay", help="replay a trace on the KV-cache layer alone (no model), compared",
        description="The front end, routing, scheduler processes, KVCacheManagers and "
        "pool(s) of shmkv run, but no rank processes and no model (a step's tokens are a "
        "deterministic function of the request), so what is measured is the KV-cache "
        "layer alone. Shared and private pools are compared as by shmkv run; --blocks "
        "A,B,C sweeps capacities. Exit 1 if a request did not finish or a pool is not "
        "valid afterwards.")
    _add_run_arguments(replay, replay=True)


def _add_run_arguments(run, replay: bool) -> None:
    """The options of run and replay; replay has none of the model's (--model, --device,
    --kv, --dtype, --rank-nice, --no-check), and its plot is shmkv-replay.png."""
    if replay:
        run.set_defaults(model="none", no_check=True, device=None, kv=None, dtype=None)
        cost = run.add_argument_group(
            "cost model", "with no model, a step takes the time a model's would (a sleep "
            "outside the pool's lock), so queues and times to the first token mean something")
        cost.add_argument("--prefill-ms-per-token", type=float, default=0.1, metavar="MS",
                          help="time per token a step computes that is not a decode token "
                          "(prompt tokens not hit in the cache) (0.1)")
        cost.add_argument("--decode-ms-per-step", type=float, default=1.0, metavar="MS",
                          help="time of every step that runs something (1)")
    else:
        run.add_argument("--model", choices=["tiny", "small", "none"], default="tiny",
                         help="the model on the rank processes: tiny (3 layers, for the "
                         "CPU), small (a Llama-like shape of 0.6 B parameters, random "
                         "weights, for a GPU), or none: as shmkv replay (tiny)")
        run.add_argument("--device", default="cpu",
                         help="where the ranks run the model and the reference check runs: "
                         "cpu, cuda, cuda:N or auto (a GPU when torch sees one) (cpu)")
        run.add_argument("--kv", default=None,
                         help="where the KV cache lives: device (one tensor per pool that "
                         "every rank attends over in place; on a GPU shared through CUDA "
                         "IPC) or host (the node-wide store in shared memory, each rank "
                         "copying its requests' blocks to and from its device) (device)")
        run.add_argument("--dtype", default=None,
                         help="float32 or bfloat16, the model's and the KV cache's (bfloat16 "
                         "for --model small on a GPU, float32 otherwise); in bfloat16 greedy "
                         "flips against the reference are reported, not failed")
    run.add_argument("--pool", choices=["shared", "private"], default="shared",
                     help="the configuration of the first run (and the only one with "
                     "--no-compare): one pool for all schedulers, or one private pool each "
                     "(shared)")
    run.add_argument("--routing", choices=list(ROUTING_POLICIES),
                     default="prefix-aware", help="how the front end picks a scheduler in "
                     "that run: round-robin; least-loaded (fewest requests in flight); "
                     "prefix-aware (the scheduler whose cache holds the prompt's longest "
                     "prefix, unless too loaded: on private pools an oracle that looks into "
                     "every pool, on the shared pool a router that follows its event log); "
                     "sglang-cache-aware (SGLang's router: approximate prefix trees of what it "
                     "sent, load-balance thresholds); llm-d-scorer (llm-d's scheduler: "
                     "prefix-cache, queue and KV-cache scorers, weighted) (prefix-aware)")
    router = run.add_argument_group(
        "router settings", "the baselines' own defaults (docs/serving.md, Routers)")
    router.add_argument("--cache-threshold", type=float, default=0.3, metavar="X",
                        help="sglang-cache-aware: the share of the prompt its tree must "
                        "match to route by cache (0..1; 0.3)")
    router.add_argument("--balance-abs-threshold", type=int, default=64, metavar="N",
                        help="sglang-cache-aware: imbalanced when the most and least loaded "
                        "schedulers differ by more than N requests in flight (64) ...")
    router.add_argument("--balance-rel-threshold", type=float, default=1.5, metavar="X",
                        help="... and the most loaded has more than X times the least's "
                        "(>= 1; 1.5); then the least loaded gets the request")
    router.add_argument("--prefix-scorer-weight", type=float, default=3.0, metavar="W",
                        help="llm-d-scorer: the prefix-cache scorer's weight (3)")
    router.add_argument("--queue-scorer-weight", type=float, default=2.0, metavar="W",
                        help="llm-d-scorer: the waiting-queue scorer's weight (2)")
    router.add_argument("--utilization-scorer-weight", type=float, default=2.0, metavar="W",
                        help="llm-d-scorer: the KV-cache utilization scorer's weight (2)")
    run.add_argument("--no-compare", action="store_true",
                     help="run the --pool/--routing configuration alone and print its full "
                     "report (default: compare it with private pools under SGLang's and "
                     "llm-d's routers and round-robin, and with the shared pool for --pool "
                     "private)")
    run.add_argument("--compare", action="store_true", help=argparse.SUPPRESS)  # the default
    run.add_argument("--verbose", action="store_true",
                     help="print every run's full report, not one line each")
    run.add_argument("--schedulers", type=int, default=4, help="scheduler processes (4)")
    run.add_argument("--blocks", default="512", metavar="N[,N...]",
                     help="KV-cache blocks in all, split evenly between private pools; the "
                     "model's 2 KV-cache groups (full attention, sliding window) each take "
                     "one block per cached prompt block, so each group gets half (512); "
                     "several (2048,8192,32768): every configuration at each, one table "
                     "with the infinite-cache bound, the plot of hit rate against capacity, "
                     "--json of every run")
    run.add_argument("--block-size", type=int, default=16, help="tokens per block (16)")
    run.add_argument("--max-num-seqs", type=int, default=8,
                     help="requests a scheduler runs at once (8)")
    run.add_argument("--max-num-batched-tokens", type=int, default=512,
                     help="tokens a scheduler step computes at most (512)")
    if not replay:
        run.add_argument("--rank-nice", type=int, default=10, metavar="N",
                         help="how much nicer (lower priority) the rank processes run than "
                         "the schedulers, so that a rank does not preempt a scheduler "
                         "holding the pool lock (0 to 19; 10)")
    run.add_argument("--max-model-len", type=int, default=512,
                     help="longest prompt plus output, in tokens; checked against the "
                     "workload before anything starts (512)")
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
    run.add_argument("--workload", choices=list(WORKLOADS), default="chat",
                     help="the built-in workload when there is no --trace: chat (tenants, "
                     "shared system prompts, multi-turn conversations) or hot-prompts (single "
                     "requests on 64 system prompts of Zipf-skewed popularity, Poisson "
                     "arrivals at --request-rate, honoured with --time-scale 1) (chat)")
    run.add_argument("--requests", type=int, default=3000,
                     help="hot-prompts: requests (3000)")
    run.add_argument("--request-rate", type=float, default=150.0, metavar="R",
                     help="hot-prompts: arrivals a second at --time-scale 1 (150)")
    run.add_argument("--zipf", type=float, default=1.0, metavar="S",
                     help="hot-prompts: system prompt k is drawn with weight 1/k**S (1)")
    run.add_argument("--seed", type=int, default=0, help="workload seed (0)")
    run.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    plot = "shmkv-replay.png" if replay else "shmkv-run.png"
    run.add_argument("--plot", metavar="PATH", default=plot,
                     help=f"PNG of hit rate and pool usage over time, one line per run (a "
                     f"sweep: hit rate against capacity) ({plot}; '' for none)")
    run.add_argument("--kill-one", action="store_true",
                     help="SIGKILL one scheduler half way through the first run; the others "
                     "carry on")
    run.add_argument("--restart-one", action="store_true",
                     help="in every run: SIGKILL the highest scheduler half way through and "
                     "start a fresh one in its place (on private pools with an empty pool: "
                     "its cache is lost; on the shared pool the cache stays)")
    run.add_argument("--rolling-restart", action="store_true",
                     help="in every run: restart every scheduler in turn (as --restart-one), "
                     "evenly spread over the run, as a rolling upgrade does")
    if not replay:
        run.add_argument("--no-check", action="store_true",
                         help="do not check the tokens against the no-cache reference")
    run.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                     help="progress bar on stderr, 'run k of n' first (default: when "
                     "stderr is a terminal)")
    run.add_argument("--timeout", type=float, default=300.0,
                     help="seconds before giving up on unfinished requests, per run (300; "
                     "with --time-scale, after the last arrival)")
    run.set_defaults(func=cmd_run)


COMMANDS = {
    "run": add_run_parser,
    "replay": add_replay_parser,
}
