"""Multi-process histories of one pool replay identically through vLLM's own BlockPool.

2, 4 and 8 processes run seeded random churn (prefix lookups, touch, allocate, cache, free,
evict, reset) on one recorded pool, on both kernels, some SIGKILLed at random steps; the
checker (``tests/linearizability/checker.py``) merges their histories by lock hold and
replays them through one vLLM ``BlockPool``: every answer, every event, the reaped references
and the final free queue and block keys must be the same. The checker itself is shown to
catch a changed answer, a lost release and a different end state, and a run without the
lock.
"""

from __future__ import annotations

import logging
import os
import random

import pytest

pytest.importorskip("vllm.v1.core.block_pool")  # the checker replays on vLLM's own code

from shmkv import BlockPool  # noqa: E402
from tests.conftest import unique_pool_name  # noqa: E402
from tests.helpers import make_request  # noqa: E402
from tests.linearizability.checker import FinalState, check  # noqa: E402
from tests.linearizability.harness import run_history, run_interleaved  # noqa: E402
from tests.linearizability.recordings import rewrite_history  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.long]


@pytest.fixture(autouse=True)
def _quiet_resets():
    """Failed resets are logged by both pools, a line each; the churn makes many."""
    logging.disable(logging.WARNING)
    yield
    logging.disable(logging.NOTSET)


@pytest.mark.parametrize("num_procs", [2, 4, 8])
def test_churn_histories_replay_through_vllm(kernel, num_procs):
    report = run_interleaved(kernel, num_procs, num_ops=60)
    assert report.histories == num_procs + 1 and report.calls_replayed > 60 * num_procs


@pytest.mark.parametrize("num_procs", [2, 4, 8])
def test_churn_with_sigkills_replays_through_vllm(kernel, num_procs):
    run_interleaved(kernel, num_procs, num_ops=80, num_kills=max(1, num_procs // 2))


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="without the pool lock the processes' calls overlap: the history "
                          "has no lock order, or its replay differs from vLLM's")
def test_churn_without_the_lock_is_caught(kernel):
    seed = random.randrange(1 << 30)
    report, _codes = run_history(kernel, 4, seed, num_ops=200, lock_enabled=False)
    assert report, f"seed={seed}: {report}"


# ------------------------------------------------------------------ the checker can fail


@pytest.fixture
def recorded(kernel, tmp_path):
    """Two recorded handles on one pool (the second closes holding blocks, so its close
    releases them), the final state, and the folder of the histories."""
    name = unique_pool_name("linu")
    pool = BlockPool.create(name, 9, kernel=kernel, enable_kv_cache_events=True,
                            record=str(tmp_path / "a.history"))
    try:
        other = BlockPool.attach(name, kernel=kernel, record=str(tmp_path / "b.history"))
        req = make_request(48)
        blocks = other.get_new_blocks(3)
        other.cache_full_blocks(req, blocks, 0, 3, 16, 0)
        other.free_blocks(list(reversed(blocks)))
        hit = pool.get_cached_prefix(req.block_hashes)
        pool.touch(hit)
        other.touch(hit[:1])
        assert [b.block_id for b in other.get_new_blocks(4)] == [4, 5, 6, 7]
        pool.evict_blocks([blocks[2].block_id])
        assert pool.reset_prefix_cache() is False
        other.close()
        pool.check_invariants()
        final = FinalState.of(pool)
    finally:
        pool.close()
        BlockPool.unlink(name)
    return tmp_path, final


def test_checker_passes_an_unchanged_history(recorded):
    folder, final = recorded
    report = check(str(folder), final)
    assert report and report.calls_replayed == 11, report


def test_checker_catches_a_changed_answer(recorded):
    folder, final = recorded

    def edit(rec):
        if getattr(rec, "result", None) == [4, 5, 6, 7]:  # the second allocation's ids
            rec.result = [4, 5, 7, 6]
        return rec

    rewrite_history(os.path.join(folder, "b.history"), edit)
    assert "get_new_blocks(num_blocks=4): shmkv answered [4, 5, 7, 6]" in \
        check(str(folder), final).differences[0]


def test_checker_catches_a_lost_release(recorded):
    folder, final = recorded
    rewrite_history(os.path.join(folder, "b.history"),
                    lambda rec: None if type(rec).__name__ == "Released" else rec)
    assert "end: free queue" in check(str(folder), final).differences[0]


def test_checker_catches_another_end_state(recorded):
    folder, final = recorded
    final.free_ids[0], final.free_ids[1] = final.free_ids[1], final.free_ids[0]
    assert "end: free queue" in check(str(folder), final).differences[0]


def test_checker_catches_changed_events(recorded):
    folder, final = recorded

    def edit(rec):
        if type(rec).__name__ == "Exit" and rec.events:
            rec.events = rec.events[1:]
        return rec

    rewrite_history(os.path.join(folder, "b.history"), edit)
    assert "events: shmkv" in check(str(folder), final).differences[0]
