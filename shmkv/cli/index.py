"""``shmkv index`` and ``shmkv route``: the cluster-wide prefix index in Redis."""

from __future__ import annotations

import argparse
import sys
import time

from shmkv.cli.common import EXIT_ERROR, EXIT_OK, StopOnSignals
from shmkv.errors import ShmKVError


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
    import redis

    from shmkv.cluster_index import ClusterIndexer

    sources = [_parse_source(text) for text in args.source]
    index = _connect_index(args)
    with ClusterIndexer(index, sources, identity_check_s=args.identity_check,
                        replay_timeout_s=args.source_timeout,
                        retry_max_s=max(args.retry_max, 0.5)) as indexer:
        print(f"indexing {len(sources)} source(s) into {args.redis} (key prefix "
              f"{args.key_prefix!r}): " + ", ".join(src.name for src in sources), flush=True)
        stop = StopOnSignals()
        deadline = None if args.duration is None else time.monotonic() + args.duration
        try:
            while not stop.stopped and (deadline is None or time.monotonic() < deadline):
                indexer.poll()
        except redis.RedisError as exc:  # a lost connection is retried inside poll()
            raise ShmKVError(f"Redis at {args.redis} refused the index's work: {exc} "
                             "(check its URL, password, ACL and memory limit)") from None
        st = indexer.stats
        print(f"applied {st.applied} batches live, {st.replayed} by replay, {st.snapshots} "
              f"snapshots, {st.duplicates} duplicates, {st.redis_errors} Redis errors, "
              f"{st.source_errors} unanswered source requests", flush=True)
    return stop.exit_code  # 143 after SIGTERM, 130 after Ctrl-C


def add_index_parser(sub) -> None:
    p = sub.add_parser(
        "index", help="keep a cluster-wide prefix index in Redis from pools' event streams",
        description="Subscribes to the KV-event streams of one or more pools (each served by "
        "`shmkv publish NAME --endpoint ... --replay-endpoint ...`, on any node) and keeps, "
        "in Redis, which pool holds every cached block, exactly: it catches up by replay "
        "after its own restart, and from a snapshot of the pool after a Redis restart, "
        "lost events or a re-created pool. A source that does not answer is retried with a "
        "backoff while the others are indexed. Exits 2 only on a Redis error it cannot "
        "recover from (a lost connection is retried). Runs until SIGTERM or Ctrl-C (exit "
        "143 or 130). Needs pyzmq and redis (pip install 'shmkv[zmq,redis]').")
    p.add_argument("--redis", default="redis://127.0.0.1:6379/0", metavar="URL",
                   help="Redis URL (redis://127.0.0.1:6379/0)")
    p.add_argument("--source", action="append", required=True, metavar="SPEC",
                   help="NAME=PUB_ENDPOINT,REPLAY_ENDPOINT[,NODE]; repeat for each pool")
    p.add_argument("--key-prefix", default="shmkv", help="prefix of every Redis key (shmkv)")
    p.add_argument("--identity-check", type=float, default=1.0, metavar="S",
                   help="seconds between checks that each pool is still the same (1)")
    p.add_argument("--source-timeout", type=float, default=2.0, metavar="S",
                   help="seconds a source may leave a request unanswered before it counts as "
                   "down; the others are indexed meanwhile and it is retried (2)")
    p.add_argument("--retry-max", type=float, default=30.0, metavar="S",
                   help="longest wait between retries of a source that is down: the wait "
                   "starts at 0.5 s and doubles (30)")
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


COMMANDS = {
    "index": add_index_parser,
    "route": add_route_parser,
}
