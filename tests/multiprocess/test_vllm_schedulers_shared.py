"""Two real vLLM 0.33.0 schedulers (``Scheduler`` + ``OffloadingConnector`` + shmkv's
``SharedCPUOffloadingSpec``), in two processes, on one shared tier: the second one's
prefix hits are loaded from exactly the chunks the first one stored, and it stores
nothing twice. Built on CPU from a local model config directory; the GPU worker's part
is played by the driver (see ``vllm_scheduler_driver.py``)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")
pytest.importorskip("einops")  # vLLM's model inspection imports it (vllm_peer/requirements)

from shmkv.vllm import SharedCPUOffloadingManager  # noqa: E402
from tests.conftest import unique_pool_name  # noqa: E402
from tests.multiprocess.conftest import join_processes  # noqa: E402
from tests.multiprocess.vllm_scheduler_driver import (  # noqa: E402
    BLOCK_SIZE,
    first_replica,
    make_scheduler,
    run_request,
    write_model_dir,
)

pytestmark = [pytest.mark.multiprocess, pytest.mark.long]


@pytest.mark.timeout(180)
def test_second_scheduler_hits_the_first_ones_stores(spawn_ctx, tmp_path):
    """Replica 0 (a spawned process) serves a 6-block prompt and exits; replica 1 (this
    process) gets the same prompt: the connector loads all 6 chunks replica 0 stored."""
    pool = unique_pool_name("vs")
    model_dir = write_model_dir(str(tmp_path / "model"))
    prompt = [1 + (i * 7) % 900 for i in range(6 * BLOCK_SIZE + 5)]  # 6 full blocks
    to_parent = spawn_ctx.Queue()
    try:
        first = spawn_ctx.Process(target=first_replica, args=(pool, model_dir, prompt, to_parent))
        first.start()
        replica0 = to_parent.get(timeout=150)
        assert join_processes([first]) == [0]
        assert replica0["loaded"] == [] and len(replica0["stored"]) == 6

        scheduler = make_scheduler(pool, model_dir)
        replica1 = run_request(scheduler, "replica1-req0", prompt)
        assert replica1["loaded"] == replica0["stored"]
        assert replica1["stored"] == []
        manager = scheduler.connector.connector_scheduler.manager
        assert isinstance(manager, SharedCPUOffloadingManager)
        num_chunks = manager.num_chunks
        scheduler.connector.shutdown()
        assert manager.pool is None  # the connector's shutdown detached it

        with SharedCPUOffloadingManager(pool, num_chunks) as fresh:
            fresh.pool.reap_dead()
            rows = fresh.pool.block_rows()
            assert int(rows["ref_cnt"][1:].max()) == 0  # no pin or store left behind
            del rows
            fresh.pool.check_invariants()
    finally:
        SharedCPUOffloadingManager.unlink(pool)
