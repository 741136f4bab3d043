"""The ``shmkv`` command.

    shmkv demo [--processes N] [--requests R]   several schedulers share one pool
    shmkv inspect NAME                          a live pool: header, usage, processes, invariants
    shmkv recover NAME [--reclaim PID]          take over from the dead, repair, report
    shmkv unlink NAME                           remove a pool's segment, lock and lock file
    shmkv cleanup [--dry-run]                   remove pools no live process is attached to

Exit codes: 0 success; 1 the command ran and found a problem (broken invariants, nothing to
unlink, a demo process failed); 2 bad usage or an error (message on stderr, no traceback
unless ``--debug``).
"""

from __future__ import annotations

import argparse
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


def cmd_cleanup(args: argparse.Namespace) -> int:
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


# ---------------------------------------------------------------------------- publish

class _Stop(Exception):
    """SIGTERM/SIGINT: leave a long-running command cleanly (exit 0)."""


def _stop_on_signals() -> None:
    import signal

    def handler(signum, frame):  # noqa: ARG001
        raise _Stop()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


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
        _stop_on_signals()
        deadline = None if args.duration is None else time.monotonic() + args.duration
        try:
            while deadline is None or time.monotonic() < deadline:
                pub.poll()
        except _Stop:
            pass
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


# ---------------------------------------------------------------------------- main

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shmkv", description="One KV-cache block pool shared by every scheduler process "
        "on a node.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", required=True)

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
                             "died without unlinking). A process attaching at that very "
                             "moment keeps working on the removed pool.")
    cleanup.add_argument("--dry-run", action="store_true", help="only say what would go")
    cleanup.set_defaults(func=cmd_cleanup)

    add_publish_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo" and (args.processes < 1 or args.requests < 1 or args.blocks < 16):
        print("shmkv demo: --processes and --requests must be >= 1, --blocks >= 16",
              file=sys.stderr)
        return EXIT_ERROR
    try:
        return args.func(args)
    except (ShmKVError, OSError) as exc:
        if args.debug:
            raise
        print(f"shmkv {args.command}: {exc}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
