"""vLLM 0.33.0's pool calls that its own tests use (issue 20, items 5 and 7): the free queue's
``get_all_free_blocks`` / ``iter_blocks_after``, ``is_block_writable``,
``emit_cached_block_events`` (pool and coordinator), and ``move_block_hashes`` on a pool
without alias rows. Both kernels; invariants checked after every call (``make_checked_pool``).
"""

from __future__ import annotations

import pytest

from shmkv import BlockStored, UsageError
from shmkv.core.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from shmkv.core.kv_cache_manager import KVCacheManager
from shmkv.core.request import Request
from shmkv.events import external_block_hash, use_int_block_hashes
from tests.helpers import make_request, segment_image

BS = 16


def _ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def test_get_all_free_blocks_lists_the_queue_as_handles(make_checked_pool):
    """The handles come in queue order (head first) and are the pool's own objects."""
    pool = make_checked_pool(8)
    a, b, c = pool.get_new_blocks(3)
    pool.free_blocks([b, a])
    queue = pool.free_block_queue
    assert _ids(queue.get_all_free_blocks()) == pool.get_free_block_ids() == [2, 1, 4, 5, 6, 7]
    assert queue.get_all_free_blocks()[0] is b
    assert all(blk.ref_cnt == 0 for blk in queue.get_all_free_blocks())


def test_iter_blocks_after_walks_from_the_head_or_a_cursor(make_checked_pool):
    """From None: the whole queue; from a free block: what follows it, in eviction order."""
    pool = make_checked_pool(6)
    queue = pool.free_block_queue
    assert _ids(queue.iter_blocks_after(None)) == [1, 2, 3, 4, 5]
    third = queue.get_all_free_blocks()[2]
    assert _ids(queue.iter_blocks_after(third)) == [4, 5]
    assert _ids(queue.iter_blocks_after(queue.get_all_free_blocks()[-1])) == []


def test_iter_blocks_after_refuses_a_cursor_that_is_not_free(make_checked_pool):
    """An allocated block, the null block or a non-block is refused by name; nothing moves."""
    pool = make_checked_pool(6)
    (taken,) = pool.get_new_blocks(1)
    image = segment_image(pool._pool)
    queue = pool.free_block_queue
    for cursor in (taken, pool.null_block, "7"):
        with pytest.raises(UsageError, match="is not a free block"):
            list(queue.iter_blocks_after(cursor))
    assert segment_image(pool._pool) == image


def test_is_block_writable(make_checked_pool):
    """Writable: one reference and no prefix-cache key; never the null block."""
    pool = make_checked_pool(8)
    req = make_request(2 * BS)
    a, b = pool.get_new_blocks(2)
    assert pool.is_block_writable(a) and pool.is_block_writable(b)
    pool.cache_full_blocks(req, [a, b], 0, 1, BS, 0)
    assert not pool.is_block_writable(a)           # cached: other requests can hit it
    assert pool.is_block_writable(b)
    pool.touch([b])
    assert not pool.is_block_writable(b)           # two references
    assert not pool.is_block_writable(pool.null_block)
    with pytest.raises(UsageError, match="out of range"):
        pool.is_block_writable(type("B", (), {"block_id": 99})())


def test_emit_cached_block_events_announces_the_hit_and_changes_nothing(make_checked_pool):
    """One BlockStored for the hit (no parent, the hit's tokens); no block state changes."""
    pool = make_checked_pool(8, enable_kv_cache_events=True)
    req = make_request(3 * BS + 2)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(req, blocks, 0, 3, BS, 0)
    pool.take_events()
    before = [(b.ref_cnt, b.block_hash) for b in blocks]
    pool.emit_cached_block_events(req, 2, BS, 0)
    (event,) = pool.take_events()
    as_int = use_int_block_hashes()
    assert isinstance(event, BlockStored)
    assert event.block_hashes == [external_block_hash(h, as_int) for h in req.block_hashes[:2]]
    assert event.parent_block_hash is None
    assert event.token_ids == req.all_token_ids[:2 * BS]
    assert (event.block_size, event.group_idx) == (BS, 0)
    assert [(b.ref_cnt, b.block_hash) for b in blocks] == before
    pool.emit_cached_block_events(req, 0, BS, 0)   # no hit: no event
    assert pool.take_events() == []


def test_emit_cached_block_events_refuses_bad_arguments(make_checked_pool):
    """Bad counts or sizes, or a hit longer than the request's hashes: refused, no event."""
    pool = make_checked_pool(8, enable_kv_cache_events=True)
    req = make_request(2 * BS)
    for args, match in (((-1, BS, 0), "num_cached_blocks"), ((1, 10, 0), "multiple"),
                        ((1, BS, True), "kv_cache_group_id"), ((3, BS, 0), "3 are needed")):
        with pytest.raises(UsageError, match=match):
            pool.emit_cached_block_events(req, *args)
    assert pool.take_events() == []


def test_full_report_mode_emits_the_reused_blocks(make_pool):
    """KVCacheManager.get_computed_blocks of a request in vLLM's "full" report mode announces
    its hit (coordinator.emit_cached_block_events); the default mode does not."""
    pool = make_pool(16, enable_kv_cache_events=True)
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype="float32")
    config = KVCacheConfig(16, [], [KVCacheGroupSpec(["layer"], spec)])
    kvm = KVCacheManager(config, max_model_len=512, scheduler_block_size=BS, hash_block_size=BS,
                         block_pool=pool, enable_kv_cache_events=True)
    hasher = pool.make_block_hasher()
    first = Request("a", list(range(3 * BS)), block_hasher=hasher)
    hit, num_hit, _ = kvm.get_computed_blocks(first)
    kvm.allocate_slots(first, first.num_tokens, num_hit, hit)
    kvm.free(first)
    kvm.take_events()
    plain = Request("b", list(range(3 * BS)), block_hasher=hasher)
    hit, num_hit, _ = kvm.get_computed_blocks(plain)
    assert num_hit == 2 * BS and kvm.take_events() == []
    kvm.allocate_slots(plain, plain.num_tokens - num_hit, num_hit, hit)
    kvm.free(plain)
    kvm.take_events()
    full = Request("c", list(range(3 * BS)), block_hasher=hasher)
    full.kv_cache_report_mode = "full"
    hit, num_hit, _ = kvm.get_computed_blocks(full)
    events = kvm.take_events()
    assert num_hit == 2 * BS
    assert [type(e).__name__ for e in events] == ["BlockStored"]
    assert events[0].token_ids == list(range(2 * BS)) and events[0].parent_block_hash is None
    kvm.allocate_slots(full, full.num_tokens - num_hit, num_hit, hit)
    kvm.free(full)
    pool.check_invariants()


def test_move_block_hashes_without_alias_rows_moves_the_key(make_checked_pool):
    """On a pool created without partial_keys, a block's key moves to the copy (it used to
    index past the block rows: IndexError)."""
    pool = make_checked_pool(8)
    req = make_request(2 * BS)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, [a], 0, 1, BS, 0)
    pool.move_block_hashes(a, b)
    assert a.block_hash is None and b.block_hash is not None
    assert pool.get_cached_block(req.block_hashes[0], [0]) == [b]


def test_free_list_links_read_as_vllms_fields(make_checked_pool):
    """``prev_free_block`` / ``next_free_block`` of handles and of the list's two ends
    (``fake_free_list_head`` / ``_tail``) follow the shared links; off the queue: None."""
    pool = make_checked_pool(5)
    queue = pool.free_block_queue
    head, tail = queue.fake_free_list_head, queue.fake_free_list_tail
    assert head.prev_free_block is None and tail.next_free_block is None
    assert head.next_free_block.block_id == 1 and tail.prev_free_block.block_id == 4
    taken = pool.get_new_blocks(4)
    assert head.next_free_block is tail and tail.prev_free_block is head
    assert taken[0].prev_free_block is None and taken[0].next_free_block is None
    pool.free_blocks([taken[1], taken[0]])
    first = head.next_free_block
    assert first is taken[1] and first.prev_free_block is head
    assert first.next_free_block is taken[0] and taken[0].next_free_block is tail
