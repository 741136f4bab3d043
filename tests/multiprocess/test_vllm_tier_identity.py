"""One identity per tier, with real vLLM 0.33.0 Schedulers in separate processes: a replica
whose KV bytes could differ from the tier's (another TP/PP split, hf_overrides, block-hash
seed) is refused at start, naming the field and both values; an equal one is welcome, also
when it serves a copy of the model directory at another path."""

from __future__ import annotations

import os
import shutil

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")
pytest.importorskip("einops")  # vLLM's model inspection imports it (vllm_peer/requirements)

from shmkv.vllm import SharedCPUOffloadingManager  # noqa: E402
from tests.conftest import unique_pool_name  # noqa: E402
from tests.multiprocess.conftest import join_processes  # noqa: E402
from tests.multiprocess.vllm_scheduler_driver import make_scheduler, write_model_dir  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.long]

COPY = "-copy"  # a variant's model directory: the tier's, copied to its path + COPY
VARIANTS = {
    "same": {"parallel": {"tensor_parallel_size": 2}},
    "copied model": {"parallel": {"tensor_parallel_size": 2}, "model_dir": COPY},
    "TP1xPP2": {"parallel": {"tensor_parallel_size": 1, "pipeline_parallel_size": 2}},
    "hf_overrides": {"parallel": {"tensor_parallel_size": 2},
                     "model": {"hf_overrides": {"num_hidden_layers": 1}}},
    "hash seed": {"parallel": {"tensor_parallel_size": 2}, "env": {"PYTHONHASHSEED": "7"}},
    "plain connector": {"parallel": {"tensor_parallel_size": 2},
                        "connector": "OffloadingConnector"},
}


def start_variants(pool: str, model_dir: str, to_parent) -> None:
    """Another replica's process: starts a scheduler per variant, reporting each error."""
    for name, variant in VARIANTS.items():
        variant = dict(variant)
        env = variant.pop("env", {})
        directory = model_dir + variant.pop("model_dir", "")
        os.environ.update(env)
        try:
            scheduler = make_scheduler(pool, directory, engine_id=f"B-{name}", **variant)
        except Exception as exc:  # noqa: BLE001 (reported to the parent)
            to_parent.put((name, f"{type(exc).__name__}: {exc}"))
        else:
            scheduler.connector.shutdown()
            to_parent.put((name, None))
        for key in env:
            del os.environ[key]


@pytest.mark.timeout(240)
def test_replicas_whose_kv_differs_are_refused_naming_the_field(spawn_ctx, tmp_path):
    """The tier's first replica is TP2 x PP1; a TP1 x PP2 replica is refused for its layout
    (pipeline parallelism), never as another replica; one with hf_overrides, one with
    another PYTHONHASHSEED and one built by vLLM's plain OffloadingConnector are refused
    naming the field; an equal replica starts, and so does one serving a copy of the model
    directory at another path (the path is shown, not compared)."""
    pool = unique_pool_name("idn")
    model_dir = write_model_dir(str(tmp_path / "model"))
    shutil.copytree(model_dir, model_dir + COPY)
    to_parent = spawn_ctx.Queue()
    first = make_scheduler(pool, model_dir, engine_id="A", parallel={"tensor_parallel_size": 2})
    try:
        other = spawn_ctx.Process(target=start_variants, args=(pool, model_dir, to_parent))
        other.start()
        answers = dict(to_parent.get(timeout=200) for _ in VARIANTS)
        assert join_processes([other]) == [0]
    finally:
        first.connector.shutdown()
        SharedCPUOffloadingManager.unlink(pool)
    assert answers["same"] is None
    assert answers["copied model"] is None
    tp_pp = answers["TP1xPP2"]  # refused for its layout, never as "another replica"
    assert tp_pp.startswith("UsageError"), tp_pp
    assert "does not support pipeline parallelism (pipeline_parallel_size=2" in tp_pp
    assert "differs from the replicas" not in tp_pp
    assert "hf_overrides: this replica '{\"num_hidden_layers\": 1}', the tier '{}'" in \
        answers["hf_overrides"]
    assert "hash_seed: this replica 'PYTHONHASHSEED digest" in answers["hash seed"]
    assert '"kv_connector": "SharedOffloadingConnector"' in answers["plain connector"]
