"""The checks a replica gets before its KV cache is sized, through the calls vLLM itself
makes on the connector class: ``requires_piecewise_for_cudagraph`` (the API server, while
it builds vLLM's config) and ``get_required_kvcache_layout`` (each engine core, before it
profiles memory), here through vLLM's own functions that make them. A refusal names the
problem and the fix, is logged once, and makes nothing in /dev/shm.
"""

from __future__ import annotations

import logging
import os

import pytest

pytest.importorskip("vllm.v1.kv_offload.cpu.manager")

from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.utils import (  # noqa: E402
    get_kv_connector_cache_layout,
)

from shmkv import LayoutMismatchError, UsageError  # noqa: E402
from shmkv.vllm import SharedCPUOffloadingManager  # noqa: E402
from shmkv.vllm import spec as spec_module  # noqa: E402
from tests.conftest import unique_pool_name  # noqa: E402
from tests.multiprocess.vllm_scheduler_driver import make_vllm_config, write_model_dir  # noqa: E402
from tests.unit.test_vllm_offload_bad_input import make_config, make_spec  # noqa: E402

Connector = spec_module.SharedOffloadingConnector
PREFLIGHT_LINE = "shmkv refuses this replica before its KV cache is sized"


@pytest.fixture
def pool():
    name = unique_pool_name("pf")
    yield name
    SharedCPUOffloadingManager.unlink(name)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_dir(str(tmp_path_factory.mktemp("model") / "model"))


def _mine(pool: str) -> list[str]:
    """This test's objects in /dev/shm (every name of a tier holds the pool's name)."""
    return sorted(n for n in os.listdir("/dev/shm") if pool in n)


def _refusals(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if PREFLIGHT_LINE in r.getMessage()]


def test_a_good_config_passes_and_makes_nothing(pool, model_dir):
    """With no tier yet, vLLM's engine-core call returns the offloading connector's layout
    and nothing of the tier is made (the first worker makes it)."""
    config = make_vllm_config(pool, model_dir)
    layout = get_kv_connector_cache_layout(config)
    assert layout == Connector.__mro__[1].get_required_kvcache_layout(config)
    assert _mine(pool) == []
    assert Connector.requires_piecewise_for_cudagraph(
        config.kv_transfer_config.kv_connector_extra_config) is False


@pytest.mark.parametrize("change, field", [
    ({"model": {"revision": "v2"}}, "revision"),
    ({"model": {"hf_overrides": {"num_hidden_layers": 1}}}, "hf_overrides"),
    ({"parallel": {"tensor_parallel_size": 2}}, "tensor_parallel_size"),
])
def test_a_replica_of_another_identity_is_refused_before_sizing(pool, model_dir, caplog,
                                                                 change, field):
    """A tier is running; a replica of another revision, overrides or parallel layout is
    refused at vLLM's engine-core call, before its KV cache is sized: the field with both
    values and the way to start afresh, said once in the log; the tier is unchanged."""
    manager = make_spec(model_dir, make_config(pool)).get_manager()
    try:
        before = _mine(pool)
        with pytest.raises(LayoutMismatchError, match=rf"{field}: this replica .*shmkv unlink"):
            get_kv_connector_cache_layout(make_vllm_config(pool, model_dir, **change))
        assert len(_refusals(caplog)) == 1, caplog.text
        assert field in _refusals(caplog)[0]
        assert _mine(pool) == before
        # the same replica as the tier's passes
        get_kv_connector_cache_layout(make_vllm_config(pool, model_dir))
    finally:
        manager.close()


def test_the_model_of_a_running_tier_is_compared_before_sizing(pool, model_dir, tmp_path):
    """Other weights (another model directory's files) are refused at the engine-core call."""
    manager = make_spec(model_dir, make_config(pool)).get_manager()
    try:
        other = write_model_dir(str(tmp_path / "other"))
        with open(os.path.join(other, "model.safetensors"), "wb") as f:
            f.write(b"\0" * 64)
        with pytest.raises(LayoutMismatchError, match="model_files: this replica"):
            get_kv_connector_cache_layout(make_vllm_config(pool, other))
    finally:
        manager.close()


@pytest.mark.parametrize("extra, message", [
    ({"shmkv_poool": "x"}, r"unknown kv_connector_extra_config keys \['shmkv_poool'\]"),
    ({"shmkv_pool": ""}, "needs 'shmkv_pool'"),
    ({"shmkv_pool": "no/slash"}, "pool name"),
    ({"eviction_policy": "arc"}, "eviction_policy 'arc' is not supported"),
    ({"spec_name": "CPUOffloadingSpec"}, r"\"spec_name\": \"SharedCPUOffloadingSpec\""),
    ({"spec_module_path": None}, r"\"spec_module_path\": \"shmkv.vllm\""),
])
def test_bad_extra_config_is_refused_while_vllm_builds_its_config(pool, model_dir, caplog,
                                                                  extra, message):
    """The API server's call (the extra config alone) and the engine core's refuse a bad
    extra config, naming the key and what to set; nothing is made."""
    config = make_vllm_config(pool, model_dir)
    merged = {**config.kv_transfer_config.kv_connector_extra_config, **extra}
    with pytest.raises(UsageError, match=message):
        Connector.requires_piecewise_for_cudagraph(merged)
    assert len(_refusals(caplog)) == 1
    config.kv_transfer_config.kv_connector_extra_config = merged
    with pytest.raises(UsageError, match=message):
        get_kv_connector_cache_layout(config)
    assert _mine(pool) == []


def test_pipeline_parallelism_is_refused_before_sizing(pool, model_dir):
    """PP is refused at the engine-core call, naming the layout and what runs instead."""
    config = make_vllm_config(pool, model_dir)
    config.parallel_config.pipeline_parallel_size = 2
    with pytest.raises(UsageError, match="pipeline_parallel_size=2"):
        get_kv_connector_cache_layout(config)
    assert _mine(pool) == []


def test_the_spec_still_runs_every_check(pool, model_dir):
    """The spec's construction runs the same extra-config and engine checks (vLLM's plain
    connector never calls the class-level ones)."""
    with pytest.raises(UsageError, match="eviction_policy 'arc'"):
        make_spec(model_dir, make_config(pool, eviction_policy="arc"))
    config = make_vllm_config(pool, model_dir, connector="OffloadingConnector")
    with set_current_vllm_config(config), \
            pytest.raises(UsageError, match='"kv_connector": "SharedOffloadingConnector"'):
        spec_module.SharedCPUOffloadingSpec(make_config(pool))
    assert _mine(pool) == []


@pytest.fixture(autouse=True)
def _log_errors(caplog):
    caplog.set_level(logging.ERROR, logger="shmkv.vllm.spec")


# ------------------------------------------------------------------ /dev/shm beside the tier

def test_vllms_queues_are_counted_per_engine_and_worker():
    """Two engines of one worker: 2 x (160 MiB broadcast + 240 MiB response) = 800 MiB, the
    apparent size an operator saw with DP=2 on vLLM's CPU build; TP=2 adds a response queue per
    worker and the TP group's queue; the chunk size follows VLLM_MQ_MAX_CHUNK_BYTES_MB."""
    from types import SimpleNamespace

    from shmkv.vllm.sizing import MIB, vllm_ipc_bytes

    dp2 = SimpleNamespace(world_size=1, tensor_parallel_size=1, data_parallel_size_local=2)
    assert vllm_ipc_bytes(dp2, {}) == 800 * MIB
    tp2 = SimpleNamespace(world_size=2, tensor_parallel_size=2, data_parallel_size_local=1)
    assert vllm_ipc_bytes(tp2, {}) == (160 + 2 * 240 + 24) * MIB
    assert vllm_ipc_bytes(dp2, {"VLLM_MQ_MAX_CHUNK_BYTES_MB": "32"}) == 2 * (320 + 240) * MIB


def test_a_tier_that_leaves_vllm_too_little_room_is_warned_of_at_start(pool, model_dir,
                                                                       caplog):
    """The engine core's check warns, naming both sizes and the fix, when /dev/shm would
    keep less than vLLM's queues need once the tier is made; it makes nothing."""
    from shmkv.vllm.sizing import vllm_ipc_bytes

    caplog.set_level(logging.WARNING, logger="shmkv.vllm.sizing")
    st = os.statvfs("/dev/shm")
    free = st.f_bavail * st.f_frsize
    small = make_vllm_config(pool, model_dir, cpu_bytes=1 << 20)
    get_kv_connector_cache_layout(small)
    room = free - (1 << 20) >= vllm_ipc_bytes(small.parallel_config)
    assert bool([r for r in caplog.records if r.name == "shmkv.vllm.sizing"]) == (not room)
    caplog.clear()
    get_kv_connector_cache_layout(make_vllm_config(pool, model_dir, cpu_bytes=free))
    warned = [r.getMessage() for r in caplog.records if r.name == "shmkv.vllm.sizing"]
    assert len(warned) == 1, caplog.text
    assert "vLLM's own inter-process queues" in warned[0] and "--shm-size" in warned[0]
    assert _mine(pool) == []
