"""The ``shmkv`` command (``shmkv --help``, ``shmkv COMMAND --help``).

    shmkv run [--pool shared|private] [--routing R] [--schedulers N] [--trace PATH] ...
                                                serve a chat workload with N scheduler
                                                processes (and their model ranks) on one pool
    shmkv demo [--processes N] [--requests R]   several schedulers share one pool
    shmkv create NAME --blocks N [--events]     create a pool and leave it in /dev/shm
    shmkv inspect NAME                          a live pool: header, usage, processes, invariants
    shmkv stats NAME [--interval S]             live figures, refreshed, with rates
    shmkv events NAME [-f] [-n N] [--json]      print / follow the global event log
    shmkv publish NAME --endpoint ADDR          KV events over ZMQ, vLLM's wire format
    shmkv metrics NAME --port P                 Prometheus metrics over HTTP
    shmkv recover NAME [--reclaim PID]          take over from the dead, repair, report
    shmkv unlink NAME                           remove a pool (segment, lock, lock file, siblings)
    shmkv ls [--all] [--json]                   every shmkv object on this machine
    shmkv cleanup [--dry-run]                   remove pools no live process is attached to
                                                (and what a killed ``shmkv run`` left)
    shmkv bench [NAME [ARGS...]] [--list]       the built-in benchmark, or benchmarks/bench_NAME.py
    shmkv index --redis URL --source SPEC...    a cluster-wide prefix index in Redis
    shmkv route --redis URL --tokens IDS        how much of a prompt each pool has cached

Exit codes: 0 success; 1 the command ran and found a problem (broken invariants, nothing to
unlink, a demo process failed, a run with unfinished requests or wrong tokens); 2 bad usage
or an error (message on stderr, no traceback unless ``--debug``). Long-running commands
(publish, metrics, stats, events -f) stop on SIGTERM or Ctrl-C with exit 0; ``run`` stops
its processes, removes its segments, reports and exits 130.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import os
import random
import sys
import time

from shmkv.pool import layout as L
from shmkv.pool.block_pool import BlockPool
from shmkv.errors import ShmKVError
from shmkv.plot import PlotUnavailable
from shmkv.pool.lock import decode_holder
from shmkv.pool.recovery import collect_violations

EXIT_OK, EXIT_PROBLEM, EXIT_ERROR = 0, 1, 2


# ---------------------------------------------------------------------------- demo

SYSTEM_PROMPTS = {
    "assistant": list(range(1000, 1064)),  # 64 tokens: 4 blocks of 16
    "coder": list(range(2000, 2096)),  # 96 tokens: 6 blocks
}


def _demo_scheduler(name: str, index: int, num_requests: int, seed: int, first_done,
                    lines) -> None:
    """One scheduler process: serve requests, report each one's prefix hit."""
    from shmkv.core.request import Request
    from shmkv.stats import PoolStats

    pool = BlockPool.attach(name, label=f"scheduler-{index}")
    stats = PoolStats.open(pool, time_lock=True)  # for `shmkv stats` / `shmkv metrics`
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
        stats.add_prefix_cache(req.num_tokens, len(hits) * bs)
        foreign = sum(1 for b in hits if b.block_id not in own_blocks)
        own_blocks.update(b.block_id for b in new)
        lines.put((index, r, system, req.num_tokens, len(hits) * bs, foreign * bs))
        pool.free_blocks(reversed(blocks))
        if index == 0 and r == 1:
            first_done.set()
    first_done.set()
    stats.close()
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
        from shmkv.stats import unlink_stats

        unlink_stats(name)
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
        try:
            report.plot_timeline([r.figures for r in results], args.plot)
            print(f"  plot: {args.plot}")
        except PlotUnavailable as e:
            print(f"  plot: {e}")
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
        _print_siblings(args.name)
        print("invariants: " + ("OK" if not violations else f"{len(violations)} broken"))
        for v in violations:
            print(f"  {v}")
        return EXIT_OK if not violations else EXIT_PROBLEM
    finally:
        pool.close()


def _print_siblings(name: str) -> None:
    """The pool's publisher position and stats segment, if it has them."""
    from shmkv.publisher import saved_position
    from shmkv.stats import read_stats

    saved = saved_position(name)
    if saved is not None:
        print(f"publisher: {'running' if saved['running'] else 'not running'} (last pid "
              f"{saved['pid']}), next seq {saved['next_seq']}, {saved['published']} batches "
              f"sent, {saved['lost']} events lost")
    rows = read_stats(name)
    if rows is not None:
        recorded = int((rows["pid"] != 0).sum())
        print(f"stats: {recorded} slot(s) recorded, {int(rows['queries'].sum()):,} prefix "
              f"tokens queried, {int(rows['hits'].sum()):,} hit")


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
    from shmkv.publisher import unlink_state
    from shmkv.stats import unlink_stats

    L.validate_pool_name(args.name)
    extras = [what for what, gone in (("publisher position", unlink_state(args.name)),
                                      ("stats", unlink_stats(args.name))) if gone]
    if BlockPool.unlink(args.name):
        print(f"removed pool {args.name}" + (f" (and its {', '.join(extras)})"
                                             if extras else ""))
        return EXIT_OK
    if extras:
        print(f"no pool named {args.name}; removed its leftover {', '.join(extras)}")
        return EXIT_OK
    print(f"no pool named {args.name}", file=sys.stderr)
    return EXIT_PROBLEM


# ---------------------------------------------------------------------------- cleanup

def orphaned_pools() -> tuple[list[str], list[str]]:
    """(pools of this layout version with no live process attached, segments of another
    layout version). Reads the process tables without attaching (no slot is taken)."""
    import numpy as np

    from shmkv.pool.liveness import AliveLocks, alive_path
    from shmkv.pool.segment import Segment, read_config

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
    from shmkv.publisher import saved_position, unlink_state
    from shmkv.stats import unlink_stats

    present = set(os.listdir("/dev/shm"))
    for entry in sorted(present):
        for prefix, unlink in (("shmkv_pub-", unlink_state), ("shmkv_stats-", unlink_stats)):
            if not (entry.startswith(prefix) and entry.endswith("-v1")):
                continue
            name = entry[len(prefix):-len("-v1")]
            if (name not in orphans and L.segment_name(name)[1:] in present) or (
                    prefix == "shmkv_pub-" and (saved_position(name) or {}).get("running")):
                continue  # its pool is still there, or a publisher runs on it
            if args.dry_run:
                print(f"would remove /dev/shm/{entry} (its pool {name} is gone)")
            else:
                unlink(name)
                print(f"removed /dev/shm/{entry} (its pool {name} is gone)")
    for entry in foreign:
        print(f"left /dev/shm/{entry}: another layout version (remove it with the shmkv "
              "that made it, or by hand)")
    if not orphans:
        print("no orphaned pools")
    return EXIT_OK


# ---------------------------------------------------------------------------- publish

class _StopOnSignals:
    """SIGTERM/SIGINT end a long-running command cleanly (exit 0): the handler only sets
    a flag, which the command's loop checks between steps, so no step (a pool call, a
    send and the save of its position) is cut in the middle."""

    def __init__(self) -> None:
        import signal

        self.stopped = False

        def handler(signum, frame):  # noqa: ARG001
            self.stopped = True

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    def sleep(self, seconds: float) -> None:
        """Sleeps up to ``seconds``, less if a signal comes."""
        end = time.monotonic() + seconds
        while not self.stopped and (left := end - time.monotonic()) > 0:
            time.sleep(min(left, 0.05))


def cmd_publish(args: argparse.Namespace) -> int:
    from shmkv.publisher import KVEventPublisher

    pub = KVEventPublisher(args.name, args.endpoint, args.replay_endpoint, args.topic,
                           bind=not args.connect, int_hashes=True if args.int_hashes else None,
                           rank_from=args.rank_from, start=args.start,
                           resume=not args.no_resume)
    try:
        replay = f", replay on {pub.replay_endpoint}" if pub.replay_endpoint else ""
        print(f"publishing pool {args.name} on {pub.endpoint}{replay}, topic "
              f"{args.topic!r}, from seq {pub.next_seq}", flush=True)
        stop = _StopOnSignals()
        deadline = None if args.duration is None else time.monotonic() + args.duration
        while not stop.stopped and (deadline is None or time.monotonic() < deadline):
            pub.poll()
        print(f"published {pub.published} batches ({pub.lost} events lost, {pub.replays} "
              f"replays); next seq {pub.next_seq}", flush=True)
        return EXIT_OK
    finally:
        pub.close()


def add_publish_parser(sub) -> None:
    p = sub.add_parser(
        "publish", help="publish the pool's KV events over ZMQ (vLLM's wire format)",
        description="Publishes every event of the pool's global log on a ZMQ PUB socket as "
        "vLLM does: frames [topic, 8-byte big-endian seq, msgpack KVEventBatch], one batch "
        "per event, whose seq is the event's number in the log; data_parallel_rank names the "
        "scheduler process that caused it. With --replay-endpoint, a ROUTER socket answers "
        "[b'', start seq] with every batch from there and then seq -1. One publisher per "
        "pool; a restarted one resumes right after the last batch sent. Runs until SIGTERM "
        "or Ctrl-C (exit 0). Needs pyzmq (pip install 'shmkv[zmq]').")
    p.add_argument("name", help="pool name")
    p.add_argument("--endpoint", required=True, metavar="ADDR",
                   help="PUB address, e.g. tcp://127.0.0.1:5557 (bound unless --connect)")
    p.add_argument("--replay-endpoint", metavar="ADDR", help="ROUTER address for replays")
    p.add_argument("--topic", default="", help="topic frame ('')")
    p.add_argument("--connect", action="store_true",
                   help="connect the PUB socket (to a relay) instead of binding it")
    p.add_argument("--int-hashes", action="store_true",
                   help="send 32-byte hashes as their 64-bit integer form (low 64 bits)")
    p.add_argument("--rank-from", choices=("slot", "label"), default="slot",
                   help="data_parallel_rank: the process slot, or the trailing number of "
                   "the process label, e.g. scheduler-3 (slot)")
    p.add_argument("--from", dest="start", choices=("oldest", "end"), default="oldest",
                   help="with no saved position: every event still in the log, or only "
                   "new ones (oldest)")
    p.add_argument("--no-resume", action="store_true",
                   help="ignore the position a previous publisher saved")
    p.add_argument("--duration", type=float, metavar="SECONDS",
                   help="stop after this long (default: run until stopped)")
    p.set_defaults(func=cmd_publish)


# ---------------------------------------------------------------------------- create

def cmd_create(args: argparse.Namespace) -> int:
    kwargs = {}
    if args.max_processes is not None:
        kwargs["max_processes"] = args.max_processes
    if args.event_log_bytes is not None:
        kwargs["event_log_bytes"] = args.event_log_bytes
    pool = BlockPool.create(args.name, args.blocks, enable_caching=not args.no_caching,
                            hash_block_size=args.block_size,
                            enable_kv_cache_events=args.events, label="shmkv-create",
                            **kwargs)
    try:
        print(f"created pool {args.name}: {args.blocks} blocks of {args.block_size} tokens, "
              f"{pool.layout.total_bytes:,} bytes in /dev/shm{pool._segment.shm_name}, "
              f"events {'on' if args.events else 'off'}, "
              f"{pool.layout.config.max_processes} process slots")
    finally:
        pool.close()
    print(f"it stays until `shmkv unlink {args.name}` (or `shmkv cleanup` while no process "
          "is attached)")
    return EXIT_OK


def add_create_parser(sub) -> None:
    p = sub.add_parser("create", help="create a pool and leave it in /dev/shm",
                       description="Creates a new pool segment for schedulers to attach "
                       "to, then exits (the pool stays). Exit 2 if it exists already.")
    p.add_argument("name", help="pool name")
    p.add_argument("--blocks", type=int, required=True, help="blocks in the pool (with the "
                   "null block)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per hash block (16)")
    p.add_argument("--events", action="store_true", help="keep the global KV-event log "
                   "(needed by publish, events, and the eviction metrics)")
    p.add_argument("--event-log-bytes", type=int, help="size of the event ring (4 MiB)")
    p.add_argument("--max-processes", type=int, help="process-table slots")
    p.add_argument("--no-caching", action="store_true", help="no prefix caching")
    p.set_defaults(func=cmd_create)


# ---------------------------------------------------------------------------- stats

def _format_snapshot(s, prev, dt: float) -> list[str]:
    def rate(now: int, before: int | None) -> str:
        return "" if before is None or dt <= 0 else f" ({(now - before) / dt:,.0f}/s)"

    hit = s.hits / s.queries if s.queries else 0.0
    lines = [
        f"pool {s.pool}  {time.strftime('%H:%M:%S')}",
        f"  blocks   {s.num_blocks} total, {s.free} free, {s.in_use} in use, {s.cached} "
        f"cached keys, usage {s.usage:.1%}",
        f"  procs    {s.alive} alive, {s.dead} dead (not reaped); {s.reaped} reaped, "
        f"{s.repairs} repairs, {s.takeovers} lock take-overs",
        f"  lock     {s.lock_acquisitions:,} holds"
        f"{rate(s.lock_acquisitions, prev and prev.lock_acquisitions)}",
        f"  prefix   {s.queries:,} tokens queried, {s.hits:,} hit ({hit:.1%})"
        f"{rate(s.queries, prev and prev.queries)}",
        f"  events   {s.events_logged:,} logged{rate(s.events_logged, prev and prev.events_logged)}"
        f", {s.evictions:,} evictions{rate(s.evictions, prev and prev.evictions)}, "
        f"{s.events_dropped} dropped",
    ]
    for slot, row in sorted(s.engines.items()):
        waits, holds = row["lock_wait_count"], row["lock_hold_count"]
        mean_wait = row["lock_wait_sum_ns"] / waits / 1e3 if waits else 0.0
        mean_hold = row["lock_hold_sum_ns"] / holds / 1e3 if holds else 0.0
        lines.append(f"  slot {slot:>3} pid {row['pid']:>7}: {row['queries']:,} queried, "
                     f"{row['hits']:,} hit; lock mean wait {mean_wait:.1f} us, hold "
                     f"{mean_hold:.1f} us over {holds:,} holds")
    return lines


def cmd_stats(args: argparse.Namespace) -> int:
    from shmkv.metrics import PoolMetrics

    pool = BlockPool.attach(args.name, label="shmkv-stats")
    try:
        metrics = PoolMetrics(pool)
        prev, t_prev = None, time.monotonic()
        stop = _StopOnSignals()
        shown = 0
        clear = sys.stdout.isatty() and not args.no_clear
        while not stop.stopped and (args.count is None or shown < args.count):
            if shown:
                stop.sleep(args.interval)
                if stop.stopped:
                    break
            snap, now = metrics.snapshot(), time.monotonic()
            text = "\n".join(_format_snapshot(snap, prev, now - t_prev))
            print(("\033[H\033[J" if clear else "") + text, flush=True)
            prev, t_prev = snap, now
            shown += 1
        return EXIT_OK
    finally:
        pool.close()


def add_stats_parser(sub) -> None:
    p = sub.add_parser("stats", help="live figures of a pool, refreshed",
                       description="Prints a live pool's usage, processes, lock holds, "
                       "prefix-cache queries and hits (recorded by processes that use "
                       "shmkv.stats.PoolStats) and evictions, every --interval seconds "
                       "with rates, until Ctrl-C or --count refreshes.")
    p.add_argument("name", help="pool name")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (1)")
    p.add_argument("--count", type=int, help="stop after this many refreshes")
    p.add_argument("--no-clear", action="store_true", help="do not clear the terminal")
    p.set_defaults(func=cmd_stats)


# ---------------------------------------------------------------------------- events

def _event_line(logged, labels: dict[int, tuple[str, int]]) -> str:
    from shmkv.events import BlockRemoved, BlockStored

    e = logged.event
    label, since_ns = labels.get(logged.slot, ("", 0))
    # a slot's label now is that of the process attached now: it names the event's
    # process only if that one attached before the event
    who = label if since_ns <= logged.ts * 1e9 else ""
    head = f"{logged.seq:>8}  {logged.ts:.6f}  slot {logged.slot:>3} {who:<14}"

    def h(x) -> str:
        return f"{x:016x}" if isinstance(x, int) else bytes(x).hex()[:16]

    if isinstance(e, BlockStored):
        parent = "-" if e.parent_block_hash is None else h(e.parent_block_hash)
        return (f"{head} BlockStored   {len(e.block_hashes)} block(s) "
                f"[{', '.join(h(x) for x in e.block_hashes[:4])}"
                f"{', ...' if len(e.block_hashes) > 4 else ''}] parent {parent} "
                f"group {e.group_idx} {len(e.token_ids)} tokens")
    if isinstance(e, BlockRemoved):
        return (f"{head} BlockRemoved  [{', '.join(h(x) for x in e.block_hashes)}] "
                f"group {e.group_idx}")
    return f"{head} {type(e).__name__}"


def cmd_events(args: argparse.Namespace) -> int:
    import msgspec

    from shmkv.pool.event_log import LoggedEvent, decode_event

    pool = BlockPool.attach(args.name, label="shmkv-events")
    try:
        if not pool._log.capacity:
            print(f"shmkv events: pool {args.name} has no event log (created without "
                  "events)", file=sys.stderr)
            return EXIT_ERROR
        cursor = pool.event_cursor(from_start=args.start == "oldest")
        if args.follow:
            print(f"following pool {args.name} from seq {cursor.seq}", file=sys.stderr,
                  flush=True)
        labels: dict[int, tuple[str, int]] = {}
        printed = 0
        stop = _StopOnSignals()
        while not stop.stopped and (args.count is None or printed < args.count):
            limit = 64 if args.count is None else min(64, args.count - printed)
            with pool.lock():  # copy a few records under the lock, decode after
                records, lost = pool._log.read_raw(cursor, limit)
            events = [LoggedEvent(seq, slot, ts, decode_event(body))
                      for seq, slot, ts, body in records]
            if lost:
                print(f"({lost} events lost: overwritten before they were read)",
                      file=sys.stderr, flush=True)
            if events and any(e.slot not in labels for e in events):
                labels.update({p["slot"]: (p["label"], p["attach_ns"])
                               for p in pool.processes() if not p["self"]})
            for logged in events:
                if args.json:
                    print(msgspec.json.encode({
                        "seq": logged.seq, "slot": logged.slot, "ts": logged.ts,
                        "event": logged.event}).decode())
                else:
                    print(_event_line(logged, labels))
                printed += 1
            sys.stdout.flush()
            if not args.follow and not events:
                break
            if not events:
                stop.sleep(args.interval)
        return EXIT_OK
    finally:
        pool.close()


def add_events_parser(sub) -> None:
    p = sub.add_parser("events", help="print (and follow) the pool's global event log",
                       description="Prints the events of every process from the pool's "
                       "global log, in order, one line each (seq, time, process slot and "
                       "label, event), or as JSON lines; with --follow, waits for new ones "
                       "until Ctrl-C. Exit 2 if the pool has no log.")
    p.add_argument("name", help="pool name")
    p.add_argument("--from", dest="start", choices=("oldest", "end"), default="oldest",
                   help="the oldest event still in the log, or only new ones (oldest)")
    p.add_argument("-f", "--follow", action="store_true", help="keep waiting for events")
    p.add_argument("-n", "--count", type=int, help="stop after this many events")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument("--interval", type=float, default=0.1, help="poll interval with --follow")
    p.set_defaults(func=cmd_events)


# ---------------------------------------------------------------------------- metrics

def cmd_metrics(args: argparse.Namespace) -> int:
    from shmkv.metrics import serve

    pool = BlockPool.attach(args.name, label="shmkv-metrics")
    try:
        try:
            server, thread, _ = serve(pool, args.port, args.addr)
        except OSError as exc:
            print(f"shmkv metrics: cannot listen on {args.addr}:{args.port}: {exc}",
                  file=sys.stderr)
            return EXIT_ERROR
        print(f"serving metrics of pool {args.name} on "
              f"http://{args.addr}:{server.server_port}/metrics", flush=True)
        stop = _StopOnSignals()
        stop.sleep(float("inf") if args.duration is None else args.duration)
        server.shutdown()
        thread.join(10)
        return EXIT_OK
    finally:
        pool.close()


def add_metrics_parser(sub) -> None:
    p = sub.add_parser("metrics", help="serve a pool's Prometheus metrics over HTTP",
                       description="Serves a live pool's metrics at http://ADDR:PORT/metrics "
                       "(vLLM's names where the meaning is the same: vllm:kv_cache_usage_perc,"
                       " vllm:prefix_cache_queries/hits; shmkv_* for the rest, see "
                       "shmkv/metrics.py) until SIGTERM or Ctrl-C. Needs prometheus-client "
                       "(pip install 'shmkv[metrics]').")
    p.add_argument("name", help="pool name")
    p.add_argument("--port", type=int, required=True, help="TCP port (0: any free one)")
    p.add_argument("--addr", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    p.add_argument("--duration", type=float, metavar="SECONDS",
                   help="stop after this long (default: run until stopped)")
    p.set_defaults(func=cmd_metrics)


# ---------------------------------------------------------------------------- ls

def list_objects() -> list[dict]:
    """Every shmkv object in /dev/shm: pools (with owner, size, processes, creator alive),
    their locks and liveness files, and sibling objects (channels, doorbells, publisher
    positions, stats, block tables...), each with the pool it belongs to if any."""
    import pwd

    import numpy as np

    from shmkv.pool.liveness import AliveLocks, alive_path
    from shmkv.pool.segment import Segment, read_config

    def owner_of(st) -> str:
        try:
            return pwd.getpwuid(st.st_uid).pw_name
        except KeyError:
            return str(st.st_uid)

    out = []
    for entry in sorted(os.listdir("/dev/shm")):
        path = f"/dev/shm/{entry}"
        base = entry[len("sem."):] if entry.startswith("sem.") else entry
        if not (base.startswith("shmkv-") or base.startswith("shmkv_")):
            continue
        try:
            st = os.stat(path)
        except FileNotFoundError:
            continue
        row = {"entry": entry, "owner": owner_of(st), "bytes": st.st_size, "kind": "other",
               "name": base, "version": None, "processes": None, "alive": None,
               "creator_alive": None, "note": ""}
        out.append(row)
        if entry.startswith("sem."):
            row["kind"] = "lock" if base.endswith(".lock") else "semaphore"
            if base.startswith("shmkv_bell-"):
                row["kind"] = "doorbell"
            row["name"] = base.removesuffix(".lock")
            continue
        if entry.endswith(".alive"):
            row["kind"] = "liveness"
            row["name"] = base.removesuffix(".alive")
            continue
        head, sep, version = base.rpartition("-v")
        if sep and version.isdigit():
            row["version"] = int(version)
        if base.startswith("shmkv_"):
            kind, _, rest = head[len("shmkv_"):].partition("-")
            known = {"ch": "channel", "pub": "publisher", "stats": "stats"}
            row["kind"] = known.get(kind, "sibling")
            row["name"] = rest if kind in known else head[len("shmkv_"):]
            if kind == "pub":
                from shmkv.publisher import saved_position

                saved = saved_position(rest) if row["version"] == 1 else None
                if saved:
                    row["note"] = (f"next seq {saved['next_seq']}, "
                                   f"{'running' if saved['running'] else 'stopped'}")
            continue
        row["kind"] = "pool"
        row["name"] = head[len("shmkv-"):] if sep else base[len("shmkv-"):]
        if row["version"] != L.LAYOUT_VERSION:
            row["note"] = f"layout v{row['version']}, not this shmkv's v{L.LAYOUT_VERSION}"
            continue
        try:
            segment = Segment.open(f"/{entry}")
        except ShmKVError as exc:
            row["note"] = str(exc)
            continue
        try:
            layout = read_config(segment)
            hdr = layout.view(segment.buf, "header")[0]
            creator = int(hdr["creator_pid"])
            del hdr
            procs = layout.view(segment.buf, "proc_table")
            active = np.flatnonzero(procs["state"] == L.SLOT_ACTIVE).tolist()
            pids = {slot: int(procs[slot]["pid"]) for slot in active}
            del procs
            alive = AliveLocks(alive_path(f"/{entry}"), create=False)
            try:
                live = [slot for slot in active if alive.is_alive(slot)]
            finally:
                alive.close()
            row["processes"], row["alive"] = len(active), len(live)
            row["creator_alive"] = any(pids[slot] == creator for slot in live)
            row["note"] = f"{layout.config.num_blocks} blocks, creator pid {creator}"
        except (ShmKVError, OSError) as exc:
            row["note"] = f"unreadable: {exc}"
        finally:
            segment.close()
    pools = sorted((r["name"] for r in out if r["kind"] == "pool"), key=len, reverse=True)
    for r in out:
        if r["kind"] in ("pool", "lock", "liveness"):
            continue
        bare = r["name"].removeprefix("shmkv_bell-")
        owner = next((p for p in pools if bare == p or bare.startswith(p + "-")
                      or bare.startswith(p + "+")), None)
        if owner is not None:
            r["pool"] = owner
            r["note"] = (r["note"] + "; " if r["note"] else "") + f"of pool {owner}"
    return out


def cmd_ls(args: argparse.Namespace) -> int:
    rows = list_objects()
    if not args.all:
        rows = [r for r in rows if r["kind"] not in ("lock", "liveness")]
    if args.json:
        import json

        print(json.dumps(rows, indent=1))
        return EXIT_OK
    if not rows:
        print("no shmkv objects in /dev/shm")
        return EXIT_OK
    print(f"{'KIND':<10} {'NAME':<44} {'OWNER':<8} {'BYTES':>13} {'PROCS':>9} "
          f"{'CREATOR':<8} NOTE")
    for r in rows:
        procs = "" if r["processes"] is None else f"{r['alive']}/{r['processes']}"
        creator = "" if r["creator_alive"] is None else (
            "alive" if r["creator_alive"] else "gone")
        print(f"{r['kind']:<10} {r['name']:<44} {r['owner']:<8} {r['bytes']:>13,} "
              f"{procs:>9} {creator:<8} {r['note']}")
    pools = [r for r in rows if r["kind"] == "pool"]
    print(f"{len(pools)} pool(s), {len(rows) - len(pools)} other object(s); PROCS = alive/"
          "attached")
    return EXIT_OK


def add_ls_parser(sub) -> None:
    p = sub.add_parser("ls", help="list every shmkv object on this machine",
                       description="Lists the shmkv objects in /dev/shm: pools (owner, "
                       "size, attached processes alive/total, whether the creator is "
                       "alive), message channels and their doorbells, publisher positions, "
                       "stats segments and other siblings; --all adds pool locks and "
                       "liveness files. Reads process tables without attaching.")
    p.add_argument("--all", action="store_true", help="also pool locks and liveness files")
    p.add_argument("--json", action="store_true", help="a JSON list, for scripts")
    p.set_defaults(func=cmd_ls)


# ---------------------------------------------------------------------------- bench

def _benchmarks_dir():
    from pathlib import Path

    here = Path(__file__).resolve().parent.parent / "benchmarks"
    return here if here.is_dir() else None


def _builtin_bench(args: argparse.Namespace) -> int:
    from shmkv.core.request import Request

    name = f"bench-{os.getpid()}"
    pool = BlockPool.create(name, args.blocks, label="shmkv-bench")
    try:
        rows = []
        n = args.iterations
        for width in (1, 16):
            t0 = time.perf_counter_ns()
            for _ in range(n):
                pool.free_blocks(pool.get_new_blocks(width))
            rows.append((f"get_new_blocks + free_blocks, {width} block(s)",
                         (time.perf_counter_ns() - t0) / n / width))
        hasher = pool.make_block_hasher()
        req = Request("bench", list(range(16 * 16)), block_hasher=hasher)
        blocks = pool.get_new_blocks(16)
        pool.cache_full_blocks(req, blocks, 0, 16, 16, 0)
        t0 = time.perf_counter_ns()
        for _ in range(n):
            pool.get_cached_block(req.block_hashes[7], [0])
        rows.append(("get_cached_block, hit", (time.perf_counter_ns() - t0) / n))
        t0 = time.perf_counter_ns()
        for _ in range(n):
            pool.get_cached_prefix(req.block_hashes)
        rows.append(("get_cached_prefix, 16 blocks", (time.perf_counter_ns() - t0) / n / 16))
        pool.free_blocks(reversed(blocks))
        print(f"built-in benchmark: {args.blocks} blocks, {n} iterations, kernel "
              f"{pool.kernel}")
        for what, ns in rows:
            print(f"  {what:<40} {ns:>10,.0f} ns per block")
        return EXIT_OK
    finally:
        pool.close()
        BlockPool.unlink(name)


def cmd_bench(args: argparse.Namespace) -> int:
    import subprocess

    bench_dir = _benchmarks_dir()
    scripts = sorted(p.stem[len("bench_"):] for p in bench_dir.glob("bench_*.py")) \
        if bench_dir else []
    if args.list:
        print("built-in: shmkv bench (no name): a few-second single-process benchmark")
        if bench_dir:
            print(f"scripts in {bench_dir}: " + ", ".join(scripts))
        else:
            print("no benchmarks/ directory next to this shmkv (it ships with the source "
                  "tree, not the installed package)")
        return EXIT_OK
    if args.script is None:
        if args.iterations < 1 or args.blocks < 32:
            print("shmkv bench: --iterations must be >= 1 and --blocks >= 32",
                  file=sys.stderr)
            return EXIT_ERROR
        return _builtin_bench(args)
    if bench_dir is None:
        print(f"shmkv bench: no benchmarks/ directory next to {os.path.dirname(__file__)}: "
              "the benchmark scripts ship with the source tree (git clone), not the "
              "installed package; `shmkv bench` alone runs the built-in one",
              file=sys.stderr)
        return EXIT_ERROR
    if args.script not in scripts:
        print(f"shmkv bench: no benchmark {args.script!r}; there are: {', '.join(scripts)}",
              file=sys.stderr)
        return EXIT_ERROR
    script = bench_dir / f"bench_{args.script}.py"
    env = dict(os.environ)
    root = str(bench_dir.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH")
                                else "")
    return subprocess.call([sys.executable, str(script), *args.script_args], env=env,
                           cwd=root)


def add_bench_parser(sub) -> None:
    p = sub.add_parser(
        "bench", help="run a benchmark",
        description="Without a name: a short built-in single-process benchmark (ns per "
        "block of allocate+free, lookup, prefix lookup). With a name: runs "
        "benchmarks/bench_NAME.py of the source tree (block_pool, contention, "
        "kv_cache_manager, locks, recovery, transport), passing the arguments after the "
        "name; its exit code is returned. --list shows what is there.")
    p.add_argument("script", nargs="?", help="benchmark script name, e.g. block_pool")
    p.add_argument("script_args", nargs=argparse.REMAINDER,
                   help="arguments for the script (e.g. --quick)")
    p.add_argument("--list", action="store_true", help="list the benchmarks")
    p.add_argument("--iterations", type=int, default=20_000,
                   help="built-in: iterations per operation (20000)")
    p.add_argument("--blocks", type=int, default=4096, help="built-in: pool size (4096)")
    p.set_defaults(func=cmd_bench)


# ------------------------------------------------------------- cluster index (Redis)

def _parse_source(text: str):
    """``NAME=PUB_ENDPOINT,REPLAY_ENDPOINT[,NODE]`` -> IndexSource."""
    from shmkv.cluster_index import IndexSource
    from shmkv.errors import UsageError

    name, sep, rest = text.partition("=")
    parts = rest.split(",") if sep else []
    if not name or len(parts) not in (2, 3) or not all(parts):
        raise UsageError(f"--source {text!r}: expected NAME=PUB_ENDPOINT,REPLAY_ENDPOINT[,NODE]"
                         ", e.g. node0=tcp://10.0.0.5:5557,tcp://10.0.0.5:5558")
    return IndexSource(name, parts[0], parts[1], node=parts[2] if len(parts) == 3 else None)


def _connect_index(args: argparse.Namespace):
    from shmkv.cluster_index import RedisPrefixIndex

    try:
        import redis
    except ImportError:
        raise ShmKVError("the cluster index needs the redis package: "
                         "pip install 'shmkv[redis]'") from None
    index = RedisPrefixIndex.from_url(args.redis, args.key_prefix)
    try:
        index.ping()
    except redis.RedisError as exc:
        raise ShmKVError(f"cannot reach Redis at {args.redis}: {exc}") from None
    return index


def cmd_index(args: argparse.Namespace) -> int:
    from shmkv.cluster_index import ClusterIndexer

    sources = [_parse_source(text) for text in args.source]
    index = _connect_index(args)
    with ClusterIndexer(index, sources, identity_check_s=args.identity_check) as indexer:
        print(f"indexing {len(sources)} source(s) into {args.redis} (key prefix "
              f"{args.key_prefix!r}): " + ", ".join(src.name for src in sources), flush=True)
        stop = _StopOnSignals()
        deadline = None if args.duration is None else time.monotonic() + args.duration
        while not stop.stopped and (deadline is None or time.monotonic() < deadline):
            indexer.poll()
        st = indexer.stats
        print(f"applied {st.applied} batches live, {st.replayed} by replay, {st.snapshots} "
              f"snapshots, {st.duplicates} duplicates, {st.redis_errors} Redis errors",
              flush=True)
    return EXIT_OK


def add_index_parser(sub) -> None:
    p = sub.add_parser(
        "index", help="keep a cluster-wide prefix index in Redis from pools' event streams",
        description="Subscribes to the KV-event streams of one or more pools (each served by "
        "`shmkv publish NAME --endpoint ... --replay-endpoint ...`, on any node) and keeps, "
        "in Redis, which pool holds every cached block, exactly: it catches up by replay "
        "after its own restart, and from a snapshot of the pool after a Redis restart, "
        "lost events or a re-created pool. Runs until SIGTERM or Ctrl-C (exit 0). Needs "
        "pyzmq and redis (pip install 'shmkv[zmq,redis]').")
    p.add_argument("--redis", default="redis://127.0.0.1:6379/0", metavar="URL",
                   help="Redis URL (redis://127.0.0.1:6379/0)")
    p.add_argument("--source", action="append", required=True, metavar="SPEC",
                   help="NAME=PUB_ENDPOINT,REPLAY_ENDPOINT[,NODE]; repeat for each pool")
    p.add_argument("--key-prefix", default="shmkv", help="prefix of every Redis key (shmkv)")
    p.add_argument("--identity-check", type=float, default=1.0, metavar="S",
                   help="seconds between checks that each pool is still the same (1)")
    p.add_argument("--duration", type=float, default=None, help="stop after S seconds")
    p.set_defaults(func=cmd_index)


def cmd_route(args: argparse.Namespace) -> int:
    import json

    from shmkv.cluster_index import PrefixRouter

    if args.tokens is not None:
        text = args.tokens
    else:
        with open(args.prompt_file) as f:
            text = f.read()
    try:
        tokens = [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        print("shmkv route: the prompt must be token ids (integers separated by spaces or "
              "commas)", file=sys.stderr)
        return EXIT_ERROR
    if not tokens:
        print("shmkv route: the prompt is empty", file=sys.stderr)
        return EXIT_ERROR
    index = _connect_index(args)
    router = PrefixRouter(index, hash_block_size=args.hash_block_size,
                          hash_fn_name=args.hash_fn)
    cached = router.cached_tokens(tokens, cache_salt=args.cache_salt)
    known = {st.source: st for st in index.sources()}
    rows = sorted(({"source": name, "node": st.node, "cached_tokens": cached.get(name, 0)}
                   for name, st in known.items()), key=lambda r: -r["cached_tokens"])
    if args.json:
        print(json.dumps({"prompt_tokens": len(tokens), "sources": rows}))
        return EXIT_OK
    print(f"prompt: {len(tokens)} tokens; {len(known)} source(s) in the index")
    for row in rows:
        print(f"  {row['source']:<24} node {row['node']:<16} {row['cached_tokens']:>7} "
              "tokens cached")
    return EXIT_OK


def add_route_parser(sub) -> None:
    p = sub.add_parser(
        "route", help="how much of a prompt each pool has cached, from the Redis index",
        description="Hashes the prompt as the pools do and asks the index (one round trip) "
        "for the longest cached prefix on every source. Exit 0.")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--tokens", help="token ids, e.g. '1 2 3' or '1,2,3'")
    prompt.add_argument("--prompt-file", metavar="PATH", help="a file of token ids")
    p.add_argument("--redis", default="redis://127.0.0.1:6379/0", metavar="URL")
    p.add_argument("--key-prefix", default="shmkv")
    p.add_argument("--cache-salt", default=None)
    p.add_argument("--hash-block-size", type=int, default=16,
                   help="the pools' hash_block_size (16)")
    p.add_argument("--hash-fn", default="sha256", help="the pools' hash function (sha256)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_route)


# ---------------------------------------------------------------------------- main

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shmkv", description="One KV-cache block pool shared by every scheduler process "
        "on a node.", epilog="Exit codes: 0 success; 1 the command ran and found a problem "
        "(broken invariants, nothing to unlink, a demo process failed); 2 bad usage or an "
        "error (one line on stderr; --debug shows the traceback). publish, metrics, stats "
        "and events --follow run until SIGTERM or Ctrl-C and then exit 0.")
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

    add_create_parser(sub)
    add_stats_parser(sub)
    add_events_parser(sub)
    add_publish_parser(sub)
    add_metrics_parser(sub)
    add_ls_parser(sub)
    add_bench_parser(sub)
    add_index_parser(sub)
    add_route_parser(sub)
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
    except BrokenPipeError:  # `shmkv events NAME | head`: the reader left; not an error
        try:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115  (no flush error at exit)
        except OSError:
            pass
        return EXIT_OK
    except KeyboardInterrupt:
        if args.debug:
            raise
        return 130
    except (ShmKVError, OSError) as exc:
        if args.debug:
            raise
        print(f"shmkv {args.command}: {exc}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
