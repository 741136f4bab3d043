"""The offload tier's eviction heap in C (``_ckernel.heap_push`` / ``heap_pop``) against its
Python reference in ``shmkv/vllm/lru.py`` and against ``heapq``: same entries popped in the
same order, and the same array contents after every step (ties broken by block id)."""

from __future__ import annotations

import heapq
import random
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm.v1.kv_offload.base")

from shmkv.pool.block_pool import _ckernel as _ck  # noqa: E402
from shmkv.vllm.lru import TierLRU  # noqa: E402
from shmkv.vllm.tier import W_HEAP_SIZE  # noqa: E402

pytestmark = pytest.mark.skipif(_ck is None, reason="shmkv.pool._ckernel is not built "
                                "(pip install -e . builds it)")
CAP = 257


def _arrays():
    return (memoryview(bytearray(8 * CAP)).cast("q"), memoryview(bytearray(4 * CAP)).cast("i"))


def _python_heap():
    hr, hb = _arrays()
    return SimpleNamespace(_hr=hr, _hb=hb, _words=memoryview(bytearray(8 * 16)).cast("q"))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_c_heap_matches_the_python_reference_and_heapq(seed):
    rng = random.Random(seed)
    hr, hb = _arrays()
    size = 0
    ref = _python_heap()
    model: list[tuple[int, int]] = []
    for _ in range(3000):
        if size < CAP - 1 and (not size or rng.random() < 0.55):
            rank = rng.randrange(-40, 40) * (1 << 40)  # many ties, and int64-wide ranks
            block = rng.randrange(0, 1 << 31)
            _ck.heap_push(hr, hb, size, rank, block)
            TierLRU._sift_up(ref, size, rank, block)
            ref._words[W_HEAP_SIZE] = size + 1
            heapq.heappush(model, (rank, block))
            size += 1
        else:
            got = _ck.heap_pop(hr, hb, size)
            assert got == TierLRU._py_pop(ref) == heapq.heappop(model)
            size -= 1
        assert ref._words[W_HEAP_SIZE] == size
        assert hr[:size].tolist() == ref._hr[:size].tolist()
        assert hb[:size].tolist() == ref._hb[:size].tolist()


def test_c_heap_refuses_a_size_out_of_range_and_mismatched_arrays():
    hr, hb = _arrays()
    with pytest.raises(ValueError, match="heap_pop: size 0 out of"):
        _ck.heap_pop(hr, hb, 0)
    with pytest.raises(ValueError, match=f"heap_push: size {CAP} out of"):
        _ck.heap_push(hr, hb, CAP, 1, 1)
    with pytest.raises(ValueError, match="int64 and blocks int32"):
        _ck.heap_pop(hb, hr, 1)
    assert hr.tolist() == [0] * CAP and hb.tolist() == [0] * CAP  # nothing written


def _tier_lru(rng: random.Random, num_blocks: int, num_entries: int):
    """A TierLRU over plain buffers: block rows (ref, key, group), ranks, job bits and a heap
    of entries of which some are stale (old ranks, blocks without a key or still being
    stored) and many tie on rank; built on the object as __init__ would over a tier."""
    from shmkv.pool import layout as L
    from shmkv.vllm.tier import PENDING_BIT

    row = L.ROW_I32
    words = memoryview(bytearray(4 * row * (num_blocks + 1))).cast("i")
    ranks = memoryview(bytearray(8 * (num_blocks + 1))).cast("q")
    jobs = memoryview(bytearray(8 * (num_blocks + 1))).cast("Q")
    for b in range(1, num_blocks + 1):
        ranks[b] = rng.randrange(0, 12)  # few ranks: many ties
        words[b * row + L.F_REF] = rng.choice([0, 0, 0, 1])
        words[b * row + L.F_HASH_TOKENS] = rng.choice([1, 1, 1, L.NO_HASH_TOKENS])
        words[b * row + L.F_GROUP] = rng.choice([0, 0, 3, PENDING_BIT])
        jobs[b] = rng.choice([0, 0, 0, 0, 2])
        at = (b * row + L.HASH_BYTE_OFFSET // 4)
        words[at] = rng.randrange(1 << 30)  # the key bytes that break a tie
    lru = object.__new__(TierLRU)
    lru._tier = SimpleNamespace(rank_words=ranks, job_words=jobs)
    lru._block_words = words
    lru._words = memoryview(bytearray(8 * 16)).cast("q")
    lru._hr, lru._hb = _arrays()
    lru._cap, lru._c_heap = CAP, True
    lru._layout = (row, L.F_REF, L.F_HASH_TOKENS, L.F_GROUP, L.NO_HASH_TOKENS, PENDING_BIT)
    for _ in range(num_entries):
        b = rng.randrange(1, num_blocks + 1)
        lru.push(ranks[b] if rng.random() < 0.8 else rng.randrange(0, 12), b)
    return lru


def _copy(lru):
    twin = object.__new__(TierLRU)
    for name in ("_tier", "_block_words", "_cap", "_c_heap", "_layout"):
        setattr(twin, name, getattr(lru, name))
    twin._words = memoryview(bytearray(lru._words.tobytes())).cast("q")
    twin._hr = memoryview(bytearray(lru._hr.tobytes())).cast("q")
    twin._hb = memoryview(bytearray(lru._hb.tobytes())).cast("i")
    return twin


@pytest.mark.parametrize("seed", range(8))
def test_c_victims_loop_matches_the_python_reference(seed):
    """pop_victims with its loop in C (up to a rank tie, then the Python loop) takes the
    same victims in the same order as the Python loop alone, and leaves the same heap:
    stale entries dropped, held and protected blocks set aside and pushed back, rank ties
    broken by key bytes; None (nothing taken) when too few are evictable."""
    from shmkv.pool import layout as L

    rng = random.Random(seed)
    lru = _tier_lru(rng, num_blocks=60, num_entries=200)
    words, row = lru._block_words, L.ROW_I32

    def key_of(b):
        return words[b * row + L.HASH_BYTE_OFFSET // 4:b * row + L.HASH_BYTE_OFFSET // 4 + 8
                     ].tobytes()

    outcomes = set()
    for _ in range(12):
        num = rng.randint(1, 12)
        protected = set(rng.sample(range(1, 61), 5))
        twin = _copy(lru)
        got = lru.pop_victims(num, protected, key_of, use_c=True)
        want = twin.pop_victims(num, protected, key_of, use_c=False)
        assert got == want
        size = lru._words[W_HEAP_SIZE]
        assert size == twin._words[W_HEAP_SIZE]
        assert lru._hr[:size].tolist() == twin._hr[:size].tolist()
        assert lru._hb[:size].tolist() == twin._hb[:size].tolist()
        outcomes.add("none" if got is None else "taken")
    assert outcomes == {"none", "taken"}


def test_c_victims_loop_refuses_bad_buffers_and_layout():
    """heap_victims checks its buffers and layout before it pops anything."""
    lru = _tier_lru(random.Random(0), num_blocks=8, num_entries=10)
    size = lru._words[W_HEAP_SIZE]
    before = (lru._hr.tolist(), lru._hb.tolist())
    args = [lru._hr, lru._hb, size, lru._tier.rank_words, lru._block_words,
            lru._tier.job_words, set(), 3, lru._layout]
    for index, bad, message in [(6, [], "protected must be a set"),
                                (8, (0, 1, 2, 3, 4, 5), "bad buffers, size or layout"),
                                (2, 10**6, "bad buffers, size or layout"),
                                (4, lru._tier.rank_words, "bad buffers, size or layout")]:
        broken = list(args)
        broken[index] = bad
        with pytest.raises((TypeError, ValueError), match=message):
            _ck.heap_victims(*broken)
    assert (lru._hr.tolist(), lru._hb.tolist()) == before
