"""One level up: per-process shmkv ``KVCacheManager``s on one pool against vLLM's
``KVCacheManager``s, one per process, built over ONE vLLM ``BlockPool``
(``tests/linearizability/manager_replay.py`` hands each the shared pool).

Every manager call (admit: ``get_computed_blocks`` + ``allocate_slots``; a decode step;
``free``; ``evict_blocks``; ``reset_prefix_cache``) runs in one hold of the pool lock and is
recorded with it; the pool calls it made are recorded inside it. Both levels are checked:
the pool calls against one vLLM ``BlockPool``, the manager calls against the vLLM managers
(hits, allocations, events, what a dead or closing process's requests held, the end state).
"""

from __future__ import annotations

import logging
import os

import pytest

pytest.importorskip("vllm.v1.core.kv_cache_manager")  # the checker replays on vLLM's own code

from shmkv import BlockPool, KVCacheManager  # noqa: E402
from shmkv import Request as ShmRequest  # noqa: E402
from shmkv.core import kv_cache_interface as specs  # noqa: E402
from tests.conftest import unique_pool_name  # noqa: E402
from tests.linearizability.checker import FinalState, check  # noqa: E402
from tests.linearizability.harness import run_interleaved  # noqa: E402
from tests.linearizability.manager_workers import MANAGER_KWARGS, manager_config  # noqa: E402
from tests.linearizability.recordings import rewrite_history  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.long]


@pytest.fixture(autouse=True)
def _quiet_resets():
    logging.disable(logging.WARNING)
    yield
    logging.disable(logging.NOTSET)


@pytest.mark.parametrize(("num_procs", "num_kills"), [(2, 0), (4, 0), (8, 0), (4, 2)])
def test_manager_histories_replay_through_vllm_managers(kernel, num_procs, num_kills):
    report = run_interleaved(kernel, num_procs, num_ops=50, num_kills=num_kills, managers=True)
    assert report.calls_replayed > 40 * (num_procs - num_kills), report


def test_manager_checker_catches_a_changed_hit(kernel, tmp_path):
    name = unique_pool_name("linm")
    pool = BlockPool.create(name, 16, kernel=kernel, enable_kv_cache_events=True,
                            record=str(tmp_path / "a.history"))
    try:
        other = BlockPool.attach(name, kernel=kernel, record=str(tmp_path / "b.history"))
        managers = [KVCacheManager(manager_config(specs, 16), block_pool=p, **MANAGER_KWARGS)
                    for p in (pool, other)]
        hasher = pool.make_block_hasher()
        prompt = list(range(40))
        for i, (p, mgr) in enumerate(zip((pool, other), managers, strict=True)):
            req = ShmRequest(f"r{i}", prompt, block_hasher=hasher)

            def admit(mgr=mgr, req=req):
                hit, num_hit, boundary = mgr.get_computed_blocks(req)
                new = mgr.allocate_slots(req, req.num_tokens - num_hit, num_hit, hit)
                return [[list(g) for g in hit.get_block_ids()], num_hit, boundary,
                        [list(g) for g in new.get_block_ids()]]

            assert p.record_call("mgr.admit", {"request_id": f"r{i}", "tokens": prompt},
                                 admit, answer=list)[1] == 32 * i  # the second one hits
        other.close()
        final = FinalState.of(pool)
    finally:
        pool.close()
        BlockPool.unlink(name)
    assert check(str(tmp_path), final, level="manager"), "the unchanged history"

    def edit(rec):
        if getattr(rec, "result", None) and type(rec).__name__ == "Exit" \
                and isinstance(rec.result, list) and len(rec.result) == 4 and rec.result[1]:
            rec.result[1] = 16  # a shorter hit than the one vLLM finds
        return rec

    rewrite_history(os.path.join(tmp_path, "b.history"), edit)
    report = check(str(tmp_path), final, level="manager")
    assert "mgr.admit(r1): shmkv answered [[[1, 2]], 16" in report.differences[0], report
