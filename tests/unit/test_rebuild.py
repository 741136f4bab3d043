"""rebuild(): every derived structure (ref counts, free queue, index chains) rewritten from
the authoritative ones (ledger, hash fields, queue keys) gives back the same pool."""

from __future__ import annotations

import random

import numpy as np
import pytest

from shmkv.pool import layout as L
from shmkv.pool.recovery import RebuildReport, _packed_sort, _place_by_key, _sort_by_key, rebuild
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


# ------------------------------------------------------------ against the plain algorithm


def _reference_rebuild(pool) -> RebuildReport:
    """rebuild() as first written: one numpy pass per field, every field rewritten, the free
    queue ordered by a stable argsort of the keys: rebuild() must leave the same bytes."""
    lay = pool._layout
    n = lay.config.num_blocks
    blocks, hdr = pool._blocks, pool._hdr64
    ref = pool._ledger[pool._procs["state"] == L.SLOT_ACTIVE].sum(axis=0, dtype=np.int32)
    ref[L.NULL_BLOCK_ID] = 0
    ref_fixed = int(np.count_nonzero(blocks["ref_cnt"][:n] != ref))
    blocks["ref_cnt"][:n] = ref
    free = np.flatnonzero(ref == 0)
    free = free[free != L.NULL_BLOCK_ID]
    order = free[np.argsort(blocks["queue_key"][free], kind="stable")]
    chain = np.concatenate(([lay.free_head], order, [lay.free_tail]))
    for field, src, dst in (("next", chain[:-1], chain[1:]), ("prev", chain[1:], chain[:-1])):
        links = np.full(n + 2, L.NO_BLOCK, dtype=np.int32)
        links[src] = dst
        blocks[field] = links
    blocks["queue_key"][order] = np.arange(len(order))
    hdr[L.H_NUM_FREE] = len(order)
    hdr[L.H_QUEUE_HEAD_KEY], hdr[L.H_QUEUE_TAIL_KEY] = 0, len(order) - 1
    htok = blocks["hash_num_tokens"][:n].copy()
    invalid = htok < 0
    invalid[L.NULL_BLOCK_ID] |= htok[L.NULL_BLOCK_ID] != L.NO_HASH_TOKENS
    dropped = [(bytes(blocks["block_hash"][b]), int(blocks["group_id"][b]))
               for b in np.flatnonzero(invalid).tolist()]
    htok[invalid] = L.NO_HASH_TOKENS
    blocks["hash_num_tokens"][:n] = htok
    blocks["group_id"][:n][htok == L.NO_HASH_TOKENS] = 0
    chain_next = np.full(n + 2, L.NO_BLOCK, dtype=np.int32)
    buckets = lay.view(pool._segment.buf, "index_buckets")
    buckets[:] = L.NO_BLOCK
    for b in np.flatnonzero(htok != L.NO_HASH_TOKENS).tolist():  # block-id order
        bucket = pool._index.bucket_of(*pool._index.block_key(b))
        if buckets[bucket] == L.NO_BLOCK:
            buckets[bucket] = b
        else:
            last = int(buckets[bucket])
            while chain_next[last] != L.NO_BLOCK:
                last = int(chain_next[last])
            chain_next[last] = b
    blocks["index_next"] = chain_next
    hdr[L.H_EPOCH] += 1
    return RebuildReport(ref_fixed, len(order), int(np.count_nonzero(htok)),
                         int(np.count_nonzero(invalid)), 0.0, dropped)


def _damage(pool, kind: str, rng: np.random.Generator) -> None:
    n = pool.num_gpu_blocks
    blocks = pool._blocks
    if kind == "links":  # every derived field scrambled
        blocks["ref_cnt"][:n] = rng.integers(-2, 4, n)
        for field in ("prev", "next", "index_next"):
            blocks[field] = rng.integers(-1, n + 2, n + 2)
        buckets = pool.layout.view(pool._segment.buf, "index_buckets")
        buckets[:] = rng.integers(-1, n, len(buckets))
        pool._hdr64[L.H_NUM_FREE] = 3
    elif kind == "hash_fields":  # negative token counts, a key on the null block, stray groups
        blocks["hash_num_tokens"][rng.integers(1, n, 4)] = -3
        blocks["hash_num_tokens"][L.NULL_BLOCK_ID] = 16
        blocks["group_id"][rng.integers(0, n, 4)] = rng.integers(1, 5, 4)
    elif kind == "duplicate_keys":  # few distinct keys: placement fails, the sort decides ties
        blocks["queue_key"][:n] = rng.integers(0, 4, n)
    elif kind == "wide_keys":  # distinct, spread far apart: the packed sort
        blocks["queue_key"][:n] = rng.permutation(n) * 1_000_003 - 10**12
    elif kind == "huge_keys":  # a span beyond 63 bits: the argsort
        blocks["queue_key"][rng.integers(0, n, 3)] = [2**62, -(2**62), 2**63 - 1]
    elif kind == "dense_keys":  # already 0..k-1 in block-id order: nothing to renumber
        free = np.flatnonzero(blocks["ref_cnt"][:n] == 0)[1:]
        blocks["queue_key"][free] = np.arange(len(free))
    elif kind == "ledger":  # the ledger disagrees with ref_cnt
        pool._ledger[pool.slot, rng.integers(1, n, 5)] += 1
    elif kind == "no_keys":  # nothing cached: the index is emptied
        blocks["hash_num_tokens"][:n] = L.NO_HASH_TOKENS


DAMAGE = ["none", "links", "hash_fields", "duplicate_keys", "wide_keys", "huge_keys",
          "dense_keys", "ledger", "no_keys"]


@pytest.mark.parametrize("kind", DAMAGE)
@pytest.mark.parametrize("seed", [1, 2])
def test_rebuild_matches_the_plain_algorithm(make_pool, kind, seed):
    """On a worked pool, damaged one way, rebuild leaves the same bytes and reports the same
    counts as the plain per-field algorithm, whichever fast path each part takes."""
    pool = make_pool(96)
    _workload(pool, seed)
    _damage(pool, kind, np.random.default_rng(seed))
    size = pool.layout.total_bytes
    damaged = bytes(pool._segment.buf[:size])
    with pool.lock():
        want_report = _reference_rebuild(pool)
    want = bytes(pool._segment.buf[:size])
    pool._segment.buf[:size] = damaged
    with pool.lock():
        report = rebuild(pool)
    assert bytes(pool._segment.buf[:size]) == want
    assert {**vars(report), "seconds": 0.0} == vars(want_report)
    pool.check_invariants()


def test_rebuild_of_a_rebuilt_pool_changes_no_row(make_pool):
    """A second rebuild finds every derived field right: the rows stay as they are."""
    pool = make_pool(64)
    _workload(pool, 3)
    with pool.lock():
        rebuild(pool)
        before = pool._blocks.copy()
        report = rebuild(pool)
    assert report.ref_cnt_fixed == 0 and report.hashes_dropped == 0
    assert pool._blocks.tobytes() == before.tobytes()
    pool.check_invariants()


def test_rebuild_with_duplicate_keys_gives_a_valid_queue(make_pool):
    """Equal queue keys (a damaged pool) still give a valid queue: by key, ties by block id,
    the keys renumbered 0..k-1."""
    pool = make_pool(32)
    pool.get_new_blocks(5)
    n = pool.num_gpu_blocks
    keys = pool._blocks["queue_key"]
    keys[:n] = np.arange(n) % 3
    free = [b for b in range(1, n) if pool._blocks["ref_cnt"][b] == 0]
    want = sorted(free, key=lambda b: (int(keys[b]), b))
    with pool.lock():
        rebuild(pool)
    assert pool.get_free_block_ids() == want
    assert [int(keys[b]) for b in want] == list(range(len(want)))
    pool.check_invariants()


def _stable(ids, keys):
    return ids[np.argsort(keys, kind="stable")]


def test_the_three_sorts_agree():
    """Placement (distinct keys in a narrow span), the packed sort and the stable argsort give
    the same order; placement gives up on equal keys; the packed sort breaks ties by id."""
    rng = np.random.default_rng(0)
    ids = np.sort(rng.choice(np.arange(1, 5000), 1000, replace=False))
    for keys in (rng.permutation(1000) + 7, rng.choice(1900, 1000, replace=False) - 500):
        want = _stable(ids, keys)
        placed = _place_by_key(ids, keys.copy(), int(keys.min()), int(np.ptp(keys)) + 1)
        assert placed.tolist() == want.tolist()
        id_bits = int(ids[-1]).bit_length()
        packed = _packed_sort(ids, keys.copy(), int(keys.min()), id_bits)
        assert packed.tolist() == want.tolist()
    equal = rng.integers(0, 50, 1000)
    assert _place_by_key(ids, equal, 0, 50) is None
    one_pair = np.arange(1000)
    one_pair[10] = 11  # dense span, one slot left empty
    assert _place_by_key(ids, one_pair, 0, 1000) is None
    assert one_pair[10] == 11 and one_pair[999] == 999  # keys handed back as they came
    assert _packed_sort(ids, equal.copy(), 0, 13).tolist() == _stable(ids, equal).tolist()


@pytest.mark.parametrize("keys, numbered", [
    (np.arange(1000)[::-1], True),  # 0..k-1: placement, nothing to renumber
    (np.arange(1000) + 5, False),  # dense but shifted: placement
    (np.arange(1000) * 3, False),  # wider than twice their number: packed sort
    (np.arange(1000) % 7, False),  # equal keys: placement fails, packed sort
    (np.arange(1000) * (2**52), False),  # too wide to pack beside 10-bit ids: argsort
])
def test_sort_by_key_paths(keys, numbered):
    ids = np.arange(1, 1001)
    want = _stable(ids, keys)
    order, got_numbered = _sort_by_key(ids, keys.astype(np.int64))
    assert order.tolist() == want.tolist()
    assert got_numbered == numbered


def test_a_rebuild_cut_short_is_done_again_by_the_next_hold(make_pool):
    """rebuild marks the journal overflowed while it works, so a process killed in the
    middle of it leaves the whole rebuild to the next hold (the lock's repair); when it
    finishes, the journal is empty."""
    from shmkv.pool import layout as L
    from shmkv.pool.recovery import rebuild

    pool = make_pool(64)
    held = pool.get_new_blocks(5)
    with pool.lock():
        rebuild(pool)
        assert pool._hdr64[L.H_JOURNAL_LEN] == 0
    # A rebuild killed half way: the overflow mark stays, and a ref count is wrong.
    pool._hdr64[L.H_JOURNAL_LEN] = L.JOURNAL_OVERFLOWED
    pool._blocks["ref_cnt"][held[0].block_id] = 7
    assert pool.get_num_free_blocks() == 58  # a plain read: no hold, no repair
    pool.free_blocks(held[1:])  # this hold's acquire rebuilds first
    assert pool.last_repair.rebuilt and not pool.last_repair.took_over
    assert held[0].ref_cnt == 1
    pool.check_invariants()


def test_repair_logs_the_keys_a_rebuild_drops_and_bumps_the_epoch(make_pool):
    """repair() on a pool with an invalid hash field rebuilds; the dropped key appears in
    the event log as a BlockRemoved (subscribers must forget it too) and the epoch moves."""
    from shmkv.events import BlockRemoved, external_block_hash, use_int_block_hashes
    from shmkv.pool import layout as L
    from tests.helpers import make_request

    pool = make_pool(32, enable_kv_cache_events=True)
    req = make_request(32)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, 2, 16, 0)
    pool.take_events()
    cursor = pool.event_cursor(from_start=False)
    epoch = int(pool._hdr64[L.H_EPOCH])
    pool._blocks["hash_num_tokens"][blocks[1].block_id] = -5  # damaged
    report = pool.repair()
    assert report["rebuilt"].hashes_dropped == 1
    assert [v.split(":")[0] for v in report["violations_found"]].count("INV-HASH") >= 1
    assert report["violations_left"] == [] and report["epoch"] > epoch
    logged = [e.event for e in pool.read_events(cursor)[0]]
    want = external_block_hash(req.block_hashes[1], use_int_block_hashes())
    assert logged == [BlockRemoved(block_hashes=[want], medium="GPU", group_idx=0)]
    assert blocks[1].block_hash is None and blocks[0].block_hash is not None
    pool.check_invariants()


def test_a_hold_that_outgrows_the_journal_is_repaired_by_rebuild(make_pool):
    """A hold that changes more words than the journal has entries marks it overflowed and
    goes on; a process that dies then leaves the overflow mark, and the next hold rebuilds
    every derived structure from the ledger and the blocks' own fields (the hold's effects
    stand: they are not rolled back word for word)."""
    from shmkv.pool import layout as L

    pool = make_pool(256, journal_entries=64)
    with pool.lock():
        held = pool.get_new_blocks(200)
        assert pool._hdr64[L.H_JOURNAL_LEN] == L.JOURNAL_OVERFLOWED
        pool.free_blocks(held[100:])
    # Died before its commit: the mark stays, and one derived word is off.
    pool._hdr64[L.H_JOURNAL_LEN] = L.JOURNAL_OVERFLOWED
    pool._blocks["ref_cnt"][held[0].block_id] = 9
    pool.touch([])  # any hold: its acquire repairs first
    assert pool.last_repair.rebuilt and pool.last_repair.journal_entries_undone == 0
    assert held[0].ref_cnt == 1 and pool.get_num_free_blocks() == 255 - 100
    assert pool._hdr64[L.H_JOURNAL_LEN] == 0
    pool.check_invariants()
