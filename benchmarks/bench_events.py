"""KV events over ZMQ and the lock-timing recorder: what they cost.

1. publish: the pool's log holds N events (scheduler-like requests, each a BlockStored, and
   the evictions they cause); a ``KVEventPublisher`` sends them all to a SUB socket that a
   thread drains. Reports batches/s and the longest hold of the pool lock a read took
   (what the schedulers could wait for the publisher).
2. replay: a replay request from seq 0 (read back from the log, not the memory window).
3. lock timing: ns per ``get_new_blocks(1) + free_blocks`` without and with
   ``PoolStats(time_lock=True)``.

    python benchmarks/bench_events.py [--events 20000] [--json FILE]

Prints one JSON line per measurement, then a short table. Needs pyzmq.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

try:
    import shmkv  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import zmq

from shmkv import BlockPool
from shmkv.core.request import Request
from shmkv.publisher import KVEventPublisher, KVEventSubscriber, unlink_state
from shmkv.stats import PoolStats, unlink_stats


def fill(pool, num_events: int) -> None:
    hasher = pool.make_block_hasher()
    bs = pool.hash_block_size
    r = 0
    while pool.event_cursor(from_start=False).seq < num_events:
        req = Request(f"r{r}", list(range(32)) + [100_000 + r * 100 + t for t in range(40)],
                      block_hasher=hasher)
        with pool.lock():
            hits = pool.get_cached_prefix(req.block_hashes)
            pool.touch(hits)
            blocks = hits + pool.get_new_blocks(-(-req.num_tokens // bs) - len(hits))
            pool.cache_full_blocks(req, blocks, len(hits), req.num_tokens // bs, bs, 0)
        pool.free_blocks(reversed(blocks))
        r += 1


def bench_publish(name: str, num_events: int) -> list[dict]:
    pool = BlockPool.create(name, 2048, enable_kv_cache_events=True,
                            event_log_bytes=64 << 20)
    try:
        fill(pool, num_events)
        end = pool.event_cursor(from_start=False).seq
        with KVEventPublisher(name, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0") as pub:
            holds = []
            read = pub._read

            def timed_read(cursor):
                t0 = time.perf_counter_ns()
                out = read(cursor)
                holds.append(time.perf_counter_ns() - t0)
                return out

            pub._read = timed_read
            ctx = zmq.Context.instance()
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.setsockopt(zmq.RCVHWM, 0)
            sub.connect(pub.endpoint)
            time.sleep(0.5)  # the subscription reaches the PUB socket
            got = [0]

            def drain():
                while got[0] < end:
                    if sub.poll(5000):
                        sub.recv_multipart()
                        got[0] += 1
                    else:
                        return

            thread = threading.Thread(target=drain)
            thread.start()
            t0 = time.perf_counter()
            sent = pub.publish_pending()
            thread.join(120)
            dt = time.perf_counter() - t0
            sub.close(linger=0)
            with KVEventSubscriber(pub.endpoint, pub.replay_endpoint) as client:
                stop = threading.Event()
                server = threading.Thread(target=lambda: [pub.poll(0.01) for _ in iter(
                    stop.is_set, True)])
                server.start()
                t1 = time.perf_counter()
                replayed = client.replay(0)
                dt_replay = time.perf_counter() - t1
                stop.set()
                server.join(30)
        return [
            {"bench": "publish", "events": end, "sent": sent, "received": got[0],
             "seconds": round(dt, 3), "batches_per_s": round(end / dt),
             "max_lock_hold_us": round(max(holds) / 1e3, 1),
             "median_lock_hold_us": round(sorted(holds)[len(holds) // 2] / 1e3, 1)},
            {"bench": "replay", "events": len(replayed), "seconds": round(dt_replay, 3),
             "batches_per_s": round(len(replayed) / dt_replay)},
        ]
    finally:
        pool.close()
        BlockPool.unlink(name)
        unlink_state(name)


def bench_lock_timing(name: str, iterations: int) -> list[dict]:
    pool = BlockPool.create(name, 1024)
    out = []
    try:
        for timed in (False, True):
            stats = PoolStats.open(pool, time_lock=timed)
            for _ in range(1000):
                pool.free_blocks(pool.get_new_blocks(1))
            best = None
            for _ in range(5):
                t0 = time.perf_counter_ns()
                for _ in range(iterations):
                    pool.free_blocks(pool.get_new_blocks(1))
                stats.sync()  # binning the recorded holds is part of the cost
                ns = (time.perf_counter_ns() - t0) / iterations
                best = ns if best is None else min(best, ns)
            stats.close()
            out.append({"bench": "alloc_free_1", "lock_timed": timed, "kernel": pool.kernel,
                        "ns_per_pair_best_of_5": round(best)})
    finally:
        pool.close()
        BlockPool.unlink(name)
        unlink_stats(name)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--events", type=int, default=20_000, help="events in the log (20000)")
    p.add_argument("--iterations", type=int, default=20_000,
                   help="lock timing: calls per repeat (20000)")
    p.add_argument("--json", help="append the JSON lines to this file")
    args = p.parse_args(argv)
    name = f"bench-events-{os.getpid()}"
    rows = bench_publish(name, args.events) + bench_lock_timing(name + "-lock",
                                                                 args.iterations)
    for row in rows:
        print(json.dumps(row))
    if args.json:
        with open(args.json, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    pub, rep, plain, timed = rows
    print(f"\npublish: {pub['events']:,} events, {pub['batches_per_s']:,} batches/s to one "
          f"SUB ({pub['received']:,} received); pool lock held by the publisher's reads: "
          f"median {pub['median_lock_hold_us']} us, max {pub['max_lock_hold_us']} us")
    print(f"replay from seq 0 (from the log): {rep['events']:,} batches, "
          f"{rep['batches_per_s']:,}/s")
    print(f"get_new_blocks(1) + free_blocks: {plain['ns_per_pair_best_of_5']:,} ns, with lock "
          f"timing {timed['ns_per_pair_best_of_5']:,} ns ({plain['kernel']} kernel)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
