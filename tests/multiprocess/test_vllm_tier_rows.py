"""A replica of vLLM's own making names its tier row: its GPU worker (a process, built from
vLLM's config as vLLM's worker builds it) joins first, then its engine core (a real vLLM
``Scheduler`` with shmkv's connector, another process); `shmkv inspect`, `shmkv stats` (the
real commands) and the ``shmkv_tier_*`` metrics name its row by the DP rank vLLM gave the
engine (``parallel_config.data_parallel_index``) and the engine id vLLM logs
(``kv_transfer_config.engine_id``), and once the core joined, by the core's pid. The GPU
worker's part of the protocol is played by the driver (``vllm_scheduler_driver.py``)."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")
pytest.importorskip("einops")  # vLLM's model inspection imports it (vllm_peer/requirements)

from shmkv import BlockPool  # noqa: E402
from shmkv.vllm import SharedCPUOffloadingManager  # noqa: E402
from tests.conftest import unique_pool_name  # noqa: E402
from tests.ecosystem_helpers import shmkv  # noqa: E402
from tests.multiprocess.conftest import join_processes  # noqa: E402
from tests.multiprocess.vllm_scheduler_driver import (  # noqa: E402
    BLOCK_SIZE,
    replica_worker,
    serving_core,
    write_model_dir,
)

pytestmark = [pytest.mark.multiprocess, pytest.mark.long]

ENGINE_ID = "rows-7f3a_dp3"  # vLLM's engine id of DP rank 3: <kv_transfer_config's>_dp3


def _tier_rows(name: str) -> dict[str, list[str]]:
    """The replica rows `shmkv inspect` and `shmkv stats` print, spaces collapsed."""
    out = {}
    for what, command in (("inspect", ("inspect", name)),
                          ("stats", ("stats", name, "--count", "1", "--no-clear"))):
        done = shmkv(*command)
        assert done.returncode == 0 and "Traceback" not in done.stderr, (what, done.stderr)
        out[what] = [" ".join(line.split()) for line in done.stdout.splitlines()
                     if line.strip().startswith("row ")]
    return out


@pytest.mark.timeout(300)
def test_a_vllm_replicas_row_shows_its_dp_rank_engine_id_and_core_pid(spawn_ctx, tmp_path):
    """DP rank 3's worker joins: its row reads ``dp 3 rows-7f3a_dp3``; its engine core joins
    and stores a 6-block prompt: ``dp 3 rows-7f3a_dp3 pid <core pid> live: 6 stored``, in
    both commands and as the metrics' labels; once both processes are gone the row reads
    ``gone`` under the same name."""
    pool = unique_pool_name("vrows")
    model_dir = write_model_dir(str(tmp_path / "model"))
    prompt = [1 + (i * 11) % 900 for i in range(6 * BLOCK_SIZE + 3)]
    from_worker, to_worker = spawn_ctx.Queue(), spawn_ctx.Queue()
    from_core, to_core = spawn_ctx.Queue(), spawn_ctx.Queue()
    procs = []
    try:
        worker = spawn_ctx.Process(target=replica_worker, args=(
            pool, model_dir, ENGINE_ID, 1 << 20, from_worker, to_worker),
            kwargs={"dp_index": 3})
        worker.start()
        procs.append(worker)
        ready, num_chunks, _ = from_worker.get(timeout=150)
        assert ready == "ready"
        expected = [f"row 0 dp 3 {ENGINE_ID} live: 0 stored, 0 loaded, 0 cross-replica hits"]
        assert _tier_rows(pool) == {"inspect": expected, "stats": expected}

        core = spawn_ctx.Process(target=serving_core, args=(
            pool, model_dir, ENGINE_ID, 3, prompt, from_core, to_core))
        core.start()
        procs.append(core)
        core_pid, served = from_core.get(timeout=150)
        assert core_pid == core.pid and len(served["stored"]) == 6, served
        expected = [f"row 0 dp 3 {ENGINE_ID} pid {core_pid} live: 6 stored, 0 loaded, "
                    "0 cross-replica hits"]
        assert _tier_rows(pool) == {"inspect": expected, "stats": expected}
        with BlockPool.attach(pool, label="metrics") as attached:
            samples = _stored_samples(attached)
        assert samples == {("node", "", ""): 6, ("0", "3", ENGINE_ID): 6}, samples

        to_core.put("exit")
        to_worker.put("exit")
        assert join_processes(procs) == [0, 0]
        gone = f"row 0 dp 3 {ENGINE_ID} pid {core_pid} gone: 6 stored, 0 loaded, " \
               "0 cross-replica hits"
        rows = _tier_rows(pool)
        assert gone in rows["inspect"] and gone in rows["stats"], rows
        with SharedCPUOffloadingManager(pool, num_chunks) as fresh:
            fresh.pool.reap_dead()
            fresh.pool.check_invariants()
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(30)
        SharedCPUOffloadingManager.unlink(pool)
    assert not [e for e in os.listdir("/dev/shm") if pool in e]


def _stored_samples(pool) -> dict[tuple[str, str, str], float]:
    """``shmkv_tier_stored_chunks_total`` by (replica, dp_rank, engine_id)."""
    pytest.importorskip("prometheus_client")
    from shmkv.metrics import PoolMetrics

    out = {}
    for family in PoolMetrics(pool).collect():
        for sample in family.samples:
            if sample.name == "shmkv_tier_stored_chunks_total":
                labels = sample.labels
                out[(labels["replica"], labels["dp_rank"], labels["engine_id"])] = sample.value
    return out
