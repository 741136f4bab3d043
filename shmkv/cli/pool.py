"""``shmkv`` commands on pools: ``create``, ``inspect``, ``stats``, ``recover``,
``unlink``; ``ls`` and ``cleanup`` over every pool of the machine; ``demo`` and ``bench``,
which make a pool of their own."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import stat
import sys
import time

from shmkv.cli.common import (
    EXIT_ERROR,
    EXIT_OK,
    EXIT_PROBLEM,
    StopOnSignals,
    attach_pool,
    missing_pool_message,
)
from shmkv.errors import SegmentError, ShmKVError, UsageError
from shmkv.pool import layout as L
from shmkv.pool.block_pool import BlockPool
from shmkv.pool.lock import decode_holder
from shmkv.pool.recovery import collect_violations
from shmkv.pool.tier_counters import TierFiles, read_tier_counts, row_name

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
    if args.processes < 1 or args.requests < 1 or args.blocks < 16:
        print("shmkv demo: --processes and --requests must be >= 1, --blocks >= 16",
              file=sys.stderr)
        return EXIT_ERROR
    name = f"demo-{os.getpid()}"
    ctx = mp.get_context("spawn")
    pool = BlockPool.create(name, args.blocks, enable_kv_cache_events=True,
                            max_processes=args.processes + 2, label="demo")
    print(f"pool {name}: {args.blocks} blocks of {pool.hash_block_size} tokens in "
          f"/dev/shm{pool.segment_name}; {args.processes} scheduler processes, "
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
              f"{pool.num_gpu_blocks - 1} usable")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
        pool.close()
        BlockPool.unlink(name)  # with its stats
    return status


def add_demo_parser(sub) -> None:
    demo = sub.add_parser("demo", help="several scheduler processes share one pool",
                          description="Starts scheduler processes on one new pool; each "
                          "serves chat requests and prints the prefix hits it got.")
    demo.add_argument("--processes", type=int, default=3, help="scheduler processes (3)")
    demo.add_argument("--requests", type=int, default=6, help="requests per process (6)")
    demo.add_argument("--blocks", type=int, default=256, help="blocks in the pool (256)")
    demo.add_argument("--seed", type=int, default=0, help="random seed (0)")
    demo.add_argument("--timeout", type=float, default=120.0, help="seconds before giving up")
    demo.set_defaults(func=cmd_demo)


# ---------------------------------------------------------------------------- inspect

def blocks_text(num_gpu_blocks: int) -> str:
    """A pool's size, said the same way by every command (and counted as ``shmkv_blocks
    {state="total"}`` of the metrics): the usable blocks, the null block apart."""
    return (f"{num_gpu_blocks - 1} usable (of {num_gpu_blocks}: block 0 is the null block, "
            "never handed out)")


RETENTION_WORDS = {
    L.RETENTION_UNRECORDED: "not recorded: kept, as if it stays",
    L.RETENTION_SCOPED: "lives while a process holds it",
    L.RETENTION_STAYS: "stays until unlinked",
}


def cmd_inspect(args: argparse.Namespace) -> int:
    from shmkv.metrics import blocks_with_data

    pool = attach_pool(args.name, label="shmkv-inspect")
    try:
        # The holder as it stands before this command takes the lock (inside its own hold
        # the header would name the inspect itself).
        holder = pool.holder()
        with TierFiles(args.name) as tier_files, pool.lock():  # the files opened before
            hdr = pool.header_snapshot()  # as of this hold
            violations = collect_violations(pool)
            tier = read_tier_counts(pool, tier_files)
            with_data = blocks_with_data(pool)
        if getattr(args, "keys", False):
            from shmkv.cli.keys import print_keys

            return print_keys(pool, args)
        print(f"pool {args.name}  segment {pool.segment_name}  "
              f"({pool.layout.total_bytes:,} bytes, layout v{L.LAYOUT_VERSION})")
        for field in L.HEADER_DTYPE.names:
            value = hdr[field]
            if field == "state":
                value = L.STATE_NAMES.get(int(value), int(value))
            elif field == "magic":
                value = hex(int(value))
            elif field in ("medium", "hash_fn_name", "stays_by"):
                value = bytes(value).decode(errors="replace")
            elif field == "retention":
                value = f"{int(value)} ({RETENTION_WORDS.get(int(value), 'unknown')})"
            elif field in ("pool_id", "tier_of"):
                value = bytes(value).hex() if any(bytes(value)) else "none"
            elif field == "none_hash":
                value = bytes(value).hex()[:16] + "..."
            elif field == "holder":  # read before this command's own hold
                value = "free" if holder is None else f"slot {holder[0]}, pid {holder[1]}"
            print(f"  {field:<20} {value}")
        print("regions:")
        for name, offset, nbytes, _ in pool.layout.describe():
            print(f"  {name:<14} offset {offset:>12,}  {nbytes:>14,} B  "
                  f"shape {pool.layout.shapes[name]}")
        n = pool.num_gpu_blocks
        free = pool.get_num_free_blocks()
        cached = len(pool.cached_block_hash_to_block)
        print(f"blocks: {blocks_text(n)}, {free} free, {n - 1 - free} in use, "
              f"{cached} cached keys; {usage_text(n - 1 - free, with_data, n - 1)}")
        print("processes:")
        for proc in pool.processes():
            if proc["self"]:
                continue
            print(f"  slot {proc['slot']:>3}  pid {proc['pid']:>7}  "
                  f"{'alive' if proc['alive'] else 'DEAD '}  refs {proc['references']:>7}  "
                  f"{proc['label']}")
        _print_siblings(args.name)
        if tier is not None:
            print("\n".join(tier_lines(tier)))
        for note in tier_files.notes:
            print(note)
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

    try:
        saved = saved_position(name)
    except SegmentError as exc:  # something planted at its path: not read
        saved = None
        print(f"publisher: not read: {exc}")
    if saved is not None:
        print(f"publisher: {'running' if saved['running'] else 'not running'} (last pid "
              f"{saved['pid']}), next seq {saved['next_seq']}, {saved['published']} batches "
              f"sent, {saved['lost']} events lost")
    try:
        rows = read_stats(name)
    except SegmentError as exc:
        rows = None
        print(f"stats: not read: {exc}")
    if rows is not None:
        recorded = int((rows["pid"] != 0).sum())
        print(f"stats: {recorded} slot(s) recorded, {int(rows['queries'].sum()):,} prefix "
              f"tokens queried, {int(rows['hits'].sum()):,} hit")


def add_inspect_parser(sub) -> None:
    inspect = sub.add_parser("inspect", help="print a live pool's state (--keys: its cache)",
                             description="Header, regions, usage, processes and invariant "
                             "status of a live pool. Exit 1 if an invariant is broken. "
                             "--keys lists the cached blocks instead: KV-cache group, hash, "
                             "tokens, reference count, place in the eviction (LRU) order, "
                             "the process that cached it (from the event log, if the pool "
                             "keeps one) and the processes holding it.")
    inspect.add_argument("name", help="pool name")
    inspect.add_argument("--keys", action="store_true",
                         help="list the cached blocks (evictable ones in eviction order, "
                         "then the held ones)")
    inspect.add_argument("--limit", type=int, default=100,
                         help="--keys: list at most this many blocks (100)")
    inspect.add_argument("--json", action="store_true", help="--keys: as JSON")
    inspect.set_defaults(func=cmd_inspect)


# ---------------------------------------------------------------------------- recover

def _live_lock_holder(name: str) -> tuple[int, int] | None:
    """(slot or attach mark, pid) of the pool lock's holder if it is alive, read without
    attaching (no lock, no slot); None when the lock is free, its holder dead, or the pool
    unreadable (attach then says why)."""
    from shmkv.pool.liveness import AliveLocks, alive_path, is_mark
    from shmkv.pool.segment import Segment, read_config

    shm_name = L.segment_name(name)
    try:
        segment = Segment.open(shm_name)
    except (ShmKVError, OSError):
        return None
    try:
        layout = read_config(segment, allow_poisoned=True)
        hdr = layout.view(segment.buf, "header")[0]
        holder = decode_holder(int(hdr["holder"]))
        del hdr
        if holder is None:
            return None
        procs = layout.view(segment.buf, "proc_table")
        alive = AliveLocks(alive_path(shm_name), create=False, procs=procs.copy())
        del procs
        try:
            slot = holder[0]
            if is_mark(slot):
                live = alive.mark_alive(slot)
            else:
                live = 0 <= slot < layout.config.max_processes and alive.is_alive(slot)
        finally:
            alive.close()
        return holder if live else None
    except (ShmKVError, OSError):
        return None
    finally:
        segment.close()


def cmd_recover(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    holder = _live_lock_holder(args.name) if args.reclaim else None
    if holder is not None and holder[1] in args.reclaim:
        # A process stopped or hung inside a hold cannot be fenced: the fence is checked
        # when the lock is taken, and the process would finish its writes when it runs again.
        pid = holder[1]
        print(f"shmkv recover: pid {pid} holds the pool lock and is alive (stopped or hung "
              "in the middle of a call); its slot cannot be reclaimed while it holds the "
              f"lock, for it would finish its writes when it runs again. Kill it (kill -9 "
              f"{pid}), then run shmkv recover {args.name} again: it takes the lock over "
              "from the dead process, rolls its hold back and frees its slot.",
              file=sys.stderr)
        return EXIT_ERROR
    pool = attach_pool(args.name, label="shmkv-recover", lock_timeout_s=args.timeout,
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


def add_recover_parser(sub) -> None:
    recover = sub.add_parser(
        "recover", help="take over from dead processes, repair, report",
        description="Attaches to a pool (taking the lock over from a holder that died in "
        "it and rolling its hold back), reaps dead processes, checks every invariant and "
        "rebuilds the derived structures if one is broken; a POISONED pool that passes is "
        "READY again. Exit 1 if the pool is still broken.")
    recover.add_argument("name", help="pool name")
    recover.add_argument("--reclaim", type=int, action="append", default=[], metavar="PID",
                         help="also take the slot of this live (stuck) process; it is fenced "
                         "(not a process that holds the pool lock: kill that one)")
    recover.add_argument("--timeout", type=float, default=30.0,
                         help="seconds to wait for the lock (30)")
    recover.add_argument("--stuck-after", type=float, default=2.0,
                         help="seconds a lock may stand taken with no holder before a dead "
                         "taker is blamed (2)")
    recover.set_defaults(func=cmd_recover)


# ---------------------------------------------------------------------------- unlink

def cmd_unlink(args: argparse.Namespace) -> int:
    from shmkv.pool.siblings import human_bytes, tier_in_use, unlink_pool

    L.validate_pool_name(args.name)
    in_use = tier_in_use(args.name)
    if in_use and not args.force:
        print(f"shmkv unlink: pool {args.name} is a shared tier in use ({'; '.join(in_use)}): "
              "removed now, its running replicas would go on alone on a tier that no other "
              "process, `shmkv ls`, `stats` or `metrics` sees, and their next restart would "
              "be cold. Stop them first, or pass --force to remove it anyway",
              file=sys.stderr)
        return EXIT_PROBLEM
    if in_use:
        print(f"shmkv unlink: --force: removing pool {args.name} while in use "
              f"({'; '.join(in_use)}); its running replicas keep their mappings, share "
              "nothing with replicas started from now on, and lose what they stored at their "
              "next restart", file=sys.stderr)
    found, extras, freed = unlink_pool(args.name, BlockPool.TIERS)
    if found:
        print(f"removed pool {args.name}" + (f" (and its {', '.join(extras)})"
                                             if extras else "")
              + f": {human_bytes(freed)} of /dev/shm freed")
        return EXIT_OK
    if extras:
        print(f"no pool named {args.name}; removed its leftover {', '.join(extras)}: "
              f"{human_bytes(freed)} of /dev/shm freed")
        return EXIT_OK
    print(f"shmkv unlink: {missing_pool_message(args.name)}", file=sys.stderr)
    return EXIT_ERROR


def add_unlink_parser(sub) -> None:
    unlink = sub.add_parser("unlink", help="remove a pool",
                            description="Removes a pool's segment, lock and lock file, its "
                            "tiers (HiSparse's host pool, known by its header: a pool of its "
                            "own named <name>.host stays), and what is named after the pool "
                            "alone (publisher position, stats, the vLLM offload tier's table "
                            "and data region, the SGLang page store, and the earlier versions "
                            "of these an older shmkv made, when they are regular files of "
                            "this user), whether the pool is meant to stay or not, "
                            "and says how much of /dev/shm that frees. Processes that have it "
                            "mapped keep working. A shared tier (vLLM offload tier, SGLang "
                            "page store) is removed whole, its pool first, and is refused "
                            "(exit 1) while a process holds it, unless --force. Exit 2 if "
                            "there is no such pool (as every command).")
    unlink.add_argument("name", help="pool name")
    unlink.add_argument("--force", action="store_true",
                        help="remove a shared tier even while replicas hold it (they go on "
                        "alone on the removed tier)")
    unlink.set_defaults(func=cmd_unlink)


# ---------------------------------------------------------------------------- cleanup

def _describe(v) -> str:
    """How cleanup names one object: a pool by its name, anything else by its path."""
    if v.kind == "pool":
        return f"pool {v.name}"
    return f"{v.path} ({v.kind}{f' of pool {v.pool}' if v.pool else ''})"


def cmd_cleanup(args: argparse.Namespace) -> int:
    from shmkv.pool import siblings
    from shmkv.pool.siblings import human_bytes

    if args.prefix is not None:
        _check_prefix(args.prefix)
    verdicts = siblings.plan(include_idle=args.include_idle, prefix=args.prefix)
    if args.dry_run:
        removed = [v for v in verdicts if v.remove]
        for v in removed:
            print(f"would remove {_describe(v)}: {v.reason}")
    else:
        removed = []
        for v, ok in siblings.remove(verdicts):
            if ok:
                removed.append(v)
                print(f"removed {_describe(v)}: {v.reason}")
    kept = [v for v in verdicts if not v.remove]
    for v in kept:
        extra = ""
        if v.kind == "pool" and v.idle:
            extra = f" ({human_bytes(siblings.memory_of(verdicts, v.name))} of /dev/shm)"
        print(f"kept {_describe(v)}: {v.reason}{extra}")
    freed = sum(v.memory_bytes for v in removed)
    staying = [v.name for v in removed if v.kind == "pool" and v.idle]
    if args.prefix and staying:
        print(f"--include-idle with --prefix {args.prefix!r} "
              f"{'would remove' if args.dry_run else 'removed'} {len(staying)} pool(s) meant "
              f"to stay whose name starts with it: {', '.join(staying)}")
    idle = [v for v in kept if v.kind == "pool" and v.idle]
    print(f"{len(removed)} object(s) {'to remove' if args.dry_run else 'removed'} "
          f"({human_bytes(freed)} of /dev/shm{' to free' if args.dry_run else ' freed'}), "
          f"{len(kept)} kept"
          + ("" if any(v.kind == "pool" and v.remove for v in verdicts)
             else "; no orphaned pools")
          + (f"; {len(idle)} idle pool(s) meant to stay kept (`shmkv unlink NAME` or "
             "--include-idle removes them)" if idle else "")
          + (f"; only objects whose name, or whose pool's name, starts with {args.prefix!r}"
             if args.prefix else ""))
    return EXIT_OK


def _check_prefix(prefix: str) -> None:
    """A ``--prefix`` must be the start of a name: non-empty, of a name's characters."""
    import re

    if not re.fullmatch(r"[A-Za-z0-9._+-]+", prefix):
        raise UsageError(f"--prefix {prefix!r}: give the start of the names to act on (it "
                         "matches every name starting with it), in the characters of a pool "
                         "name (letters, digits, '.', '_', '-', '+'); leave --prefix out for "
                         "every object; `shmkv unlink NAME` removes one pool")


def add_cleanup_parser(sub) -> None:
    cleanup = sub.add_parser(
        "cleanup", help="remove every orphaned shmkv object (pools meant to stay are kept)",
        description="Removes every orphaned pool of this layout version: one whose attached "
        "processes and creator are all dead and that was never marked to stay (pools made "
        "by `shmkv create`, the vLLM offload tier and the SGLang page store stay), or whose "
        "creator died while creating it; with its lock and liveness file. Removes every "
        "sibling object (channels and their doorbells, block tables, KV stores, stats, "
        "publisher positions) whose creator is dead and whose pool is gone or removed with "
        "it, as their headers record it. Lists everything it keeps with the reason: meant "
        "to stay, live, being created, recoverable, another user's, of another layout "
        "version, or with a corrupt header; and the /dev/shm memory freed. A process "
        "attaching at that very moment keeps working on the removed pool.")
    cleanup.add_argument("--dry-run", action="store_true",
                         help="only say what would go (and what stays)")
    cleanup.add_argument("--include-idle", action="store_true",
                         help="also remove the pools meant to stay that no live process "
                         "holds (with their siblings and data regions)")
    cleanup.add_argument("--prefix", metavar="PREFIX",
                         help="only objects whose name, or whose pool's name, starts with "
                         "PREFIX: the start of names (e.g. every name of one test run), "
                         "which matches every pool whose name starts with it; to remove one "
                         "pool, use `shmkv unlink NAME`")
    cleanup.set_defaults(func=cmd_cleanup)


# ---------------------------------------------------------------------------- create

CREATE_STAYS_BY = "shmkv create"  # what `shmkv ls` says keeps a pool it made


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
        pool.mark_stays(CREATE_STAYS_BY)
        print(f"created pool {args.name}: {args.blocks} blocks of {args.block_size} tokens "
              f"({args.blocks - 1} usable: block 0 is the null block), "
              f"{pool.layout.total_bytes:,} bytes in /dev/shm{pool.segment_name}, "
              f"events {'on' if args.events else 'off'}, "
              f"{pool.layout.config.max_processes} process slots")
    finally:
        pool.close()
    print(f"it stays until `shmkv unlink {args.name}` (`shmkv cleanup` keeps it; "
          "`shmkv cleanup --include-idle` removes it while no process is attached)")
    return EXIT_OK


def add_create_parser(sub) -> None:
    p = sub.add_parser("create", help="create a pool and leave it in /dev/shm",
                       description="Creates a new pool segment for schedulers to attach "
                       "to, then exits. The pool is marked to stay: `shmkv cleanup` keeps it "
                       "until `shmkv unlink NAME` (or `shmkv cleanup --include-idle` while no "
                       "process holds it). Exit 2 if it exists already.")
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

# Each refresh takes the pool lock once: ten a second at most is nothing to the schedulers.
MIN_STATS_INTERVAL_S = 0.1

def _format_snapshot(s, prev, dt: float) -> list[str]:
    def rate(now: int, before: int | None) -> str:
        return "" if before is None or dt <= 0 else f" ({(now - before) / dt:,.0f}/s)"

    hit = s.hits / s.queries if s.queries else 0.0
    lines = [
        f"pool {s.pool}  {time.strftime('%H:%M:%S')}",
        f"  blocks   {blocks_text(s.num_blocks + 1)}, {s.free} free, {s.in_use} in use, "
        f"{s.cached} cached keys; {usage_text(s.in_use, s.with_data, s.num_blocks)}",
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
    if s.tier is not None:
        lines += ["  " + line for line in tier_lines(s.tier)]
    lines += ["  " + note for note in s.notes]
    for slot, row in sorted(s.engines.items()):
        waits, holds = row["lock_wait_count"], row["lock_hold_count"]
        mean_wait = row["lock_wait_sum_ns"] / waits / 1e3 if waits else 0.0
        mean_hold = row["lock_hold_sum_ns"] / holds / 1e3 if holds else 0.0
        lines.append(f"  slot {slot:>3} pid {row['pid']:>7}: {row['queries']:,} queried, "
                     f"{row['hits']:,} hit; lock mean wait {mean_wait:.1f} us, hold "
                     f"{mean_hold:.1f} us over {holds:,} holds")
    return lines


def usage_text(in_use: int, with_data: int, num_blocks: int) -> str:
    """How full a pool is, both ways (``shmkv stats``, ``shmkv inspect``): the blocks holding
    data (held, or cached with a key: a tier's chunks with data, which no request holds
    between a store and a load) and the blocks held, each per usable block."""
    def pct(n: int) -> str:
        return f"{n / num_blocks:.1%}" if num_blocks else "0.0%"

    return f"holding data {pct(with_data)}, held {pct(in_use)}"


def tier_lines(tier) -> list[str]:
    """A tier's chunks and counters (``shmkv stats``, ``shmkv inspect``): the node's, then
    one line per replica row (a vLLM replica, named by its DP rank, engine id and engine
    core pid; an SGLang process slot, by its pid)."""
    unit = tier.unit
    full = tier.chunks_with_data / tier.num_chunks if tier.num_chunks else 0.0
    lines = [
        f"tier     {tier.kind}: {tier.num_chunks:,} {unit}, {tier.chunks_with_data:,} with "
        f"data ({full:.1%} full; {tier.chunks_storing:,} being stored), {tier.chunks_held:,} "
        "held",
        f"  node   {tier.stored:,} {unit} stored, {tier.loaded:,} loaded, "
        f"{tier.cross_replica_hits:,} cross-replica hits",
    ]
    for row in tier.rows:
        lines.append(f"  row {row['row']:>2} {row_name(row)} "
                     f"{'live' if row['live'] else 'gone'}: {row['stored']:,} stored, "
                     f"{row['loaded']:,} loaded, {row['cross_replica_hits']:,} cross-replica "
                     "hits")
    return lines


def cmd_stats(args: argparse.Namespace) -> int:
    from shmkv.metrics import PoolMetrics

    if not args.interval >= MIN_STATS_INTERVAL_S:  # NaN too
        raise UsageError(f"--interval {args.interval!r}: must be at least "
                         f"{MIN_STATS_INTERVAL_S} s (each refresh takes the pool lock that "
                         "the live schedulers share)")
    if args.count is not None and args.count < 1:
        raise UsageError(f"--count {args.count}: must be a whole number >= 1")
    pool = attach_pool(args.name, label="shmkv-stats")
    try:
        metrics = PoolMetrics(pool)
        prev, t_prev = None, time.monotonic()
        stop = StopOnSignals()
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
        return stop.exit_code  # 143 after SIGTERM, 130 after Ctrl-C
    finally:
        pool.close()


def add_stats_parser(sub) -> None:
    p = sub.add_parser("stats", help="live figures of a pool, refreshed",
                       description="Prints a live pool's usage, processes, lock holds, "
                       "prefix-cache queries and hits (recorded by processes that use "
                       "shmkv.stats.PoolStats) and evictions, every --interval seconds "
                       "with rates, until Ctrl-C or --count refreshes.")
    p.add_argument("name", help="pool name")
    p.add_argument("--interval", type=float, default=1.0,
                   help=f"seconds between refreshes, at least {MIN_STATS_INTERVAL_S} (1)")
    p.add_argument("--count", type=int, help="stop after this many refreshes")
    p.add_argument("--no-clear", action="store_true", help="do not clear the terminal")
    p.set_defaults(func=cmd_stats)


# ---------------------------------------------------------------------------- ls

def list_objects(prefix: str | None = None) -> list[dict]:
    """Every shmkv object in /dev/shm (``prefix``: those whose name, or whose pool's name,
    starts with it, ``siblings.in_scope``): pools
    (with owner, size, processes, creator alive, whether each is meant to stay), their locks
    and liveness files, and sibling objects (channels, doorbells, publisher positions,
    stats, block tables...), each with the pool it belongs to if any."""
    from shmkv.pool import siblings

    all_verdicts = siblings.plan()
    verdicts = {v.entry: v for v in all_verdicts}
    out = []
    for entry in sorted(os.listdir("/dev/shm")):
        v = verdicts.get(entry)
        if prefix is not None and not (siblings.in_scope(v, prefix) if v
                                       else entry.startswith(f"shmkv-{prefix}")):
            continue
        row = _object_row(entry)
        if row is not None:
            out.append(row)
    _name_owning_pools(out)
    for row in out:
        v = verdicts.get(row["entry"])
        row["orphan"] = bool(v and v.remove)
        row["cleanup"] = v.reason if v else "gone meanwhile"
        if row["kind"] == "pool":
            # "stays", "scoped" (lives while a process holds it), "orphan"; "" left alone
            row["lifetime"] = v.lifetime if v else ""
            row["idle"] = bool(v and v.idle)
            row["memory_bytes"] = siblings.memory_of(all_verdicts, row["name"])
        if v and v.pool and "pool" not in row:
            row["pool"] = v.pool
            row["note"] = (row["note"] + "; " if row["note"] else "") + f"of pool {v.pool}"
    return out


def _object_row(entry: str) -> dict | None:
    """The row of one entry of /dev/shm; None if it is not shmkv's (or just went). Read
    without following a link; anything that is not a regular file of this user (a FIFO, a
    directory, a link, another user's file: /dev/shm is world-writable) is listed as what it
    is, left alone and never opened."""
    import pwd

    from shmkv.pool.segment import file_type
    from shmkv.pool.siblings import foreign_reason

    path = f"/dev/shm/{entry}"
    base = entry[len("sem."):] if entry.startswith("sem.") else entry
    region_of = L.offload_data_region_pool(entry)
    if not (base.startswith("shmkv-") or base.startswith("shmkv_") or region_of):
        return None
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    try:
        owner = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        owner = str(st.st_uid)
    row = {"entry": entry, "owner": owner, "bytes": st.st_size, "kind": "other",
           "name": base, "version": None, "processes": None, "alive": None,
           "creator_alive": None, "note": ""}
    problem = foreign_reason(st)
    if problem and not stat.S_ISREG(st.st_mode):
        problem = f"{file_type(st.st_mode)}, {problem}"
    if region_of:
        row.update(kind="data region", name=region_of, pool=region_of,
                   note=problem or f"the vLLM offload tier's data region of pool {region_of} "
                   "(its chunks' KV bytes)")
        return row
    if entry.startswith("sem."):
        row["kind"] = "lock" if base.endswith(".lock") else "semaphore"
        if base.startswith("shmkv_bell-"):
            row["kind"] = "doorbell"
        row["name"] = base.removesuffix(".lock")
        row["note"] = problem or ""
        return row
    if entry.endswith(".alive"):
        row["kind"] = "liveness"
        row["name"] = base.removesuffix(".alive")
        row["note"] = problem or ""
        return row
    replicas = base.endswith(L.OFFLOAD_REPLICAS_SUFFIX)
    head, sep, version = base.removesuffix(L.OFFLOAD_REPLICAS_SUFFIX).rpartition("-v")
    if sep and version.isdigit():
        row["version"] = int(version)
    if base.startswith("shmkv_"):
        kind, _, rest = head[len("shmkv_"):].partition("-")
        known = {"ch": "channel", "pub": "publisher", "stats": "stats", "bt": "tables",
                 "kv": "kv store", "offload": "tier table", "sglang": "page store"}
        row["kind"] = known.get(kind, "sibling")
        row["name"] = rest if kind in known else head[len("shmkv_"):]
        if kind == "offload":
            row["kind"] = "tier locks" if replicas else "tier table"
            row["note"] = ("the vLLM offload tier's replica lock file (a lock per replica row)"
                           if replicas else "the vLLM offload tier's table (keys, counters)")
        if problem:
            row["note"] = problem
        elif kind == "pub":
            from shmkv.publisher import saved_position

            try:
                saved = (saved_position(rest)
                         if row["version"] == L.PUBLISHER_STATE_VERSION else None)
            except (ShmKVError, OSError, ValueError) as exc:
                saved, row["note"] = None, f"unreadable: {exc}"
            if saved:
                row["note"] = (f"next seq {saved['next_seq']}, "
                               f"{'running' if saved['running'] else 'stopped'}")
        return row
    row["kind"] = "pool"
    row["name"] = head[len("shmkv-"):] if sep else base[len("shmkv-"):]
    if problem:
        row["note"] = problem
        return row
    if row["version"] != L.LAYOUT_VERSION:
        row["note"] = f"layout v{row['version']}, not this shmkv's v{L.LAYOUT_VERSION}"
        return row
    _read_pool(row, entry)
    return row


def _read_pool(row: dict, entry: str) -> None:
    """Fills a pool's row from its process table, without attaching (no slot is taken)."""
    import numpy as np

    from shmkv.pool.liveness import AliveLocks, alive_path
    from shmkv.pool.segment import Segment, read_config

    try:
        segment = Segment.open(f"/{entry}")
    except (ShmKVError, OSError, ValueError) as exc:  # replaced since it was judged
        row["note"] = str(exc)
        return
    try:
        layout = read_config(segment)
        hdr = layout.view(segment.buf, "header")[0]
        creator = int(hdr["creator_pid"])
        del hdr
        procs = layout.view(segment.buf, "proc_table")
        active = np.flatnonzero(procs["state"] == L.SLOT_ACTIVE).tolist()
        pids = {slot: int(procs[slot]["pid"]) for slot in active}
        alive = AliveLocks(alive_path(f"/{entry}"), create=False, procs=procs.copy())
        del procs
        try:
            live = [slot for slot in active if alive.is_alive(slot)]
        finally:
            alive.close()
        row["processes"], row["alive"] = len(active), len(live)
        row["creator_alive"] = any(pids[slot] == creator for slot in live)
        row["note"] = f"{layout.config.num_blocks} blocks, creator pid {creator}"
    except (ShmKVError, OSError, ValueError) as exc:
        row["note"] = f"unreadable: {exc}"
    finally:
        segment.close()


def _name_owning_pools(rows: list[dict]) -> None:
    """Adds to each sibling object the pool it belongs to, by name."""
    pools = sorted((r["name"] for r in rows if r["kind"] == "pool"), key=len, reverse=True)
    for r in rows:
        if r["kind"] in ("pool", "lock", "liveness") or "pool" in r:
            continue
        bare = r["name"].removeprefix("shmkv_bell-")
        owner = next((p for p in pools if bare == p or bare.startswith(p + "-")
                      or bare.startswith(p + "+")), None)
        if owner is not None:
            r["pool"] = owner
            r["note"] = (r["note"] + "; " if r["note"] else "") + f"of pool {owner}"


def cmd_ls(args: argparse.Namespace) -> int:
    from shmkv.pool.siblings import human_bytes

    if args.prefix is not None:
        _check_prefix(args.prefix)
    rows = list_objects(args.prefix)
    if not args.all:
        rows = [r for r in rows if r["kind"] not in ("lock", "liveness")]
    if args.json:
        import json

        print(json.dumps(rows, indent=1))
        return EXIT_OK
    if not rows:
        print("no shmkv objects in /dev/shm"
              + (f" whose name, or whose pool's name, starts with {args.prefix!r}"
                 if args.prefix else ""))
        return EXIT_OK
    print(f"{'KIND':<11} {'NAME':<44} {'OWNER':<8} {'BYTES':>13} {'PROCS':>9} "
          f"{'CREATOR':<8} {'LIFETIME':<8} NOTE")
    for r in rows:
        procs = "" if r["processes"] is None else f"{r['alive']}/{r['processes']}"
        creator = "" if r["creator_alive"] is None else (
            "alive" if r["creator_alive"] else "gone")
        lifetime = r.get("lifetime", "")
        if r["kind"] == "pool":
            lifetime = "ORPHAN" if r["orphan"] else lifetime
            why = r["cleanup"]
            if r["idle"]:
                why += f"; it takes {human_bytes(r['memory_bytes'])} of /dev/shm"
            note = (r["note"] if why in r["note"]  # what it is says why it is left alone
                    else f"{why}; {r['note']}" if r["note"] else why)
        else:
            note = f"ORPHAN ({r['cleanup']}); {r['note']}" if r["orphan"] else r["note"]
        print(f"{r['kind']:<11} {r['name']:<44} {r['owner']:<8} {r['bytes']:>13,} "
              f"{procs:>9} {creator:<8} {lifetime:<8} {note}".rstrip("; "))
    pools = [r for r in rows if r["kind"] == "pool"]
    orphans = sum(r["orphan"] for r in rows)
    staying = sum(r["lifetime"] == "stays" for r in pools)
    print(f"{len(pools)} pool(s), {len(rows) - len(pools)} other object(s), {orphans} "
          f"orphan(s) (`shmkv cleanup` removes them), {staying} pool(s) meant to stay "
          "(`shmkv unlink NAME` removes one); PROCS = alive/attached; LIFETIME: stays (kept "
          "until unlinked), scoped (lives while a process holds it), ORPHAN")
    return EXIT_OK


def add_ls_parser(sub) -> None:
    p = sub.add_parser("ls", help="list every shmkv object on this machine",
                       description="Lists the shmkv objects in /dev/shm: pools (owner, "
                       "size, attached processes alive/total, whether the creator is "
                       "alive, and their LIFETIME: `stays` for a pool meant to stay, with "
                       "what made it, `scoped` for one that lives while a process holds "
                       "it, `ORPHAN` for one `shmkv cleanup` removes, with why), message "
                       "channels and their doorbells, publisher positions, stats segments "
                       "and other siblings; --all adds pool locks and liveness files. Marks "
                       "ORPHAN what `shmkv cleanup` would remove, with the reason. Reads "
                       "process tables without attaching.")
    p.add_argument("--all", action="store_true", help="also pool locks and liveness files")
    p.add_argument("--json", action="store_true", help="a JSON list, for scripts")
    p.add_argument("--prefix", metavar="PREFIX",
                   help="only objects whose name, or whose pool's name, starts with PREFIX "
                   "(the start of names, which may match several pools)")
    p.set_defaults(func=cmd_ls)


# ---------------------------------------------------------------------------- bench

def _benchmarks_dir():
    from pathlib import Path

    here = Path(__file__).resolve().parents[2] / "benchmarks"  # beside shmkv/
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
        package_dir = os.path.dirname(os.path.dirname(__file__))
        print(f"shmkv bench: no benchmarks/ directory next to {package_dir}: "
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


COMMANDS = {
    "demo": add_demo_parser,
    "inspect": add_inspect_parser,
    "recover": add_recover_parser,
    "unlink": add_unlink_parser,
    "cleanup": add_cleanup_parser,
    "create": add_create_parser,
    "stats": add_stats_parser,
    "ls": add_ls_parser,
    "bench": add_bench_parser,
}
