"""The ``shmkv`` command.

    shmkv run [--pool shared|private] [--routing R] [--schedulers N] [--trace PATH] ...
                                                serve a chat workload with N scheduler
                                                processes (and their model ranks) on one pool
    shmkv demo [--processes N] [--requests R]   several schedulers share one pool
    shmkv inspect NAME                          a live pool: header, usage, processes, invariants
    shmkv recover NAME [--reclaim PID]          take over from the dead, repair, report
    shmkv unlink NAME                           remove a pool's segment, lock and lock file
    shmkv cleanup [--dry-run]                   remove pools no live process is attached to
                                                (and what a killed ``shmkv run`` left)

Exit codes: 0 success; 1 the command ran and found a problem (broken invariants, nothing to
unlink, a demo process failed, a run with unfinished requests or wrong tokens); 2 bad usage
or an error (message on stderr, no traceback unless ``--debug``); 130 ``run`` interrupted
(Ctrl-C or SIGTERM: it stops its processes and removes its segments first).
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import os
import random
import sys
import time

from shmkv import layout as L
from shmkv.block_pool import BlockPool
from shmkv.errors import ShmKVError
from shmkv.lock import decode_holder
from shmkv.recovery import collect_violations

EXIT_OK, EXIT_PROBLEM, EXIT_ERROR = 0, 1, 2


# ---------------------------------------------------------------------------- demo

SYSTEM_PROMPTS = {
    "assistant": list(range(1000, 1064)),  # 64 tokens: 4 blocks of 16
    "coder": list(range(2000, 2096)),  # 96 tokens: 6 blocks
}


def _demo_scheduler(name: str, index: int, num_requests: int, seed: int, first_done,
                    lines) -> None:
    """One scheduler process: serve requests, report each one's prefix hit."""
    from shmkv.request import Request

    pool = BlockPool.attach(name, label=f"scheduler-{index}")
    hasher = pool.make_block_hasher()
    rng = random.Random(seed)
    own_blocks: set[int] = set()
    bs = pool.hash_block_size
    if index > 0:
        first_done.wait(60)  # let scheduler 0 compute the system prompts first
    for r in range(num_requests):
        system = rng.choice(sorted(SYSTEM_PROMPTS))
        user = [rng.randrange(30_000, 40_000) for _ in range(rng.randint(8, 40))]
        req = Request(f"s{index}-r{r}", SYSTEM_PROMPTS[system] + user, block_hasher=hasher)
        with pool.lock():
            hits = pool.get_cached_prefix(req.block_hashes)
            pool.touch(hits)
            new = pool.get_new_blocks(-(-req.num_tokens // bs) - len(hits))
            blocks = hits + new
            pool.cache_full_blocks(req, blocks, len(hits), req.num_tokens // bs, bs, 0)
        foreign = sum(1 for b in hits if b.block_id not in own_blocks)
        own_blocks.update(b.block_id for b in new)
        lines.put((index, r, system, req.num_tokens, len(hits) * bs, foreign * bs))
        pool.free_blocks(reversed(blocks))
        if index == 0 and r == 1:
            first_done.set()
    first_done.set()
    pool.close()


def cmd_demo(args: argparse.Namespace) -> int:
    name = f"demo-{os.getpid()}"
    ctx = mp.get_context("spawn")
    pool = BlockPool.create(name, args.blocks, enable_kv_cache_events=True,
                            max_processes=args.processes + 2, label="demo")
    print(f"pool {name}: {args.blocks} blocks of {pool.hash_block_size} tokens in "
          f"/dev/shm{pool._segment.shm_name}; {args.processes} scheduler processes, "
          f"{args.requests} requests each")
    lines = ctx.Queue()
    first_done = ctx.Event()
    procs = [
        ctx.Process(target=_demo_scheduler,
                    args=(name, i, args.requests, args.seed + i, first_done, lines))
        for i in range(args.processes)
    ]
    status = EXIT_OK
    try:
        for p in procs:
            p.start()
        totals = {"requests": 0, "tokens": 0, "hit": 0, "foreign": 0}
        deadline = time.monotonic() + args.timeout
        for _ in range(args.processes * args.requests):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not any(p.is_alive() for p in procs) and lines.empty():
                break
            try:
                index, r, system, tokens, hit, foreign = lines.get(timeout=max(remaining, 0.1))
            except Exception:  # noqa: BLE001  (queue.Empty: a scheduler died; reported below)
                break
            totals["requests"] += 1
            totals["tokens"] += tokens
            totals["hit"] += hit
            totals["foreign"] += foreign
            print(f"  scheduler-{index} request {r:>2}: {system:<9} prompt {tokens:>3} tokens, "
                  f"prefix hit {hit:>3} tokens ({foreign:>3} computed by another process)")
        for p in procs:
            p.join(max(deadline - time.monotonic(), 1))
            if p.is_alive():
                p.kill()
                p.join(10)
            if p.exitcode != 0:
                print(f"{p.name} exited with code {p.exitcode}", file=sys.stderr)
                status = EXIT_PROBLEM
        rate = totals["hit"] / totals["tokens"] if totals["tokens"] else 0.0
        print(f"{totals['requests']} requests, {totals['tokens']} prompt tokens, "
              f"{totals['hit']} served from the shared prefix cache ({rate:.0%}), "
              f"{totals['foreign']} of them cached by another scheduler process")
        events, lost = pool.read_events(pool.event_cursor())
        print(f"global event log: {len(events)} events from "
              f"{len({e.slot for e in events})} processes, {lost} lost")
        pool.check_invariants()
        print(f"invariants: OK; blocks free: {pool.get_num_free_blocks()} of "
              f"{pool.num_gpu_blocks - 1}")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
        pool.close()
        BlockPool.unlink(name)
    return status


# ---------------------------------------------------------------------------- run

EXIT_INTERRUPTED = 130


def cmd_run(args: argparse.Namespace) -> int:
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
    result = Runner(cfg, workload, progress=progress).run()
    f = result.figures
    print(report.report_text(f))
    results = [result]
    if args.compare and not result.interrupted:
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
            if other.interrupted:
                break
        print()
        print(report.comparison_text([r.figures for r in results]))
        f = dict(f, compare=[{k: v for k, v in r.figures.items() if k != "timeline"}
                             for r in results[1:]])
    if args.json:
        report.write_json(f, args.json)
        print(f"  figures: {args.json}")
    if args.plot:
        report.plot_timeline([r.figures for r in results], args.plot)
        print(f"  plot: {args.plot}")
    if any(r.interrupted for r in results):
        return EXIT_INTERRUPTED
    bad = any(r.problems or r.figures["token_mismatches"]
              or r.figures["requests"] < r.figures["requests_total"]
              or not r.figures["pool_valid"] for r in results)
    return EXIT_PROBLEM if bad else EXIT_OK


# ---------------------------------------------------------------------------- inspect

def cmd_inspect(args: argparse.Namespace) -> int:
    pool = BlockPool.attach(args.name, label="shmkv-inspect")
    try:
        with pool.lock():
            hdr = pool.layout.view(pool._segment.buf, "header")[0].copy()  # as of this hold
            holder = decode_holder(int(hdr["holder"]))
            violations = collect_violations(pool)
        print(f"pool {args.name}  segment {pool._segment.shm_name}  "
              f"({pool.layout.total_bytes:,} bytes, layout v{L.LAYOUT_VERSION})")
        for field in L.HEADER_DTYPE.names:
            value = hdr[field]
            if field == "state":
                value = L.STATE_NAMES.get(int(value), int(value))
            elif field == "magic":
                value = hex(int(value))
            elif field in ("medium", "hash_fn_name"):
                value = bytes(value).decode(errors="replace")
            elif field == "none_hash":
                value = bytes(value).hex()[:16] + "..."
            elif field == "holder":
                value = "free" if holder is None else f"slot {holder[0]}, pid {holder[1]}"
            print(f"  {field:<20} {value}")
        print("regions:")
        for name, offset, nbytes, _ in pool.layout.describe():
            print(f"  {name:<14} offset {offset:>12,}  {nbytes:>14,} B  "
                  f"shape {pool.layout.shapes[name]}")
        n = pool.num_gpu_blocks
        free = pool.get_num_free_blocks()
        cached = len(pool.cached_block_hash_to_block)
        print(f"blocks: {n} total, {free} free, {n - 1 - free} in use, "
              f"{cached} cached keys, usage {pool.get_usage():.1%}")
        print("processes:")
        for proc in pool.processes():
            if proc["self"]:
                continue
            print(f"  slot {proc['slot']:>3}  pid {proc['pid']:>7}  "
                  f"{'alive' if proc['alive'] else 'DEAD '}  refs {proc['references']:>7}  "
                  f"{proc['label']}")
        print("invariants: " + ("OK" if not violations else f"{len(violations)} broken"))
        for v in violations:
            print(f"  {v}")
        return EXIT_OK if not violations else EXIT_PROBLEM
    finally:
        pool.close()


# ---------------------------------------------------------------------------- recover

def cmd_recover(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    pool = BlockPool.attach(args.name, label="shmkv-recover", lock_timeout_s=args.timeout,
                            stuck_after_s=args.stuck_after, _recovering=True)
    try:
        print(f"pool {args.name}: attached as slot {pool.slot} (pid {pool.pid})")
        taken = pool.last_repair
        if taken is None:
            print("  lock: free or held by a live process; no dead hold to roll back")
        else:
            print(f"  lock: taken over: {taken.cause}")
            if taken.rebuilt:
                print("  its hold had overflowed the journal: derived structures rebuilt")
            else:
                print(f"  its hold rolled back: {taken.journal_entries_undone} journaled "
                      "word(s) restored")
            print(f"  reaped with it: {taken.processes_reaped} process(es), "
                  f"{taken.references_released} block reference(s) released")
        for pid in args.reclaim:
            slots = [p["slot"] for p in pool.processes() if p["pid"] == pid and not p["self"]]
            if not slots:
                print(f"  reclaim: no process with pid {pid} is attached", file=sys.stderr)
                return EXIT_ERROR
            released = pool.reclaim_slot(slots[0])
            print(f"  reclaimed slot {slots[0]} (pid {pid}): {released} reference(s) "
                  "released; the process is fenced")
        report = pool.repair()
        print(f"  dead processes reaped: {report['processes_reaped']} "
              f"({report['references_released']} block reference(s) released)")
        found = report["violations_found"]
        print(f"  invariants: {'OK' if not found else f'{len(found)} broken'}")
        for v in found:
            print(f"    {v}")
        if report["rebuilt"] is not None:
            r = report["rebuilt"]
            print(f"  rebuilt: {r.num_free_blocks} free blocks, {r.num_cached_blocks} cached, "
                  f"{r.ref_cnt_fixed} ref counts fixed, {r.hashes_dropped} hashes dropped")
            left = report["violations_left"]
            print(f"  after the rebuild: {'OK' if not left else f'{len(left)} still broken'}")
            for v in left:
                print(f"    {v}")
        free = pool.get_num_free_blocks()
        print(f"  blocks: {free} free of {pool.num_gpu_blocks - 1}; epoch "
              f"{report['epoch']}; {time.perf_counter() - t0:.3f} s")
        return EXIT_OK if not report["violations_left"] else EXIT_PROBLEM
    finally:
        pool.close()


# ---------------------------------------------------------------------------- unlink

def cmd_unlink(args: argparse.Namespace) -> int:
    if BlockPool.unlink(args.name):
        print(f"removed pool {args.name}")
        return EXIT_OK
    print(f"no pool named {args.name}", file=sys.stderr)
    return EXIT_PROBLEM


# ---------------------------------------------------------------------------- cleanup

def orphaned_pools() -> tuple[list[str], list[str]]:
    """(pools of this layout version with no live process attached, segments of another
    layout version). Reads the process tables without attaching (no slot is taken)."""
    import numpy as np

    from shmkv.liveness import AliveLocks, alive_path
    from shmkv.segment import Segment, read_config

    suffix = f"-v{L.LAYOUT_VERSION}"
    orphans, foreign = [], []
    for entry in sorted(os.listdir("/dev/shm")):
        if not entry.startswith("shmkv-") or entry.endswith(".alive"):
            continue
        if not entry.endswith(suffix):
            foreign.append(entry)
            continue
        name = entry[len("shmkv-"):-len(suffix)]
        try:
            segment = Segment.open(f"/{entry}")
        except ShmKVError:
            continue
        try:
            layout = read_config(segment)
            procs = layout.view(segment.buf, "proc_table")
            active = np.flatnonzero(procs["state"] == L.SLOT_ACTIVE).tolist()
            del procs
            alive = AliveLocks(alive_path(f"/{entry}"), create=False)
            try:
                if not any(alive.is_alive(slot) for slot in active):
                    orphans.append(name)
            finally:
                alive.close()
        except ShmKVError:
            orphans.append(name)  # torn or half-created, and nobody can attach to it
        finally:
            segment.close()
    return orphans, foreign


def stale_run_segments() -> list[str]:
    """Entries of /dev/shm that a ``shmkv run`` made (channels, doorbells, block tables, KV
    stores: ``shmkv_<kind>-run<pid>-<id>...``) whose front end is dead: it was SIGKILLed and
    could not remove them. (Its pool is an orphaned pool like any other.)"""
    import re

    pattern = re.compile(r"^(?:sem\.)?shmkv_(?:ch|bt|kv|bell)-run(\d+)-[0-9a-f]{6}(?:-|$)")
    out = []
    for entry in sorted(os.listdir("/dev/shm")):
        m = pattern.match(entry)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            out.append(entry)
    return out


def cmd_cleanup(args: argparse.Namespace) -> int:
    for entry in stale_run_segments():
        if args.dry_run:
            print(f"would remove /dev/shm/{entry} (its shmkv run's front end is dead)")
        else:
            try:
                os.unlink(f"/dev/shm/{entry}")
            except FileNotFoundError:
                continue
            print(f"removed /dev/shm/{entry} (its shmkv run's front end is dead)")
    orphans, foreign = orphaned_pools()
    for name in orphans:
        if args.dry_run:
            print(f"would remove pool {name} (no live process attached)")
        else:
            BlockPool.unlink(name)
            print(f"removed pool {name} (no live process attached)")
    for entry in foreign:
        print(f"left /dev/shm/{entry}: another layout version (remove it with the shmkv "
              "that made it, or by hand)")
    if not orphans:
        print("no orphaned pools")
    return EXIT_OK


# ---------------------------------------------------------------------------- main

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shmkv", description="One KV-cache block pool shared by every scheduler process "
        "on a node.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", required=True)

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

    demo = sub.add_parser("demo", help="several scheduler processes share one pool",
                          description="Starts scheduler processes on one new pool; each "
                          "serves chat requests and prints the prefix hits it got.")
    demo.add_argument("--processes", type=int, default=3, help="scheduler processes (3)")
    demo.add_argument("--requests", type=int, default=6, help="requests per process (6)")
    demo.add_argument("--blocks", type=int, default=256, help="blocks in the pool (256)")
    demo.add_argument("--seed", type=int, default=0, help="random seed (0)")
    demo.add_argument("--timeout", type=float, default=120.0, help="seconds before giving up")
    demo.set_defaults(func=cmd_demo)

    inspect = sub.add_parser("inspect", help="print a live pool's state",
                             description="Header, regions, usage, processes and invariant "
                             "status of a live pool. Exit 1 if an invariant is broken.")
    inspect.add_argument("name", help="pool name")
    inspect.set_defaults(func=cmd_inspect)

    recover = sub.add_parser(
        "recover", help="take over from dead processes, repair, report",
        description="Attaches to a pool (taking the lock over from a holder that died in "
        "it and rolling its hold back), reaps dead processes, checks every invariant and "
        "rebuilds the derived structures if one is broken; a POISONED pool that passes is "
        "READY again. Exit 1 if the pool is still broken.")
    recover.add_argument("name", help="pool name")
    recover.add_argument("--reclaim", type=int, action="append", default=[], metavar="PID",
                         help="also take the slot of this live (stuck) process; it is fenced")
    recover.add_argument("--timeout", type=float, default=30.0,
                         help="seconds to wait for the lock (30)")
    recover.add_argument("--stuck-after", type=float, default=2.0,
                         help="seconds a lock may stand taken with no holder before a dead "
                         "taker is blamed (2)")
    recover.set_defaults(func=cmd_recover)

    unlink = sub.add_parser("unlink", help="remove a pool",
                            description="Removes a pool's segment, lock and lock file. "
                            "Processes that have it mapped keep working. Exit 1 if none.")
    unlink.add_argument("name", help="pool name")
    unlink.set_defaults(func=cmd_unlink)

    cleanup = sub.add_parser("cleanup", help="remove pools no live process is attached to",
                             description="Removes every pool of this layout version whose "
                             "process table names no live process (their creators and users "
                             "died without unlinking), and the channels, doorbells, block "
                             "tables and KV stores of a shmkv run whose front end is dead. A "
                             "process attaching at that very moment keeps working on the "
                             "removed pool.")
    cleanup.add_argument("--dry-run", action="store_true", help="only say what would go")
    cleanup.set_defaults(func=cmd_cleanup)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo" and (args.processes < 1 or args.requests < 1 or args.blocks < 16):
        print("shmkv demo: --processes and --requests must be >= 1, --blocks >= 16",
              file=sys.stderr)
        return EXIT_ERROR
    if args.command == "run" and (args.schedulers < 1 or args.blocks < 16
                                  or args.conversations < 1 or args.max_num_seqs < 1
                                  or args.max_num_batched_tokens < 1):
        print("shmkv run: --schedulers, --conversations, --max-num-seqs and "
              "--max-num-batched-tokens must be >= 1, --blocks >= 16", file=sys.stderr)
        return EXIT_ERROR
    try:
        return args.func(args)
    except KeyboardInterrupt:
        if args.debug:
            raise
        print(f"shmkv {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (ShmKVError, OSError) as exc:
        if args.debug:
            raise
        print(f"shmkv {args.command}: {exc}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
