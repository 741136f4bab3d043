"""Processes for the cluster-index tests (module level, so spawn can import them)."""

from __future__ import annotations

import random
import sys
import traceback

from shmkv import BlockPool, Request
from shmkv.pool import fault

BS = 16
SYSTEMS = [list(range(s * 1000, s * 1000 + 64)) for s in range(4)]


def prompt(rng: random.Random) -> list[int]:
    """A chat-like prompt: a shared system prompt and a short message of its own."""
    return rng.choice(SYSTEMS) + [rng.randrange(50_000) for _ in range(rng.randint(1, 40))]


def admit(pool: BlockPool, req: Request) -> list:
    """A scheduler's admission under one hold: look up, touch, allocate, cache."""
    with pool.lock():
        hits = pool.get_cached_prefix(req.block_hashes)
        pool.touch(hits)
        blocks = hits + pool.get_new_blocks(-(-req.num_tokens // BS) - len(hits))
        pool.cache_full_blocks(req, blocks, len(hits), req.num_tokens // BS, BS, 0)
    return blocks


def scheduler(name: str, seed: int, num_requests: int, crash_op: str | None = None) -> None:
    """Serves ``num_requests`` requests on an attached pool; with ``crash_op``, SIGKILLs
    itself half way through that operation of its last request, inside the pool lock."""
    try:
        rng = random.Random(seed)
        pool = BlockPool.attach(name, label=f"scheduler-{seed}")
        hasher = pool.make_block_hasher()
        for i in range(num_requests):
            req = Request(f"s{seed}-{i}", prompt(rng), block_hasher=hasher)
            if crash_op is not None and i == num_requests - 1:
                fault.arm(crash_op, 6)
            blocks = admit(pool, req)
            pool.free_blocks(reversed(blocks))
        pool.close()
    except BaseException:
        traceback.print_exc()
        sys.exit(1)


def indexer(redis_url: str, key_prefix: str, sources: list[tuple], stop, stats_queue) -> None:
    """Runs a ClusterIndexer until ``stop`` is set, then reports its stats."""
    try:
        from shmkv.cluster_index import ClusterIndexer, IndexSource, RedisPrefixIndex

        index = RedisPrefixIndex.from_url(redis_url, key_prefix)
        with ClusterIndexer(index, [IndexSource(*s) for s in sources],
                            identity_check_s=0.2) as ix:
            ix.run(stop)
            stats_queue.put(vars(ix.stats))
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
