"""HiSparse's pool calls and configs: ``BlockPool.unpin_blocks`` (the tail of the free queue,
the reuse watcher), the host tier (``BlockPool.tier``), ``free_blocks`` of a tier's blocks
through the device pool, and the refusals of bad input (a clear UsageError, nothing changed).
Both kernels; every pool checks its invariants after each step."""

from __future__ import annotations

import pytest

from shmkv import (
    BlockPool,
    FullAttentionSpec,
    HiSparseHotSpec,
    HiSparseResidentSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    Request,
    UsageError,
    get_hisparse_coordinator,
)
from shmkv.core.kv_cache_interface import KVCacheGroupRole
from shmkv.pool import siblings
from tests.helpers import free_ids, ids, make_request, segment_image

BS = 4


def test_unpin_joins_the_tail_in_order_and_reuse_calls_the_watcher(make_pool):
    pool = make_pool(8, hash_block_size=BS)
    blocks = pool.get_new_blocks(5)
    pool.cache_full_blocks(make_request(4, block_size=BS), blocks[:1], 0, 1, BS, 0)
    seen = []
    # Unhashed 3 and hashed 1 both go to the tail, in the order given; free_blocks would
    # put the unhashed one first.
    pool.unpin_blocks([blocks[2], blocks[0]], seen.append)
    pool.check_invariants()
    assert free_ids(pool) == [6, 7, 3, 1]
    assert pool.get_num_free_blocks() == 4 and seen == []
    pool.touch([blocks[1]])                  # a second reference: unpinning keeps the block
    pool.unpin_blocks([blocks[1]], seen.append)
    assert blocks[1].ref_cnt == 1 and free_ids(pool) == [6, 7, 3, 1]
    got = pool.get_new_blocks(3)             # 6, 7, then 3: only 3 was watched
    assert ids(got) == [6, 7, 3] and seen == [blocks[2]]
    pool.check_invariants()
    pool.free_blocks(got)
    pool.free_blocks([blocks[1], blocks[3], blocks[4]])
    assert pool.reset_prefix_cache()         # a reset reports every watched block left
    assert sorted(b.block_id for b in seen) == [1, 2, 3]
    pool.check_invariants()


@pytest.mark.parametrize("case", ["null", "not callable", "twice", "free", "other process",
                                  "not a block", "out of range"])
def test_unpin_bad_input_changes_nothing(make_pool, case):
    pool = make_pool(8, hash_block_size=BS, enable_kv_cache_events=True)
    blocks = pool.get_new_blocks(3)
    other = BlockPool.attach(pool.pool_name, label="other")
    try:
        theirs = other.get_new_blocks(1)[0]
        args, match = {
            "null": (([pool.null_block], print), "null block"),
            "not callable": ((blocks[:1], None), "on_reuse must be callable"),
            "twice": (([blocks[0], blocks[0]], print), "ref_cnt 1 but is unpinned 2"),
            "free": (([pool.blocks[7]], print), "ref_cnt 0 but is unpinned 1"),
            "other process": (([pool.blocks[theirs.block_id]], print),
                              "this process holds 0 reference"),
            "not a block": (([3], print), "takes KVCacheBlock handles"),
            "out of range": (([type(blocks[0])(pool, 99)], print), "out of range"),
        }[case]
        before = segment_image(pool)
        with pytest.raises(UsageError, match=match):
            pool.unpin_blocks(*args)
        assert segment_image(pool) == before
        assert pool._reuse_watchers == {} and pool.take_events() == []
        pool.check_invariants()
    finally:
        other.close()


def test_tier_is_one_shared_pool_closed_and_unlinked_with_its_pool(make_pool):
    pool = make_pool(8, hash_block_size=BS, enable_kv_cache_events=True)
    host = pool.tier("host", 6, enable_caching=True)
    assert pool.tier("host", 6, enable_caching=True) is host
    assert (host.pool_name, host.num_gpu_blocks, host.medium) == (f"{pool.pool_name}.host", 6,
                                                                  "CPU")
    other = BlockPool.attach(pool.pool_name, label="other")
    other_host = other.tier("host", 6, enable_caching=True)
    held = other_host.get_new_blocks(2)
    assert host.get_num_free_blocks() == 3      # one segment for both processes
    # The device pool frees a tier's blocks in their pool, after its own.
    mine = host.get_new_blocks(1) + pool.get_new_blocks(1)
    pool.free_blocks(mine)
    assert host.get_num_free_blocks() == 3 and pool.get_num_free_blocks() == 7
    other_host.free_blocks(held)
    other.close()
    assert other_host._tiers == {} and host.get_num_free_blocks() == 5
    host.check_invariants()
    pool.check_invariants()
    with pytest.raises(UsageError, match="tier must be one of"):
        pool.tier("disk", 6, enable_caching=True)
    with pytest.raises(UsageError, match="the host tier has 6 blocks"):
        pool.tier("host", 7, enable_caching=True)
    with pytest.raises(UsageError, match="the host tier has 6 blocks"):
        pool.tier("host", 6, enable_caching=False)
    name = pool.pool_name
    pool.close()
    with pytest.raises(UsageError):  # closed with its pool
        host.get_num_free_blocks()
    assert BlockPool.unlink(name)
    with pytest.raises(Exception, match="no|not found|No"):
        BlockPool.attach(f"{name}.host")


def _groups(resident_first=False, source=True, spec_role=KVCacheGroupRole.HISPARSE_SOURCE):
    full = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype="float16")
    groups = []
    if source:
        groups.append(KVCacheGroupSpec(["source"], full, host_resident=True, role=spec_role))
    groups.append(KVCacheGroupSpec(["indexer"], full, role=KVCacheGroupRole.HISPARSE_INDEXER))
    resident = [
        KVCacheGroupSpec(["resident"], HiSparseResidentSpec(block_size=BS, page_size=64)),
        KVCacheGroupSpec(["hot"], HiSparseHotSpec(block_size=BS, page_size=64,
                                                  blocks_per_request=2)),
    ]
    return resident + groups if resident_first else groups + resident


@pytest.mark.parametrize("case, match", [
    ("no host capacity", "HiSparse host group needs host capacity"),
    ("resident first", "HiSparse host group must precede resident groups"),
    ("no source", "No HiSparse cache group is configured|HiSparse resident groups need"),
])
def test_bad_hisparse_configs_are_refused(make_pool, case, match):
    pool = make_pool(16, hash_block_size=BS)
    cfg = KVCacheConfig(
        num_blocks=16, kv_cache_tensors=[],
        kv_cache_groups=_groups(resident_first=case == "resident first",
                                source=case != "no source"),
        hisparse_host_num_blocks=None if case == "no host capacity" else 8,
    )
    manager = KVCacheManager(cfg, max_model_len=64, scheduler_block_size=BS,
                             hash_block_size=BS, enable_caching=True, block_pool=pool)
    with pytest.raises(UsageError, match=match):
        get_hisparse_coordinator(manager)
    pool.check_invariants()


def test_a_role_that_is_not_a_role_is_refused(make_pool):
    pool = make_pool(16, hash_block_size=BS)
    cfg = KVCacheConfig(num_blocks=16, kv_cache_tensors=[],
                        kv_cache_groups=_groups(spec_role="hisparse_sauce"),
                        hisparse_host_num_blocks=8)
    with pytest.raises(UsageError, match="role must be one of .*'hisparse_sauce'"):
        KVCacheManager(cfg, max_model_len=64, scheduler_block_size=BS, hash_block_size=BS,
                       enable_caching=True, block_pool=pool)
    assert pool.get_num_free_blocks() == 15
    pool.check_invariants()


def test_poll_reuse_reports_blocks_another_process_took(make_pool):
    """Invariant "watch-stamp": a block another process allocates is reported by the next
    poll_reuse, even once that process has freed it again; this process's own touch and
    free of a watched block is not a reuse."""
    pool = make_pool(7, hash_block_size=BS)
    a, b, c = pool.get_new_blocks(3)
    seen = []
    pool.unpin_blocks([a, b, c], seen.append)
    pool.touch([c])                           # this process reads c again, then lets it go
    pool.free_blocks([c])
    assert pool.poll_reuse() == 0 and seen == []
    assert free_ids(pool) == [3, 4, 5, 6, 1, 2]   # c, unhashed, freed to the front
    other = BlockPool.attach(pool.pool_name, label="other")
    try:
        taken = other.get_new_blocks(5)       # c, 4, 5, 6, then a
        assert ids(taken) == [3, 4, 5, 6, 1] and seen == []   # another process: no call yet
        assert pool.poll_reuse() == 2 and seen == [a, c]
        other.free_blocks(taken)
        assert pool.poll_reuse() == 0         # only b is watched now, and untouched
        other.free_blocks(other.get_new_blocks(6))  # takes b too, and gives it back
        assert pool.get_num_free_blocks() == 6 and b.ref_cnt == 0
        assert pool.poll_reuse() == 1 and seen == [a, c, b]
        assert pool._reuse_watchers == {} and pool._watch_stamps == {}
        pool.check_invariants()
    finally:
        other.close()


def test_admitting_before_the_coordinator_is_bound_is_refused(make_pool):
    pool = make_pool(16, hash_block_size=BS)
    cfg = KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=_groups(),
                        hisparse_host_num_blocks=8)
    manager = KVCacheManager(cfg, max_model_len=64, scheduler_block_size=BS,
                             hash_block_size=BS, enable_caching=True, block_pool=pool)
    req = Request("r", list(range(2 * BS)), block_hasher=pool.make_block_hasher())
    with pytest.raises(UsageError, match="call get_hisparse_coordinator"):
        manager.allocate_slots(req, req.num_tokens)
    assert pool.get_num_free_blocks() == 15     # nothing was allocated
    coordinator = get_hisparse_coordinator(manager)
    assert manager.allocate_slots(req, req.num_tokens) is not None
    assert coordinator.get_host_block_pool().get_num_free_blocks() == 7 - 2
    manager.free(req)
    pool.check_invariants()


def test_a_new_pool_does_not_inherit_a_stale_host_tier(make_pool):
    """A host tier whose pool was unlinked without it (its creator killed) is not attached
    by the next pool of that name: that pool's host pages would claim copies that are gone."""
    pool = make_pool(8, hash_block_size=BS)
    name = pool.pool_name
    stale = pool.tier("host", 6, enable_caching=True)  # as a killed run left it
    stale.cache_full_blocks(make_request(BS, block_size=BS), stale.get_new_blocks(1), 0, 1, BS, 0)
    pool.close()  # closes its tier too
    siblings.unlink_pool_files(name)  # the device pool only
    fresh = BlockPool.create(name, 8, hash_block_size=BS)
    try:
        host = fresh.tier("host", 6, enable_caching=True)
        assert host.get_num_free_blocks() == 5 and len(host.cached_keys_by_group()) == 0
        host.check_invariants()
    finally:
        fresh.close()
        BlockPool.unlink(name)


def test_the_host_tier_is_bound_to_one_host_geometry(make_pool):
    """The coordinator binds the host tier (a pool of its own) to its source group's host
    layout, as the KV-cache coordinators bind the device pool: a process of another host
    block stride is refused with its managers left as they were; one of the same layout is
    taken."""
    pool = make_pool(16, hash_block_size=BS)

    def config(stride):
        return KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=_groups(),
                             hisparse_host_num_blocks=8, hisparse_host_block_stride=stride)

    def manager_over(handle, stride):
        return KVCacheManager(config(stride), max_model_len=64, scheduler_block_size=BS,
                              hash_block_size=BS, enable_caching=True, block_pool=handle)

    first = get_hisparse_coordinator(manager_over(pool, None))
    host = first.get_host_block_pool()
    assert host.cache_geometry != 0 and pool.cache_geometry != 0
    other = BlockPool.attach(pool.pool_name, label="other")
    try:
        refused = manager_over(other, 2)
        with pytest.raises(UsageError, match="another KV-cache configuration"):
            get_hisparse_coordinator(refused)
        source = refused.coordinator.single_type_managers[0]
        assert source.block_pool is other                   # not bound to the host tier
        assert all(getattr(m, "coordinator", None) is None
                   for m in refused.coordinator.single_type_managers)
        same = get_hisparse_coordinator(manager_over(other, None))
        assert same.get_host_block_pool().cache_geometry == host.cache_geometry
        host.check_invariants()
        pool.check_invariants()
    finally:
        other.close()
