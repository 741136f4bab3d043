"""The shared offload tier survives a SIGKILL at every shared-memory store of each of its
calls: a victim process (forked by the crash zygote) is killed before the n-th store of
each pool operation that a manager call makes under one hold of the lock, for n = 1, 2, ...
until the call completes. After each death the survivor finds the victim's whole call
rolled back (its keys in the state of the step before) and nothing it held still held;
the pool's invariants hold; at the end every chunk is reusable."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1.kv_offload.cpu.manager")

from vllm.v1.kv_offload.base import LookupResult, ReqContext  # noqa: E402

from shmkv.vllm import SharedCPUOffloadingManager  # noqa: E402
from tests.conftest import unique_pool_name  # noqa: E402
from tests.crash.conftest import KILLED  # noqa: E402
from tests.crash.offload_scenarios import (  # noqa: E402
    STEP_OPS,
    STEPS,
    STUCK_AFTER_S,
    offload_victim,
    victim_keys,
)

pytestmark = [pytest.mark.crash, pytest.mark.long]
NUM_CHUNKS = 8
MAX_STORES = 400
HIT, MISS = LookupResult.HIT, LookupResult.MISS


def _expected(step: str, killed: bool) -> list:
    """Each key's state once the victim is gone: a killed call is rolled back whole, and
    an unfinished store of a dead process is absent."""
    stored = STEPS.index(step) > STEPS.index("complete_store") or (
        step == "complete_store" and not killed)
    return [HIT, HIT, HIT, MISS] if stored else [MISS] * 4


@pytest.mark.timeout(300)
@pytest.mark.parametrize("step", STEPS)
def test_sigkill_inside_each_call(forker, step):
    """A victim killed at every 5th store inside ``step`` (stores 1, 6, 11, ...; the full
    sweep is the slow test below) leaves the tier consistent and reusable."""
    _sweep(forker, step, stride=5)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("step", STEPS)
def test_sigkill_at_every_store_of_a_call(forker, step):
    """A victim killed at every store inside ``step`` leaves the tier consistent."""
    _sweep(forker, step, stride=1)


def _sweep(forker, step: str, stride: int) -> None:
    name = unique_pool_name("vk")
    survivor = SharedCPUOffloadingManager(name, NUM_CHUNKS, label="survivor",
                                          stuck_after_s=STUCK_AFTER_S)
    ctx = ReqContext("survivor")
    tag = 0
    try:
        for op in STEP_OPS[step]:
            for n in range(1, MAX_STORES, stride):
                tag += 1
                end = forker(offload_victim, name, NUM_CHUNKS, tag, step, op, n)
                assert end in (KILLED, "exit:0"), (step, op, n, end)
                label = f"{step}/{op} killed before store {n}"
                survivor.pool.reap_dead()
                got = [survivor.lookup(k, ctx) for k in victim_keys(tag)]
                assert got == _expected(step, end == KILLED), label
                rows = survivor.pool.block_rows()
                assert int(rows["ref_cnt"][1:].max()) == 0, f"{label}: a chunk still held"
                del rows
                survivor.pool.check_invariants()
                if end == "exit:0":
                    break
            else:
                raise AssertionError(f"{step}/{op} still unfinished after {MAX_STORES} stores")
        fresh = [victim_keys(10_000 + i)[0] for i in range(NUM_CHUNKS)]
        out = survivor.prepare_store(fresh, ctx)
        assert out is not None and sorted(out.store_spec.block_ids.tolist()) == list(
            range(NUM_CHUNKS))
        survivor.complete_store(fresh, ctx)
        survivor.pool.check_invariants()
    finally:
        survivor.close()
        SharedCPUOffloadingManager.unlink(name)
