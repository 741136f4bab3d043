"""BlockPool scenarios with exact block ids and exact free-queue orders, after vLLM's
test_prefix_caching (one full-attention group, block size 16, 11 blocks: 10 usable). Every
call on a checked pool is followed by check_invariants()."""

from __future__ import annotations

import msgspec
import pytest

from shmkv import AllBlocksCleared, BlockPool, BlockRemoved, BlockStored, KVEventBatch, UsageError
from shmkv.events import decode_batch, encode_batch
from tests.helpers import chain_hashes, free_ids, ids, make_request

BS = 16


@pytest.fixture
def byte_hashes(monkeypatch):
    """Events carry the 32 hash bytes instead of vLLM's default 64-bit integers."""
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")


def _allocate_and_cache(pool, req, num_tokens: int, hits=()):
    """What a scheduler does for a new request: touch the hits, allocate the rest, cache the
    full blocks. Returns the request's blocks."""
    hits = list(hits)
    pool.touch(hits)
    need = -(-num_tokens // BS) - len(hits)
    blocks = hits + pool.get_new_blocks(need)
    pool.cache_full_blocks(req, blocks, len(hits), num_tokens // BS, BS, 0)
    return blocks


def _lookup(pool, req) -> list:
    hits = []
    for h in req.block_hashes:
        found = pool.get_cached_block(h, [0])
        if found is None:
            break
        hits.append(found[0])
    return hits


def test_prefill_hit_free_order_and_reuse(make_checked_pool):
    """vLLM test_prefill at pool level: ids, hits, the free-queue order after two requests
    are freed, and reuse of the unhashed block first."""
    pool = make_checked_pool(11)
    common = list(range(48))
    req0 = make_request(55)  # 3 full blocks + 7 tokens
    blocks0 = _allocate_and_cache(pool, req0, 55)
    assert ids(blocks0) == [1, 2, 3, 4]
    for b in blocks0[:3]:
        assert b.ref_cnt == 1 and b.block_hash is not None
        assert b.block_hash[-4:] == (0).to_bytes(4, "big")
    assert blocks0[3].block_hash is None
    assert [b.block_hash[:32] for b in blocks0[:3]] == req0.block_hashes

    from tests.helpers import FakeRequest

    req1 = FakeRequest(common + [99] * 5)
    hits = _lookup(pool, req1)
    assert ids(hits) == [1, 2, 3]
    blocks1 = _allocate_and_cache(pool, req1, 53, hits)
    assert ids(blocks1) == [1, 2, 3, 5]
    assert [b.ref_cnt for b in blocks1] == [2, 2, 2, 1]
    assert pool.get_num_free_blocks() == 5

    pool.free_blocks(reversed(blocks0))
    pool.free_blocks(reversed(blocks1))
    # unhashed blocks first (5 freed last is reused first), then never-used blocks,
    # then the cached chain tail first.
    assert free_ids(pool) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]

    req2 = FakeRequest(common + [7] * 7)
    hits = _lookup(pool, req2)
    assert ids(hits) == [1, 2, 3]
    blocks2 = _allocate_and_cache(pool, req2, 55, hits)
    assert ids(blocks2) == [1, 2, 3, 5]
    assert pool.get_num_free_blocks() == 6
    pool.free_blocks(reversed(blocks2))

    # A 160-token miss takes all 10 blocks in queue order and evicts every hash.
    req3 = make_request(160, first_token=1000)
    assert _lookup(pool, req3) == []
    blocks3 = pool.get_new_blocks(10)
    assert ids(blocks3) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    assert all(b.block_hash is None for b in blocks3)
    assert free_ids(pool) == [] and pool.get_num_free_blocks() == 0
    q = pool.raw.free_block_queue
    assert pool.raw._blocks[q.head]["next"] == q.tail
    assert pool.raw._blocks[q.tail]["prev"] == q.head


def test_evict_order(make_checked_pool):
    """vLLM test_evict: freed chains queue tail-first, hits come out of the queue."""
    pool = make_checked_pool(11)
    req0 = make_request(5 * BS + 7)
    blocks0 = _allocate_and_cache(pool, req0, 5 * BS + 7)
    assert ids(blocks0) == [1, 2, 3, 4, 5, 6]
    req1 = make_request(3 * BS, first_token=500)
    blocks1 = _allocate_and_cache(pool, req1, 3 * BS)
    assert ids(blocks1) == [7, 8, 9]
    pool.free_blocks(reversed(blocks0))
    assert free_ids(pool) == [6, 10, 5, 4, 3, 2, 1]
    pool.free_blocks(reversed(blocks1))
    assert free_ids(pool) == [6, 10, 5, 4, 3, 2, 1, 9, 8, 7]

    req2 = make_request(2 * BS + 3)  # shares the first 2 blocks of req0
    hits = _lookup(pool, req2)
    assert ids(hits) == [1, 2]
    blocks2 = _allocate_and_cache(pool, req2, 2 * BS + 3, hits)
    assert ids(blocks2) == [1, 2, 6]
    assert pool.get_num_free_blocks() == 7
    assert free_ids(pool) == [10, 5, 4, 3, 9, 8, 7]


def test_computed_blocks_not_evicted(make_checked_pool):
    """vLLM test_computed_blocks_not_evicted: a hit is touched before allocating, so the
    allocation takes the other cached block, never the hit."""
    pool = make_checked_pool(3)
    req0 = make_request(BS)
    b0 = _allocate_and_cache(pool, req0, BS)
    req1 = make_request(BS, first_token=100)
    b1 = _allocate_and_cache(pool, req1, BS)
    assert ids(b0) == [1] and ids(b1) == [2]
    pool.free_blocks(b0)
    pool.free_blocks(b1)
    req2 = make_request(2 * BS)  # hits block 1, needs one more
    hits = _lookup(pool, req2)
    assert ids(hits) == [1]
    blocks2 = _allocate_and_cache(pool, req2, 2 * BS, hits)
    assert ids(blocks2) == [1, 2]
    assert pool.get_cached_block(req1.block_hashes[0], [0]) is None


def test_reused_block_loses_its_hash(make_checked_pool):
    """vLLM test_hash_block_correct_reuse: a cached block handed out again is unhashed."""
    pool = make_checked_pool(2)
    req = make_request(BS)
    blocks = _allocate_and_cache(pool, req, BS)
    pool.free_blocks(blocks)
    assert blocks[0].block_hash is not None
    new = pool.get_new_blocks(1)
    assert ids(new) == [1] and new[0].block_hash is None
    assert pool.get_cached_block(req.block_hashes[0], [0]) is None


def test_duplicate_keys_first_inserted_wins_and_last_block_drops_key(make_checked_pool):
    """vLLM test_maybe_evict_cached_block: several blocks share a key; lookup returns the
    first inserted; the key goes only with its last block."""
    pool = make_checked_pool(8)
    req = make_request(3 * BS)
    h0, h1, h2 = req.block_hashes
    blocks = pool.get_new_blocks(4)  # 1,2,3,4 ; 4 duplicates 1
    pool.cache_full_blocks(req, blocks[:3], 0, 3, BS, 0)
    pool.cache_full_blocks(req, [blocks[3]], 0, 1, BS, 0)
    idx = pool.raw.cached_block_hash_to_block
    assert len(idx) == 3
    assert ids(pool.get_cached_block(h0, [0])) == [1]
    pool.evict_blocks({1})
    assert ids(pool.get_cached_block(h0, [0])) == [4]
    assert len(idx) == 3
    pool.evict_blocks({4})
    assert pool.get_cached_block(h0, [0]) is None
    assert len(idx) == 2
    pool.evict_blocks({2, 3, 5})  # 5 has no hash: left alone
    assert len(idx) == 0
    assert [b.ref_cnt for b in blocks] == [1, 1, 1, 1]  # evicting never frees


def test_multi_group_lookup_needs_every_group(make_checked_pool):
    """vLLM test_cache_blocks_multi_group: a lookup across groups hits only where every
    group holds the key."""
    pool = make_checked_pool(11)
    req = make_request(3 * BS)
    g0 = pool.get_new_blocks(2)
    g1 = pool.get_new_blocks(3)
    pool.cache_full_blocks(req, g0, 0, 2, BS, 0)
    pool.cache_full_blocks(req, g1, 0, 3, BS, 1)
    assert len(pool.raw.cached_block_hash_to_block) == 5
    h = req.block_hashes
    assert ids(pool.get_cached_block(h[0], [0, 1])) == [1, 3]
    assert ids(pool.get_cached_block(h[1], [0, 1])) == [2, 4]
    assert pool.get_cached_block(h[2], [0, 1]) is None
    assert ids(pool.get_cached_block(h[2], [1])) == [5]
    assert g1[0].block_hash == h[0] + (1).to_bytes(4, "big")


def test_cache_blocks_grows_index_incrementally(make_checked_pool):
    """vLLM test_cache_blocks: caching blocks [0,2) then [2,3) grows the map 2 -> 3."""
    pool = make_checked_pool(5)
    req = make_request(3 * BS)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(req, blocks, 0, 2, BS, 0)
    assert len(pool.raw.cached_block_hash_to_block) == 2
    assert blocks[2].block_hash is None
    pool.cache_full_blocks(req, blocks, 2, 3, BS, 0)
    assert len(pool.raw.cached_block_hash_to_block) == 3
    assert [b.block_hash_num_tokens for b in blocks] == [16, 32, 48]


def test_null_and_masked_blocks_are_not_cached(make_checked_pool, byte_hashes):
    """Null blocks and blocks masked out are skipped; the null block stays unhashed."""
    pool = make_checked_pool(8, enable_kv_cache_events=True)
    req = make_request(4 * BS)
    blocks = [pool.null_block] + pool.get_new_blocks(3)
    pool.cache_full_blocks(req, blocks, 0, 4, BS, 0, block_mask=[True, True, False, True])
    assert pool.null_block.block_hash is None and pool.null_block.is_null
    assert [b.block_hash is not None for b in blocks] == [False, True, False, True]
    (event,) = pool.take_events()
    assert event.block_hashes == [req.block_hashes[1], req.block_hashes[3]]
    assert event.token_ids == list(range(4 * BS)) and event.parent_block_hash is None


def test_coarse_block_size_uses_last_fine_hash(make_checked_pool):
    """A group with blocks of 2 hash units is keyed by the fine hash at index 2i+1."""
    pool = make_checked_pool(6, hash_block_size=16, enable_kv_cache_events=True)
    req = make_request(4 * BS)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, 2, 32, 0)
    assert blocks[0].block_hash[:32] == req.block_hashes[1]
    assert blocks[1].block_hash[:32] == req.block_hashes[3]
    assert ids(pool.get_cached_block(req.block_hashes[3], [0])) == [2]
    (event,) = pool.take_events()
    assert event.block_size == 32 and event.parent_block_hash is None


def test_reset_prefix_cache_only_when_idle(make_checked_pool):
    """vLLM test_reset_prefix_cache: False while blocks are in use, True once freed, and
    then no hash is left anywhere."""
    pool = make_checked_pool(11, enable_kv_cache_events=True)
    req = make_request(3 * BS + 2)
    blocks = _allocate_and_cache(pool, req, 3 * BS + 2)
    pool.take_events()
    assert pool.reset_prefix_cache() is False
    assert len(pool.raw.cached_block_hash_to_block) == 3
    assert pool.take_events() == []
    pool.free_blocks(reversed(blocks))
    order = free_ids(pool)
    assert pool.reset_prefix_cache() is True
    assert len(pool.raw.cached_block_hash_to_block) == 0
    assert all(b.block_hash is None for b in pool.blocks)
    assert free_ids(pool) == order  # the queue is untouched
    assert pool.take_events() == [AllBlocksCleared()]


@pytest.mark.parametrize("num_blocks", [2, 3, 10])
def test_kv_cache_events(make_checked_pool, byte_hashes, num_blocks):
    """vLLM test_kv_cache_events: one BlockStored per call, one BlockRemoved per evicted
    key on reuse, AllBlocksCleared on reset; batches encode to vLLM's wire format."""
    pool = make_checked_pool(num_blocks + 1, enable_kv_cache_events=True)
    req = make_request(num_blocks * BS)
    blocks = _allocate_and_cache(pool, req, num_blocks * BS)
    events = pool.take_events()
    assert len(events) == 1 and isinstance(events[0], BlockStored)
    stored = events[0]
    assert stored.block_hashes == req.block_hashes
    assert len(stored.token_ids) == num_blocks * BS and stored.block_size == BS
    assert stored.medium == "GPU" and stored.group_idx == 0 and stored.lora_id is None
    assert pool.take_events() == []

    pool.free_blocks(reversed(blocks))
    again = pool.get_new_blocks(num_blocks)
    removed = pool.take_events()
    assert len(removed) == num_blocks
    assert all(isinstance(e, BlockRemoved) for e in removed)
    assert all(e.block_hashes[0] in req.block_hashes for e in removed)
    pool.free_blocks(again)
    assert pool.reset_prefix_cache()
    assert pool.take_events() == [AllBlocksCleared()]

    batch = KVEventBatch(ts=1.5, events=events + removed, data_parallel_rank=2)
    wire = encode_batch(batch)
    assert decode_batch(wire) == batch
    # The layout vLLM consumers expect: [ts, [{"type": "BlockStored", ...}, ...], rank]
    raw = msgspec.msgpack.decode(wire)
    assert raw[0] == 1.5 and raw[2] == 2
    assert raw[1][0]["type"] == "BlockStored" and "kv_cache_spec_kind" not in raw[1][0]


def test_events_disabled_take_events_is_empty(make_checked_pool):
    """With events off, take_events() is always []."""
    pool = make_checked_pool(4)
    req = make_request(BS)
    _allocate_and_cache(pool, req, BS)
    assert pool.take_events() == []


def test_cache_salt_marks_only_the_first_block_in_events(make_checked_pool, byte_hashes):
    """The salt appears in the first block's extra keys only (vLLM's rule)."""
    pool = make_checked_pool(6, enable_kv_cache_events=True)
    req = make_request(3 * BS, cache_salt="tenant-a")
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(req, blocks, 0, 2, BS, 0)
    pool.cache_full_blocks(req, blocks, 2, 3, BS, 0)
    first, second = pool.take_events()
    assert first.extra_keys == [("tenant-a",), None]
    assert second.extra_keys == [None] and second.parent_block_hash == req.block_hashes[1]
    other = make_request(3 * BS, cache_salt="tenant-b")
    assert chain_hashes(other.all_token_ids, BS, "tenant-b")[0] != req.block_hashes[0]
    assert pool.get_cached_block(other.block_hashes[0], [0]) is None


def test_caching_disabled_never_hashes(make_checked_pool):
    """Without prefix caching, freed blocks all go to the front and nothing is hashed."""
    pool = make_checked_pool(6, enable_caching=False)
    blocks = pool.get_new_blocks(3)
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [3, 2, 1, 4, 5]


def test_usage_excludes_null_block(make_checked_pool):
    """get_usage is the used fraction of the non-null blocks; 0 for a 1-block pool."""
    pool = make_checked_pool(11)
    assert pool.get_usage() == 0.0
    blocks = pool.get_new_blocks(4)
    assert pool.get_usage() == pytest.approx(0.4)
    pool.free_blocks(blocks)
    assert pool.get_usage() == 0.0
    tiny = make_checked_pool(1)
    assert tiny.get_usage() == 0 and tiny.get_num_free_blocks() == 0


def test_touch_pulls_cached_block_out_of_queue_and_counts_refs(make_checked_pool):
    """touch() of a free cached block removes it from the queue; of a held one adds a ref."""
    pool = make_checked_pool(6)
    req = make_request(2 * BS)
    blocks = _allocate_and_cache(pool, req, 2 * BS)
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [3, 4, 5, 2, 1]
    pool.touch([blocks[0], pool.null_block])
    assert free_ids(pool) == [3, 4, 5, 2] and blocks[0].ref_cnt == 1
    pool.touch([blocks[0]])
    assert blocks[0].ref_cnt == 2
    pool.free_blocks([blocks[0], blocks[0]])
    assert free_ids(pool) == [3, 4, 5, 2, 1]


def test_large_batches_take_the_bulk_path_with_same_results(make_checked_pool):
    """Allocating and freeing 200 blocks at once (numpy path) keeps vLLM's order rules."""
    pool = make_checked_pool(301)
    req = make_request(150 * BS)
    blocks = pool.get_new_blocks(200)
    assert ids(blocks) == list(range(1, 201))
    pool.cache_full_blocks(req, blocks, 0, 150, BS, 0)
    pool.free_blocks(reversed(blocks))
    order = free_ids(pool)
    assert order == list(range(200, 150, -1)) + list(range(201, 301)) + list(range(150, 0, -1))
    again = pool.get_new_blocks(160)
    assert ids(again) == order[:160]
    assert pool.get_cached_block(req.block_hashes[0], [0]) is not None  # block 1 not reached
    assert pool.get_cached_block(req.block_hashes[149], [0]) is None  # block 150 was evicted


def test_attach_sees_the_same_pool(make_pool):
    """A second BlockPool object attached to the segment sees the creator's cache, and its
    hits stay alive after the creator frees them."""
    pool = make_pool(11)
    req = make_request(2 * BS)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, 2, BS, 0)
    other = BlockPool.attach(pool.pool_name, num_gpu_blocks=11, hash_block_size=16)
    try:
        hits = [other.get_cached_block(h, [0])[0] for h in req.block_hashes]
        assert ids(hits) == [1, 2]
        assert other.get_num_free_blocks() == 8
        other.touch(hits)
        pool.free_blocks(reversed(blocks))  # the creator's references go; the hits stay held
        assert [b.ref_cnt for b in hits] == [1, 1] and pool.get_num_free_blocks() == 8
        other.free_blocks(reversed(hits))
        assert pool.get_free_block_ids() == [3, 4, 5, 6, 7, 8, 9, 10, 2, 1]
        other.check_invariants()
    finally:
        other.close()


def test_context_manager_creator_unlinks_attacher_does_not(pool_name):
    """The creator's with-block unlinks the segment; an attacher's only closes."""
    import os

    from shmkv.pool.layout import segment_name

    path = f"/dev/shm{segment_name(pool_name)}"
    with BlockPool.create(pool_name, 4) as pool:
        with BlockPool.attach(pool_name) as other:
            other.get_new_blocks(1)
            assert pool.get_num_free_blocks() == 2
        assert os.path.exists(path)
        assert pool.get_num_free_blocks() == 3  # the attacher's close gave its block back
    assert not os.path.exists(path)


def test_undecodable_event_batch_is_a_protocol_error():
    """Bytes that are not a KV-event batch raise ProtocolError, not a msgspec error."""
    from shmkv import ProtocolError

    with pytest.raises(ProtocolError, match="not a KV-event batch"):
        decode_batch(b"\x93\x01garbage")


def test_event_hashes_are_64_bit_ints_by_default(make_checked_pool, monkeypatch):
    """As in vLLM 0.33.0, events carry the low 64 bits of each digest (big-endian) unless
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0."""
    monkeypatch.delenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", raising=False)
    pool = make_checked_pool(6, enable_kv_cache_events=True)
    req = make_request(3 * BS)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(req, blocks, 0, 2, BS, 0)
    pool.cache_full_blocks(req, blocks, 2, 3, BS, 0)
    low64 = [int.from_bytes(h, "big") & (2**64 - 1) for h in req.block_hashes]
    first, second = pool.take_events()
    assert first.block_hashes == low64[:2] and first.parent_block_hash is None
    assert second.block_hashes == low64[2:] and second.parent_block_hash == low64[1]
    pool.free_blocks(blocks)
    pool.get_new_blocks(5)
    removed = pool.take_events()
    assert sorted(e.block_hashes[0] for e in removed) == sorted(low64)


def test_get_cached_prefix_equals_the_lookup_loop(make_checked_pool):
    """get_cached_prefix returns what a get_cached_block loop finds, honours the limit and
    the group, and checks its hashes."""
    pool = make_checked_pool(16)
    req = make_request(5 * BS)
    blocks = pool.get_new_blocks(5)
    pool.cache_full_blocks(req, blocks, 0, 3, BS, 0)
    assert ids(pool.get_cached_prefix(req.block_hashes)) == ids(_lookup(pool, req)) == [1, 2, 3]
    assert ids(pool.get_cached_prefix(req.block_hashes, max_num_blocks=2)) == [1, 2]
    assert pool.get_cached_prefix(req.block_hashes, kv_cache_group_id=1) == []
    assert pool.get_cached_prefix([]) == []
    with pytest.raises(ValueError, match="block hash 0 must be 32 bytes"):
        pool.get_cached_prefix([b"short"])


def test_lookup_block_ids_answers_each_key_and_its_fallback_form(make_checked_pool):
    """lookup_block_ids equals lookup_block_id key by key; a key missing in its group but
    kept under group | fallback_bit is answered -2 - its block; bad input is refused before
    any lookup, naming the problem."""
    pool = make_checked_pool(16)
    req = make_request(4 * BS)
    blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(req, blocks, 0, 2, BS, 0)  # keys 0, 1 in group 0
    pool.cache_full_blocks(req, blocks, 2, 4, BS, 1 << 20)  # keys 2, 3 in group 2**20
    hashes = list(req.block_hashes)
    assert pool.lookup_block_ids(hashes, [0] * 4) == [
        pool.lookup_block_id(h, 0) for h in hashes] == [1, 2, -1, -1]
    assert pool.lookup_block_ids(hashes, [0] * 4, 1 << 20) == [1, 2, -2 - 3, -2 - 4]
    assert pool.lookup_block_ids(hashes[2:], [1 << 20] * 2, 1 << 20) == [3, 4]
    assert pool.lookup_block_ids([], []) == []
    bad = [
        ((hashes, [0]), "two lists of one length|lists of one length"),
        ((tuple(hashes), [0] * 4), "lists of one length"),
        (([b"short"], [0]), "must be 32 bytes"),
        (([hashes[0]], [-1]), r"kv_cache_group_id -1 is not an int in \[0, 2\*\*31\)"),
        (([hashes[0]], [2**31]), "is not an int"),
        (([hashes[0], "x"], [0, 0]), "block hash must be bytes, got str"),
        (([hashes[0]], [0], 2**40), "is not an int"),
    ]
    for args, message in bad:
        with pytest.raises(UsageError, match=message):
            pool.lookup_block_ids(*args)
    pool.free_blocks(blocks)
