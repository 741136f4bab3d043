"""Tests of the invariant checker itself (shmkv/pool/recovery.py).

Each test builds a realistic pool with the public API, corrupts one thing in the shared
arrays on purpose, and asserts that ``check_invariants`` raises ``InvariantViolation`` naming
the right invariant id (and, where the corruption touches only one invariant, no other id).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

import numpy as np
import pytest

import shmkv.pool.recovery
from shmkv import BlockPool, InvariantViolation, SegmentError
from shmkv.errors import LayoutMismatchError
from shmkv.pool import layout as L
from tests.helpers import make_request, segment_image

ALL_IDS = {"INV-HDR", "INV-FREE", "INV-QKEY", "INV-REF", "INV-CONSERVE", "INV-HASH",
           "INV-ALIAS", "INV-LEDGER", "INV-PROC", "INV-LOG", "INV-JOURNAL"}


# ----------------------------------------------------------------------------- helpers


@dataclass
class Scene:
    """A pool in a realistic state, and which blocks are where in it."""

    pool: BlockPool
    queue: list[int]  # free queue, head to tail
    free_hashed: list[int]  # in the queue, holding a key
    free_unhashed: list[int]
    held_hashed: list[int]  # ref_cnt > 0, holding a key
    held_unhashed: list[int]

    @property
    def blocks(self) -> np.ndarray:
        return self.pool._blocks

    @property
    def buckets(self) -> np.ndarray:
        return self.pool._layout.view(self.pool._segment.buf, "index_buckets")

    @property
    def header(self) -> np.ndarray:
        return self.pool._layout.view(self.pool._segment.buf, "header")


def build_scene(pool: BlockPool) -> Scene:
    """Two requests cached, one freed, one cache hit touched back out of the queue."""
    a = make_request(80)  # 5 full blocks
    blocks_a = pool.get_new_blocks(6)  # 5 full + 1 partial
    pool.cache_full_blocks(a, blocks_a, 0, 5, 16, 0)
    b = make_request(40, first_token=1000)  # 2 full blocks
    blocks_b = pool.get_new_blocks(3)
    pool.cache_full_blocks(b, blocks_b, 0, 2, 16, 0)
    pool.free_blocks(reversed(blocks_a))  # partial to the front, hashed ones to the back
    hit = pool.get_cached_block(a.block_hashes[0], [0])
    assert hit is not None
    pool.touch(hit)  # a cache hit taken out of the middle of the queue
    pool.check_invariants()

    queue = pool.get_free_block_ids()
    real = range(1, pool.num_gpu_blocks)
    hashed = {i for i in real if pool.blocks[i].block_hash is not None}
    held = [i for i in real if pool.blocks[i].ref_cnt > 0]
    scene = Scene(
        pool=pool,
        queue=queue,
        free_hashed=[i for i in queue if i in hashed],
        free_unhashed=[i for i in queue if i not in hashed],
        held_hashed=[i for i in held if i in hashed],
        held_unhashed=[i for i in held if i not in hashed],
    )
    # Every category is populated, so each corruption below has a target.
    assert len(scene.queue) >= 4 and scene.free_hashed and scene.free_unhashed
    assert scene.held_hashed and scene.held_unhashed
    return scene


@pytest.fixture
def scene(make_pool) -> Scene:
    return build_scene(make_pool(16))


def violations(pool: BlockPool) -> list[str]:
    with pytest.raises(InvariantViolation) as info:
        pool.check_invariants()
    assert info.value.violations, "InvariantViolation raised with no violations"
    return info.value.violations


def ids_of(found: list[str]) -> set[str]:
    return {v.split(":", 1)[0] for v in found}


def assert_reports(pool: BlockPool, *, exactly=None, includes=(), excludes=(), message=None):
    """Runs the checker; checks the reported ids (and optionally a message substring)."""
    found = violations(pool)
    got = ids_of(found)
    assert got <= ALL_IDS, found
    if exactly is not None:
        assert got == set(exactly), found
    assert set(includes) <= got, found
    assert not got & set(excludes), found
    if message is not None:
        assert any(message in v for v in found), found
    return found


def chain_tail(scene: Scene) -> int:
    """A hashed block at the end of its bucket chain."""
    nxt = scene.blocks["index_next"]
    return next(b for b in scene.held_hashed + scene.free_hashed if nxt[b] == L.NO_BLOCK)


def unchain(scene: Scene, block_id: int) -> int:
    """Unlinks a block from its bucket chain but leaves its key; returns the bucket."""
    pool, nxt, buckets = scene.pool, scene.blocks["index_next"], scene.buckets
    bucket = pool._index.bucket_of(*pool._index.block_key(block_id))
    if buckets[bucket] == block_id:
        buckets[bucket] = nxt[block_id]
    else:
        cur = int(buckets[bucket])
        while nxt[cur] != block_id:
            cur = int(nxt[cur])
        nxt[cur] = nxt[block_id]
    nxt[block_id] = L.NO_BLOCK
    return bucket


# ----------------------------------------------------------------------------- catalogue


def test_catalogue_ids_are_the_ones_tested():
    """The ids in recovery.py's catalogue are exactly the ones this module tests."""
    assert set(re.findall(r"\*\*(INV-[A-Z]+)\*\*", shmkv.pool.recovery.__doc__)) == ALL_IDS


def test_healthy_scene_passes(scene):
    """The realistic scene every corruption test starts from passes the checker."""
    scene.pool.check_invariants()


def test_check_on_healthy_pool_writes_nothing(scene):
    """A passing check leaves the segment byte-for-byte unchanged."""
    before = segment_image(scene.pool)
    scene.pool.check_invariants()
    assert segment_image(scene.pool) == before


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_healthy_pool_passes_after_long_random_workload(make_pool, seed):
    """A pool driven by a long random mix of every public call passes after each step."""
    rng = random.Random(seed)
    pool = make_pool(64, enable_kv_cache_events=True)
    prefixes = [rng.randrange(10_000) * 1000 for _ in range(4)]  # shared prefixes: hits
    live: list[list] = []
    steps = 0
    for _ in range(400):
        op = rng.random()
        if op < 0.5:
            num_tokens = rng.randrange(1, 420)  # up to 27 blocks: bulk and small paths
            first = rng.choice(prefixes) if rng.random() < 0.7 else rng.randrange(10**6) * 1000
            req = make_request(num_tokens, first_token=first)
            hits = []
            for h in req.block_hashes:
                got = pool.get_cached_block(h, [0])
                if got is None:
                    break
                hits.append(got[0])
            need = -(-num_tokens // 16) - len(hits)
            if need > pool.get_num_free_blocks() - sum(b.ref_cnt == 0 for b in hits):
                continue
            pool.touch(hits)
            blocks = hits + pool.get_new_blocks(need)
            pool.cache_full_blocks(req, blocks, len(hits), num_tokens // 16, 16, 0)
            live.append(blocks)
        elif op < 0.85 and live:
            blocks = live.pop(rng.randrange(len(live)))
            pool.free_blocks(reversed(blocks))
        elif op < 0.95:
            pool.evict_blocks(rng.sample(range(64), rng.randrange(4)))
        elif not live and rng.random() < 0.5:
            assert pool.reset_prefix_cache()
        pool.check_invariants()
        pool.take_events()
        steps += 1
    for blocks in live:
        pool.free_blocks(reversed(blocks))
    pool.check_invariants()
    assert pool.get_num_free_blocks() == 63
    assert steps > 300


# ----------------------------------------------------------------------------- INV-HDR


@pytest.mark.parametrize(
    "field",
    ["magic", "layout_version", "format_flags", "header_bytes", "total_bytes",
     "num_blocks", "hash_block_size", "num_index_buckets", "block_hash_bytes"],
)
def test_hdr_changed_header_field(scene, field):
    """A changed immutable header field is reported as INV-HDR, naming the field."""
    hdr = scene.header
    hdr[field] = int(hdr[field][0]) ^ 2
    assert_reports(scene.pool, exactly={"INV-HDR"}, message=f"header {field} is")


def test_hdr_changed_medium(scene):
    """A medium in the header other than the one attached to is INV-HDR."""
    scene.header["medium"] = b"CPU"
    assert_reports(scene.pool, exactly={"INV-HDR"}, message="header medium is 'CPU'")


@pytest.mark.parametrize("state", [L.STATE_POISONED, L.STATE_INITIALIZING, 0, 99])
def test_hdr_state_not_ready(scene, state):
    """A header state other than READY (POISONED, INITIALIZING, garbage) is INV-HDR."""
    scene.header["state"] = state
    found = assert_reports(scene.pool, exactly={"INV-HDR"}, message="not READY")
    if state == L.STATE_POISONED:
        assert any("state is POISONED" in v for v in found), found


def test_hdr_unchecked_fields_do_not_trigger(scene):
    """Fields outside the config echo (creator pid, epoch) may change without a report."""
    scene.header["creator_pid"] = 1
    scene.header["epoch"] = 77
    scene.pool.check_invariants()


# ----------------------------------------------------------------------------- INV-FREE


def test_free_next_link_skips_a_block(scene):
    """A next link that skips a queued block breaks INV-FREE (and leaks that block)."""
    nxt = scene.blocks["next"]
    b = scene.queue[1]
    nxt[b] = nxt[nxt[b]]
    assert_reports(
        scene.pool, includes={"INV-FREE", "INV-REF"},
        excludes={"INV-HDR", "INV-HASH", "INV-CONSERVE"}, message="num_free_blocks says",
    )


@pytest.mark.parametrize("target", ["out_of_range", "head_sentinel", "no_block"])
def test_free_next_link_out_of_range(scene, target):
    """A next link to a non-block row (garbage, the head sentinel, NO_BLOCK) is INV-FREE."""
    n = scene.pool.num_gpu_blocks
    value = {"out_of_range": n + 7, "head_sentinel": n, "no_block": L.NO_BLOCK}[target]
    scene.blocks["next"][scene.queue[2]] = value
    assert_reports(
        scene.pool, includes={"INV-FREE"}, excludes={"INV-HDR", "INV-HASH"},
        message="not a block or the tail sentinel",
    )


def test_free_prev_link_wrong(scene):
    """A prev link that is not the inverse of next is INV-FREE and nothing else."""
    prev = scene.blocks["prev"]
    b = scene.queue[3]
    prev[b] = scene.queue[0]
    assert_reports(scene.pool, exactly={"INV-FREE"}, message=f"block {b}.prev is {scene.queue[0]}")


def test_free_tail_sentinel_prev_wrong(scene):
    """The tail sentinel's prev not pointing at the last queued block is INV-FREE."""
    scene.blocks["prev"][scene.pool._layout.free_tail] = scene.queue[0]
    assert_reports(scene.pool, exactly={"INV-FREE"}, message="tail sentinel .prev")


def test_free_cycle(scene):
    """A cycle in the queue (last block linking back to the first) is INV-FREE."""
    scene.blocks["next"][scene.queue[-1]] = scene.queue[0]
    assert_reports(scene.pool, exactly={"INV-FREE"}, message="reached twice")


def test_free_short_cycle_leaks_the_rest(scene):
    """A cycle in the middle of the queue is INV-FREE; the blocks cut off show as leaked."""
    scene.blocks["next"][scene.queue[2]] = scene.queue[1]
    assert_reports(
        scene.pool, includes={"INV-FREE", "INV-REF"}, excludes={"INV-HDR", "INV-HASH"},
        message="reached twice",
    )


def test_free_num_free_blocks_counter_wrong(scene):
    """A num_free_blocks header counter off by one breaks INV-FREE and INV-CONSERVE."""
    scene.pool._hdr64[L.H_NUM_FREE] += 1
    assert_reports(
        scene.pool, exactly={"INV-FREE", "INV-CONSERVE"}, message="num_free_blocks says",
    )


def test_free_null_block_linked_into_queue(scene):
    """The null block linked at the head of the queue (with a valid key) is INV-FREE."""
    blocks, hdr64 = scene.blocks, scene.pool._hdr64
    head, first = scene.pool._layout.free_head, scene.queue[0]
    blocks["next"][head], blocks["prev"][0] = 0, head
    blocks["next"][0], blocks["prev"][first] = first, 0
    blocks["queue_key"][0] = blocks["queue_key"][first] - 1
    hdr64[L.H_QUEUE_HEAD_KEY] = int(blocks["queue_key"][0])
    hdr64[L.H_NUM_FREE] += 1
    # Counting the null block as free also breaks conservation; nothing else is wrong.
    assert_reports(
        scene.pool, exactly={"INV-FREE", "INV-CONSERVE"},
        message="the null block (0) is in the free queue",
    )


@pytest.mark.parametrize("link", ["prev", "next"])
def test_free_stray_link_on_allocated_block(scene, link):
    """An allocated block (not queued) with a prev or next link set is INV-FREE only."""
    b = scene.held_unhashed[0]
    scene.blocks[link][b] = scene.queue[0]
    assert_reports(scene.pool, exactly={"INV-FREE"}, message=f"e.g. block {b}")


# ----------------------------------------------------------------------------- INV-QKEY


def test_qkey_not_increasing(scene):
    """Two adjacent queued blocks with swapped queue keys break INV-QKEY only."""
    keys = scene.blocks["queue_key"]
    a, b = scene.queue[1], scene.queue[2]
    keys[a], keys[b] = keys[b], keys[a]
    assert_reports(scene.pool, exactly={"INV-QKEY"}, message="does not increase")


def test_qkey_equal_keys(scene):
    """Two adjacent queued blocks with the same queue key break INV-QKEY (strictly)."""
    keys = scene.blocks["queue_key"]
    keys[scene.queue[2]] = keys[scene.queue[1]]
    assert_reports(scene.pool, exactly={"INV-QKEY"}, message="does not increase")


@pytest.mark.parametrize("end", ["head", "tail"])
def test_qkey_outside_header_range(scene, end):
    """Queue keys beyond the header's [queue_head_key, queue_tail_key] break INV-QKEY."""
    keys = scene.blocks["queue_key"][scene.queue]
    if end == "head":
        scene.pool._hdr64[L.H_QUEUE_HEAD_KEY] = int(keys.min()) + 1
    else:
        scene.pool._hdr64[L.H_QUEUE_TAIL_KEY] = int(keys.max()) - 1
    assert_reports(scene.pool, exactly={"INV-QKEY"}, message="outside the header's")


# ----------------------------------------------------------------------------- INV-REF


def test_ref_negative(scene):
    """A negative ref_cnt on an allocated block is INV-REF (and it no longer counts as used)."""
    b = scene.held_unhashed[0]
    scene.blocks["ref_cnt"][b] = -1
    assert_reports(
        scene.pool, exactly={"INV-REF", "INV-CONSERVE", "INV-LEDGER"},
        message=f"ref_cnt < 0, e.g. block {b} (-1)",
    )


def test_ref_zero_but_not_queued_is_a_leak(scene):
    """An allocated block whose ref_cnt drops to 0 without joining the queue is a leak."""
    b = scene.held_hashed[0]
    scene.blocks["ref_cnt"][b] = 0
    assert_reports(
        scene.pool, exactly={"INV-REF", "INV-CONSERVE", "INV-LEDGER"},
        message=f"(leaked), e.g. block {b}",
    )


def test_ref_queued_with_positive_ref(scene):
    """A block in the free queue with ref_cnt > 0 is INV-REF."""
    b = scene.free_hashed[0]
    scene.blocks["ref_cnt"][b] = 1
    assert_reports(
        scene.pool, exactly={"INV-REF", "INV-CONSERVE", "INV-LEDGER"},
        message=f"in the free queue with ref_cnt != 0, e.g. block {b}",
    )


def test_ref_null_block_nonzero(scene):
    """A null block whose ref_cnt is not 0 is INV-REF and nothing else."""
    scene.blocks["ref_cnt"][0] = 3
    assert_reports(scene.pool, exactly={"INV-REF"}, message="null block's ref_cnt is 3")


# ----------------------------------------------------------------------------- INV-CONSERVE


def test_conserve_block_popped_but_not_referenced(scene):
    """A block unlinked from the queue (counter decremented) but left at ref 0 breaks
    INV-CONSERVE, and INV-REF reports it leaked."""
    pool, blocks = scene.pool, scene.blocks
    head, first = pool._layout.free_head, scene.queue[0]
    second = scene.queue[1]
    blocks["next"][head], blocks["prev"][second] = second, head
    blocks["prev"][first] = blocks["next"][first] = L.NO_BLOCK
    pool._hdr64[L.H_NUM_FREE] -= 1
    assert_reports(
        pool, exactly={"INV-REF", "INV-CONSERVE"}, message="+ blocks in use",
    )


# ----------------------------------------------------------------------------- INV-HASH


def test_hash_chain_points_to_unhashed_block(scene):
    """A bucket chain linking to a block without a key is INV-HASH only."""
    tail, u = chain_tail(scene), scene.held_unhashed[0]
    scene.blocks["index_next"][tail] = u
    # u's own index_next stays NO_BLOCK and its group 0: the only fault is the chain link.
    assert_reports(scene.pool, exactly={"INV-HASH"}, message=f"block {u} is in bucket")


def test_hash_block_in_wrong_bucket(scene):
    """A keyed block chained in another bucket than its key hashes to is INV-HASH only."""
    b = scene.held_hashed[0]
    home = unchain(scene, b)
    buckets = scene.buckets
    other = next(i for i in range(len(buckets)) if i != home and buckets[i] == L.NO_BLOCK)
    buckets[other] = b
    assert_reports(
        scene.pool, exactly={"INV-HASH"},
        message=f"block {b} is chained in bucket {other}, its key hashes to bucket {home}",
    )


def test_hash_hashed_block_in_no_chain(scene):
    """A block holding a key but reachable from no bucket is INV-HASH only."""
    b = scene.free_hashed[0]
    unchain(scene, b)
    assert_reports(scene.pool, exactly={"INV-HASH"}, message="in no chain, e.g. block")


def test_hash_key_set_without_linking(scene):
    """An unhashed block given hash fields but never linked is INV-HASH only."""
    b = scene.held_unhashed[0]
    scene.blocks["hash_num_tokens"][b] = 16
    scene.blocks["block_hash"][b] = bytes(range(32))
    assert_reports(scene.pool, exactly={"INV-HASH"}, message=f"e.g. block {b}")


def test_hash_chain_cycle(scene):
    """A bucket chain that links back to itself is INV-HASH only."""
    tail = chain_tail(scene)
    scene.blocks["index_next"][tail] = tail
    assert_reports(scene.pool, exactly={"INV-HASH"}, message="chain has a cycle")


def test_hash_block_in_two_chains(scene):
    """A keyed block linked from a second bucket too is INV-HASH only."""
    b = scene.held_hashed[0]
    buckets = scene.buckets
    empty = next(i for i in range(len(buckets)) if buckets[i] == L.NO_BLOCK)
    buckets[empty] = b
    assert_reports(scene.pool, exactly={"INV-HASH"}, message=f"block {b} appears 2 times")


def test_hash_bucket_links_out_of_range(scene):
    """A bucket holding a row index that is not a block is INV-HASH only."""
    buckets = scene.buckets
    empty = next(i for i in range(len(buckets)) if buckets[i] == L.NO_BLOCK)
    buckets[empty] = scene.pool.num_gpu_blocks  # the head sentinel row
    assert_reports(scene.pool, exactly={"INV-HASH"}, message="not a block")


def test_hash_null_block_hashed(scene):
    """The null block holding a prefix-cache key is INV-HASH only."""
    scene.blocks["hash_num_tokens"][0] = 16
    scene.blocks["block_hash"][0] = bytes(range(32))
    assert_reports(
        scene.pool, exactly={"INV-HASH"}, message="the null block (0) holds a prefix-cache key",
    )


def test_hash_stray_fields_on_unkeyed_block(scene):
    """A block without a key but with index_next or group_id set is INV-HASH only."""
    b = scene.free_unhashed[0]
    scene.blocks["group_id"][b] = 5
    assert_reports(
        scene.pool, exactly={"INV-HASH"}, message="without a key have index_next or group_id set",
    )


def test_hash_negative_num_tokens(scene):
    """A negative hash_num_tokens is INV-HASH."""
    b = scene.held_unhashed[0]
    scene.blocks["hash_num_tokens"][b] = -16
    assert_reports(scene.pool, includes={"INV-HASH"}, message="hash_num_tokens < 0")


# ----------------------------------------------------------------------------- reporting


def test_every_violation_is_collected(scene):
    """Independent corruptions in different regions are all reported in one exception."""
    scene.header["hash_block_size"] = 32
    keys = scene.blocks["queue_key"]
    keys[scene.queue[1]], keys[scene.queue[2]] = keys[scene.queue[2]], keys[scene.queue[1]]
    scene.blocks["index_next"][chain_tail(scene)] = chain_tail(scene)
    with pytest.raises(InvariantViolation) as info:
        scene.pool.check_invariants()
    found = info.value.violations
    assert ids_of(found) == {"INV-HDR", "INV-QKEY", "INV-HASH"}, found
    assert str(info.value).startswith(f"{len(found)} invariant violation(s):")
    assert all(v in str(info.value) for v in found)


def test_violation_poisons_segment_and_attach_refuses(scene):
    """A failed check marks the segment POISONED, and a later attach refuses it."""
    pool = scene.pool
    scene.blocks["ref_cnt"][scene.held_unhashed[0]] = -1
    violations(pool)
    assert int(scene.header["state"][0]) == L.STATE_POISONED
    with pytest.raises(SegmentError, match="POISONED") as info:
        BlockPool.attach(pool.pool_name)
    assert not isinstance(info.value, LayoutMismatchError)
    # Repairing the block does not clear the poison: the checker still reports the state.
    scene.blocks["ref_cnt"][scene.held_unhashed[0]] = 1
    assert_reports(pool, exactly={"INV-HDR"}, message="state is POISONED")


# ----------------------------------------------------------------------------- INV-JOURNAL
# A non-empty journal at the start of a hold means a dead hold, which the lock repairs
# before anything else; so these corrupt it, and check, inside one hold.


def test_journal_length_out_of_range(scene):
    pool = scene.pool
    with pool.lock():
        pool._hdr64[L.H_JOURNAL_LEN] = pool.layout.config.journal_entries + 1
        assert_reports(pool, exactly={"INV-JOURNAL"}, message="outside [0,")
        pool._hdr64[L.H_JOURNAL_LEN] = 0


def test_journal_entry_outside_the_segment(scene):
    pool = scene.pool
    entries = pool.layout.view(pool._segment.buf, "journal")
    with pool.lock():
        entries[0] = ((pool.layout.total_bytes << 4) | 8, 0)
        pool._hdr64[L.H_JOURNAL_LEN] = 1
        assert_reports(pool, exactly={"INV-JOURNAL"}, message="entry 0 names 8 byte(s)")
        pool._hdr64[L.H_JOURNAL_LEN] = 0


def test_journal_entry_in_the_immutable_header(scene):
    pool = scene.pool
    entries = pool.layout.view(pool._segment.buf, "journal")
    with pool.lock():
        entries[0] = ((8 << 4) | 4, 0)  # layout_version
        pool._hdr64[L.H_JOURNAL_LEN] = 1
        assert_reports(pool, exactly={"INV-JOURNAL"}, message="mutable part")
        pool._hdr64[L.H_JOURNAL_LEN] = 0


def test_journal_bad_lock_phase(scene):
    scene.pool._procs["lock_phase"][3] = 7  # a free slot's row
    assert_reports(scene.pool, exactly={"INV-JOURNAL"}, message="slot 3 has lock_phase 7")


def test_a_hold_that_finds_the_journal_non_empty_rolls_it_back(scene):
    """What the crash tests rely on, in one process: journal entries a hold left without
    committing are undone by the next acquire, which restores every word they name."""
    pool = scene.pool
    queue = pool.get_free_block_ids()
    refs = pool._blocks["ref_cnt"].copy()
    ledger = pool._ledger.copy()
    with pool.lock():
        pool.get_new_blocks(2)
        pool.free_blocks(pool.get_new_blocks(1))
        left = int(pool._hdr64[L.H_JOURNAL_LEN])
        assert left > 0
    # The release committed (journal_len = 0); a hold killed before its commit leaves this:
    pool._hdr64[L.H_JOURNAL_LEN] = left
    assert pool.get_free_block_ids() == queue  # this call's acquire rolled the hold back
    assert (pool._blocks["ref_cnt"] == refs).all() and (pool._ledger == ledger).all()
    assert pool.last_repair.journal_entries_undone == left
    assert not pool.last_repair.took_over
    pool.check_invariants()


def test_a_repair_cut_short_at_any_word_is_finished_by_the_next_hold(scene):
    """A repairer killed half way through its undo has written back some of the words the
    dead hold changed, in whatever order, and left ``journal_len`` as it was. The next hold
    must end where a whole repair would: the undo restores each word's value from before the
    hold (its earliest entry), not a change relative to what is there now."""
    import numpy as np

    pool = scene.pool
    rng = np.random.default_rng(7)
    queue = pool.get_free_block_ids()
    blocks, ledger = pool._blocks.tobytes(), pool._ledger.copy()
    seg32 = np.frombuffer(pool._segment.buf, dtype="<i4")
    seg64 = np.frombuffer(pool._segment.buf, dtype="<i8")
    for _ in range(20):
        with pool.lock():
            pool.free_blocks(pool.get_new_blocks(3)[1:])
            pool.get_new_blocks(2)
            left = int(pool._hdr64[L.H_JOURNAL_LEN])
        pool._hdr64[L.H_JOURNAL_LEN] = left  # the dead hold, uncommitted
        entries = pool.layout.view(pool._segment.buf, "journal")[:left]
        where, first = np.unique(entries["where"], return_index=True)
        done = rng.permutation(len(where))[:rng.integers(0, len(where) + 1)]
        for i in done:  # what the first repairer wrote back before it died
            offset, width, old = int(where[i] >> 4), int(where[i] & 15), entries["old"][first[i]]
            if width == 4:
                seg32[offset >> 2] = old
            else:
                seg64[offset >> 3] = old
        assert pool.get_free_block_ids() == queue  # this acquire finished the repair
        assert pool._blocks.tobytes() == blocks and (pool._ledger == ledger).all()
        assert pool.last_repair.journal_entries_undone == left
        pool.check_invariants()
