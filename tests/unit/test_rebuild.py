"""rebuild(): every derived structure (ref counts, free queue, index chains) rewritten from
the authoritative ones (ledger, hash fields, queue keys) gives back the same pool."""

from __future__ import annotations

import random

import numpy as np

from shmkv import layout as L
from shmkv.recovery import rebuild
from tests.helpers import make_request


def _workload(pool, seed: int):
    rng = random.Random(seed)
    held = []
    for i in range(60):
        req = make_request(rng.randint(1, 6) * 16 + rng.randint(0, 15),
                           first_token=rng.choice([0, 0, 500, 900 + i]))
        hits = pool.get_cached_prefix(req.block_hashes)
        pool.touch(hits)
        need = -(-len(req.all_token_ids) // 16) - len(hits)
        try:
            blocks = hits + pool.get_new_blocks(need)
        except ValueError:
            pool.free_blocks(reversed(hits))
            continue
        pool.cache_full_blocks(req, blocks, len(hits), len(req.block_hashes), 16, 0)
        held.append(blocks)
        if rng.random() < 0.6:
            pool.free_blocks(reversed(held.pop(rng.randrange(len(held)))))
    return held


def _state(pool):
    keys = {}
    for b in pool.blocks:
        if b.block_hash is not None:
            keys.setdefault(b.block_hash, []).append(b.block_id)
    return {
        "ref": [b.ref_cnt for b in pool.blocks],
        "free": pool.get_free_block_ids(),
        "keys": keys,
    }


def test_rebuild_restores_a_scrambled_pool(make_pool):
    """Scramble ref counts, links, counters and chains; rebuild gives back the same refs,
    the same free-queue order and the same keys; lookups find the lowest block of a key."""
    pool = make_pool(64)
    held = _workload(pool, 1)
    before = _state(pool)
    assert before["keys"], "the workload cached nothing"
    blocks = pool._blocks
    rng = np.random.default_rng(0)
    blocks["ref_cnt"][:64] = rng.integers(0, 3, 64)
    blocks["prev"] = rng.integers(-1, 66, 66)
    blocks["next"] = rng.integers(-1, 66, 66)
    blocks["index_next"] = rng.integers(-1, 64, 66)
    pool.layout.view(pool._segment.buf, "index_buckets")[:] = L.NO_BLOCK
    pool._hdr64[L.H_NUM_FREE] = 3
    epoch = int(pool._hdr64[L.H_EPOCH])
    with pool.lock():
        report = rebuild(pool)
    pool.check_invariants()
    after = _state(pool)
    assert after["ref"] == before["ref"]
    assert after["free"] == before["free"]
    assert after["keys"] == before["keys"]
    for key, ids in before["keys"].items():
        found = pool.get_cached_block(key[:32], [int.from_bytes(key[32:], "big")])
        assert found[0].block_id == min(ids)
    assert report.num_free_blocks == len(before["free"])
    assert report.num_cached_blocks == sum(len(v) for v in before["keys"].values())
    assert int(pool._hdr64[L.H_EPOCH]) == epoch + 1
    for blocks_of_request in held:  # and the pool keeps working
        pool.free_blocks(reversed(blocks_of_request))
    assert len(pool.get_new_blocks(63)) == 63
    pool.check_invariants()


def test_rebuild_takes_ref_counts_from_the_ledger(make_pool):
    """A ref_cnt that disagrees with the ledger is corrected and counted."""
    pool = make_pool(16)
    blocks = pool.get_new_blocks(3)
    pool._blocks["ref_cnt"][blocks[1].block_id] = 0
    pool._blocks["ref_cnt"][blocks[2].block_id] = 5
    with pool.lock():
        report = rebuild(pool)
    assert report.ref_cnt_fixed == 2
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    pool.check_invariants()
