"""Model-based test: hypothesis drives random allocate / cache / lookup-touch / free / evict
/ reset sequences against shmkv's BlockPool and a tiny pure-Python reference of vLLM's rules,
comparing block ids, hits, ref counts, hashes and the exact free-queue order after each step,
with check_invariants() as a state-machine invariant."""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from shmkv import BlockPool
from shmkv.pool.block_pool import _ckernel
from tests.conftest import unique_pool_name
from tests.helpers import FakeRequest

BS = 16
NUM_BLOCKS = 12


class ReferencePool:
    """vLLM's BlockPool rules in a few lines: a list as the queue, a dict as the index."""

    def __init__(self, num_blocks: int) -> None:
        self.queue = list(range(1, num_blocks))
        self.ref = [0] * num_blocks
        self.key: list[tuple[bytes, int] | None] = [None] * num_blocks
        self.index: dict[tuple[bytes, int], OrderedDict[int, None]] = {}

    def _evict(self, b: int) -> None:
        key = self.key[b]
        if key is not None:
            del self.index[key][b]
            if not self.index[key]:
                del self.index[key]
            self.key[b] = None

    def get_new_blocks(self, n: int) -> list[int]:
        if n > len(self.queue):
            raise ValueError(f"Cannot get {n} free blocks from the pool")
        out, self.queue = self.queue[:n], self.queue[n:]
        for b in out:
            self._evict(b)
            self.ref[b] = 1
        return out

    def free_blocks(self, ordered: list[int]) -> None:
        first, last = [], []
        for b in ordered:
            if b == 0:
                continue
            self.ref[b] -= 1
            if self.ref[b] == 0:
                (last if self.key[b] else first).append(b)
        self.queue = first + self.queue + last

    def touch(self, blocks: list[int]) -> None:
        for b in blocks:
            if b and self.ref[b] == 0:
                self.queue.remove(b)
            if b:
                self.ref[b] += 1

    def cache(self, hashes: list[bytes], blocks: list[int], start: int, stop: int) -> None:
        for i in range(start, stop):
            b = blocks[i]
            if b:
                self.key[b] = (hashes[i], 0)
                self.index.setdefault((hashes[i], 0), OrderedDict())[b] = None

    def lookup(self, h: bytes) -> int | None:
        blocks = self.index.get((h, 0))
        return next(iter(blocks)) if blocks else None

    def reset(self) -> bool:
        if len(self.queue) != len(self.ref) - 1:
            return False
        self.index.clear()
        self.key = [None] * len(self.key)
        return True


PROMPTS = [list(range(p * 1000, p * 1000 + 64)) for p in range(3)]


class PoolMachine(RuleBasedStateMachine):
    """Each running request owns its blocks; blocks are freed tail first, as vLLM does."""

    kernel = "python"

    @initialize()
    def setup(self) -> None:
        self.name = unique_pool_name("hyp")
        self.pool = BlockPool.create(self.name, NUM_BLOCKS, hash_block_size=BS,
                                     kernel=self.kernel)
        self.ref = ReferencePool(NUM_BLOCKS)
        self.running: list[tuple[FakeRequest, list[int]]] = []

    def teardown(self) -> None:
        if hasattr(self, "pool"):
            self.pool.close()
            BlockPool.unlink(self.name)

    @rule(prompt=st.integers(0, 2), shared_blocks=st.integers(0, 4),
          extra=st.integers(1, 40), salt=st.integers(0, 1000))
    def admit(self, prompt: int, shared_blocks: int, extra: int, salt: int) -> None:
        tokens = PROMPTS[prompt][: shared_blocks * BS] + [salt] * extra
        req = FakeRequest(tokens)
        hits_pool, hits_ref = [], []
        for h in req.block_hashes:
            found = self.pool.get_cached_block(h, [0])
            expected = self.ref.lookup(h)
            assert (found[0].block_id if found else None) == expected
            if found is None:
                break
            hits_pool.append(found[0])
            hits_ref.append(expected)
        need = -(-len(tokens) // BS) - len(hits_pool)
        self.pool.touch(hits_pool)
        self.ref.touch(hits_ref)
        try:
            new = self.pool.get_new_blocks(need)
        except ValueError as exc:
            try:
                self.ref.get_new_blocks(need)
            except ValueError as ref_exc:
                assert str(exc) == str(ref_exc)
            self.pool.free_blocks(reversed(hits_pool))
            self.ref.free_blocks(hits_ref[::-1])
            return
        blocks_ref = hits_ref + self.ref.get_new_blocks(need)
        blocks = hits_pool + new
        assert [b.block_id for b in blocks] == blocks_ref
        full = len(tokens) // BS
        self.pool.cache_full_blocks(req, blocks, len(hits_pool), full, BS, 0)
        self.ref.cache(req.block_hashes, blocks_ref, len(hits_ref), full)
        self.running.append((req, blocks_ref))

    @precondition(lambda self: self.running)
    @rule(which=st.integers(0, 100))
    def finish(self, which: int) -> None:
        _, blocks = self.running.pop(which % len(self.running))
        self.pool.free_blocks([self.pool.blocks[b] for b in reversed(blocks)])
        self.ref.free_blocks(blocks[::-1])

    @rule(block_id=st.integers(0, NUM_BLOCKS - 1))
    def evict(self, block_id: int) -> None:
        self.pool.evict_blocks({block_id})
        self.ref._evict(block_id) if block_id else None

    @rule()
    def reset(self) -> None:
        assert self.pool.reset_prefix_cache() == self.ref.reset()

    @invariant()
    def same_state(self) -> None:
        if not hasattr(self, "pool"):
            return
        self.pool.check_invariants()
        assert self.pool.get_free_block_ids() == self.ref.queue
        assert [b.ref_cnt for b in self.pool.blocks[1:]] == self.ref.ref[1:]
        for b, key in enumerate(self.ref.key):
            got = self.pool.blocks[b].block_hash
            assert got == (None if key is None else key[0] + b"\0\0\0\0")


class CKernelPoolMachine(PoolMachine):
    kernel = "c"


_SETTINGS = settings(max_examples=60, stateful_step_count=40, deadline=None)
PoolMachine.TestCase.settings = _SETTINGS
CKernelPoolMachine.TestCase.settings = _SETTINGS
TestPythonKernel = PoolMachine.TestCase
TestCKernel = pytest.mark.skipif(_ckernel is None, reason="shmkv.pool._ckernel is not built")(
    CKernelPoolMachine.TestCase
)
