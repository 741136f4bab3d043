"""BlockPool.unpin_blocks: vLLM's call for blocks a reader still streams from. One reference
less each; blocks reaching ref_cnt 0 join the free queue's tail, hashed or not (the last to be
evicted, counted as free); the caller's ``on_reuse`` fires when ``get_new_blocks`` hands the
block out again or ``reset_prefix_cache`` succeeds. Both kernels, against vLLM's own pool where
vLLM is installed; bad input changes nothing."""

from __future__ import annotations

import pytest

from shmkv import BlockPool
from shmkv.errors import UsageError
from tests.helpers import make_request


def _drive(pool, hashes_request):
    """The same calls on either pool; returns what the caller observes."""
    seen: list[tuple[str, int]] = []
    out: dict = {}
    blocks = pool.get_new_blocks(6)  # ids 1..6
    pool.cache_full_blocks(hashes_request, blocks, 0, 2, 16, 0)  # 1 and 2 hashed
    pool.touch([blocks[0]])  # block 1: ref_cnt 2
    # Unpin 1 (still held once more), 3 (unhashed: to the tail, not the head) and 2 (hashed).
    pool.unpin_blocks([blocks[0], blocks[2], blocks[1]], lambda b: seen.append(("a", b.block_id)))
    out["refs"] = [b.ref_cnt for b in blocks]
    out["queue"] = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
    out["num_free"] = pool.get_num_free_blocks()
    pool.free_blocks([blocks[3]])  # an unhashed block freed the usual way: to the head
    out["queue2"] = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
    # Taking every free block reaches the unpinned ones last; their callbacks fire then.
    taken = pool.get_new_blocks(pool.get_num_free_blocks() - 2)
    out["seen_before_last"] = list(seen)
    taken += pool.get_new_blocks(2)
    out["seen"] = list(seen)
    out["taken"] = [b.block_id for b in taken]
    pool.free_blocks(taken + [blocks[0], blocks[4], blocks[5]])
    # A block unpinned and never reused is reported by a successful reset.
    again = pool.get_new_blocks(1)
    pool.unpin_blocks(again, lambda b: seen.append(("reset", b.block_id)))
    out["reset"] = pool.reset_prefix_cache()
    out["seen_after_reset"] = list(seen)
    return out


def test_unpin_blocks_observations(make_checked_pool):
    """Exact queue order, ref counts and callbacks (the values vLLM's pool gives)."""
    pool = make_checked_pool(12)
    out = _drive(pool, make_request(32))
    assert out["refs"] == [1, 0, 0, 1, 1, 1]
    # 7..11 never used, then the unpinned 3 and 2 at the tail, in the call's order.
    assert out["queue"] == [7, 8, 9, 10, 11, 3, 2]
    assert out["num_free"] == 7
    assert out["queue2"] == [4, 7, 8, 9, 10, 11, 3, 2]
    assert out["seen_before_last"] == []
    assert out["seen"] == [("a", 3), ("a", 2)]
    assert out["reset"] is True
    assert out["seen_after_reset"][-1][0] == "reset"
    pool.check_invariants()


def test_unpin_blocks_matches_vllm(make_pool):
    """vLLM's BlockPool, driven by the same calls, observes the same."""
    vbp = pytest.importorskip("vllm.v1.core.block_pool")
    pytest.importorskip("vllm.v1.core.kv_cache_utils")
    ours = make_pool(12)
    theirs = vbp.BlockPool(12, True, 16)
    request = make_request(32)
    assert _drive(ours, request) == _drive(theirs, request)
    ours.check_invariants()


def _state(pool):
    with pool.lock():
        return (bytes(pool.block_rows()), pool.get_free_block_ids(),
                bytes(pool.layout.view(pool._segment.buf, "ledger")))


@pytest.mark.parametrize("case", ["null", "twice", "freed", "other_process", "not_handle",
                                  "callback"])
def test_bad_unpin_changes_nothing(make_pool, case):
    """Each bad call is a UsageError naming unpin_blocks and leaves the pool as it was, with
    no callback registered."""
    pool = make_pool(12)
    held = pool.get_new_blocks(3)
    pool.cache_full_blocks(make_request(32), held, 0, 2, 16, 0)
    other = BlockPool.attach(pool.pool_name, kernel=pool.kernel)
    try:
        theirs = other.get_new_blocks(1)
        pool.free_blocks([held[2]])
        args = {
            "null": ([held[0], pool.null_block], "block 0 is the null block"),
            "twice": ([held[0], held[1], held[1]], "block 2 has ref_cnt 1 but is unpinned 2"),
            "freed": ([held[0], held[2]], "block 3 has ref_cnt 0 but is unpinned 1"),
            "other_process": ([held[0], pool.blocks[theirs[0].block_id]],
                              "block 4 is unpinned 1 time.s. but this process holds 0"),
            "not_handle": ([held[0], 5], "takes KVCacheBlock handles"),
            "callback": ([held[0]], "on_reuse must be callable"),
        }[case]
        before = _state(pool)
        with pytest.raises(UsageError, match="unpin_blocks\\(\\): " if case != "not_handle"
                           else "unpin_blocks"):
            pool.unpin_blocks(args[0], None if case == "callback" else print)
        assert _state(pool) == before
        assert pool._reuse_watchers == {}
        with pytest.raises(UsageError, match=args[1]):
            pool.unpin_blocks(args[0], None if case == "callback" else print)
        pool.check_invariants()
        other.free_blocks(theirs)
    finally:
        other.close()
    pool.check_invariants()
