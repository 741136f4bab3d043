"""Helpers for the ecosystem tests (ZMQ events, metrics, the command): free ports, the
command in a subprocess, and a scheduler-like workload that produces events."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0, read it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command_env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT))


def shmkv(*args: str, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    """Runs the real ``shmkv`` command (this checkout's) and waits for it."""
    return subprocess.run([sys.executable, "-m", "shmkv.cli", *args], capture_output=True,
                          text=True, env=command_env(), timeout=timeout, cwd=ROOT, **kwargs)


def start_shmkv(*args: str) -> subprocess.Popen:
    """Starts the real ``shmkv`` command in the background (line-buffered text stdout)."""
    return subprocess.Popen([sys.executable, "-u", "-m", "shmkv.cli", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=command_env(), cwd=ROOT)


def serve_requests(pool, hasher, first: int, count: int, prompt=(), user_tokens: int = 24):
    """Scheduler-like work on an attached pool: per request, under one lock hold, look up
    the prefix, touch the hits, allocate the rest, cache the full blocks; then free them.
    Each request is ``prompt`` plus ``user_tokens`` tokens of its own."""
    from shmkv.core.request import Request

    bs = pool.hash_block_size
    hits_total = 0
    for r in range(first, first + count):
        tokens = list(prompt) + [100_000 + r * 1000 + t for t in range(user_tokens)]
        req = Request(f"r{r}", tokens, block_hasher=hasher)
        with pool.lock():
            hits = pool.get_cached_prefix(req.block_hashes)
            pool.touch(hits)
            new = pool.get_new_blocks(-(-req.num_tokens // bs) - len(hits))
            blocks = hits + new
            pool.cache_full_blocks(req, blocks, len(hits), req.num_tokens // bs, bs, 0)
        hits_total += len(hits)
        pool.free_blocks(reversed(blocks))
    return hits_total


def pool_cached_hashes(pool) -> Counter:
    """The pool's prefix cache as a multiset of event-form (64-bit integer) hashes."""
    from shmkv.events import external_block_hash

    index = pool.cached_block_hash_to_block
    out: Counter = Counter()
    with pool.lock():
        for block_id in range(1, pool.num_gpu_blocks):
            key = index.block_key(block_id)
            if key is not None:
                out[external_block_hash(bytes(key[0]), True)] += 1
    return out


def rebuild_cached_hashes(batches) -> Counter:
    """What a cache indexer rebuilds from a KV-event stream: +1 per stored block hash, -1
    per removed one, empty on AllBlocksCleared."""
    from shmkv.events import AllBlocksCleared, BlockRemoved, BlockStored

    state: Counter = Counter()
    for batch in batches:
        for event in batch.events:
            if isinstance(event, BlockStored) or type(event).__name__ == "BlockStored":
                state.update(event.block_hashes)
            elif isinstance(event, BlockRemoved) or type(event).__name__ == "BlockRemoved":
                state.subtract(event.block_hashes)
            elif isinstance(event, AllBlocksCleared) or (
                    type(event).__name__ == "AllBlocksCleared"):
                state.clear()
    return +state
