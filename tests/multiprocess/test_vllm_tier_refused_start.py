"""A replica the tier refuses at start leaves /dev/shm exactly as it found it: vLLM's plain
``OffloadingConnector`` (whose workers would otherwise make the tier before the engine core
is refused), a tier larger than /dev/shm's room, a pipeline-parallel layout. Real vLLM
0.33.0 workers' connectors, built as vLLM builds them; every object whose name carries the
test's pool name is compared byte for byte before and after."""

from __future__ import annotations

import hashlib
import os

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")
pytest.importorskip("einops")  # vLLM's model inspection imports it (vllm_peer/requirements)

from shmkv.errors import NoSpaceError, UsageError  # noqa: E402
from shmkv.vllm import SharedCPUOffloadingManager  # noqa: E402
from tests.conftest import unique_pool_name  # noqa: E402
from tests.multiprocess.vllm_scheduler_driver import (  # noqa: E402
    make_kv_cache_config,
    make_vllm_config,
    worker_spec,
    write_model_dir,
)

pytestmark = [pytest.mark.multiprocess, pytest.mark.long]


def _shm_of(pool: str) -> dict[str, str]:
    """Every /dev/shm entry naming ``pool``, with a digest of its bytes."""
    out = {}
    for entry in sorted(os.listdir("/dev/shm")):
        if pool in entry:
            with open(f"/dev/shm/{entry}", "rb") as f:
                out[entry] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.fixture
def tier(tmp_path):
    pool = unique_pool_name("ref")
    yield pool, write_model_dir(str(tmp_path / "model"))
    SharedCPUOffloadingManager.unlink(pool)


def test_the_plain_offloading_connector_is_refused_before_anything_is_made(tier):
    """A worker built by vLLM's own OffloadingConnector with shmkv's spec is refused, naming
    the connector to set, and makes nothing (before, it made the pool, the table and a
    full-size data region, then its engine core was refused)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )

    pool, model_dir = tier
    before = _shm_of(pool)
    vllm_config = make_vllm_config(pool, model_dir, connector="OffloadingConnector")
    with set_current_vllm_config(vllm_config), pytest.raises(
            UsageError, match='"kv_connector": "SharedOffloadingConnector"'):
        OffloadingConnector(vllm_config, KVConnectorRole.WORKER, make_kv_cache_config())
    assert _shm_of(pool) == before == {}


def test_a_tier_larger_than_dev_shm_is_refused_before_anything_is_made(tier):
    """A tier whose data region cannot fit /dev/shm is a NoSpaceError naming both sizes,
    and nothing of the tier is made (before: its pool and table stayed behind)."""
    pool, model_dir = tier
    st = os.statvfs("/dev/shm")
    too_big = st.f_bavail * st.f_frsize + (1 << 30)
    before = _shm_of(pool)
    spec = worker_spec(pool, model_dir, cpu_bytes=too_big)
    with pytest.raises(NoSpaceError, match=r"needs at least .* bytes in /dev/shm .* nothing "
                                           r"was made"):
        spec.open_data_region(0)
    assert _shm_of(pool) == before == {}


def test_a_pipeline_parallel_replica_is_refused_naming_the_layout(tier):
    """A PP=2 worker is refused at its spec's construction, naming the layout (never as a
    replica that differs from the tier), and makes nothing."""
    pool, model_dir = tier
    with pytest.raises(UsageError, match=r"does not support pipeline parallelism "
                                         r"\(pipeline_parallel_size=2"):
        worker_spec(pool, model_dir, parallel={"pipeline_parallel_size": 2})
    assert _shm_of(pool) == {}
