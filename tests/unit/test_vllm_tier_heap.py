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
