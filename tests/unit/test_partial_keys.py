"""Partial-block prefix-cache keys: ``BlockPool.cache_partial_block``, a block's alias key
(the ``block_alias`` region), ``move_block_hashes``, and what eviction, reset, the invariant
checker and rebuild do with them.

The pools here hash 4-token units and the requests' blocks are 16 tokens (four units), so a
block has three interior hash boundaries: 4, 8 and 12 tokens into it.
"""

from __future__ import annotations

import logging
import random

import pytest

from shmkv import BlockPool, InvariantViolation, UsageError
from shmkv.events import BlockRemoved, BlockStored, external_block_hash, use_int_block_hashes
from shmkv.pool.block_pool import _ckernel
from shmkv.pool.recovery import rebuild
from tests.conftest import unique_pool_name
from tests.helpers import make_request, segment_image

HBS = 4  # tokens per hash unit
BS = 16  # tokens per block


def ext(*hashes: bytes) -> list:
    """Hashes as the events carry them."""
    return [external_block_hash(h, use_int_block_hashes()) for h in hashes]


def key_of(block_hash: bytes, group: int = 0) -> bytes:
    return block_hash + group.to_bytes(4, "big")


@pytest.fixture
def pool(make_pool) -> BlockPool:
    return make_pool(12, hash_block_size=HBS, enable_kv_cache_events=True, partial_keys=True)


def test_partial_key_on_a_block_without_one_becomes_its_own(pool):
    req = make_request(30, block_size=HBS)  # 7 hash units
    a, b = pool.get_new_blocks(2)
    key = pool.cache_partial_block(req, b, 24, 0, BS)  # 8 tokens into the second block
    assert key == key_of(req.block_hashes[5])
    assert b.block_hash == key and b.block_hash_num_tokens == 24
    assert pool.get_cached_block(req.block_hashes[5], [0]) == [b]
    assert pool.get_cached_block(req.block_hashes[4], [0]) is None  # only that boundary
    (event,) = pool.take_events()
    assert isinstance(event, BlockStored)
    assert event.block_hashes == ext(req.block_hashes[5])
    assert [event.parent_block_hash] == ext(req.block_hashes[4])
    assert event.token_ids == list(range(20, 24)) and event.block_size == HBS
    pool.check_invariants()


def test_full_key_replaces_a_partial_one(pool):
    req = make_request(40, block_size=HBS)
    blocks = pool.get_new_blocks(2)
    pool.cache_partial_block(req, blocks[1], 24, 0, BS)
    pool.take_events()
    pool.cache_full_blocks(req, blocks, 0, 2, BS, 0)
    removed, stored = pool.take_events()
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == ext(req.block_hashes[5])
    assert stored.block_hashes == ext(req.block_hashes[3], req.block_hashes[7])
    assert blocks[1].block_hash_num_tokens == 32
    assert pool.get_cached_block(req.block_hashes[5], [0]) is None
    assert pool.get_cached_block(req.block_hashes[7], [0]) == [blocks[1]]
    pool.check_invariants()


def test_partial_key_on_a_full_block_is_an_alias(pool):
    req = make_request(40, block_size=HBS)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, 2, BS, 0)
    pool.take_events()
    key = pool.cache_partial_block(req, blocks[1], 28, 0, BS)
    assert key == key_of(req.block_hashes[6])
    # The block keeps its own (full) key; the alias is a second way to find it.
    assert blocks[1].block_hash == key_of(req.block_hashes[7])
    assert blocks[1].block_hash_num_tokens == 32
    assert pool.cached_block_hash_to_block.alias_key(blocks[1].block_id) == (req.block_hashes[6], 0)
    assert pool.get_cached_block(req.block_hashes[6], [0]) == [blocks[1]]
    assert pool.get_cached_block(req.block_hashes[7], [0]) == [blocks[1]]
    assert pool.get_cached_prefix([req.block_hashes[6]]) == [blocks[1]]  # C and Python scans
    assert len(pool.cached_block_hash_to_block) == 3
    (stored,) = pool.take_events()
    assert stored.block_hashes == ext(req.block_hashes[6]) and stored.token_ids == [24, 25, 26, 27]
    # Asking again changes nothing and records nothing.
    image = segment_image(pool)
    assert pool.cache_partial_block(req, blocks[1], 28, 0, BS) == key
    assert segment_image(pool) == image and pool.take_events() == []
    pool.check_invariants()


def test_eviction_drops_the_alias_after_the_own_key(pool):
    req = make_request(40, block_size=HBS)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, 2, BS, 0)
    pool.cache_partial_block(req, blocks[1], 28, 0, BS)
    pool.free_blocks(reversed(blocks))
    pool.take_events()
    # Everything else is taken first; then the two cached blocks are evicted, tail first.
    rest = pool.get_new_blocks(pool.get_num_free_blocks() - 2)
    assert pool.take_events() == []
    again = pool.get_new_blocks(2)
    assert [b.block_id for b in again] == [blocks[1].block_id, blocks[0].block_id]
    events = pool.take_events()
    assert [e.block_hashes for e in events] == [
        ext(req.block_hashes[7]), ext(req.block_hashes[6]), ext(req.block_hashes[3])]
    assert all(isinstance(e, BlockRemoved) for e in events)
    assert pool.get_cached_block(req.block_hashes[6], [0]) is None
    assert len(pool.cached_block_hash_to_block) == 0
    pool.free_blocks(rest + again)
    pool.check_invariants()


def test_evict_blocks_and_reset_drop_aliases(pool):
    req = make_request(40, block_size=HBS)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, 2, BS, 0)
    pool.cache_partial_block(req, blocks[1], 20, 0, BS)
    pool.take_events()
    pool.evict_blocks([blocks[1].block_id])
    assert [e.block_hashes for e in pool.take_events()] == [
        ext(req.block_hashes[7]), ext(req.block_hashes[4])]
    pool.cache_full_blocks(req, blocks, 1, 2, BS, 0)
    pool.cache_partial_block(req, blocks[1], 20, 0, BS)
    pool.free_blocks(reversed(blocks))
    assert pool.reset_prefix_cache()
    assert len(pool.cached_block_hash_to_block) == 0
    assert pool.get_cached_block(req.block_hashes[4], [0]) is None
    pool.check_invariants()


def test_a_longer_partial_key_replaces_a_shorter_own_one(pool):
    req = make_request(40, block_size=HBS)
    a, b = pool.get_new_blocks(2)
    pool.cache_partial_block(req, b, 20, 0, BS)
    pool.take_events()
    pool.cache_partial_block(req, b, 28, 0, BS)
    removed, stored = pool.take_events()
    assert removed.block_hashes == ext(req.block_hashes[4])
    assert stored.block_hashes == ext(req.block_hashes[6])
    assert b.block_hash_num_tokens == 28
    assert pool.cached_block_hash_to_block.alias_key(b.block_id) is None
    # A shorter one than the own key becomes the alias instead.
    pool.cache_partial_block(req, b, 24, 0, BS)
    assert b.block_hash_num_tokens == 28
    assert pool.get_cached_block(req.block_hashes[5], [0]) == [b]
    pool.check_invariants()


def test_replace_existing_hashes_drops_every_key_first(pool):
    req = make_request(40, block_size=HBS)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, 2, BS, 0)
    pool.cache_partial_block(req, blocks[1], 24, 0, BS)
    pool.take_events()
    pool.cache_partial_block(req, blocks[1], 20, 0, BS, replace_existing_hashes=True)
    events = pool.take_events()
    assert [type(e).__name__ for e in events] == ["BlockRemoved", "BlockRemoved", "BlockStored"]
    assert blocks[1].block_hash == key_of(req.block_hashes[4])
    assert blocks[1].block_hash_num_tokens == 20
    assert pool.get_cached_block(req.block_hashes[7], [0]) is None
    pool.check_invariants()


def test_a_second_alias_replaces_the_first(pool):
    """One alias row per block: where vLLM would keep both aliases, shmkv keeps the newer
    and says it dropped the older."""
    req = make_request(40, block_size=HBS)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, 2, BS, 0)
    pool.cache_partial_block(req, blocks[1], 20, 0, BS)
    pool.take_events()
    pool.cache_partial_block(req, blocks[1], 24, 0, BS)
    removed, stored = pool.take_events()
    assert removed.block_hashes == ext(req.block_hashes[4])
    assert stored.block_hashes == ext(req.block_hashes[5])
    assert pool.get_cached_block(req.block_hashes[4], [0]) is None
    assert pool.get_cached_block(req.block_hashes[5], [0]) == [blocks[1]]
    pool.check_invariants()


def test_null_block_is_never_keyed(pool):
    req = make_request(40, block_size=HBS)
    image = segment_image(pool)
    assert pool.cache_partial_block(req, pool.null_block, 20, 0, BS) is None
    assert segment_image(pool) == image and pool.take_events() == []


@pytest.mark.parametrize("kwargs, match", [
    ({"num_tokens": 22}, "multiple of hash_block_size"),
    ({"num_tokens": 0}, "positive multiple"),
    ({"num_tokens": 44}, "covered by the request"),
    ({"num_tokens": -4}, "int >= 0"),
    ({"block_size": 6}, "block_size 6"),
    ({"block_size": 0}, "block_size 0"),
    ({"kv_cache_group_id": -1}, "kv_cache_group_id"),
    ({"kv_cache_group_id": 1 << 31}, "2\\*\\*31"),
    ({"num_tokens": 20.0}, "num_tokens"),
])
def test_bad_arguments_raise_usage_error_and_change_nothing(pool, kwargs, match):
    req = make_request(40, block_size=HBS)
    (block,) = pool.get_new_blocks(1)
    args = {"request": req, "block": block, "num_tokens": 20, "kv_cache_group_id": 0,
            "block_size": BS, **kwargs}
    image = segment_image(pool)
    with pytest.raises(UsageError, match=match):
        pool.cache_partial_block(**args)
    assert segment_image(pool) == image and pool.take_events() == []


def test_bad_block_handles_raise_usage_error(pool):
    req = make_request(40, block_size=HBS)
    image = segment_image(pool)
    for bad in (object(), type("B", (), {"block_id": 99})(), type("B", (), {"block_id": -1})()):
        with pytest.raises(UsageError):
            pool.cache_partial_block(req, bad, 20, 0, BS)
        with pytest.raises(UsageError):
            pool.move_block_hashes(bad, pool.blocks[1])
    assert segment_image(pool) == image


def test_move_block_hashes_moves_own_key_and_alias(pool):
    req = make_request(40, block_size=HBS)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, 2, BS, 0)
    pool.cache_partial_block(req, blocks[1], 24, 0, BS)
    (copy,) = pool.get_new_blocks(1)
    pool.take_events()
    pool.move_block_hashes(blocks[1], copy)
    assert pool.take_events() == []  # the keys stay live: nothing to tell subscribers
    assert blocks[1].block_hash is None
    assert copy.block_hash == key_of(req.block_hashes[7]) and copy.block_hash_num_tokens == 32
    assert pool.get_cached_block(req.block_hashes[5], [0]) == [copy]
    assert pool.get_cached_block(req.block_hashes[7], [0]) == [copy]
    pool.check_invariants()
    # The destination must hold no key; refused without a change.
    image = segment_image(pool)
    with pytest.raises(UsageError, match="must hold no key"):
        pool.move_block_hashes(blocks[0], copy)
    with pytest.raises(UsageError, match="must hold no key"):
        pool.move_block_hashes(copy, copy)
    assert segment_image(pool) == image


def test_move_block_hashes_of_a_block_without_keys_does_nothing(pool):
    a, b = pool.get_new_blocks(2)
    image = segment_image(pool)
    pool.move_block_hashes(a, b)
    assert segment_image(pool) == image


def test_pool_without_partial_keys_keeps_own_partial_keys_only(make_pool, caplog):
    pool = make_pool(12, hash_block_size=HBS, enable_kv_cache_events=True)
    assert pool.layout.shapes["block_alias"] == (0,)
    assert pool.layout.offsets["index_buckets"] == pool.layout.offsets["block_alias"]
    req = make_request(40, block_size=HBS)
    blocks = pool.get_new_blocks(2)
    pool.cache_partial_block(req, blocks[1], 20, 0, BS)  # own key: kept
    assert pool.get_cached_block(req.block_hashes[4], [0]) == [blocks[1]]
    pool.cache_full_blocks(req, blocks, 0, 2, BS, 0)
    pool.take_events()
    with caplog.at_level(logging.WARNING, logger="shmkv.pool.block_pool"):
        key = pool.cache_partial_block(req, blocks[1], 24, 0, BS)  # would be an alias
        pool.cache_partial_block(req, blocks[1], 28, 0, BS)
    assert key == key_of(req.block_hashes[5])
    assert pool.get_cached_block(req.block_hashes[5], [0]) is None
    assert sum("partial_keys" in r.getMessage() for r in caplog.records) == 1  # once per pool
    pool.check_invariants()


def test_attach_sees_partial_keys_and_aliases(pool):
    req = make_request(40, block_size=HBS)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, 2, BS, 0)
    pool.cache_partial_block(req, blocks[1], 28, 0, BS)
    with BlockPool.attach(pool.pool_name, kernel=pool.kernel) as other:
        assert other.layout.config.partial_keys
        assert [b.block_id for b in other.get_cached_block(req.block_hashes[6], [0])] == [
            blocks[1].block_id]
        other.check_invariants()


# ----------------------------------------------------------------------------- invariants


def _alias_pool(pool):
    req = make_request(40, block_size=HBS)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(req, blocks[:2], 0, 2, BS, 0)
    pool.cache_partial_block(req, blocks[1], 28, 0, BS)
    return req, blocks


def test_an_alias_without_an_own_key_is_inv_alias(pool):
    req, blocks = _alias_pool(pool)
    rows = pool._key_rows
    rows["hash_num_tokens"][blocks[1].block_id] = 0  # the own key's marker, only
    with pytest.raises(InvariantViolation) as info:
        pool.check_invariants()
    assert any(v.startswith("INV-ALIAS") for v in info.value.violations)


def test_an_alias_equal_to_the_own_key_is_inv_alias(pool):
    req, blocks = _alias_pool(pool)
    rows = pool._key_rows
    b = blocks[1].block_id
    alias = pool.layout.alias_row(b)
    index = pool.cached_block_hash_to_block
    with pool.lock():  # journaled writes: a hold that ends keeps them
        index.pop(alias)
        index.insert(bytes(rows["block_hash"][b]), 0, alias, 28)
    with pytest.raises(InvariantViolation) as info:
        pool.check_invariants()
    assert {v.split(":")[0] for v in info.value.violations} == {"INV-ALIAS"}


def test_an_unchained_alias_is_inv_hash(pool):
    req, blocks = _alias_pool(pool)
    alias = pool.layout.alias_row(blocks[1].block_id)
    index = pool.cached_block_hash_to_block
    bucket = index.bucket_of(*index.block_key(alias))
    buckets = pool.layout.view(pool._segment.buf, "index_buckets")
    nxt = pool._key_rows["index_next"]
    if buckets[bucket] == alias:  # unlink the alias row, leaving its key
        buckets[bucket] = nxt[alias]
    else:
        cur = int(buckets[bucket])
        while nxt[cur] != alias:
            cur = int(nxt[cur])
        nxt[cur] = nxt[alias]
    nxt[alias] = -1
    with pytest.raises(InvariantViolation) as info:
        pool.check_invariants()
    assert any("the alias row of block" in v and v.startswith("INV-HASH")
               for v in info.value.violations)


def test_rebuild_rechains_aliases_and_drops_orphans(pool):
    req, blocks = _alias_pool(pool)
    pool.cache_partial_block(req, blocks[2], 36, 0, BS)  # an own partial key
    buckets = pool.layout.view(pool._segment.buf, "index_buckets")
    buckets[:] = -1  # lose every chain
    with pool.lock():
        report = rebuild(pool)
    assert report.hashes_dropped == 0
    pool.check_invariants()
    for fine, block in ((6, blocks[1]), (7, blocks[1]), (8, blocks[2]), (3, blocks[0])):
        assert pool.get_cached_block(req.block_hashes[fine], [0]) == [block]
    # An alias whose block lost its own key is dropped (and reported).
    pool._key_rows["hash_num_tokens"][blocks[1].block_id] = -5
    with pool.lock():
        report = rebuild(pool)
    assert sorted(report.dropped_keys) == sorted(
        [(req.block_hashes[7], 0), (req.block_hashes[6], 0)])
    assert pool.get_cached_block(req.block_hashes[6], [0]) is None
    pool.check_invariants()


# ----------------------------------------------------------------------------- kernels


def _partial_workload(pool: BlockPool, rng: random.Random) -> list:
    """A seeded mix of pool calls with partial keys, aliases and moves."""
    results = []
    running = []
    for _ in range(300):
        op = rng.random()
        if op < 0.4:
            req = make_request(rng.randint(2, 40) * HBS, block_size=HBS,
                               first_token=rng.choice([0, 0, 1000]))
            full = len(req.block_hashes) // (BS // HBS)
            hits = pool.get_cached_prefix(req.block_hashes[BS // HBS - 1::BS // HBS])
            pool.touch(hits)
            need = -(-len(req.all_token_ids) // BS) - len(hits)
            try:
                blocks = hits + pool.get_new_blocks(need)
            except ValueError as exc:
                results.append(str(exc))
                pool.free_blocks(reversed(hits))
                continue
            cut = rng.randint(len(hits), full)
            pool.cache_full_blocks(req, blocks, len(hits), cut, BS, 0)
            boundary = rng.randrange(1, len(req.block_hashes) + 1) * HBS
            results.append(pool.cache_partial_block(req, blocks[(boundary - 1) // BS],
                                                    boundary, 0, BS))
            running.append(blocks)
            results.append([b.block_id for b in blocks])
        elif op < 0.55 and running:
            blocks = rng.choice(running)
            try:
                (copy,) = pool.get_new_blocks(1)
            except ValueError as exc:
                results.append(str(exc))
                continue
            pool.move_block_hashes(rng.choice(blocks), copy)
            pool.free_blocks([copy])
        elif op < 0.85 and running:
            pool.free_blocks(reversed(running.pop(rng.randrange(len(running)))))
        elif op < 0.95:
            pool.evict_blocks({rng.randrange(pool.num_gpu_blocks)})
        else:
            results.append(pool.reset_prefix_cache())
        results.append(pool.take_events())
    return results


@pytest.mark.skipif(_ckernel is None, reason="shmkv.pool._ckernel is not built")
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kernels_write_identical_bytes_with_aliases(seed):
    pools = [
        BlockPool.create(unique_pool_name(), 61, hash_block_size=HBS, partial_keys=True,
                         enable_kv_cache_events=True, kernel=k)
        for k in ("python", "c")
    ]
    try:
        outcomes = [_partial_workload(p, random.Random(seed)) for p in pools]
        assert outcomes[0] == outcomes[1]
        lay = pools[0].layout
        regions = ("block_meta", "block_alias", "index_buckets", "ledger")
        images = [b"".join(bytes(lay.view(p._segment.buf, r)) for r in regions) for p in pools]
        assert images[0] == images[1]
        num_aliases = int((pools[0]._key_rows["hash_num_tokens"][lay.alias_row(0):] != 0).sum())
        assert num_aliases > 0  # the workload leaves some aliases behind
        for p in pools:
            p.check_invariants()
    finally:
        for p in pools:
            name = p.pool_name
            p.close()
            BlockPool.unlink(name)


def test_layout_of_alias_rows():
    from shmkv.pool import layout as L

    lay = L.Layout.from_config(L.PoolConfig(num_blocks=10, hash_block_size=HBS, partial_keys=True,
                                            journal_entries=4096))
    assert lay.shapes["block_alias"] == (10,)
    assert lay.config.format_flags & L.FLAG_PARTIAL_KEYS
    # The alias rows follow the block rows and the two sentinels with no gap: key rows.
    assert lay.offsets["block_alias"] == lay.offsets["block_meta"] + 64 * 12
    assert lay.num_key_rows == 22 and lay.alias_row(3) == 15
    plain = L.Layout.from_config(L.PoolConfig(num_blocks=10, hash_block_size=HBS,
                                              journal_entries=4096))
    assert plain.shapes["block_alias"] == (0,) and plain.num_key_rows == 12
    assert lay.total_bytes - plain.total_bytes == 640
    # By default the journal has room for alias evictions too.
    assert L.PoolConfig(num_blocks=10, hash_block_size=HBS, partial_keys=True).journal_entries \
        > L.PoolConfig(num_blocks=10, hash_block_size=HBS).journal_entries
