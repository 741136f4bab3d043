"""FreeKVCacheBlockQueue on int32 links: pointer-exact tests, in the style of vLLM's
test_kv_cache_utils. The queue is driven directly here (ref counts are not maintained), so
only the queue invariants are checked, not the whole pool."""

from __future__ import annotations

import pytest

from shmkv import OutOfBlocksError, UsageError
from shmkv.pool.layout import NO_BLOCK
from shmkv.pool.recovery import collect_violations
from tests.helpers import segment_image


def links(pool, block_id):
    row = pool._blocks[block_id]
    return int(row["prev"]), int(row["next"])


def _assert_queue(pool, expected: list[int], label: str) -> None:
    q = pool.free_block_queue
    head, tail = q.head, q.tail
    assert q.get_all_free_block_ids() == expected, label
    assert q.num_free_blocks == len(expected), label
    chain = [head, *expected, tail]
    for before, block, after in zip(chain, chain[1:], chain[2:], strict=False):
        assert links(pool, block) == (before, after), f"{label}: links of {block}"
    assert links(pool, head)[1] == chain[1], label
    assert links(pool, tail)[0] == chain[-2], label
    queue_problems = [v for v in collect_violations(pool) if v.startswith(("INV-FREE", "INV-QKEY"))]
    unqueued = [v for v in queue_problems if "not in the queue still have links" in v]
    assert queue_problems == unqueued == [], label


def test_initial_queue_is_block_order_without_null(make_pool):
    """A new pool's queue holds blocks 1..N-1 in id order; block 0 is the null block."""
    pool = make_pool(6)
    _assert_queue(pool, [1, 2, 3, 4, 5], "initial")
    assert links(pool, 0) == (NO_BLOCK, NO_BLOCK)


def test_popleft_remove_append(make_pool):
    """popleft takes the head, remove unlinks from the middle, append adds at the tail."""
    pool = make_pool(6)
    q = pool.free_block_queue
    assert q.popleft() == 1
    assert links(pool, 1) == (NO_BLOCK, NO_BLOCK)
    _assert_queue(pool, [2, 3, 4, 5], "after popleft")
    # head <-> 2 <-> 3 <-> 4 <-> 5 <-> tail ; remove 4
    q.remove(4)
    assert links(pool, 4) == (NO_BLOCK, NO_BLOCK)
    _assert_queue(pool, [2, 3, 5], "after remove(4)")
    q.append(4)
    _assert_queue(pool, [2, 3, 5, 4], "after append(4)")
    q.append(1)
    _assert_queue(pool, [2, 3, 5, 4, 1], "after append(1)")


def test_draining_links_sentinels_and_popleft_on_empty_raises(make_pool):
    """Popping every block leaves head <-> tail; one more popleft is vLLM's ValueError."""
    pool = make_pool(4)
    q = pool.free_block_queue
    assert [q.popleft() for _ in range(3)] == [1, 2, 3]
    _assert_queue(pool, [], "drained")
    with pytest.raises(ValueError, match="^No free blocks available$") as exc:
        q.popleft()
    assert isinstance(exc.value, OutOfBlocksError)
    _assert_queue(pool, [], "after failed popleft")


@pytest.mark.parametrize("n", [0, 1, 2, 3, 40])
def test_popleft_n_returns_head_in_order_with_cleared_links(make_pool, n):
    """popleft_n(n) returns the first n blocks in order and clears their links (both the
    short loop and the numpy bulk path)."""
    pool = make_pool(50)
    q = pool.free_block_queue
    q.remove(3)
    q.append(3)  # an order that is not id order: 1,2,4,...,49,3
    order = q.get_all_free_block_ids()
    popped = q.popleft_n(n)
    assert popped == order[:n]
    for b in popped:
        assert links(pool, b) == (NO_BLOCK, NO_BLOCK)
    _assert_queue(pool, order[n:], f"after popleft_n({n})")


def test_popleft_n_more_than_free_changes_nothing(make_pool):
    """Asking for more blocks than are free raises vLLM's message and pops nothing."""
    pool = make_pool(5)
    before = segment_image(pool)
    with pytest.raises(ValueError, match="^Cannot get 5 free blocks from the pool$"):
        pool.free_block_queue.popleft_n(5)
    assert segment_image(pool) == before


@pytest.mark.parametrize("n", [0, 1, 2, 3, 30])
def test_append_n_keeps_order(make_pool, n):
    """append_n adds blocks at the tail in the given order."""
    pool = make_pool(64)
    q = pool.free_block_queue
    taken = q.popleft_n(40)
    rest = q.get_all_free_block_ids()
    chosen = list(reversed(taken[:n]))
    q.append_n(chosen)
    _assert_queue(pool, rest + chosen, f"append_n({n})")


@pytest.mark.parametrize("n", [0, 1, 2, 3, 30])
def test_prepend_n_keeps_order(make_pool, n):
    """prepend_n puts blocks at the head in the given order (vLLM has no test; ours)."""
    pool = make_pool(64)
    q = pool.free_block_queue
    taken = q.popleft_n(40)
    rest = q.get_all_free_block_ids()
    chosen = taken[::-1][:n]
    q.prepend_n(chosen)
    _assert_queue(pool, chosen + rest, f"prepend_n({n})")


def test_queue_keys_increase_head_to_tail_through_mixed_operations(make_pool):
    """queue_key orders the queue after prepends, appends and removes (INV-QKEY)."""
    pool = make_pool(32)
    q = pool.free_block_queue
    a = q.popleft_n(10)
    q.prepend_n(a[:3])
    q.append_n(a[3:6])
    q.remove(a[4])
    q.prepend_n([a[6]])
    q.append(a[4])
    order = q.get_all_free_block_ids()
    keys = [int(pool._blocks[b]["queue_key"]) for b in order]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)
    assert sorted(order, key=lambda b: int(pool._blocks[b]["queue_key"])) == order
    _assert_queue(pool, order, "mixed")


def test_remove_of_unqueued_block_raises(make_pool):
    """remove() of a block that is not queued names the block and changes nothing."""
    pool = make_pool(5)
    q = pool.free_block_queue
    b = q.popleft()
    before = segment_image(pool)
    with pytest.raises(UsageError, match=f"block {b} is not in the free queue"):
        q.remove(b)
    assert segment_image(pool) == before
