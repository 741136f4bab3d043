"""KVCacheManager and the coordinators over a shmkv pool, on both kernels: prefill hits,
decode growth, preemption by free, cache_salt isolation, hybrid full-attention + sliding-window
hits, the factory's refusals, the retention interval, and the cross-process lookup hold."""

from __future__ import annotations

import pytest

from shmkv import (
    BlockPool,
    HybridKVCacheCoordinator,
    KVCacheCoordinatorNoPrefixCache,
    KVCacheManager,
    Request,
    UnitaryKVCacheCoordinator,
    UsageError,
    get_kv_cache_coordinator,
)
from shmkv.core.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

BS = 16


def full(bs: int = BS) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=8, dtype="float16")


def swa(window: int, bs: int = BS) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=bs, num_kv_heads=1, head_size=8, dtype="float16",
                             sliding_window=window)


def config(num_blocks: int, *specs, retention: int | None = None) -> KVCacheConfig:
    groups = [KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(specs)]
    return KVCacheConfig(num_blocks, [], groups, prefix_cache_retention_interval=retention)


def manager(pool, *specs, bs: int = BS, caching: bool = True, **kw) -> KVCacheManager:
    return KVCacheManager(config(pool.num_gpu_blocks, *(specs or (full(bs),))), 1024,
                          scheduler_block_size=bs, hash_block_size=bs, enable_caching=caching,
                          block_pool=pool, **kw)


def req(pool, rid: str, tokens, salt: str | None = None) -> Request:
    return Request(rid, list(tokens), block_hasher=pool.make_block_hasher(), cache_salt=salt)


def admit(m: KVCacheManager, r: Request):
    """What vLLM's scheduler does for a waiting request: lookup, then allocate the rest."""
    hit, n, _ = m.get_computed_blocks(r)
    new = m.allocate_slots(r, r.num_tokens - n, n, hit)
    if new is not None:
        r.num_computed_tokens = r.num_tokens
    return hit, n, new


@pytest.fixture(autouse=True)
def _no_retention_env(monkeypatch):
    monkeypatch.delenv("SHMKV_PREFIX_CACHE_RETENTION_INTERVAL", raising=False)


def test_prefill_hits_shared_prefix(make_pool):
    pool = make_pool(11, hash_block_size=BS)
    m = manager(pool)
    common = list(range(48))
    a = req(pool, "a", common + [100 + i for i in range(7)])  # 3 full blocks + 7 tokens
    hit, n, new = admit(m, a)
    assert n == 0 and new.get_block_ids() == ([1, 2, 3, 4],)
    assert [b.ref_cnt for b in new.blocks[0]] == [1, 1, 1, 1]
    assert [b.block_hash is not None for b in new.blocks[0]] == [True, True, True, False]
    b = req(pool, "b", common + [200 + i for i in range(5)])
    hit, n, new = admit(m, b)
    assert n == 48 and hit.get_block_ids() == ([1, 2, 3],)
    assert new.get_block_ids() == ([5],)
    assert [blk.ref_cnt for blk in hit.blocks[0]] == [2, 2, 2]
    assert pool.get_num_free_blocks() == 5
    pool.check_invariants()
    m.free(a)
    m.free(b)
    # unhashed tails first, untouched blocks next, cached blocks tail first
    assert pool.get_free_block_ids() == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    pool.check_invariants()


def test_whole_prompt_hit_recomputes_last_token(make_pool):
    pool = make_pool(11, hash_block_size=BS)
    m = manager(pool)
    tokens = list(range(32))
    a = req(pool, "a", tokens)
    admit(m, a)
    m.free(a)
    b = req(pool, "b", tokens)
    hit, n, _ = m.get_computed_blocks(b)
    assert n == 16 and hit.get_block_ids() == ([1],)  # 31 tokens max -> one full block
    m.release_lookup_hold()
    pool.check_invariants()


@pytest.mark.parametrize("limit,hit_tokens", [(None, 48), (0, 0), (33, 32), (16, 16), (15, 0)])
def test_prefix_cache_hit_limit_bounds_the_hit(make_pool, limit, hit_tokens):
    """A request's ``prefix_cache_hit_limit`` (vLLM 0.34) bounds its hit: 0 skips the lookup
    (prompt logprobs), n stops it at the last full block within n tokens, None leaves it
    unbounded; ``get_num_cached_tokens`` probes without the limit, holding nothing."""
    pool = make_pool(11, hash_block_size=BS)
    m = manager(pool)
    tokens = list(range(64))
    a = req(pool, "a", tokens)
    admit(m, a)
    m.free(a)
    b = Request("b", tokens, block_hasher=pool.make_block_hasher(),
                prefix_cache_hit_limit=limit)
    assert b.get_max_cache_hit_length() == (63 if limit is None else min(63, limit))
    assert b.get_max_cache_hit_length(20) == min(20, 63 if limit is None else limit)
    assert b.skip_reading_external_kv == (limit is not None)
    assert m.prefix_cache_lookup_enabled(b) == (limit != 0)
    assert m.get_num_cached_tokens(b) == (0 if limit == 0 else 48)
    assert pool.get_num_free_blocks() == 10 and not m._pending_hits
    hit, n, _ = m.get_computed_blocks(b)
    assert n == hit_tokens and len(hit.blocks[0]) == hit_tokens // BS
    m.release_lookup_hold()
    pool.check_invariants()


@pytest.mark.parametrize("skip", [False, True])
def test_an_older_vllm_requests_skip_flag_is_honoured(make_pool, skip):
    """A request of vLLM 0.33 or before (``skip_reading_prefix_cache``, no hit limit) skips
    the lookup when the flag is set, and is bounded by ``num_tokens - 1`` otherwise."""

    class OldRequest:
        def __init__(self, inner):
            self._inner = inner
            self.request_id = inner.request_id
            self.block_hashes = inner.block_hashes
            self.num_tokens = inner.num_tokens
            self.skip_reading_prefix_cache = skip

    pool = make_pool(11, hash_block_size=BS)
    m = manager(pool)
    tokens = list(range(32))
    admit(m, a := req(pool, "a", tokens))
    m.free(a)
    old = OldRequest(req(pool, "b", tokens))
    assert m.prefix_cache_lookup_enabled(old) is not skip
    _, n, _ = m.get_computed_blocks(old)
    assert n == (0 if skip else 16)
    m.release_lookup_hold()


def test_a_negative_hit_limit_is_refused():
    with pytest.raises(UsageError, match="prefix_cache_hit_limit must be None or >= 0"):
        Request("r", [1, 2, 3], prefix_cache_hit_limit=-1)


def test_decode_growth_allocates_at_block_boundaries(make_pool):
    pool = make_pool(11, hash_block_size=BS)
    m = manager(pool)
    r = req(pool, "r", range(20))
    admit(m, r)
    assert m.get_block_ids("r") == ([1, 2],)
    for step in range(12):  # tokens 21..32: the second block fills, no new block yet
        r.append_output_token_ids(1000 + step)
        new = m.allocate_slots(r, 1)
        r.num_computed_tokens += 1
        assert new.get_block_ids() == ([],) or new.blocks == ((),)
    assert m.get_block_ids("r")[0][1] == 2
    assert m.get_blocks("r").blocks[0][1].block_hash is not None  # block 2 is now full
    r.append_output_token_ids(2000)
    new = m.allocate_slots(r, 1)
    assert new.get_block_ids() == ([3],)
    assert new.blocks[0][0].block_hash is None
    # lookahead: 1 new + 16 speculative slots need one more block
    r.num_computed_tokens += 1
    r.append_output_token_ids(2001)
    new = m.allocate_slots(r, 1, num_lookahead_tokens=16)
    assert new.get_block_ids() == ([4],)
    pool.check_invariants()


def test_preemption_by_free_and_readmission_hits(make_pool):
    pool = make_pool(6, hash_block_size=BS)  # 5 usable blocks
    m = manager(pool, log_stats=True)
    a = req(pool, "a", range(40))  # 3 blocks
    admit(m, a)
    b = req(pool, "b", range(100, 132))  # needs 2 more blocks: fits exactly
    _, _, new = admit(m, b)
    assert new is not None and pool.get_num_free_blocks() == 0
    b.append_output_token_ids(7)
    assert m.allocate_slots(b, 1) is None  # decode of b does not fit: preempt a
    pool.check_invariants()
    m.free(a)
    a.num_computed_tokens = 0
    a.num_preemptions = 1
    assert m.allocate_slots(b, 1) is not None
    b.num_computed_tokens += 1
    m.free(b)
    hit, n, _ = m.get_computed_blocks(a)
    m.record_prefix_cache_stats(a, n)
    assert n > 0  # a's full blocks survived in the prefix cache
    m.allocate_slots(a, a.num_tokens - n, n, hit)
    stats = m.make_prefix_cache_stats()
    assert (stats.preempted_requests, stats.preempted_hits) == (1, n)
    m.free(a)
    assert pool.get_num_free_blocks() == 5
    pool.check_invariants()


def test_cache_salt_isolates_tenants(make_pool):
    pool = make_pool(20, hash_block_size=BS)
    m = manager(pool)
    tokens = list(range(50))
    admit(m, req(pool, "a", tokens, salt="tenant-a"))
    _, n_other, _ = admit(m, req(pool, "b", tokens, salt="tenant-b"))
    _, n_none, _ = admit(m, req(pool, "c", tokens))
    _, n_same, _ = admit(m, req(pool, "d", tokens, salt="tenant-a"))
    assert (n_other, n_none, n_same) == (0, 0, 48)
    pool.check_invariants()


def test_caching_disabled_never_hits(make_pool):
    pool = make_pool(5, enable_caching=False, hash_block_size=BS)
    m = manager(pool, caching=False)
    assert isinstance(m.coordinator, KVCacheCoordinatorNoPrefixCache)
    a = req(pool, "a", range(16))
    admit(m, a)
    m.free(a)
    hit, n, _ = m.get_computed_blocks(req(pool, "b", range(16)))
    assert n == 0 and hit is m.empty_kv_cache_blocks
    big = req(pool, "big", range(64))
    assert admit(m, big)[2] is not None
    assert m.allocate_slots(req(pool, "c", range(4)), 4) is None
    pool.check_invariants()


def test_hybrid_full_and_sliding_window_hits(make_pool):
    bs = 4
    pool = make_pool(40, hash_block_size=bs)
    m = manager(pool, full(bs), swa(8, bs), swa(8, bs), bs=bs)
    assert isinstance(m.coordinator, HybridKVCacheCoordinator)
    assert [g.group_ids for g in m.coordinator.attention_groups] == [[0], [1, 2]]
    a = req(pool, "a", range(16))
    admit(m, a)
    assert m.get_block_ids("a") == ([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12])
    b = req(pool, "b", list(range(12)) + [99] * 5)
    hit, n, new = admit(m, b)
    assert n == 12
    # the window only needs the last 8 tokens' blocks: older positions are null padding
    assert hit.get_block_ids() == ([1, 2, 3], [0, 6, 7], [0, 10, 11])
    assert new.get_block_ids() == ([13, 14], [15, 16], [17, 18])
    pool.check_invariants()
    m.free(a)
    m.free(b)
    # evicting the last cached block of one sliding-window group shortens the hit for all
    pool.evict_blocks({11})
    c = req(pool, "c", list(range(12)) + [98] * 5)
    hit, n, _ = m.get_computed_blocks(c)
    assert n == 8 and [len(g) for g in hit.blocks] == [2, 2, 2]
    m.release_lookup_hold()
    pool.check_invariants()


def test_hybrid_full_and_mamba_hits(make_pool):
    bs = 4
    pool = make_pool(40, hash_block_size=bs)
    mamba = MambaSpec(bs, ((2, 4),), ("float32",), mamba_cache_mode="align")
    m = manager(pool, full(bs), mamba, bs=bs)
    a = req(pool, "a", range(17))
    # a Mamba state exists only where a chunk ended: prefill 16 tokens, then 1
    assert m.allocate_slots(a, 16) is not None
    a.num_computed_tokens = 16
    assert m.allocate_slots(a, 1) is not None
    m.free(a)
    b = req(pool, "b", range(17))
    hit, n, _ = m.get_computed_blocks(b)
    assert n == 16 and len(hit.blocks[0]) == 4 and len(hit.blocks[1]) == 4
    assert hit.get_block_ids()[1][:3] == [0, 0, 0]  # only the state at 16 tokens is kept
    m.release_lookup_hold()
    pool.check_invariants()


# --------------------------------------------------------------------------- refusals


def _coordinator(pool, cfg, bs=BS, hash_bs=BS, caching=True, **kw):
    return get_kv_cache_coordinator(cfg, 1024, 1024, False, caching, False,
                                    kw.pop("dcp", 1), kw.pop("pcp", 1), bs, hash_bs,
                                    block_pool=pool, **kw)


def test_factory_picks_the_coordinator(make_pool):
    # A pool each: a pool's cached blocks hold one geometry (below).
    assert isinstance(_coordinator(make_pool(20, hash_block_size=BS), config(20, full())),
                      UnitaryKVCacheCoordinator)
    assert isinstance(_coordinator(make_pool(20, hash_block_size=BS),
                                   config(20, full(), swa(32))), HybridKVCacheCoordinator)
    assert isinstance(_coordinator(make_pool(20, hash_block_size=BS), config(20),
                                   caching=False), KVCacheCoordinatorNoPrefixCache)


def test_a_pool_holds_one_cache_geometry(make_pool):
    """The first prefix-caching coordinator binds the pool to its geometry; one that lays
    blocks out otherwise (block size, context parallelism, groups) is refused with nothing
    changed, whatever process it is in; the same geometry, or no caching, is welcome."""
    from tests.helpers import segment_image

    pool = make_pool(40, hash_block_size=BS, partial_keys=True)
    assert pool.cache_geometry == 0
    first = _coordinator(pool, config(40, full(), swa(32)))
    bound = pool.cache_geometry
    assert bound != 0 and "SlidingWindowSpec" in first.cache_geometry()
    _coordinator(pool, config(40, full(), swa(32)))  # the same geometry: welcome
    other = BlockPool.attach(pool.pool_name, kernel=pool.kernel)
    try:
        before = segment_image(pool)
        for cfg, kw in ((config(40, full()), {}),
                        (config(40, full(2 * BS), swa(32, 2 * BS)), {"bs": 2 * BS}),
                        (config(40, full(), _mamba()), {"dcp": 2, "bs": 2 * BS})):
            with pytest.raises(UsageError, match="another KV-cache configuration"):
                _coordinator(other, cfg, **kw)
            assert segment_image(pool) == before and pool.cache_geometry == bound
        _coordinator(other, config(40, full()), caching=False)  # shares no KV: welcome
        _coordinator(other, config(40, full(), swa(32)))
        for bad in ("", None, 3):
            with pytest.raises(UsageError, match="geometry must be a non-empty str"):
                other.claim_cache_geometry(bad)
        assert segment_image(pool) == before
    finally:
        other.close()
    pool.check_invariants()


def test_unitary_refuses_hash_block_size_mismatch(make_pool):
    pool = make_pool(20, hash_block_size=8)
    with pytest.raises(UsageError, match="hash_block_size"):
        _coordinator(pool, config(20, full()), hash_bs=8)
    # without caching the block may be bigger than the hash unit
    _coordinator(pool, config(20, full()), hash_bs=8, caching=False)


def test_hybrid_refuses_fewer_than_two_groups(make_pool):
    pool = make_pool(20, hash_block_size=BS)
    with pytest.raises(UsageError, match="at least two"):
        HybridKVCacheCoordinator(config(20, full()), 1024, 1024, False, True, False, 1, 1,
                                 BS, BS, block_pool=pool)


def _mamba(bs: int = BS) -> MambaSpec:
    return MambaSpec(bs, ((2, 4),), ("float32",), mamba_cache_mode="align")


@pytest.mark.parametrize("specs,dcp,pcp,kind", [
    ((full(), swa(32)), 2, 1, "decode-context parallelism .* group 1 is SlidingWindowSpec"),
    ((full(), swa(32)), 1, 2, "prefill-context parallelism .* group 1 is SlidingWindowSpec"),
    ((full(), _mamba()), 1, 2, "prefill-context parallelism .* group 1 is MambaSpec"),
])
def test_hybrid_refuses_context_parallelism_over_groups_vllm_does_not_shard(
        make_pool, specs, dcp, pcp, kind):
    pool = make_pool(20, hash_block_size=BS)
    before = pool.get_free_block_ids()
    with pytest.raises(UsageError, match=kind):
        _coordinator(pool, config(20, *specs), bs=BS * max(dcp, pcp), dcp=dcp, pcp=pcp)
    assert pool.get_free_block_ids() == before
    pool.check_invariants()


def test_hybrid_dcp_uses_each_groups_geometry(make_pool):
    """Full attention + Mamba "align" under DCP 2: full attention's blocks span 2 x 4 tokens,
    Mamba's stay 4 (replicated); a hit ends on a Mamba snapshot inside a full-attention
    block, whose tail block the next allocation copies."""
    bs, dcp = 4, 2
    pool = make_pool(40, hash_block_size=bs, partial_keys=True)
    m = KVCacheManager(config(40, full(bs), _mamba(bs)), 1024, scheduler_block_size=bs * dcp,
                       hash_block_size=bs, dcp_world_size=dcp, block_pool=pool)
    fa, mamba = m.coordinator.single_type_managers
    assert (fa.dcp_world_size, fa.block_size) == (dcp, bs * dcp)
    assert (mamba.dcp_world_size, mamba.block_size) == (1, bs)
    assert m.coordinator.enable_partial_hash_hits  # hashes as coarse as Mamba's blocks
    a = req(pool, "a", range(13))
    assert m.allocate_slots(a, 12) is not None  # a chunk ending at 12 keeps a state there
    a.num_computed_tokens = 12
    assert m.allocate_slots(a, 1) is not None
    m.free(a)
    m.new_step_starts()  # a partial hit waits for the step after the one that wrote it
    b = req(pool, "b", list(range(12)) + [99] * 4)
    hit, n, _ = m.get_computed_blocks(b)
    assert n == 12 and [len(g) for g in hit.blocks] == [2, 3]
    tail = hit.blocks[0][-1].block_id
    new = m.allocate_slots(b, 4, n, hit)
    assert new is not None
    copies, retained = m.take_kv_cache_block_copies()
    assert [(c.src_block_id, c.dst_block_id) for c in copies] == [
        (tail, new.get_block_ids()[0][0])]
    pool.free_blocks(retained)
    m.free(b)
    pool.check_invariants()
    assert pool.get_num_free_blocks() == 39


def test_refuses_a_missing_or_mismatched_pool(make_pool):
    with pytest.raises(UsageError, match="block_pool"):
        get_kv_cache_coordinator(config(20, full()), 1024, 1024, False, True, False, 1, 1,
                                 BS, BS)
    pool = make_pool(20, hash_block_size=8)
    with pytest.raises(UsageError, match="pool hashes"):
        _coordinator(pool, config(20, full()))
    nocache = make_pool(20, enable_caching=False, hash_block_size=BS)
    with pytest.raises(UsageError, match="without caching"):
        _coordinator(nocache, config(20, full()))


@pytest.mark.parametrize("value", [-16, 8, 24])
def test_refuses_invalid_retention_interval(make_pool, value):
    pool = make_pool(20, hash_block_size=BS)
    with pytest.raises(UsageError, match="multiple of scheduler_block_size"):
        _coordinator(pool, config(20, full(), swa(32)), prefix_cache_retention_interval=value)


def test_retention_interval_sources(make_pool, monkeypatch):
    pool = make_pool(20, hash_block_size=BS)
    hybrid = config(20, full(), swa(32), retention=64)
    assert _coordinator(pool, hybrid).retention_interval == 64
    assert _coordinator(pool, hybrid, prefix_cache_retention_interval=32).retention_interval == 32
    monkeypatch.setenv("SHMKV_PREFIX_CACHE_RETENTION_INTERVAL", "48")
    assert _coordinator(pool, config(20, full(), swa(32))).retention_interval == 48
    assert _coordinator(pool, hybrid).retention_interval == 64  # the config wins over the env
    monkeypatch.setenv("SHMKV_PREFIX_CACHE_RETENTION_INTERVAL", "often")
    with pytest.raises(UsageError, match="not an integer"):
        _coordinator(pool, config(20, full(), swa(32)))
    monkeypatch.delenv("SHMKV_PREFIX_CACHE_RETENTION_INTERVAL")
    # full attention alone ignores retention: only 0 (or unset) is accepted
    pool = make_pool(20, hash_block_size=BS)  # another geometry: a pool of its own
    assert _coordinator(pool, config(20, full(), retention=0)).retention_interval == 0
    with pytest.raises(UsageError, match="no sliding-window or Mamba"):
        _coordinator(pool, config(20, full(), retention=16))


def test_allocate_slots_refuses_nothing_to_do(make_pool):
    pool = make_pool(11, hash_block_size=BS)
    m = manager(pool)
    with pytest.raises(ValueError, match="num_new_tokens"):
        m.allocate_slots(req(pool, "a", range(4)), 0)


# --------------------------------------------------------------------------- lookup hold


def test_lookup_hold_spans_lookup_to_allocation(make_pool):
    pool = make_pool(11, hash_block_size=BS)
    m = manager(pool)
    a = req(pool, "a", range(40))
    admit(m, a)
    m.free(a)
    assert pool.holder() is None
    b = req(pool, "b", range(40))
    hit, n, _ = m.get_computed_blocks(b)
    assert n == 32 and pool.holder() is not None  # held until allocate_slots
    m.allocate_slots(b, b.num_tokens - n, n, hit)
    assert pool.holder() is None
    # a lookup the scheduler drops is released at the next step
    c = req(pool, "c", range(40))
    m.get_computed_blocks(c)
    assert pool.holder() is not None
    m.new_step_starts()
    assert pool.holder() is None
    pool.check_invariants()


def test_stale_hit_after_released_hold_is_refused(make_pool):
    pool = make_pool(11, hash_block_size=BS)
    m = manager(pool)
    a = req(pool, "a", range(40))
    admit(m, a)
    m.free(a)
    b = req(pool, "b", range(40))
    hit, n, _ = m.get_computed_blocks(b)
    m.release_lookup_hold()
    pool.evict_blocks({hit.blocks[0][0].block_id})  # what another process could do
    assert m.allocate_slots(b, b.num_tokens - n, n, hit) is None
    assert m.get_block_ids("b") == ([],)
    hit, n, _ = m.get_computed_blocks(b)  # a fresh lookup sees the eviction
    assert n == 0
    assert m.allocate_slots(b, b.num_tokens, n, hit) is not None
    pool.check_invariants()


def test_take_events_annotates_spec_kind(make_pool):
    bs = 4
    pool = make_pool(40, hash_block_size=bs, enable_kv_cache_events=True)
    m = manager(pool, full(bs), swa(8, bs), bs=bs)
    admit(m, req(pool, "a", range(9)))
    stored = [e for e in m.take_events() if type(e).__name__ == "BlockStored"]
    assert {(e.group_idx, e.kv_cache_spec_sliding_window) for e in stored} == {(0, None), (1, 8)}
    assert all(e.kv_cache_spec_kind for e in stored)


@pytest.mark.parametrize("drain", ["take_boundary_state_offloads", "take_kv_cache_block_copies",
                                   "take_new_block_ids", "take_events", "free"])
def test_end_of_schedule_drain_ends_a_dropped_lookup_hold(make_pool, drain):
    pool = make_pool(11, hash_block_size=BS)
    m = manager(pool)
    a = req(pool, "a", range(40))
    admit(m, a)
    b = req(pool, "b", range(40))
    m.get_computed_blocks(b)  # looked up, then skipped by the scheduler
    assert pool.holder() is not None
    getattr(m, drain)(a) if drain == "free" else getattr(m, drain)()
    assert pool.holder() is None
    pool.check_invariants()
