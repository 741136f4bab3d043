#!/usr/bin/env python
"""The cluster-wide prefix index on Redis: routing by it, lookup latency, indexer throughput.

Two "nodes" on this machine, each a shmkv pool with its publisher (a ZMQ PUB + replay
socket, in a thread), one Redis, one ClusterIndexer feeding it and a PrefixRouter reading
it. Three measurements:

1. Routing a chat workload over the two nodes: every request is one of ``--systems``
   shared system prompts plus a message of its own; each node keeps ``--running``
   requests in flight and its pool is too small to hold every system prompt. Policies:
   ``round_robin``; ``index`` (the node the router says holds the longest prefix, the
   less loaded on a tie); and, for reference, ``single_pool`` (one pool of both nodes'
   blocks serving everything). Figures: prefix hit rate (hit tokens / prompt tokens) and
   prefill tokens saved, measured on the pools at admission.
2. Lookup latency: ``PrefixRouter.cached_tokens`` (hashing + one round trip) and
   ``RedisPrefixIndex.longest_prefixes`` alone, p50 and p99.
3. Indexer throughput: a pool logs ``--events`` events, then an indexer catches up on all
   of them by replay; events applied per second, end to end (replay over ZMQ, decode,
   one Lua call per batch).

    python benchmarks/bench_cluster_index.py [--redis URL] [--requests N] [--quick]

Without ``--redis`` it starts a private redis-server (Debian's ``redis-server``) on a free
loopback port. Output: one JSON line per figure, then readable tables.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack

from shmkv import BlockPool, Request
from shmkv.cluster_index import ClusterIndexer, IndexSource, PrefixRouter, RedisPrefixIndex
from shmkv.events import KVEventBatch, external_block_hash
from shmkv.publisher import KVEventPublisher, pool_identity, unlink_state

BS = 16


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_redis(stack: ExitStack) -> str:
    server = shutil.which("redis-server")
    if server is None:
        raise SystemExit("redis-server not found: install it (Debian: apt-get install "
                         "redis-server) or pass --redis redis://HOST:PORT/DB")
    port = _free_port()
    workdir = stack.enter_context(tempfile.TemporaryDirectory())
    proc = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", workdir],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop() -> None:
        proc.kill()
        proc.wait(10)

    stack.callback(stop)
    import redis

    client = redis.Redis(port=port)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise SystemExit("redis-server did not start") from None
            time.sleep(0.02)
    client.close()
    return f"redis://127.0.0.1:{port}/0"


class Node:
    """A pool with a publisher thread; serves requests with ``running`` in flight."""

    def __init__(self, stack: ExitStack, label: str, num_blocks: int, running: int) -> None:
        self.label = label
        self.name = f"bench-{label}-{uuid.uuid4().hex[:8]}"
        self.pool = BlockPool.create(self.name, num_blocks, hash_block_size=BS,
                                     enable_kv_cache_events=True, event_log_bytes=64 << 20)
        stack.callback(self._close)
        self.hasher = self.pool.make_block_hasher()
        self.publisher = KVEventPublisher(self.pool, f"tcp://127.0.0.1:{_free_port()}",
                                          f"tcp://127.0.0.1:{_free_port()}").start()
        self.running: list[list] = []
        self.max_running = running
        self.prompt_tokens = self.hit_tokens = self.requests = 0

    @property
    def source(self) -> IndexSource:
        return IndexSource(self.label, self.publisher.endpoint, self.publisher.replay_endpoint)

    def serve(self, tokens: list[int]) -> int:
        """Admits one request (finishing the oldest if ``running`` are in flight)."""
        if len(self.running) >= self.max_running:
            self.pool.free_blocks(reversed(self.running.pop(0)))
        req = Request(f"{self.label}-{self.requests}", tokens, block_hasher=self.hasher)
        with self.pool.lock():
            hits = self.pool.get_cached_prefix(req.block_hashes)
            self.pool.touch(hits)
            blocks = hits + self.pool.get_new_blocks(-(-len(tokens) // BS) - len(hits))
            self.pool.cache_full_blocks(req, blocks, len(hits), len(tokens) // BS, BS, 0)
        self.running.append(blocks)
        self.requests += 1
        self.prompt_tokens += len(tokens)
        self.hit_tokens += len(hits) * BS
        return len(hits) * BS

    def _close(self) -> None:
        self.publisher.close()
        for blocks in self.running:
            self.pool.free_blocks(reversed(blocks))
        self.pool.close()
        BlockPool.unlink(self.name)
        unlink_state(self.name)


def _workload(args) -> list[list[int]]:
    rng = random.Random(args.seed)
    systems = [[rng.randrange(1000, 30_000) for _ in range(args.system_tokens)]
               for _ in range(args.systems)]
    weights = [1 / (i + 1) ** 0.5 for i in range(args.systems)]
    return [rng.choices(systems, weights)[0]
            + [rng.randrange(30_000, 60_000) for _ in range(rng.randint(8, 3 * BS))]
            for _ in range(args.requests)]


def _wait_caught_up(indexer: ClusterIndexer, nodes: list[Node], timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        indexer.poll(0.001)
        seqs = {st.source: st.seq for st in indexer.index.sources()}
        if all(seqs.get(n.label) == n.pool.event_cursor(from_start=False).seq - 1
               for n in nodes):
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"the indexer did not catch up within {timeout_s} s")


def routing(args, redis_url: str) -> tuple[list[dict], list[float], list[float]]:
    prompts = _workload(args)
    rows = []
    lookup_us, round_trip_us = [], []
    for policy in ("round_robin", "index", "single_pool"):
        with ExitStack() as stack:
            if policy == "single_pool":
                nodes = [Node(stack, "all", 2 * args.blocks, 2 * args.running)]
            else:
                nodes = [Node(stack, f"node{i}", args.blocks, args.running) for i in range(2)]
            index = RedisPrefixIndex.from_url(redis_url, f"bench{uuid.uuid4().hex[:8]}")
            indexer = stack.enter_context(ClusterIndexer(index, [n.source for n in nodes]))
            router = PrefixRouter(index, hash_block_size=BS)
            _wait_caught_up(indexer, nodes)
            t0 = time.perf_counter()
            for i, tokens in enumerate(prompts):
                if policy == "index":
                    t = time.perf_counter()
                    cached = router.cached_tokens(tokens)
                    lookup_us.append((time.perf_counter() - t) * 1e6)
                    node = max(nodes, key=lambda n: (cached.get(n.label, 0),
                                                     -len(n.running), -nodes.index(n)))
                else:
                    node = nodes[i % len(nodes)]
                node.serve(tokens)
                indexer.poll(0)
            _wait_caught_up(indexer, nodes)
            if policy == "index":
                for tokens in prompts[:500]:
                    hashes = router.block_hashes(tokens)
                    ext = [external_block_hash(h, True) for h in hashes]
                    t = time.perf_counter()
                    index.longest_prefixes(ext)
                    round_trip_us.append((time.perf_counter() - t) * 1e6)
            prompt = sum(n.prompt_tokens for n in nodes)
            hit = sum(n.hit_tokens for n in nodes)
            row = {"bench": "routing", "policy": policy, "nodes": 2, "requests": len(prompts),
                   "blocks_per_node": args.blocks, "prompt_tokens": prompt,
                   "prefill_tokens_saved": hit, "prefix_hit_rate": round(hit / prompt, 4),
                   "wall_s": round(time.perf_counter() - t0, 3)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows, lookup_us, round_trip_us


def throughput(args, redis_url: str) -> dict:
    with ExitStack() as stack:
        node = Node(stack, "tput", args.blocks, args.running)
        rng = random.Random(args.seed + 1)
        systems = [[rng.randrange(1000, 30_000) for _ in range(64)] for _ in range(64)]
        while node.pool.event_cursor(from_start=False).seq < args.events:
            node.serve(rng.choice(systems) + [rng.randrange(30_000, 60_000)
                                              for _ in range(rng.randint(8, 48))])
        events = node.pool.event_cursor(from_start=False).seq
        index = RedisPrefixIndex.from_url(redis_url, f"tput{uuid.uuid4().hex[:8]}")
        # The index "knows" this pool from before its first event: catching up is a replay
        # of every event.
        index.apply_snapshot(node.label, -1, KVEventBatch(0.0, []),
                             epoch=pool_identity(node.pool))
        t0 = time.perf_counter()
        with ClusterIndexer(index, [node.source]) as indexer:
            _wait_caught_up(indexer, [node], timeout_s=600)
            elapsed = time.perf_counter() - t0
            replayed = indexer.stats.replayed
        row = {"bench": "indexer_throughput", "events": events, "replayed": replayed,
               "seconds": round(elapsed, 3), "events_per_s": round(events / elapsed)}
        print(json.dumps(row), flush=True)
        return row


def _pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else values[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--redis", metavar="URL", help="an existing Redis (default: start one)")
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--systems", type=int, default=12, help="shared system prompts")
    p.add_argument("--system-tokens", type=int, default=128)
    p.add_argument("--blocks", type=int, default=96, help="blocks per node's pool")
    p.add_argument("--running", type=int, default=4, help="requests in flight per node")
    p.add_argument("--events", type=int, default=20_000, help="events for the throughput run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    args = p.parse_args(argv)
    if args.quick:
        args.requests, args.events = 200, 500
    if min(args.requests, args.systems, args.system_tokens, args.blocks, args.running,
           args.events) < 1:
        p.error("every size must be positive")
    with ExitStack() as stack:
        redis_url = args.redis or _start_redis(stack)
        rows, lookup_us, round_trip_us = routing(args, redis_url)
        latency = {"bench": "lookup_latency",
                   "router_p50_us": round(_pct(lookup_us, 50), 1),
                   "router_p99_us": round(_pct(lookup_us, 99), 1),
                   "round_trip_p50_us": round(_pct(round_trip_us, 50), 1),
                   "round_trip_p99_us": round(_pct(round_trip_us, 99), 1)}
        print(json.dumps(latency), flush=True)
        tput = throughput(args, redis_url)
    print()
    print(f"Routing {args.requests} chat requests ({args.systems} system prompts of "
          f"{args.system_tokens} tokens) over 2 nodes of {args.blocks} blocks:")
    print(f"{'policy':<12} {'hit rate':>9} {'prefill tokens saved':>21} {'vs round robin':>15}")
    base = rows[0]["prefill_tokens_saved"] or 1
    for row in rows:
        print(f"{row['policy']:<12} {row['prefix_hit_rate']:>9.3f} "
              f"{row['prefill_tokens_saved']:>21,} {row['prefill_tokens_saved'] / base:>14.2f}x")
    print()
    print(f"Lookup: router (hash + 1 round trip) p50 {latency['router_p50_us']:,.0f} us, p99 "
          f"{latency['router_p99_us']:,.0f} us; the Redis round trip alone p50 "
          f"{latency['round_trip_p50_us']:,.0f} us, p99 {latency['round_trip_p99_us']:,.0f} us")
    print(f"Indexer: {tput['events']:,} events caught up by replay in {tput['seconds']} s = "
          f"{tput['events_per_s']:,} events/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
