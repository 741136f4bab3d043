"""``shmkv`` commands that read a pool's events and figures as they come: ``events``
(print / follow the global log), ``publish`` (ZMQ, vLLM's wire format) and ``metrics``
(Prometheus over HTTP)."""

from __future__ import annotations

import argparse
import sys
import time

from shmkv.cli.common import EXIT_ERROR, StopOnSignals, attach_pool
from shmkv.errors import UsageError

# ---------------------------------------------------------------------------- events

MIN_EVENTS_INTERVAL_S = 0.01  # a poll takes the pool lock: at most 100 a second

def iso_time(ts: float) -> str:
    """An event's time as ``events`` prints it: ISO 8601, UTC, to the microsecond."""
    from datetime import datetime, timezone

    return datetime.fromtimestamp(ts, tz=timezone.utc).isoformat(timespec="microseconds")


def _event_line(logged, labels: dict[int, tuple[str, int]], epoch: bool = False) -> str:
    from shmkv.events import BlockRemoved, BlockStored
    from shmkv.events import short_hash as h

    e = logged.event
    label, since_ns = labels.get(logged.slot, ("", 0))
    # a slot's label now is that of the process attached now: it names the event's
    # process only if that one attached before the event
    who = label if since_ns <= logged.ts * 1e9 else ""
    when = f"{logged.ts:.6f}" if epoch else iso_time(logged.ts)
    head = f"{logged.seq:>8}  {when}  slot {logged.slot:>3} {who:<14}"

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

    if not args.interval >= MIN_EVENTS_INTERVAL_S:  # NaN too
        raise UsageError(f"--interval {args.interval!r}: must be at least "
                         f"{MIN_EVENTS_INTERVAL_S} s (each poll takes the pool lock)")
    pool = attach_pool(args.name, label="shmkv-events")
    try:
        if not pool.event_log.capacity:
            print(f"shmkv events: pool {args.name} has no event log (created without "
                  "events)", file=sys.stderr)
            return EXIT_ERROR
        cursor = pool.event_cursor(from_start=args.start == "oldest")
        if args.follow:
            print(f"following pool {args.name} from seq {cursor.seq}", file=sys.stderr,
                  flush=True)
        labels: dict[int, tuple[str, int]] = {}
        printed = 0
        stop = StopOnSignals()
        while not stop.stopped and (args.count is None or printed < args.count):
            limit = 64 if args.count is None else min(64, args.count - printed)
            with pool.lock():  # copy a few records under the lock, decode after
                records, lost = pool.event_log.read_raw(cursor, limit)
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
                        "time": iso_time(logged.ts),
                        "event": logged.event}).decode())
                else:
                    print(_event_line(logged, labels, args.epoch))
                printed += 1
            sys.stdout.flush()
            if not args.follow and not events:
                break
            if not events:
                stop.sleep(args.interval)
        return stop.exit_code  # 143 after SIGTERM, 130 after Ctrl-C
    finally:
        pool.close()


def add_events_parser(sub) -> None:
    p = sub.add_parser("events", help="print (and follow) the pool's global event log",
                       description="Prints the events of every process from the pool's "
                       "global log, in order, one line each (seq, time in ISO 8601 UTC, "
                       "process slot and label, event), or as JSON lines; with --follow, "
                       "waits for new ones until Ctrl-C. Exit 2 if the pool has no log.")
    p.add_argument("name", help="pool name")
    p.add_argument("--from", dest="start", choices=("oldest", "end"), default="oldest",
                   help="the oldest event still in the log, or only new ones (oldest)")
    p.add_argument("-f", "--follow", action="store_true", help="keep waiting for events")
    p.add_argument("-n", "--count", type=int, help="stop after this many events")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument("--epoch", action="store_true",
                   help="print times as seconds since the epoch, not ISO 8601")
    p.add_argument("--interval", type=float, default=0.1,
                   help=f"poll interval with --follow, at least {MIN_EVENTS_INTERVAL_S} s "
                   "(0.1)")
    p.set_defaults(func=cmd_events)


# ---------------------------------------------------------------------------- metrics

MAX_PORT = 65535


def cmd_metrics(args: argparse.Namespace) -> int:
    from shmkv.metrics import serve

    if not 0 <= args.port <= MAX_PORT:  # checked before the pool is attached
        raise UsageError(f"--port {args.port}: must be a TCP port in 0..{MAX_PORT} "
                         "(0: any free one)")
    pool = attach_pool(args.name, label="shmkv-metrics")
    try:
        try:
            server, thread, _ = serve(pool, args.port, args.addr)
        except OSError as exc:
            print(f"shmkv metrics: cannot listen on {args.addr}:{args.port}: {exc}",
                  file=sys.stderr)
            return EXIT_ERROR
        print(f"serving metrics of pool {args.name} on "
              f"http://{args.addr}:{server.server_port}/metrics", flush=True)
        stop = StopOnSignals()
        stop.sleep(float("inf") if args.duration is None else args.duration)
        server.shutdown()
        thread.join(10)
        return stop.exit_code  # 143 after SIGTERM, 130 after Ctrl-C
    finally:
        pool.close()


def add_metrics_parser(sub) -> None:
    p = sub.add_parser("metrics", help="serve a pool's Prometheus metrics over HTTP",
                       description="Serves a live pool's metrics at http://ADDR:PORT/metrics "
                       "(every name shmkv_*, never vLLM's vllm:* ones: "
                       "shmkv_blocks_with_data_ratio, shmkv_blocks_in_use_ratio, "
                       "shmkv_prefix_cache_queries/hits...; see docs/metrics.md) until "
                       "SIGTERM or Ctrl-C. Needs prometheus-client "
                       "(pip install 'shmkv[metrics]').")
    p.add_argument("name", help="pool name")
    p.add_argument("--port", type=int, required=True,
                   help=f"TCP port, 0..{MAX_PORT} (0: any free one)")
    p.add_argument("--addr", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    p.add_argument("--duration", type=float, metavar="SECONDS",
                   help="stop after this long (default: run until stopped)")
    p.set_defaults(func=cmd_metrics)


# ---------------------------------------------------------------------------- publish

def cmd_publish(args: argparse.Namespace) -> int:
    from shmkv.publisher import KVEventPublisher

    pub = KVEventPublisher(args.name, args.endpoint, args.replay_endpoint, args.topic,
                           bind=not args.connect, int_hashes=True if args.int_hashes else None,
                           rank_from=args.rank_from, start=args.start,
                           resume=not args.no_resume, allow_remote=args.allow_remote)
    try:
        replay = f", replay on {pub.replay_endpoint}" if pub.replay_endpoint else ""
        print(f"publishing pool {args.name} on {pub.endpoint}{replay}, topic "
              f"{args.topic!r}, from seq {pub.next_seq}", flush=True)
        stop = StopOnSignals()
        deadline = None if args.duration is None else time.monotonic() + args.duration
        while not stop.stopped and (deadline is None or time.monotonic() < deadline):
            pub.poll()
        print(f"published {pub.published} batches ({pub.lost} events lost, {pub.replays} "
              f"replays, {pub.replays_dropped} replay requests dropped); next seq "
              f"{pub.next_seq}", flush=True)
        return stop.exit_code  # 143 after SIGTERM, 130 after Ctrl-C
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
        "pool; a restarted one resumes right after the last batch sent. On loopback TCP any "
        "local user can connect; ipc:// endpoints in a directory of mode 0700 admit only its "
        "owner (docs/events.md). Runs until SIGTERM "
        "or Ctrl-C (exit 143 or 130). Needs pyzmq (pip install 'shmkv[zmq]').")
    p.add_argument("name", help="pool name")
    p.add_argument("--endpoint", required=True, metavar="ADDR",
                   help="PUB address, e.g. tcp://127.0.0.1:5557 (bound unless --connect)")
    p.add_argument("--replay-endpoint", metavar="ADDR", help="ROUTER address for replays")
    p.add_argument("--topic", default="", help="topic frame ('')")
    p.add_argument("--allow-remote", action="store_true",
                   help="bind a non-loopback address (the sockets have no authentication: "
                   "put them behind a firewall that admits only the indexers, or a CURVE "
                   "relay); without it only loopback, ipc:// and inproc:// are bound")
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


COMMANDS = {
    "events": add_events_parser,
    "metrics": add_metrics_parser,
    "publish": add_publish_parser,
}
