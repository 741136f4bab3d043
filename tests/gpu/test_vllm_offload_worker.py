"""Worker side of the shared offload tier on a GPU: two replicas' vLLM CPUOffloadingWorkers
(vLLM's own transfer code) over shmkv's one data region. Replica 0 stores GPU blocks into
chunks; replica 1, another worker with its own GPU KV cache, loads those chunks and gets
the same bytes. Skipped without CUDA (run by scripts/gpu_check.sh)."""

from __future__ import annotations

import os
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm.v1.kv_offload.cpu.gpu_worker")

from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec  # noqa: E402

from shmkv.vllm import SharedCPUOffloadingManager  # noqa: E402
from tests.conftest import unique_pool_name  # noqa: E402
from tests.unit.test_vllm_offload_bad_input import make_config  # noqa: E402

pytestmark = pytest.mark.gpu
PAGE = os.sysconf("SC_PAGE_SIZE")
NUM_GPU_BLOCKS = 16


def _kv_caches(seed: int) -> CanonicalKVCaches:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    tensor = torch.randint(-128, 127, (NUM_GPU_BLOCKS, PAGE), dtype=torch.int8, device="cuda",
                           generator=gen)
    return CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(tensor=tensor, page_size_bytes=PAGE)],
        group_data_refs=[[CanonicalKVCacheRef(tensor_idx=0, page_size_bytes=PAGE)]],
    )


def _finish(worker, job_id: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done = {r.job_id: r.success for r in worker.get_finished()}
        if job_id in done:
            assert done[job_id], f"job {job_id} failed"
            return
        time.sleep(0.001)
    raise AssertionError(f"job {job_id} did not finish in 30 s")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_replica1_loads_what_replica0_stored():
    """Blocks 2, 5, 7 of replica 0's GPU cache, stored to chunks 0..2 of the shared region,
    load into blocks 1, 3, 4 of replica 1's GPU cache byte for byte."""
    from shmkv.vllm import SharedCPUOffloadingSpec

    pool = unique_pool_name("vg")
    config = make_config(pool, kv_bytes_per_block=PAGE, cpu_bytes=8 * PAGE)
    try:
        spec0, spec1 = SharedCPUOffloadingSpec(config), SharedCPUOffloadingSpec(config)
        caches0, caches1 = _kv_caches(0), _kv_caches(1)
        worker0, worker1 = spec0.get_worker(caches0), spec1.get_worker(caches1)
        src, dst, chunks = [2, 5, 7], [1, 3, 4], [0, 1, 2]
        assert worker0.submit_store(1, GPULoadStoreSpec(src, [3], [0]), CPULoadStoreSpec(chunks))
        _finish(worker0, 1)
        assert worker1.submit_load(2, CPULoadStoreSpec(chunks), GPULoadStoreSpec(dst, [3], [0]))
        _finish(worker1, 2)
        torch.cuda.synchronize()
        got = caches1.tensors[0].tensor[dst].cpu()
        want = caches0.tensors[0].tensor[src].cpu()
        assert torch.equal(got, want)
        worker0.shutdown()
        worker1.shutdown()
    finally:
        SharedCPUOffloadingManager.unlink(pool)
