"""A decode ``allocate_slots`` whose blocks already hold the new token answers without the
pool (``KVCacheManager._slots_already_allocated``): no lock hold, nothing changed, vLLM's
empty result; the step that fills a block or needs one takes the general path. On both
kernels. (That the answers are vLLM's: tests/differential/test_decode_fast_path_vs_vllm.py.)"""

from __future__ import annotations

from tests.unit.test_kv_cache_manager import BS, admit, full, manager, req, swa


def test_decode_inside_a_block_takes_no_lock(make_pool):
    pool = make_pool(32)
    m = manager(pool)
    r = req(pool, "a", range(BS + 4))  # two blocks, the second with room for 12 tokens
    admit(m, r)
    lock = pool.lock()
    table = m.get_block_ids("a")
    free_ids = pool.get_free_block_ids()
    for i in range(BS - 5):  # tokens 21..31: inside block 1, which stays unfull
        r.append_output_token_ids(100 + i)
        before = lock.num_acquired
        assert m.allocate_slots(r, 1) is m.empty_kv_cache_blocks
        assert lock.num_acquired == before
        r.num_computed_tokens += 1
        assert m.get_block_ids("a") == table and pool.get_free_block_ids() == free_ids
        pool.check_invariants()
    block = m.get_blocks("a").blocks[0][1]
    assert block.block_hash is None
    # Token 32 fills block 1: the general path caches it (and takes the lock).
    r.append_output_token_ids(200)
    before = lock.num_acquired
    assert m.allocate_slots(r, 1) is m.empty_kv_cache_blocks
    assert lock.num_acquired > before and block.block_hash is not None
    r.num_computed_tokens += 1
    # Token 33 needs block 2.
    r.append_output_token_ids(201)
    new = m.allocate_slots(r, 1)
    assert len(new.blocks[0]) == 1 and len(m.get_block_ids("a")[0]) == 3
    pool.check_invariants()


def test_lookahead_past_the_block_takes_the_general_path(make_pool):
    pool = make_pool(32)
    m = manager(pool)
    r = req(pool, "a", range(BS + 4))
    admit(m, r)
    r.append_output_token_ids(7)
    new = m.allocate_slots(r, 1, num_lookahead_tokens=BS)
    assert len(new.blocks[0]) == 1
    pool.check_invariants()


def test_no_pool_step_keeps_another_requests_lookup_hold(make_pool):
    """The hold a lookup of request b took lasts through a's no-pool decode step and ends
    at b's allocation, as it does when a's step goes through the pool."""
    pool = make_pool(32)
    m = manager(pool)
    a = req(pool, "a", range(BS + 4))
    admit(m, a)
    b = req(pool, "b", range(BS + 8))
    hit, n, _ = m.get_computed_blocks(b)
    assert n == BS and m._lookup_hold
    a.append_output_token_ids(7)
    before = pool.lock().num_acquired
    assert m.allocate_slots(a, 1) is m.empty_kv_cache_blocks
    assert m._lookup_hold and pool.lock().num_acquired == before
    assert m.allocate_slots(b, b.num_tokens - n, n, hit) is not None
    assert not m._lookup_hold
    pool.check_invariants()


def test_sliding_window_groups_always_take_the_general_path(make_pool):
    """A window frees blocks as decode moves on, so its steps are never answered without
    the pool."""
    pool = make_pool(32)
    m = manager(pool, full(), swa(2 * BS))
    assert m._no_pool_decode_managers == ()
    r = req(pool, "a", range(BS + 4))
    admit(m, r)
    r.append_output_token_ids(7)
    before = pool.lock().num_acquired
    assert m.allocate_slots(r, 1) is m.empty_kv_cache_blocks
    assert pool.lock().num_acquired > before
    pool.check_invariants()
