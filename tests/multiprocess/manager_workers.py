"""Worker functions for tests/multiprocess/test_managers_shared.py (importable under spawn)."""

from __future__ import annotations

from shmkv import (
    BlockPool,
    FullAttentionManager,
    FullAttentionSpec,
    Request,
    SlidingWindowManager,
    SlidingWindowSpec,
)

BLOCK_SIZE = 4
SPECS = (
    FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype="float16"),
    SlidingWindowSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype="float16",
                      sliding_window=8),
)


def make_managers(pool: BlockPool):
    """A full-attention group 0 and a sliding-window group 1, as a hybrid model has."""
    kw = {"enable_caching": True, "scheduler_block_size": BLOCK_SIZE}
    return (FullAttentionManager(SPECS[0], block_pool=pool, kv_cache_group_id=0, **kw),
            SlidingWindowManager(SPECS[1], block_pool=pool, kv_cache_group_id=1, **kw))


def serve_one(name: str, request_id: str, prompt: list[int], results) -> None:
    """Attaches, looks up the hit of ``prompt`` in both groups (full attention first, the
    sliding window bounded by its length), admits the request under one hold of the pool
    lock, caches its blocks, finishes it, and reports (hit tokens, block ids per group)."""
    with BlockPool.attach(name) as pool:
        managers = make_managers(pool)
        req = Request(request_id, prompt, block_hasher=pool.make_block_hasher())
        with pool.lock():  # the hit cannot be evicted by another process before the touch
            (full_hit,), length = FullAttentionManager.find_longest_cache_hit(
                req.block_hashes, req.num_tokens - 1, [0], pool, SPECS[0], False, BLOCK_SIZE)
            (swa_hit,), swa_length = SlidingWindowManager.find_longest_cache_hit(
                req.block_hashes, length, [1], pool, SPECS[1], False, BLOCK_SIZE)
            del full_hit[swa_length // BLOCK_SIZE:]
            hits = (full_hit, swa_hit)
            for manager, hit in zip(managers, hits, strict=True):
                manager.add_local_computed_blocks(request_id, hit, swa_length, 0)
                manager.allocate_new_blocks(request_id, req.num_tokens, req.num_tokens)
                manager.cache_blocks(req, req.num_tokens, replay_boundaries=[])
        tables = [[b.block_id for b in m.req_to_blocks[request_id]] for m in managers]
        for manager in managers:
            manager.free(request_id)
        pool.check_invariants()
        results.put((swa_length, tables))
