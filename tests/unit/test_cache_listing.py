"""``BlockPool.cached_blocks``: the cached blocks of a pool, evictable ones in eviction order
with their place in it, then held ones with their holders; bounded by ``limit``; a bad
limit is refused; nothing is written (the invariants hold and the queue is unchanged)."""

from __future__ import annotations

import os

import pytest

from shmkv import BlockPool, Request
from shmkv.errors import UsageError


def _request(rid: str, n: int, pool: BlockPool) -> Request:
    return Request(rid, list(range(n)), block_hasher=pool.make_block_hasher())


def test_cached_blocks_in_eviction_order_then_held(make_pool):
    """Blocks 1..4: 1-3 cached (3 keys), 4 not; free 3, 2 (tail first), hold 1 from a
    second handle: the listing is 3, 2 at their queue places, then 1 with its holder."""
    pool = make_pool(11)
    other = BlockPool.attach(pool.pool_name, label="other")
    try:
        req = _request("a", 48, pool)
        blocks = pool.get_new_blocks(4)
        pool.cache_full_blocks(req, blocks, 0, 3, 16, 0)
        other.touch(other.get_cached_prefix(req.block_hashes)[:1])
        order_before = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
        pool.free_blocks(reversed(blocks))  # 4, 3, 2 reach 0 and go to the tail; 1 is held
        # queue: 5..10 (the never-used ones), then 4 (uncached: to the front), 3, 2
        queue = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
        listing = pool.cached_blocks()
        assert (listing.num_cached, listing.num_free) == (3, len(queue))
        assert [b.block_id for b in listing.blocks] == [3, 2, 1]
        by_id = {b.block_id: b for b in listing.blocks}
        assert by_id[3].lru_position == queue.index(3)
        assert by_id[2].lru_position == queue.index(2)
        assert by_id[1].lru_position is None and by_id[1].ref_cnt == 1
        assert by_id[1].holders == ((other.slot, os.getpid(), 1),)
        for k, b in enumerate((1, 2, 3)):
            assert by_id[b].block_hash == bytes(req.block_hashes[k])
            assert by_id[b].group_id == 0 and by_id[b].num_tokens == 16 * (k + 1)
        assert [b.block_id for b in pool.cached_blocks(2).blocks] == [3, 2]
        assert pool.cached_blocks(0).blocks == []
        # read only: the queue and the invariants are as before the listing
        assert [b.block_id for b in pool.free_block_queue.get_all_free_blocks()] == queue
        assert order_before != queue
        pool.check_invariants()
        other.free_blocks(other.get_cached_prefix(req.block_hashes)[:1])
        other.check_invariants()
    finally:
        other.close()


@pytest.mark.parametrize("limit", [-1, 1.5, "3", True, None])
def test_cached_blocks_bad_limit_is_refused(make_pool, limit):
    pool = make_pool(11)
    with pytest.raises(UsageError, match=r"cached_blocks\(\): limit must be an int >= 0"):
        pool.cached_blocks(limit)
    pool.check_invariants()


def test_an_empty_cache_lists_nothing(make_pool):
    pool = make_pool(11)
    listing = pool.cached_blocks()
    assert listing.blocks == [] and listing.num_cached == 0 and listing.num_free == 10
