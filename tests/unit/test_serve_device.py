"""``--device`` / ``--kv`` / ``--dtype`` / ``--model`` resolved and refused before a run
starts, and ``--model small``: its real size counted, its shape run cut down on the CPU
(paged forward over both placements' views equals the no-cache reference)."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from shmkv.errors import UsageError  # noqa: E402
from shmkv.ranks.block_table import batch_token_indices, compute_slot_mapping  # noqa: E402
from shmkv.serve.device import RunDevice, resolve_device, resolve_run_device  # noqa: E402
from shmkv.serve.model import TinyTransformer  # noqa: E402
from shmkv.serve.runner import RunConfig, Runner  # noqa: E402
from shmkv.serve.small_model import (  # noqa: E402
    SMALL_MODEL_CONFIG,
    model_config_for,
    num_parameters,
)
from shmkv.serve.workload import TraceRequest  # noqa: E402


def test_device_forms_resolve_and_cuda_without_a_gpu_is_refused_naming_device():
    """cpu stays cpu; auto is cpu without CUDA and cuda:0 with it; cuda is cuda:0; cuda:N
    must exist; anything else names --device and the value."""
    assert resolve_device("cpu", num_cuda_devices=0) == "cpu"
    assert resolve_device("auto", num_cuda_devices=0) == "cpu"
    assert resolve_device("auto", num_cuda_devices=2) == "cuda:0"
    assert resolve_device("cuda", num_cuda_devices=1) == "cuda:0"
    assert resolve_device("cuda:1", num_cuda_devices=2) == "cuda:1"
    with pytest.raises(UsageError, match=r"--device cuda: torch sees no CUDA device"):
        resolve_device("cuda", num_cuda_devices=0)
    with pytest.raises(UsageError, match=r"--device cuda:2: torch sees 2 CUDA device\(s\)"):
        resolve_device("cuda:2", num_cuda_devices=2)
    for bad in ("gpu", "cuda:", "cuda:x", "CPU", "", None):
        with pytest.raises(UsageError, match="--device must be cpu, cuda, cuda:N or auto"):
            resolve_device(bad, num_cuda_devices=1)


def test_this_machine_resolves_auto_to_what_torch_sees():
    """auto here is cuda:0 exactly when torch sees a GPU (cpu on the CI machine)."""
    assert resolve_run_device("auto").device == (
        "cuda:0" if torch.cuda.is_available() else "cpu")


def test_run_options_default_and_combine():
    """Defaults: the device placement, float32 (bfloat16 for small on a GPU); --kv and
    --dtype take only their choices; a replay takes none of the three."""
    assert resolve_run_device("cpu") == RunDevice("cpu", "device", "float32")
    assert resolve_run_device("cpu", "host", None, "small") == RunDevice("cpu", "host",
                                                                          "float32")
    assert resolve_run_device("cuda", None, None, "small", num_cuda_devices=1) == RunDevice(
        "cuda:0", "device", "bfloat16")
    assert resolve_run_device("cuda", None, "float32", "small", num_cuda_devices=1).dtype == (
        "float32")
    assert not RunDevice(dtype="bfloat16").exact_tokens and RunDevice().exact_tokens
    for args, needle in [(("cpu", "gpu"), "--kv must be one of device, host, got 'gpu'"),
                         (("cpu", None, "float16"), "--dtype must be one of float32, bfloat16"),
                         (("cpu", "host", None, "none"), "--model none .* --kv host"),
                         (("cuda", None, None, "none"), "--model none .* --device cuda"),
                         (("cpu", None, "bfloat16", "none"), "--dtype bfloat16"),
                         (("cpu", None, None, "huge"), "--model must be one of")]:
        with pytest.raises(UsageError, match=needle):
            resolve_run_device(*args, num_cuda_devices=0)
    assert resolve_run_device("cpu", None, None, "none") == RunDevice()
    with pytest.raises(UsageError, match="--model must be one of tiny, small"):
        model_config_for("medium")


def test_a_replay_with_a_device_is_refused_before_anything_starts():
    """RunConfig refuses a replay given a device, and the Runner makes nothing."""
    cfg = RunConfig(num_schedulers=1, model_free=True, run_device=RunDevice(kv="host"))
    with pytest.raises(UsageError, match="a replay .* runs no model"):
        Runner(cfg, [TraceRequest(request_id="r", prompt_token_ids=[1, 2, 3])])


def test_small_model_has_a_llama_like_size_of_half_to_one_billion_parameters():
    """Counted from the configuration (the full model is not built in CI); the count is
    the built model's own, checked on a cut-down copy."""
    n = num_parameters(SMALL_MODEL_CONFIG)
    assert 0.5e9 <= n <= 1e9, n
    c = SMALL_MODEL_CONFIG
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_size) == (
        20, 1536, 12, 4, 128)
    assert set(c.sliding_window) == {None}
    cut = _cut_down_small()
    assert num_parameters(cut) == sum(p.numel() for p in TinyTransformer(cut).parameters())


def _cut_down_small():
    return dataclasses.replace(SMALL_MODEL_CONFIG, vocab_size=512, num_layers=2,
                               hidden_size=64, intermediate_size=96, num_heads=4,
                               num_kv_heads=2, head_size=16, sliding_window=(None, None))


class _KV:
    """A plain tensor as forward_paged's kv (what DeviceKV and HostCache hand it)."""

    def __init__(self, c, num_blocks, block_size, dtype):
        self.block_size = block_size
        kv = torch.zeros(c.num_layers, 2, num_blocks, block_size, c.num_kv_heads,
                         c.head_size, dtype=dtype)
        self.key_cache = [kv[i, 0] for i in range(c.num_layers)]
        self.value_cache = [kv[i, 1] for i in range(c.num_layers)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_model_shape_runs_paged_on_the_cpu_like_its_reference(dtype):
    """The small model's shape, cut down, prefills and decodes over a paged cache on the
    CPU: float32 logits equal the no-cache reference's (greedy tokens identical); bfloat16
    logits stay close to its own reference."""
    c = _cut_down_small()
    model = TinyTransformer(c, dtype=dtype)
    kv = _KV(c, 8, 4, dtype)
    prompt = [7, 300, 12, 511, 2, 90, 45]
    table = torch.tensor([[3, 5, 1]], dtype=torch.int32)
    req, pos = batch_token_indices([len(prompt)], [0])
    logits = model.forward_paged(torch.tensor(prompt), pos, torch.tensor([0, len(prompt)]),
                                 torch.tensor([len(prompt)]), [table],
                                 [compute_slot_mapping(table, req, pos, 4)], kv)
    ref = model.forward_reference(prompt)[-1]
    assert logits.dtype == torch.float32
    if dtype == torch.float32:
        torch.testing.assert_close(logits[0], ref, rtol=1e-4, atol=1e-4)
        assert int(logits[0].argmax()) == int(ref.argmax())
    else:
        assert float((logits[0] - ref).abs().max()) < 0.1 * float(ref.abs().max())


def test_a_flip_is_reported_with_its_position_and_the_reference_logit_gap():
    """A served token that differs from the reference at generated token 2: the check
    finds index 2 and the reference's logit of its own choice minus the served token's;
    in bfloat16 the figures list it without making it exact-checked."""
    from types import SimpleNamespace

    from shmkv.serve.report import _device_figures
    from shmkv.serve.runner import RequestRecord
    from shmkv.serve.token_check import _check_tokens
    from shmkv.serve.workload import TraceRequest

    model = TinyTransformer(_cut_down_small())
    prompt = [4, 99, 250, 17]
    ref = model.reference_generate(prompt, 4)
    served = list(ref)
    served[2] = (ref[2] + 1) % 512
    rec = RequestRecord(trace=TraceRequest(request_id="r0", prompt_token_ids=prompt),
                        prompt_token_ids=prompt,
                        result=SimpleNamespace(output_token_ids=served))
    _check_tokens(model, rec)
    assert rec.mismatch == 2
    logits = model.forward_reference(prompt + served[:2])[-1]
    assert rec.logit_gap == pytest.approx(float(logits[ref[2]] - logits[served[2]]))
    assert rec.logit_gap > 0
    cfg = SimpleNamespace(run_device=RunDevice(dtype="bfloat16"))
    f = _device_figures(cfg, [rec], [{"device_memory_bytes": 5}, {"device_memory_bytes": 9}])
    assert f["exact_tokens"] is False and f["peak_device_memory_bytes"] == 9
    assert f["divergences"] == [{"request_id": "r0", "position": 2,
                                 "logit_gap": rec.logit_gap}]
    assert f["max_logit_gap"] == rec.logit_gap
