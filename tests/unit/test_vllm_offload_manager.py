"""SharedCPUOffloadingManager, one process: the behaviour that vLLM's own tests of its CPU
manager (``tests/v1/kv_offload/cpu/test_manager.py``) check, written for shmkv.

vLLM's tests name chunk ids ([2, 3, 0] ...); the shared tier may pick other ids, so each
scenario checks what is behaviour instead: the keys stored and evicted, the events, and that
every key loads from the chunk it was stored in, no two live keys sharing one. Where vLLM's
test reads its manager's private counters (``_num_evictable_cache_chunks``), the twin here
counts through public calls (``pool.block_rows()``). Plus: the pool's global event log sees
the tier, and the shared-tier limits (ARC, a reuse threshold) are refused clearly.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.cpu.manager")

from vllm.v1.kv_offload.base import (  # noqa: E402
    LookupResult,
    Medium,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec, CPUOffloadingMetrics  # noqa: E402

from shmkv import BlockRemoved, BlockStored, UsageError  # noqa: E402
from shmkv.events import external_block_hash, use_int_block_hashes  # noqa: E402
from shmkv.vllm import PENDING_BIT, SharedCPUOffloadingManager  # noqa: E402
from tests.conftest import unique_pool_name  # noqa: E402

HIT, MISS, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING
CTX = ReqContext("")


def to_key(i: int):
    return make_offload_key(str(i).encode(), 0)


def to_keys(ints):
    return [to_key(i) for i in ints]


@pytest.fixture
def make_manager():
    made = []

    def factory(num_chunks: int = 4, **kwargs) -> SharedCPUOffloadingManager:
        manager = SharedCPUOffloadingManager(unique_pool_name("vm"), num_chunks, **kwargs)
        made.append(manager)
        return manager

    yield factory
    for manager in made:
        name = manager.pool_name
        if manager.pool is not None:
            manager.pool.check_invariants()
        manager.close()
        SharedCPUOffloadingManager.unlink(name)


class _Chunks:
    """Key -> chunk as the manager reported it; checks loads and chunk sharing."""

    def __init__(self) -> None:
        self.chunk_of: dict[bytes, int] = {}

    def stored(self, out, expected_keys, expected_evicted) -> None:
        assert out is not None
        assert out.keys_to_store == to_keys(expected_keys)
        assert out.evicted_keys == to_keys(expected_evicted)
        assert isinstance(out.store_spec, CPULoadStoreSpec)
        for key in out.evicted_keys:
            self.chunk_of.pop(key)
        self.chunk_of.update(zip(out.keys_to_store, out.store_spec.block_ids.tolist(),
                                 strict=True))
        live = list(self.chunk_of.values())
        assert len(live) == len(set(live)), "two live keys share a chunk"

    def loaded(self, spec, ints) -> None:
        assert isinstance(spec, CPULoadStoreSpec)
        assert spec.block_ids.tolist() == [self.chunk_of[k] for k in to_keys(ints)]


def _event_sets(manager):
    stores, evictions = [], []
    for event in manager.take_events():
        assert event.medium == Medium.CPU
        (evictions if event.removed else stores).append({int(k[:-4]) for k in event.keys})
    return stores, evictions


def _num_evictable(manager) -> int:
    """Ready chunks nobody holds, counted from the pool's block rows (a public twin of
    vLLM's ``_num_evictable_cache_chunks``)."""
    rows = manager.pool.block_rows()[1:]
    count = int(((rows["ref_cnt"] == 0) & (rows["hash_num_tokens"] != 0)
                 & ((rows["group_id"] & PENDING_BIT) == 0)).sum())
    del rows
    return count


def test_lru_scenario(make_manager):
    """vLLM's test_cpu_manager: stores, in-flight lookups, eviction of the LRU, refusal
    when pinned or full, touch reordering, failed stores and their events."""
    manager = make_manager(4, enable_events=True)
    chunks = _Chunks()
    chunks.stored(manager.prepare_store(to_keys([1, 2]), CTX), [1, 2], [])
    assert [manager.lookup(k, CTX) for k in to_keys([1, 2])] == [PENDING, PENDING]
    assert list(manager.take_events()) == []
    manager.complete_store(to_keys([1, 2]), CTX)
    assert _event_sets(manager) == ([{1, 2}], [])
    assert [manager.lookup(k, CTX) for k in to_keys([1, 2, 3])] == [HIT, HIT, MISS]
    chunks.stored(manager.prepare_store(to_keys([2, 3, 4, 5]), CTX), [3, 4, 5], [1])
    assert _event_sets(manager) == ([], [{1}])
    assert manager.prepare_store(to_keys([1, 6]), CTX) is None  # 3 in flight, 2 ready
    manager.complete_store(to_keys([2, 3, 4, 5]), CTX)
    assert [manager.lookup(k, CTX) for k in to_keys([1, 2, 3, 4, 5, 0])] == \
        [MISS, HIT, HIT, HIT, HIT, MISS]
    chunks.loaded(manager.prepare_load(to_keys([2, 3]), CTX), [2, 3])
    assert manager.prepare_store(to_keys([6, 7, 8]), CTX) is None  # [2, 3] are pinned
    manager.complete_load(to_keys([2, 3]), CTX)
    chunks.stored(manager.prepare_store(to_keys([6, 7, 8]), CTX), [6, 7, 8], [2, 3, 4])
    manager.complete_store(to_keys([6, 7, 8]), CTX)
    manager.touch(to_keys([5, 6, 7]), CTX)
    chunks.stored(manager.prepare_store(to_keys([9]), CTX), [9], [8])
    manager.complete_store(to_keys([7, 9]), CTX, success=False)
    assert manager.lookup(to_key(7), CTX) == HIT
    assert manager.lookup(to_key(9), CTX) == MISS
    assert _event_sets(manager) == ([{3, 4, 5}, {6, 7, 8}], [{2, 3, 4}, {8}, {9}])


def test_already_stored_key_is_not_evicted_by_its_own_store(make_manager):
    """A key offered again in a store that must evict is protected, even as the LRU."""
    manager = make_manager(4, enable_events=True)
    chunks = _Chunks()
    chunks.stored(manager.prepare_store(to_keys([1, 2]), CTX), [1, 2], [])
    manager.complete_store(to_keys([1, 2]), CTX)
    manager.touch(to_keys([1]), CTX)  # 2 is now the LRU
    chunks.stored(manager.prepare_store(to_keys([2, 3, 4, 5]), CTX), [3, 4, 5], [1])
    manager.complete_store(to_keys([2, 3, 4, 5]), CTX)
    assert manager.lookup(to_key(2), CTX) == HIT


def test_prepare_load_preserves_key_order(make_manager):
    """chunk id i of a load spec is the chunk of key i, in any key order."""
    manager = make_manager(4)
    chunks = _Chunks()
    chunks.stored(manager.prepare_store(to_keys([0, 1, 2]), CTX), [0, 1, 2], [])
    manager.complete_store(to_keys([0, 1, 2]), CTX)
    for order in ([0, 1, 2], [1, 2, 0]):
        chunks.loaded(manager.prepare_load(to_keys(order), CTX), order)
        manager.complete_load(to_keys([0, 1, 2]), CTX)


def test_cache_usage_gauge(make_manager):
    """The usage gauge counts chunks held by transfers: 0, then 0.5, then 1.0."""
    manager = make_manager(4)

    def usage():
        return manager.get_stats().reduce()[CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC]

    assert usage() == 0.0
    manager.prepare_store(to_keys([1, 2]), CTX)
    assert usage() == pytest.approx(0.5)
    manager.prepare_store(to_keys([3, 4]), CTX)
    assert usage() == pytest.approx(1.0)
    manager.complete_store(to_keys([1, 2, 3, 4]), CTX)
    assert usage() == 0.0


def test_evictable_count_through_the_lifecycle(make_manager):
    """vLLM's test_evictable_cache_block_count, counted through public calls: stores,
    double pins, eviction, failed stores, reset, and a refusal when nothing is idle."""
    manager = make_manager(4)
    assert _num_evictable(manager) == 0
    manager.prepare_store(to_keys([1, 2, 3]), CTX)
    assert _num_evictable(manager) == 0
    manager.complete_store(to_keys([1, 2, 3]), CTX)
    assert _num_evictable(manager) == 3
    manager.prepare_load(to_keys([1]), CTX)
    manager.prepare_load(to_keys([1]), CTX)  # a second concurrent load of one chunk
    assert _num_evictable(manager) == 2
    manager.complete_load(to_keys([1]), CTX)
    assert _num_evictable(manager) == 2  # still pinned once
    manager.complete_load(to_keys([1]), CTX)
    assert _num_evictable(manager) == 3
    out = manager.prepare_store(to_keys([4, 5, 6]), CTX)
    assert out.evicted_keys == to_keys([1, 2])  # pins move no rank: 1 is still the LRU
    assert _num_evictable(manager) == 1
    manager.complete_store(to_keys([4, 5, 6]), CTX, success=False)
    assert _num_evictable(manager) == 1
    manager.reset_cache()
    assert _num_evictable(manager) == 0
    assert manager.lookup(to_key(1), CTX) == MISS
    manager.prepare_store(to_keys([10, 11, 12]), CTX)
    manager.complete_store(to_keys([10, 11, 12]), CTX)
    manager.prepare_load(to_keys([10, 11, 12]), CTX)
    assert _num_evictable(manager) == 0
    assert manager.prepare_store(to_keys([14, 15]), CTX) is None
    manager.complete_load(to_keys([10, 11, 12]), CTX)
    assert _num_evictable(manager) == 3
    out = manager.prepare_store(to_keys([14, 15]), CTX)
    assert out.evicted_keys == to_keys([10])
    assert _num_evictable(manager) == 2
    manager.complete_store(to_keys([14, 15]), CTX)
    assert _num_evictable(manager) == 4


def test_positions_order_eviction_tail_first(make_manager):
    """With key positions (as the connector records them), a finished request's tail is
    evicted before its head (vLLM's request-scoped LRU ranks)."""
    manager = make_manager(4)
    ctx = ReqContext("r")
    keys = to_keys([1, 2, 3, 4])
    for position, key in enumerate(keys):
        ctx.set_offload_key_position(key, 16 * (position + 1))
    manager.on_new_request(ctx)
    manager.prepare_store(keys, ctx)
    manager.complete_store(keys, ctx)
    manager.on_request_finished(ctx)
    out = manager.prepare_store(to_keys([7, 8]), ReqContext("s"))
    assert out.evicted_keys == to_keys([4, 3])


def test_tier_events_reach_the_global_log(make_manager):
    """Completed stores and evictions are in the pool's global event log, medium CPU, so
    ``shmkv publish`` sees the tier; failed stores leave nothing there."""
    manager = make_manager(2)
    cursor = manager.pool.event_cursor(from_start=False)
    manager.prepare_store(to_keys([1, 2]), CTX)
    manager.complete_store(to_keys([1, 2]), CTX)
    manager.prepare_store(to_keys([3]), CTX)
    manager.complete_store(to_keys([3]), CTX, success=False)
    events, lost = manager.pool.read_events(cursor)
    assert lost == 0
    kinds = [type(e.event) for e in events]
    assert kinds == [BlockStored, BlockRemoved]
    stored, removed = events[0].event, events[1].event
    assert stored.medium == removed.medium == "CPU"
    as_int = use_int_block_hashes()
    assert stored.block_hashes == [external_block_hash(h, as_int) for h in (b"1", b"2")]
    assert removed.block_hashes == [external_block_hash(b"1", as_int)]


def test_two_managers_in_one_process_share_the_tier(make_manager):
    """Two managers on one pool are one cache: the second sees the first's stores."""
    first = make_manager(4)
    second = SharedCPUOffloadingManager(first.pool_name, 4)
    try:
        out = first.prepare_store(to_keys([1, 2]), CTX)
        assert second.lookup(to_key(1), CTX) == PENDING
        assert second.prepare_store(to_keys([1, 2, 3]), CTX).keys_to_store == to_keys([3])
        first.complete_store(to_keys([1, 2]), CTX)
        spec = second.prepare_load(to_keys([2, 1]), CTX)
        assert spec.block_ids.tolist() == out.store_spec.block_ids.tolist()[::-1]
        second.complete_load(to_keys([2, 1]), CTX)
        second.complete_store(to_keys([3]), CTX)
    finally:
        second.close()


def test_arc_and_reuse_threshold_are_refused(make_manager):
    """ARC and store_threshold >= 2 need shared structures the tier lacks: clear errors,
    and no pool is created."""
    name = unique_pool_name("vm")
    with pytest.raises(UsageError, match="cache_policy='arc' is not supported"):
        SharedCPUOffloadingManager(name, 4, cache_policy="arc")
    with pytest.raises(UsageError, match="store_threshold 2 is not supported"):
        SharedCPUOffloadingManager(name, 4, store_threshold=2)
    assert not SharedCPUOffloadingManager.unlink(name)


def test_close_releases_this_process_holds(make_manager):
    """close() gives back pins and unfinished stores: the chunks become reusable."""
    manager = make_manager(2)
    other = SharedCPUOffloadingManager(manager.pool_name, 2)
    other.prepare_store(to_keys([1]), CTX)
    manager.prepare_store(to_keys([2]), CTX)
    manager.complete_store(to_keys([2]), CTX)
    other.prepare_load(to_keys([2]), CTX)
    other.close()
    assert manager.lookup(to_key(1), CTX) == MISS  # an orphaned store is absent
    out = manager.prepare_store(to_keys([5, 6]), CTX)
    assert out.evicted_keys == to_keys([2])
    assert sorted(out.store_spec.block_ids.tolist()) == [0, 1]
    rows = manager.pool.block_rows()
    assert np.array_equal(rows["ref_cnt"][1:], [1, 1])
    del rows


@pytest.mark.parametrize("damage", ["scrambled", "emptied"])
def test_an_lru_left_half_changed_is_rebuilt(make_manager, damage):
    """A writer killed half way through a change of the eviction heap or free stack
    leaves their dirty flag set (here set by hand, with the heap scrambled or emptied): the
    next holder rebuilds both from the block rows and ranks, and evicts exactly the least
    recently used keys, as before."""
    from shmkv.vllm.tier import W_FREE_TOP, W_HEAP_SIZE, W_LRU_DIRTY

    manager = make_manager(6)
    for i in range(6):
        manager.prepare_store([to_key(i)], CTX)
        manager.complete_store([to_key(i)], CTX)
    manager.touch(to_keys([0, 1]), CTX)  # LRU now: 2 3 4 5 1 0 (0 most recent)
    tier = manager._tier
    tier.words[W_LRU_DIRTY] = 1
    size = tier.words[W_HEAP_SIZE]
    if damage == "scrambled":
        tier.heap_rank[:size] = tier.heap_rank[:size][::-1].copy()
        tier.heap_block[:size] = 5
    else:
        tier.words[W_HEAP_SIZE] = 0
        tier.words[W_FREE_TOP] = 0
    out = manager.prepare_store(to_keys([10, 11, 12]), CTX)
    assert out is not None and out.evicted_keys == to_keys([2, 3, 4])
    assert tier.words[W_LRU_DIRTY] == 0
    manager.complete_store(to_keys([10, 11, 12]), CTX)
    out = manager.prepare_store(to_keys([13, 14]), CTX)
    assert out.evicted_keys == to_keys([5, 1])


@pytest.mark.parametrize("victims_in_c", [True, False])
@pytest.mark.parametrize("entry", [-3, 0, 1 << 20])
def test_a_heap_entry_written_over_is_dropped_and_the_heap_rebuilt(make_manager, monkeypatch,
                                                                   victims_in_c, entry):
    """A heap entry naming no chunk (the shared heap written over): eviction neither raises
    into vLLM's scheduler nor evicts a chunk that is not there; it evicts the least
    recently used keys, and the heap's size word matches its entries afterwards."""
    from shmkv.vllm import lru
    from shmkv.vllm.tier import W_HEAP_SIZE, W_LRU_DIRTY

    if not victims_in_c:
        monkeypatch.setattr(lru, "_c_heap_victims", None)
    elif lru._c_heap_victims is None:
        pytest.skip("shmkv.pool._ckernel is not built (pip install -e . builds it)")
    manager = make_manager(6)
    for i in range(6):
        manager.prepare_store([to_key(i)], CTX)
        manager.complete_store([to_key(i)], CTX)
    tier = manager._tier
    tier.heap_block[0] = entry  # the top entry: the first one popped
    out = manager.prepare_store(to_keys([10, 11]), CTX)
    assert out is not None and sorted(out.store_spec.block_ids.tolist()) != []
    evicted = out.evicted_keys
    assert set(evicted) <= set(to_keys(range(6))) and len(evicted) == 2
    assert all(0 <= b < 6 for b in out.store_spec.block_ids.tolist()), out.store_spec.block_ids
    assert tier.words[W_LRU_DIRTY] == 0
    manager.complete_store(to_keys([10, 11]), CTX)
    size = int(tier.words[W_HEAP_SIZE])
    assert all(0 < b <= 6 for b in tier.heap_block[:size].tolist())
    out = manager.prepare_store(to_keys([12, 13, 14, 15]), CTX)
    assert out is not None and len(out.evicted_keys) == 4
    manager.pool.check_invariants()


@pytest.mark.parametrize("victims_in_c", [True, False])
def test_calls_do_not_scan_the_tier(make_manager, monkeypatch, victims_in_c):
    """prepare_store on a full tier reads O(keys x log chunks) entries, not every block:
    the free stack and the eviction heap answer it, so a tier of 65,536 chunks and one of
    64 evict the same way, taking the same 16 entries off the heap (the victims' loop in C,
    and its Python reference)."""
    from shmkv.vllm import lru
    from shmkv.vllm.tier import W_HEAP_SIZE

    if not victims_in_c:
        monkeypatch.setattr(lru, "_c_heap_victims", None)
    elif lru._c_heap_victims is None:
        pytest.skip("shmkv.pool._ckernel is not built (pip install -e . builds it)")
    pops = []
    original = lru.TierLRU._pop

    def counting(self):
        pops.append(1)
        return original(self)

    for num_chunks in (64, 65536):
        manager = make_manager(num_chunks)
        batch = 4096
        for start in range(0, num_chunks, batch):
            keys = to_keys(range(start, min(start + batch, num_chunks)))
            manager.prepare_store(keys, CTX)
            manager.complete_store(keys, CTX)
        heap = manager._lru._words
        before = heap[W_HEAP_SIZE]
        monkeypatch.setattr(lru.TierLRU, "_pop", counting)
        out = manager.prepare_store(to_keys(range(-16, 0)), CTX)
        monkeypatch.setattr(lru.TierLRU, "_pop", original)
        assert out.evicted_keys == to_keys(range(16))
        assert before - heap[W_HEAP_SIZE] == 16, num_chunks
        assert len(pops) == (0 if victims_in_c else 16), (num_chunks, len(pops))
        pops.clear()


def test_get_stats_counts_cross_replica_hits_and_lock_holds(make_manager):
    """get_stats reaches vLLM's connector stats with the chunks a replica loaded that
    another replica stored, and its holds of the node-wide lock (count, wait, hold), each
    since the last call; vLLM's metric definitions of the spec declare them."""
    from vllm.v1.kv_offload.base import OffloadingCounterMetadata

    from shmkv.vllm import SharedCPUOffloadingSpec
    from shmkv.vllm.manager import (
        SHMKV_CROSS_REPLICA_HITS,
        SHMKV_LOCK_HOLD_S,
        SHMKV_LOCK_HOLDS,
        SHMKV_LOCK_WAIT_S,
    )

    a = make_manager(8, replica_id="A")
    b = SharedCPUOffloadingManager(a.pool_name, 8, replica_id="B")
    try:
        a.prepare_store(to_keys([1, 2, 3]), CTX)
        a.complete_store(to_keys([1, 2, 3]), CTX)
        a.get_stats()
        b.get_stats()
        b.prepare_load(to_keys([1, 2]), CTX)
        b.complete_load(to_keys([1, 2]), CTX)
        a.prepare_load(to_keys([3]), CTX)
        a.complete_load(to_keys([3]), CTX)
        sb, sa = b.get_stats().reduce(), a.get_stats().reduce()
        assert sb[SHMKV_CROSS_REPLICA_HITS] == 2 and sa[SHMKV_CROSS_REPLICA_HITS] == 0
        assert sb[SHMKV_LOCK_HOLDS] >= 2 and sb[SHMKV_LOCK_HOLD_S] > 0
        assert sb[SHMKV_LOCK_WAIT_S] >= 0
        assert b.get_stats().reduce()[SHMKV_LOCK_HOLDS] == 0  # since the last call
    finally:
        b.close()
    definitions = SharedCPUOffloadingSpec.build_metric_definitions({})
    assert all(isinstance(definitions[n], OffloadingCounterMetadata)
               for n in (SHMKV_CROSS_REPLICA_HITS, SHMKV_LOCK_HOLDS, SHMKV_LOCK_WAIT_S,
                         SHMKV_LOCK_HOLD_S))


def test_a_call_mixing_groups_and_hash_lengths_matches_vllm(make_manager):
    """One call's keys of several groups and hash lengths (a hybrid model's groups) are
    stored, found, loaded and evicted as by vLLM's own CPUOffloadingManager, call for call,
    and each key keeps its own chunk."""
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    ours, theirs = make_manager(6), CPUOffloadingManager(num_chunks=6, cache_policy="lru")

    def key(i: int, group: int):
        return make_offload_key(f"h{i}".encode() * (1 + group), group)

    batches = [[key(1, 0), key(1, 1), key(2, 2)], [key(2, 0), key(1, 1), key(3, 1)],
               [key(4, 0), key(4, 2), key(5, 7)]]
    chunks = _Chunks()
    for batch in batches:
        out, expected = ours.prepare_store(batch, CTX), theirs.prepare_store(batch, CTX)
        assert (out.keys_to_store, out.evicted_keys) == \
            (expected.keys_to_store, expected.evicted_keys)
        for evicted in out.evicted_keys:
            chunks.chunk_of.pop(evicted)
        chunks.chunk_of.update(zip(out.keys_to_store, out.store_spec.block_ids.tolist(),
                                   strict=True))
        assert len(set(chunks.chunk_of.values())) == len(chunks.chunk_of)
        ours.complete_store(out.keys_to_store, CTX)
        theirs.complete_store(expected.keys_to_store, CTX)
        ours.pool.check_invariants()
    every = [k for batch in batches for k in batch]
    assert [ours.lookup(k, CTX) for k in every] == [theirs.lookup(k, CTX) for k in every]
    held = [k for k in dict.fromkeys(every) if ours.lookup(k, CTX) == HIT]
    assert len(held) == 6
    spec = ours.prepare_load(held, CTX)
    assert spec.block_ids.tolist() == [chunks.chunk_of[k] for k in held]
    ours.complete_load(held, CTX)
    ours.pool.check_invariants()


def _positioned(ints) -> ReqContext:
    """A request context whose keys have the positions vLLM's scheduler gives them."""
    ctx = ReqContext(f"positioned-{min(ints)}")
    for i, key in enumerate(to_keys(ints)):
        ctx.set_offload_key_position(key, (i + 1) * 16)
    return ctx


def _holds(manager) -> int:
    from shmkv.vllm.manager import SHMKV_LOCK_HOLDS

    return manager.get_stats().reduce()[SHMKV_LOCK_HOLDS]


def _refs(manager, chunks: list[int]) -> list[int]:
    """The pool's reference counts of the given chunks (block id = chunk + 1)."""
    rows = manager.pool.block_rows()
    return [int(rows["ref_cnt"][c + 1]) for c in chunks]


def test_a_steps_lookups_of_a_request_take_one_hold_and_answer_as_vllm(make_manager):
    """Inside the step region, a request's prefix walk (ten HITs, then a MISS) takes ONE
    hold of the node-wide lock, answers as vLLM's own manager does, pins the ten HITs for
    the region and gives them back at its end; the keys after the MISS are neither looked
    up nor pinned. Outside a region every lookup is one hold and pins nothing."""
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    manager, theirs = make_manager(16), CPUOffloadingManager(num_chunks=16, cache_policy="lru")
    stored = list(range(10)) + [11, 12]
    for m in (manager, theirs):
        out = m.prepare_store(to_keys(stored), CTX)
        m.complete_store(out.keys_to_store, CTX)
        if m is manager:
            chunks = out.store_spec.block_ids.tolist()
    first, after_miss = chunks[:10], chunks[10:]
    ctx = _positioned(range(14))
    walk = to_keys(range(11))  # keys 0-9 stored, 10 not: vLLM's walk stops there
    _holds(manager)
    with manager.lock:
        answers = [manager.lookup(key, ctx) for key in walk]
        assert _holds(manager) == 1
        assert answers == [theirs.lookup(key, ctx) for key in walk] == [HIT] * 10 + [MISS]
        assert _refs(manager, first) == [1] * 10
        assert _refs(manager, after_miss) == [0, 0]  # after the MISS: untouched
    assert _refs(manager, first) == [0] * 10
    _holds(manager)
    assert [manager.lookup(key, ctx) for key in walk] == answers
    assert _holds(manager) == len(walk)
    assert _refs(manager, first) == [0] * 10


def test_a_kept_lookup_answer_never_outlives_its_truth(make_manager):
    """A HIT kept for the step region is pinned, so another replica's store on a full
    tier cannot evict it; once this replica loaded and unpinned it in the same region, the
    other replica may evict it and the next lookup reads the tier again (a MISS, not the
    kept HIT). A key this replica starts or completes storing in the region is read again
    too, as vLLM's manager answers it (HIT_PENDING, then HIT)."""
    a = make_manager(4, replica_id="A")
    b = SharedCPUOffloadingManager(a.pool_name, 4, replica_id="B")
    try:
        a.complete_store(a.prepare_store(to_keys([0, 1, 2, 3]), CTX).keys_to_store, CTX)
        ctx = _positioned(range(6))
        with a.lock:
            assert [a.lookup(k, ctx) for k in to_keys(range(5))] == [HIT] * 4 + [MISS]
            assert b.prepare_store(to_keys([7]), CTX) is None  # every chunk pinned by A
            a.prepare_load(to_keys([0]), ctx)
            a.complete_load(to_keys([0]), ctx)
            with a.lock:  # nested: the region goes on
                pass
            assert b.prepare_store(to_keys([7]), CTX) is not None  # evicts 0, now unpinned
            assert a.lookup(to_key(0), ctx) == MISS
            b.complete_store(to_keys([7]), CTX)
            out = a.prepare_store(to_keys([4]), ctx)  # 4 was a kept MISS; evicts B's 7
            assert (out.keys_to_store, out.evicted_keys) == (to_keys([4]), to_keys([7]))
            assert a.lookup(to_key(4), ctx) == PENDING  # stored here: read again
            a.complete_store(to_keys([4]), ctx)
            assert a.lookup(to_key(4), ctx) == HIT  # completed here: read again
        a.pool.check_invariants()
    finally:
        b.close()


def test_without_vllms_lock_a_step_runs_from_its_first_lookup_to_on_schedule_end(
        make_manager):
    """On a vLLM whose connector holds no ``manager.lock`` (0.32), a step's first lookup
    opens the step region and ``on_schedule_end`` closes it: a HIT stays pinned against
    another replica's eviction until its ``prepare_load`` (whose pin it becomes) or the
    step's end. Without the implicit region the other replica evicts the HIT, and the
    ``prepare_load`` vLLM's scheduler makes next fails. A manager not made for such a
    connector (B) never opens one: its lookups pin nothing."""
    a = make_manager(2, replica_id="A", implicit_step_region=True)
    b = SharedCPUOffloadingManager(a.pool_name, 2, replica_id="B")
    try:
        out = a.prepare_store(to_keys([0, 1]), CTX)
        a.complete_store(out.keys_to_store, CTX)
        chunks = out.store_spec.block_ids.tolist()
        ctx = _positioned(range(3))
        assert a.lookup(to_key(0), ctx) == HIT  # opens the region, pins chunk of key 0
        assert a.lookup(to_key(1), ctx) == HIT
        assert _refs(a, chunks) == [1, 1]
        assert b.prepare_store(to_keys([7]), CTX) is None  # nothing evictable: both pinned
        spec = a.prepare_load(to_keys([0]), ctx)  # the lookup's hold becomes the pin
        assert spec.block_ids.tolist() == chunks[:1]
        assert _refs(a, chunks) == [1, 1]
        a.on_schedule_end(None)  # key 1's lookup pin goes back; key 0's load pin stays
        assert _refs(a, chunks) == [1, 0]
        assert b.prepare_store(to_keys([7]), CTX).evicted_keys == to_keys([1])
        a.complete_load(to_keys([0]), ctx)
        assert _refs(a, chunks) == [0, 1]  # chunk 1 now holds B's store of key 7
        a.on_schedule_end(None)  # no region open: nothing happens
        assert b.lookup(to_key(0), ctx) == HIT
        assert _refs(a, chunks) == [0, 1]  # B's lookup pinned nothing
        a.pool.check_invariants()
    finally:
        b.close()
