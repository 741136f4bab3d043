"""``shmkv run`` on CUDA, against its CPU twin: the host placement's device cache on a GPU
gives the reference's tokens and the same bytes in the store as on the CPU; the device
placement's pool tensor, opened by another process through CUDA IPC, is the same memory;
whole runs with both placements serve with 0 mismatches in float32, and bfloat16 reports
its flips instead of failing. Skipped without CUDA (run by scripts/gpu_check.sh)."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp

import pytest

torch = pytest.importorskip("torch")

from shmkv.serve.device import RunDevice  # noqa: E402
from shmkv.serve.model import TinyModelConfig, TinyTransformer  # noqa: E402
from shmkv.serve.placement import DeviceKV, KVPlacement, PoolKV  # noqa: E402
from shmkv.serve.rank import ModelRunner  # noqa: E402
from shmkv.serve.runner import RunConfig, Runner  # noqa: E402
from shmkv.serve.small_model import SMALL_MODEL_CONFIG  # noqa: E402
from shmkv.serve.workload import ChatWorkloadConfig, chat_workload  # noqa: E402
from tests.conftest import unique_pool_name  # noqa: E402
from tests.unit.test_kv_placement import _decode, _Rig  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]


def test_host_cache_on_cuda_gives_the_cpu_twins_tokens_and_store_bytes():
    """The same steps through a HostCache on the CPU and on cuda:0 (float32): tokens equal
    the reference's on each device, and the store's completed blocks are equal."""
    config = TinyModelConfig()
    stores, tokens = {}, {}
    for device in ("cpu", "cuda:0"):
        rig = _Rig(config)
        try:
            runner = ModelRunner(rig.name, KVPlacement("host", device, "float32", rig.name),
                                 config)
            rig.runners.append(runner)
            model = TinyTransformer(config, device=device)
            prompt = list(range(3, 17))
            got = _decode(rig, runner, "a", 0, ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10]), prompt,
                          0, 5)
            other = prompt[:12] + [50, 51]
            got += _decode(rig, runner, "b", 1, ([1, 2, 3, 11, 12], [0, 7, 8, 13, 14]), other,
                           12, 4)
            assert got == model.reference_generate(prompt, 5) + model.reference_generate(
                other, 4)
            assert runner.kv_store.num_loaded_blocks > 0
            tokens[device] = got
            stores[device] = rig.store.kv.clone()
        finally:
            rig.close()
    full = [1, 2, 3, 4, 6, 7, 8, 9, 11, 13]
    torch.testing.assert_close(stores["cuda:0"][:, :, full], stores["cpu"][:, :, full],
                               rtol=1e-4, atol=1e-4)
    assert tokens["cuda:0"] == tokens["cpu"]


def _write_block(placement: KVPlacement, block_id: int, value: float) -> None:
    kv = DeviceKV(placement)
    kv.kv[:, :, block_id].fill_(value)
    torch.cuda.synchronize()
    kv.close()


def test_device_placement_tensor_is_one_memory_for_every_process():
    """The front end's pool tensor, opened through CUDA IPC by another process, is the
    same memory: what the child writes into block 3 the front end reads."""
    run = RunDevice("cuda:0", "device", "float32")
    pool = PoolKV(unique_pool_name("ipc"), TinyModelConfig(), 8, 4, run)
    try:
        assert pool.store is None and pool.placement.handle is not None
        ctx = mp.get_context("spawn")
        p = ctx.Process(target=_write_block, args=(pool.placement, 3, 7.0))
        p.start()
        p.join(120)
        assert p.exitcode == 0
        assert bool((pool.tensor[:, :, 3] == 7.0).all())
        assert int(torch.count_nonzero(pool.tensor[:, :, 2])) == 0
    finally:
        pool.close()


def _run(kv: str, pool: str = "shared", model=None, dtype: str = "float32", **kw) -> dict:
    model = model or TinyModelConfig()
    workload = chat_workload(ChatWorkloadConfig(num_conversations=kw.pop("conversations", 8),
                                                vocab_size=model.vocab_size))
    cfg = RunConfig(num_schedulers=kw.pop("schedulers", 2), pool=pool, model=model,
                    run_device=RunDevice("cuda:0", kv, dtype), **kw)
    result = Runner(cfg, workload, log=lambda _: None).run()
    assert result.problems == [], result.problems
    return result.figures


@pytest.mark.parametrize("kv", ["device", "host"])
def test_run_on_cuda_float32_has_no_mismatch(kv):
    """Two schedulers, the tiny model on cuda:0 in float32: every token the reference's,
    GPU memory sampled, the pool valid."""
    f = _run(kv, num_blocks=256)
    assert f["requests"] == f["requests_total"] and f["token_mismatches"] == 0
    assert (f["device"], f["kv"]) == ("cuda:0", kv) and f["pool_valid"]
    assert f["peak_device_memory_bytes"] > 0


def test_small_model_on_cuda_shared_device_placement_computes_fewer_prefill_tokens():
    """--model small in float32 on the GPU: 0 mismatches, and with the same blocks the shared
    pool tensor computes fewer prefill tokens than private pools."""
    shared = _run("device", "shared", SMALL_MODEL_CONFIG, num_blocks=512, conversations=12)
    private = _run("device", "private", SMALL_MODEL_CONFIG, num_blocks=512, conversations=12)
    for f in (shared, private):
        assert f["requests"] == f["requests_total"] and f["token_mismatches"] == 0
    assert shared["prefill_tokens_computed"] < private["prefill_tokens_computed"]


def test_bfloat16_reports_flips_instead_of_failing():
    """In bfloat16 the run is not an exact check: flips (if any) come with their position
    and the reference's logit gap, and the run's problems stay empty."""
    cut = dataclasses.replace(SMALL_MODEL_CONFIG, num_layers=4, sliding_window=(None,) * 4)
    f = _run("host", model=cut, dtype="bfloat16", num_blocks=256)
    assert f["requests"] == f["requests_total"] and not f["exact_tokens"]
    assert len(f["divergences"]) == min(f["requests_mismatched"], 5)
    if f["divergences"]:
        assert f["max_logit_gap"] >= 0
