"""The Redis prefix index against real pools and a real redis-server: exact after every
kind of change, exactly once under replays, and one round trip per lookup."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from shmkv import BlockPool, Request
from shmkv.cluster_index import (
    APPLIED,
    DUPLICATE,
    OUT_OF_SYNC,
    ApplyResult,
    RedisPrefixIndex,
    block_keys,
)
from shmkv.errors import UsageError
from shmkv.events import AllBlocksCleared, BlockStored, KVEventBatch, external_block_hash
from tests.conftest import unique_pool_name

redis = pytest.importorskip("redis")
BS = 16
SYSTEMS = [list(range(s * 1000, s * 1000 + 64)) for s in range(3)]


@pytest.fixture
def index(redis_server):
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    yield RedisPrefixIndex(client, key_prefix=unique_pool_name("ix"))
    client.close()


@pytest.fixture
def pools():
    made = []

    def factory(num_blocks: int = 64) -> BlockPool:
        pool = BlockPool.create(unique_pool_name("cl"), num_blocks, hash_block_size=BS,
                                enable_kv_cache_events=True)
        made.append(pool)
        return pool

    yield factory
    for pool in made:
        name = pool.pool_name
        pool.close()
        BlockPool.unlink(name)


def cached_keys(pool: BlockPool) -> set[str]:
    """The pool's prefix cache as the index names its keys, read from the block rows."""
    rows = pool.layout.view(pool._segment.buf, "block_meta")[: pool.num_gpu_blocks]
    keys = set()
    for row in rows[rows["hash_num_tokens"] > 0]:
        h = external_block_hash(bytes(row["block_hash"]), as_int=True)
        keys.add(f"{int(row['group_id'])}:{h}")
    return keys


def serve(pool: BlockPool, rng: random.Random, n: int) -> list[Request]:
    """Admits and finishes n chat-like requests (shared system prompts, unique tails)."""
    hasher = pool.make_block_hasher()
    done = []
    for i in range(n):
        tokens = rng.choice(SYSTEMS) + [rng.randrange(50_000) for _ in range(rng.randint(1, 40))]
        req = Request(f"r{i}-{rng.random()}", tokens, block_hasher=hasher)
        with pool.lock():
            hits = pool.get_cached_prefix(req.block_hashes)
            pool.touch(hits)
            blocks = hits + pool.get_new_blocks(-(-len(tokens) // BS) - len(hits))
            pool.cache_full_blocks(req, blocks, len(hits), len(tokens) // BS, BS, 0)
        pool.free_blocks(reversed(blocks))
        done.append(req)
    return done


def feed(index: RedisPrefixIndex, source: str, pool: BlockPool, cursor, epoch=1) -> Counter:
    """Applies the pool's new log events, one batch per event, sequence = log seq; returns
    how many of each kind."""
    events, lost = pool.read_events(cursor)
    assert lost == 0
    if source not in {st.source for st in index.sources()}:
        index.apply_snapshot(source, cursor.seq - len(events) - 1, KVEventBatch(0.0, []),
                             epoch=epoch)
    for logged in events:
        assert index.apply_batch(source, logged.seq, KVEventBatch(logged.ts, [logged.event]),
                                 epoch=epoch) == APPLIED
    return Counter(type(logged.event).__name__ for logged in events)


def ext(hashes):
    return [external_block_hash(h, as_int=True) for h in hashes]


def test_the_index_equals_each_pool_after_stores_evictions_and_a_reset(index, pools):
    a, b = pools(48), pools(48)
    rng = random.Random(1)
    cur_a, cur_b = a.event_cursor(), b.event_cursor()
    kinds = Counter()
    for rnd in range(4):
        reqs = serve(a, rng, 30) + serve(b, rng, 10)  # 48 blocks: plenty of evictions
        kinds += feed(index, "node-a", a, cur_a)
        feed(index, "node-b", b, cur_b)
        assert index.source_keys("node-a") == cached_keys(a)
        assert index.source_keys("node-b") == cached_keys(b)
        for req in reqs:
            answer = index.longest_prefixes(ext(req.block_hashes))
            for source, pool in (("node-a", a), ("node-b", b)):
                truth = len(pool.get_cached_prefix(req.block_hashes))
                assert answer.get(source, 0) == truth, (rnd, source)
        if rnd == 2:
            assert a.reset_prefix_cache()
            feed(index, "node-a", a, cur_a)
            assert index.source_keys("node-a") == set()
    assert kinds["BlockStored"] > 0 and kinds["BlockRemoved"] > 0
    a.check_invariants()
    b.check_invariants()


def test_replayed_batches_are_applied_once_and_gaps_are_refused(index, pools):
    pool = pools()
    serve(pool, random.Random(2), 10)
    events, _ = pool.read_events(pool.event_cursor())
    index.apply_snapshot("n", -1, KVEventBatch(0.0, []), epoch=7)
    first, rest = events[0], events[1:]
    assert index.apply_batch("n", first.seq, KVEventBatch(0.0, [first.event]), epoch=7) == APPLIED
    # One missing: refused, nothing changes.
    keys = index.source_keys("n")
    gap = rest[1]
    assert index.apply_batch("n", gap.seq, KVEventBatch(0.0, [gap.event]), epoch=7) == OUT_OF_SYNC
    assert index.source_keys("n") == keys
    for logged in rest:
        assert index.apply_batch("n", logged.seq, KVEventBatch(logged.ts, [logged.event]),
                                 epoch=7) == APPLIED
    # A replay of everything: no-ops.
    for logged in events:
        assert index.apply_batch("n", logged.seq, KVEventBatch(0.0, [logged.event]),
                                 epoch=7) == DUPLICATE
    assert index.source_keys("n") == cached_keys(pool)
    [state] = index.sources()
    assert (state.source, state.seq, state.epoch) == ("n", events[-1].seq, "7")
    assert state.num_keys == len(cached_keys(pool))
    # Another epoch, or a source never started: out of sync.
    assert index.apply_batch("n", events[-1].seq + 1, KVEventBatch(0.0, []),
                             epoch=8) == OUT_OF_SYNC
    assert index.apply_batch("new", 0, KVEventBatch(0.0, []), epoch=7) == OUT_OF_SYNC
    assert [st.source for st in index.sources()] == ["n"]


def test_a_snapshot_replaces_what_the_source_held(index, pools):
    old = pools()
    serve(old, random.Random(3), 8)
    feed(index, "n", old, old.event_cursor(), epoch=1)
    assert index.source_keys("n")
    fresh = pools()  # the node restarted: a new pool
    reqs = serve(fresh, random.Random(4), 3)
    snapshot = KVEventBatch(0.0, [AllBlocksCleared()] + [
        BlockStored([external_block_hash(h, True) for h in hashes], None, [], BS, None, None,
                    None, group_idx=group)
        for group, hashes in fresh.cached_keys_by_group().items()])
    assert index.apply_snapshot("n", 41, snapshot, epoch=2) == APPLIED
    assert index.source_keys("n") == cached_keys(fresh)
    assert index.longest_prefixes(ext(reqs[0].block_hashes)) == {
        "n": len(fresh.get_cached_prefix(reqs[0].block_hashes))}
    assert index.sources()[0].seq == 41


def test_forget_source_removes_it_and_its_keys(index, pools):
    pool = pools()
    reqs = serve(pool, random.Random(5), 5)
    feed(index, "gone", pool, pool.event_cursor())
    assert index.forget_source("gone") == len(cached_keys(pool))
    assert index.sources() == []
    assert index.longest_prefixes(ext(reqs[0].block_hashes)) == {}


def test_lookups_stop_at_the_first_gap_of_each_source(index):
    def stored_batch(hashes):
        return KVEventBatch(0.0, [BlockStored(hashes, None, [], BS, None, None, None)])

    index.apply_snapshot("x", 0, stored_batch([10, 11, 12, 13]), epoch=1)
    index.apply_snapshot("y", 0, stored_batch([10, 11, 13]), epoch=1)  # 12 missing
    assert index.longest_prefixes([10, 11, 12, 13, 14]) == {"x": 4, "y": 2}
    assert index.longest_prefixes([11, 12]) == {"x": 2, "y": 1}
    assert index.longest_prefixes([99, 10]) == {}
    assert index.longest_prefixes([]) == {}
    assert block_keys([10]) == {"0:10"}


@pytest.mark.parametrize(
    "kwargs, says",
    [
        ({"source": "a:b"}, "source"),
        ({"source": ""}, "source"),
        ({"seq": -1}, "seq"),
        ({"seq": True}, "seq"),
    ],
)
def test_bad_input_is_refused_and_changes_nothing(index, kwargs, says):
    args = {"source": "s", "seq": 0, "batch": KVEventBatch(0.0, []), "epoch": 1} | kwargs
    with pytest.raises(UsageError, match=says):
        index.apply_batch(**args)
    with pytest.raises(UsageError, match=says):
        index.apply_snapshot(**(args | {"seq": -2} if kwargs.get("seq") == -1 else args))
    assert index.sources() == []
    with pytest.raises(UsageError, match="block hash"):
        index.longest_prefixes([1.5])
    with pytest.raises(UsageError, match="key_prefix"):
        RedisPrefixIndex(index._redis, key_prefix="a:b")



def test_apply_batches_in_one_call_skips_duplicates_and_stops_at_a_gap(index, pools):
    pool = pools()
    serve(pool, random.Random(6), 6)
    events, _ = pool.read_events(pool.event_cursor())
    assert len(events) >= 6
    batches = [(e.seq, KVEventBatch(e.ts, [e.event])) for e in events]
    index.apply_snapshot("n", -1, KVEventBatch(0.0, []), epoch=1)
    assert index.apply_batches("n", batches[:2], epoch=1) == ApplyResult(True, 2, 0)
    # duplicate, next, next, then a gap (batch 5 without 4), then one that would follow.
    mixed = [batches[1], batches[2], batches[3], batches[5], batches[4]]
    assert index.apply_batches("n", mixed, epoch=1) == ApplyResult(False, 2, 1)
    assert index.sources()[0].seq == batches[3][0]
    assert index.apply_batches("n", batches[4:], epoch=1) == ApplyResult(
        True, len(batches) - 4, 0)
    assert index.source_keys("n") == cached_keys(pool)
    assert index.apply_batches("n", [], epoch=1) == ApplyResult(True, 0, 0)
