"""Single-type managers (shmkv.core.single_type_kv_cache_manager) over a real shared pool, on both
kernels: hit searches (sliding window from the right, chunked local from the chunk start,
Mamba's rightmost state), skipped blocks replaced by the null block, demands, Mamba modes,
cross attention, R-SWA gaps and the factory. Every test ends with ``check_invariants()``.

Cached patterns are written ``T``/``F`` per block: ``T`` means the block's hash is in the
prefix cache (with ref count 0, as after its request finished).
"""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import pytest

from shmkv import Request, UsageError
from shmkv.core.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    RSWASpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
)
from shmkv.core.single_type_kv_cache_manager import (
    ChunkedLocalAttentionManager,
    CrossAttentionManager,
    FullAttentionManager,
    MambaManager,
    RSWAManager,
    SinkFullAttentionManager,
    SlidingWindowManager,
    get_manager_for_kv_cache_spec,
)

T, F = True, False


def attn(cls, block_size=2, **kw):
    return cls(block_size=block_size, num_kv_heads=1, head_size=8, dtype="float16", **kw)


def make_manager(cls, spec, pool, enable_caching=True):
    return cls(spec, block_pool=pool, enable_caching=enable_caching, kv_cache_group_id=0,
               scheduler_block_size=spec.block_size)


def fake_hashes(n, tag="h"):
    return [hashlib.sha256(f"{tag}{i}".encode()).digest() for i in range(n)]


def cache_pattern(pool, pattern, block_size, tag="h"):
    """Caches one block per ``T`` of ``pattern`` under ``fake_hashes`` (ids 1.. in order),
    then frees them all, so they stay cached with ref count 0. Returns the hashes and ids."""
    hashes = fake_hashes(len(pattern), tag)
    blocks = pool.get_new_blocks(len(pattern))
    req = SimpleNamespace(request_id="seed", block_hashes=hashes)
    pool.cache_full_blocks(req, blocks, 0, len(pattern), block_size, 0, block_mask=list(pattern))
    pool.free_blocks(reversed(blocks))
    return hashes, [b.block_id for b in blocks]


def hit_ids(blocks):
    """Block ids of a hit, the null block as 0."""
    return [b.block_id for b in blocks]


def _assert_table(manager, request_id, expected, label):
    got = [b.block_id for b in manager.req_to_blocks[request_id]]
    assert got == expected, f"{label}: table {got} != {expected}"


# --------------------------------------------------------------------------- hit searches


SWA_CASES = [
    # (pattern, expected hit in blocks): window 4, block 2 -> 2 contiguous blocks needed
    ([F] * 10, 0),
    ([T], 1),
    ([T, F], 1),
    ([F, T, T], 3),
    ([F, T, T, F], 3),
    ([T, F, T, F, T], 1),  # no run of 2; the run touching block 0 counts
    ([T, T, F, T, F, F, T, T, F, T, T, T], 12),
    ([T, T, T, F, F, T, F], 3),
]


@pytest.mark.parametrize(("pattern", "expected"), SWA_CASES)
def test_sliding_window_hit_searches_from_the_right(make_pool, pattern, expected):
    """A window-4 hit needs the 2 blocks before its end cached; earlier positions are null."""
    pool = make_pool(32, hash_block_size=2)
    spec = attn(SlidingWindowSpec, sliding_window=4)
    hashes, ids = cache_pattern(pool, pattern, 2)
    (blocks,), length = SlidingWindowManager.find_longest_cache_hit(
        hashes, len(pattern) * 2, [0], pool, spec, False, 2)
    assert length == expected * 2
    want = [0] * expected
    for i in range(max(0, expected - 2), expected):
        want[i] = ids[i] if pattern[i] else 0
    if expected < 2:  # a short run at block 0 keeps its real block(s)
        want = ids[:expected]
    assert hit_ids(blocks) == want
    pool.check_invariants()


def test_sliding_window_eagle_needs_one_more_block_then_drops_it(make_pool):
    """With EAGLE a window-4 hit needs 3 contiguous blocks and returns the first 2 of them."""
    pool = make_pool(32, hash_block_size=2)
    spec = attn(SlidingWindowSpec, sliding_window=4)
    hashes, ids = cache_pattern(pool, [F, T, T, F, T, T, T], 2)
    (blocks,), length = SlidingWindowManager.find_longest_cache_hit(
        hashes, 14, [0], pool, spec, True, 2)
    assert (hit_ids(blocks), length) == ([0, 0, 0, 0, ids[4], ids[5]], 12)
    pool.check_invariants()


CHUNKED_CASES = [
    # (pattern, extra tokens past the blocks, expected hit in blocks): chunk 4, block 2
    ([], 0, 0),
    ([F], 0, 0),
    ([T], 0, 1),
    ([T, T], 0, 2),  # max length 4 = a chunk start: both blocks lie before it
    ([F, F], 0, 2),
    ([F, F, T], 1, 3),
    ([F, F, F], 1, 2),
    ([T, T, F, T], 0, 4),
    ([F, F, T, F, T], 1, 5),
    ([F, F, T, T, F], 1, 4),
    ([T] * 5 + [F], 0, 6),
]


@pytest.mark.parametrize(("pattern", "extra", "expected"), CHUNKED_CASES)
def test_chunked_local_hit_starts_at_the_current_chunk(make_pool, pattern, extra, expected):
    """Blocks before the current chunk are null hits; from the chunk start a cached run."""
    pool = make_pool(32, hash_block_size=2)
    spec = attn(ChunkedLocalAttentionSpec, attention_chunk_size=4)
    hashes, ids = cache_pattern(pool, pattern, 2) if pattern else ([], [])
    max_length = len(pattern) * 2 + extra
    (blocks,), length = ChunkedLocalAttentionManager.find_longest_cache_hit(
        hashes, max_length, [0], pool, spec, False, 2)
    assert length == expected * 2
    chunk_start_block = max_length // 4 * 4 // 2
    want = [0] * min(chunk_start_block, expected) + ids[chunk_start_block:expected]
    assert hit_ids(blocks) == want
    pool.check_invariants()


def test_full_attention_hit_is_the_leading_run(make_pool):
    """Full attention stops at the first miss; EAGLE drops the last block; two groups must
    both hit."""
    pool = make_pool(32, hash_block_size=2)
    spec = attn(FullAttentionSpec)
    hashes, ids = cache_pattern(pool, [T, T, T, F, T], 2)
    find = FullAttentionManager.find_longest_cache_hit
    assert [(hit_ids(b[0]), n) for b, n in [find(hashes, 10, [0], pool, spec, False, 2)]] == [
        (ids[:3], 6)]
    assert hit_ids(find(hashes, 10, [0], pool, spec, True, 2)[0][0]) == ids[:2]
    assert find(hashes, 5, [0], pool, spec, False, 2)[1] == 4  # max length caps it
    assert find(hashes, 10, [0], pool, spec, False, 4)[1] == 4  # alignment 4 rounds down
    assert find(hashes, 10, [0, 1], pool, spec, False, 2) == (([], []), 0)
    pool.check_invariants()


def test_mamba_hit_is_the_rightmost_cached_state(make_pool):
    """A Mamba hit is the last cached state below max length, null-padded on the left."""
    pool = make_pool(32, hash_block_size=2)
    spec = MambaSpec(2, ((4,),), ("float32",), mamba_cache_mode="align")
    hashes, ids = cache_pattern(pool, [T, F, T, F, F], 2)
    find = MambaManager.find_longest_cache_hit
    assert [(hit_ids(b[0]), n) for b, n in [find(hashes, 10, [0], pool, spec, False, 2)]] == [
        ([0, 0, ids[2]], 6)]
    assert find(hashes, 5, [0], pool, spec, False, 2)[1] == 2
    assert find(hashes, 10, [0], pool, spec, False, 4)[1] == 0  # block 2 ends off alignment
    pool.check_invariants()


# --------------------------------------------------------------------------- skipping


def _fresh_request_blocks(manager, request_id, num_tokens):
    manager.add_local_computed_blocks(request_id, [], 0, 0)
    return [b.block_id for b in manager.allocate_new_blocks(request_id, num_tokens, num_tokens)]


@pytest.mark.parametrize(("computed", "num_null"), [
    (0, 0), (4, 0), (5, 1), (6, 1), (7, 2), (11, 4),
])
def test_sliding_window_removes_whole_skipped_blocks(make_pool, computed, num_null):
    """Window 4, block 2: a block goes once all its tokens are out of the next token's
    window; it is freed to the front of the queue and replaced by the null block."""
    pool = make_pool(11, hash_block_size=2)
    manager = make_manager(SlidingWindowManager, attn(SlidingWindowSpec, sliding_window=4), pool)
    ids = _fresh_request_blocks(manager, "r", 12)
    assert ids == [1, 2, 3, 4, 5, 6]
    manager.remove_skipped_blocks("r", computed)
    _assert_table(manager, "r", [0] * num_null + ids[num_null:], f"computed {computed}")
    # Freed blocks (unhashed) go to the front, the later one first.
    assert pool.get_free_block_ids() == list(reversed(ids[:num_null])) + [7, 8, 9, 10]
    pool.check_invariants()


@pytest.mark.parametrize(("computed", "num_null"), [(0, 0), (4, 2), (6, 2), (12, 6)])
def test_chunked_local_removes_the_blocks_of_past_chunks(make_pool, computed, num_null):
    """Chunk 4, block 2: the blocks of every chunk before the current one become null."""
    pool = make_pool(11, hash_block_size=2)
    spec = attn(ChunkedLocalAttentionSpec, attention_chunk_size=4)
    manager = make_manager(ChunkedLocalAttentionManager, spec, pool)
    ids = _fresh_request_blocks(manager, "r", 12)
    manager.remove_skipped_blocks("r", computed)
    _assert_table(manager, "r", [0] * num_null + ids[num_null:], f"computed {computed}")
    pool.check_invariants()


def test_removal_stops_at_an_earlier_null_and_free_skips_leading_nulls(make_pool):
    """A second removal frees only the new blocks; free() returns the rest tail first."""
    pool = make_pool(11, hash_block_size=2)
    manager = make_manager(SlidingWindowManager, attn(SlidingWindowSpec, sliding_window=4), pool)
    _fresh_request_blocks(manager, "r", 12)  # blocks 1..6
    manager.remove_skipped_blocks("r", 7)  # blocks 1, 2
    manager.remove_skipped_blocks("r", 11)  # blocks 3, 4
    _assert_table(manager, "r", [0, 0, 0, 0, 5, 6], "after two removals")
    assert pool.get_free_block_ids() == [4, 3, 2, 1, 7, 8, 9, 10]
    manager.free("r")
    assert pool.get_free_block_ids() == [6, 5, 4, 3, 2, 1, 7, 8, 9, 10]
    assert "r" not in manager.req_to_blocks and "r" not in manager.num_cached_block
    pool.check_invariants()


def test_rswa_frees_the_gap_between_prompt_and_window(make_pool):
    """R-SWA keeps the prompt's blocks and the window's; the whole blocks in between go."""
    pool = make_pool(20, hash_block_size=2)
    manager = make_manager(RSWAManager, attn(RSWASpec, rswa_window=4), pool)
    ids = _fresh_request_blocks(manager, "r", 30)
    manager.remove_skipped_blocks("r", 20)  # without the prompt length: full attention
    _assert_table(manager, "r", ids, "no prompt length")
    manager.remove_skipped_blocks("r", 20, num_prompt_tokens=9)  # gap: blocks 5..7
    _assert_table(manager, "r", ids[:5] + [0, 0, 0] + ids[8:], "gap freed")
    pool.check_invariants()


# --------------------------------------------------------------------------- demand


def test_sliding_window_demand_leaves_out_skipped_hits(make_pool):
    """A new request's demand counts new blocks and evictable hits, but not hits inside the
    skipped prefix; a running request's demand is just its missing blocks."""
    pool = make_pool(40, hash_block_size=2)
    spec = attn(SlidingWindowSpec, sliding_window=4)
    manager = make_manager(SlidingWindowManager, spec, pool)
    hashes, ids = cache_pattern(pool, [T] * 10, 2)
    hit = [pool.blocks[i] for i in ids]
    # 40 tokens, hit 20: skipped 17 tokens = 8 blocks; 20 required - 10 held = 10 new,
    # plus hits 8 and 9, which are evictable.
    assert manager.get_num_blocks_to_allocate("r", 40, hit, 20, 20, 40) == 12
    nulls = [pool.null_block] * 5
    assert manager.get_num_blocks_to_allocate("r", 40, nulls + hit[5:], 20, 20, 40) == 12
    assert manager.get_num_blocks_to_allocate("r", 40, nulls + hit[5:], 10, 10, 40) == 15
    manager.add_local_computed_blocks("r", hit, 20, 0)
    _assert_table(manager, "r", [0] * 8 + ids[8:], "hit inside the window only")
    assert pool.blocks[ids[8]].ref_cnt == 1 and pool.blocks[ids[0]].ref_cnt == 0
    assert manager.get_num_blocks_to_allocate("r", 24, [], 20, 20, 24) == 2
    assert manager.get_num_blocks_to_allocate("r", 24, [], 20, 20, 24,
                                              apply_admission_cap=False) == 2
    pool.check_invariants()


def test_admission_cap_clamps_the_demand(make_pool):
    """The factory gives a sliding window its admission cap; the demand respects it."""
    pool = make_pool(40, hash_block_size=2)
    spec = attn(SlidingWindowSpec, sliding_window=4)
    manager = get_manager_for_kv_cache_spec(
        spec, max_in_flight_tokens=4, max_model_len=100, block_pool=pool, enable_caching=True,
        kv_cache_group_id=0, scheduler_block_size=2)
    assert isinstance(manager, SlidingWindowManager)
    assert manager.max_admission_blocks_per_request == 4 + 1
    assert manager.get_num_blocks_to_allocate("r", 40, [], 0, 0, 40) == 20
    assert manager.get_num_blocks_to_allocate("r", 40, [], 0, 0, 40,
                                              apply_admission_cap=True) == 5
    pool.check_invariants()


# --------------------------------------------------------------------------- caching, free


def test_cache_blocks_then_another_request_hits_them(make_pool):
    """Full blocks of one request are cached; after it is freed a request with the same
    prompt hits them and the free queue ends with the freed chain, tail first."""
    pool = make_pool(12, hash_block_size=2)
    manager = make_manager(FullAttentionManager, attn(FullAttentionSpec), pool)
    hasher = pool.make_block_hasher()
    a = Request("a", list(range(7)), block_hasher=hasher)
    _fresh_request_blocks(manager, "a", 7)  # blocks 1..4
    manager.cache_blocks(a, 7, replay_boundaries=[])
    assert manager.num_cached_block["a"] == 3
    manager.free("a")
    # Unhashed block 4 goes to the front, hashed 3, 2, 1 to the back.
    assert pool.get_free_block_ids() == [4, 5, 6, 7, 8, 9, 10, 11, 3, 2, 1]
    b = Request("b", list(range(7)), block_hasher=hasher)
    (hit,), length = FullAttentionManager.find_longest_cache_hit(
        b.block_hashes, 6, [0], pool, manager.kv_cache_spec, False, 2)
    assert (hit_ids(hit), length) == ([1, 2, 3], 6)
    assert manager.get_num_blocks_to_allocate("b", 7, hit, 6, 6, 7) == 1 + 3
    manager.add_local_computed_blocks("b", hit, 6, 0)
    assert [b.block_id for b in manager.allocate_new_blocks("b", 7, 7)] == [4]
    _assert_table(manager, "b", [1, 2, 3, 4], "b")
    assert manager.num_cached_block["b"] == 3
    pool.check_invariants()


def test_sliding_window_mask_caches_only_reachable_blocks(make_pool):
    """With alignment 8 and window 4 (2 blocks of 2) only the last 2 blocks before each
    8-token boundary can serve a hit; the others are left unhashed."""
    pool = make_pool(12, hash_block_size=2)
    spec = attn(SlidingWindowSpec, sliding_window=4)
    manager = SlidingWindowManager(spec, block_pool=pool, enable_caching=True,
                                   kv_cache_group_id=0, scheduler_block_size=8)
    req = Request("a", list(range(16)), block_hasher=pool.make_block_hasher())
    _fresh_request_blocks(manager, "a", 16)
    manager.cache_blocks(req, 16, replay_boundaries=[])
    cached = [b.block_hash is not None for b in manager.req_to_blocks["a"]]
    assert cached == [F, F, T, T, F, F, T, T]
    # Retention 0: only the tail before the boundary 12 rounds down to (8) is kept.
    assert SlidingWindowManager.reachable_block_mask(0, 8, 8, spec, False, 0, [12]) == [
        F, F, T, T, F, F, F, F]
    pool.check_invariants()


# --------------------------------------------------------------------------- Mamba modes


def test_mamba_none_keeps_only_the_last_state(make_pool):
    """Mode none: blocks for all tokens are allocated, then all but the last state freed."""
    pool = make_pool(12, enable_caching=False, hash_block_size=4)
    spec = MambaSpec(4, ((4,),), ("float32",))
    manager = make_manager(MambaManager, spec, pool, enable_caching=False)
    assert manager.get_num_blocks_to_allocate("r", 10, [], 0, 0, 10) == 3
    assert _fresh_request_blocks(manager, "r", 10) == [1, 2, 3]
    manager.remove_skipped_blocks("r", 10)  # 9 tokens skipped: blocks 0, 1
    _assert_table(manager, "r", [0, 0, 3], "after prefill")
    assert manager.get_num_blocks_to_allocate("r", 13, [], 10, 0, 13) == 1
    assert [b.block_id for b in manager.allocate_new_blocks("r", 13, 13)] == [2]
    manager.remove_skipped_blocks("r", 13)
    _assert_table(manager, "r", [0, 0, 0, 2], "after decode")
    manager.free("r")
    assert pool.num_gpu_blocks - 1 == pool.get_num_free_blocks()
    pool.check_invariants()


def test_mamba_none_reserves_speculative_blocks(make_pool):
    """num_speculative_blocks more blocks are reserved and allocated."""
    pool = make_pool(12, enable_caching=False, hash_block_size=4)
    spec = MambaSpec(4, ((4,),), ("float32",), num_speculative_blocks=2)
    manager = make_manager(MambaManager, spec, pool, enable_caching=False)
    assert manager.get_num_blocks_to_allocate("r", 4, [], 0, 0, 4) == 3
    assert _fresh_request_blocks(manager, "r", 4) == [1, 2, 3]
    pool.check_invariants()


def test_mamba_prefix_caching_needs_align():
    """Modes other than align refuse prefix caching, as in vLLM."""
    pool = SimpleNamespace(null_block=None)
    with pytest.raises(AssertionError, match="align"):
        make_manager(MambaManager, MambaSpec(4, ((4,),), ("float32",)), pool)


def test_mamba_align_defers_a_hit_cached_this_step(make_pool):
    """Align mode nulls the positions before the running state, caches the state at each
    block boundary, and defers a request whose hit was cached in this step (its state may
    not be written yet) until new_step_starts()."""
    pool = make_pool(12, hash_block_size=4)
    spec = MambaSpec(4, ((4,),), ("float32",), mamba_cache_mode="align")
    manager = make_manager(MambaManager, spec, pool)
    hasher = pool.make_block_hasher()
    assert _fresh_request_blocks(manager, "x", 9) == [0, 0, 1]  # one running state
    manager.free("x")
    a = Request("a", list(range(9)), block_hasher=hasher)
    manager.add_local_computed_blocks("a", [], 0, 0)
    assert [b.block_id for b in manager.allocate_new_blocks("a", 4, 4)] == [1]
    manager.cache_blocks(a, 4, replay_boundaries=[])
    manager.remove_skipped_blocks("a", 4)
    assert [b.block_id for b in manager.allocate_new_blocks("a", 8, 8)] == [2]
    manager.cache_blocks(a, 8, replay_boundaries=[])
    _assert_table(manager, "a", [1, 2], "two aligned chunks")
    b = Request("b", list(range(9)), block_hasher=hasher)
    (hit,), length = MambaManager.find_longest_cache_hit(
        b.block_hashes, 8, [0], pool, spec, False, 4)
    assert (hit_ids(hit), length) == ([0, 2], 8)
    assert manager.get_num_blocks_to_allocate("b", 9, hit, 8, 8, 9) == pool.num_gpu_blocks + 1
    manager.new_step_starts()
    assert manager.get_num_blocks_to_allocate("b", 9, hit, 8, 8, 9) == 1
    manager.add_local_computed_blocks("b", hit, 8, 0)
    _assert_table(manager, "b", [0, 2], "hit: only the state block is held")
    assert pool.blocks[2].ref_cnt == 2
    assert [b.block_id for b in manager.allocate_new_blocks("b", 9, 9)] == [3]
    pool.check_invariants()


def test_mamba_align_frees_superseded_states(make_pool):
    """Align mode with one speculative block: at most running + speculative blocks are
    held; a step needs at most one new block; older states become null as the computed
    tokens pass them (sequence checked against vLLM 0.33.0)."""
    pool = make_pool(12, hash_block_size=4)
    spec = MambaSpec(4, ((4,),), ("float32",), mamba_cache_mode="align",
                     num_speculative_blocks=1)
    manager = make_manager(MambaManager, spec, pool)
    assert manager.get_num_blocks_to_allocate("r", 8, [], 0, 0, 8) == 2
    assert _fresh_request_blocks(manager, "r", 8) == [0, 1, 2]
    manager.remove_skipped_blocks("r", 8)
    _assert_table(manager, "r", [0, 1, 2], "after prefill")
    assert manager.get_num_blocks_to_allocate("r", 9, [], 8, 0, 9) == 1
    assert [b.block_id for b in manager.allocate_new_blocks("r", 9, 9)] == [3]
    assert manager.last_state_block_idx["r"] == 1
    manager.remove_skipped_blocks("r", 9)
    _assert_table(manager, "r", [0, 0, 2, 3], "state 1 superseded")
    for n in range(10, 13):
        assert manager.allocate_new_blocks("r", n, n) == []
        manager.remove_skipped_blocks("r", n)
    assert [b.block_id for b in manager.allocate_new_blocks("r", 13, 13)] == [1]
    manager.remove_skipped_blocks("r", 13)
    _assert_table(manager, "r", [0, 0, 0, 3, 1], "step to 13")
    manager.free("r")
    assert pool.get_free_block_ids() == [1, 3, 2, 4, 5, 6, 7, 8, 9, 10, 11]
    pool.check_invariants()


# --------------------------------------------------------------------------- others


def test_cross_attention_is_allocated_once_and_never_cached(make_pool):
    """Cross attention takes blocks for the encoder tokens, has no hits and caches nothing."""
    pool = make_pool(12, hash_block_size=2)
    spec = attn(CrossAttentionSpec)
    manager = make_manager(CrossAttentionManager, spec, pool)
    manager.add_local_computed_blocks("r", [], 0, 0)
    manager.allocate_external_computed_blocks("r", 0, 8)
    assert [b.block_id for b in manager.allocate_new_blocks("r", 7, 7)] == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="prefix caching is disabled"):
        manager.cache_blocks(SimpleNamespace(request_id="r", block_hashes=[]), 7,
                             replay_boundaries=[])
    with pytest.raises(NotImplementedError):
        CrossAttentionManager.find_longest_cache_hit([], 4, [0], pool, spec, False, 2)
    manager.free("r")
    assert pool.get_free_block_ids()[:4] == [4, 3, 2, 1]
    pool.check_invariants()


def test_sink_full_attention_checks_sink_len(make_pool):
    """The sink length must be a positive multiple of the block size."""
    pool = make_pool(12, hash_block_size=2)
    ok = SinkFullAttentionSpec(block_size=2, num_kv_heads=1, head_size=8, dtype="float16",
                               sink_len=4)
    assert isinstance(make_manager(SinkFullAttentionManager, ok, pool), FullAttentionManager)
    bad = SinkFullAttentionSpec(block_size=2, num_kv_heads=1, head_size=8, dtype="float16",
                                sink_len=3)
    with pytest.raises(AssertionError):
        make_manager(SinkFullAttentionManager, bad, pool)
    pool.check_invariants()


def test_factory_resolves_spec_types_by_mro(make_pool):
    """MLA and subclasses of known specs get their base's manager; unknown specs assert."""
    pool = make_pool(12, hash_block_size=2)
    kw = {"block_pool": pool, "enable_caching": True, "kv_cache_group_id": 0,
          "scheduler_block_size": 2}

    class MySlidingWindowSpec(SlidingWindowSpec):
        pass

    mla = MLAAttentionSpec(block_size=2, num_kv_heads=1, head_size=8, dtype="float16")
    assert type(get_manager_for_kv_cache_spec(mla, 8, 64, **kw)) is FullAttentionManager
    mine = MySlidingWindowSpec(block_size=2, num_kv_heads=1, head_size=8, dtype="float16",
                               sliding_window=4)
    assert type(get_manager_for_kv_cache_spec(mine, 8, 64, **kw)) is SlidingWindowManager
    chunked = attn(ChunkedLocalAttentionSpec, attention_chunk_size=4)
    manager = get_manager_for_kv_cache_spec(chunked, 8, 64, **kw)
    assert manager.max_admission_blocks_per_request == 6
    assert get_manager_for_kv_cache_spec(attn(FullAttentionSpec), 8, 64, **kw) \
        .max_admission_blocks_per_request is None
    from shmkv.core.hisparse import HiSparseSourceManager

    # A role in the role map picks the manager whatever the spec; others take the spec's.
    assert type(get_manager_for_kv_cache_spec(mla, 8, 64, role="hisparse_source", **kw)) \
        is HiSparseSourceManager
    assert type(get_manager_for_kv_cache_spec(mla, 8, 64, role="hisparse_indexer", **kw)) \
        is FullAttentionManager
    with pytest.raises(UsageError, match="role must be one of"):
        get_manager_for_kv_cache_spec(mla, 8, 64, role="no-such-role", **kw)
    pool.check_invariants()
