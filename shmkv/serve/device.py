"""Where ``shmkv run`` computes: ``--device``, ``--kv``, ``--dtype``, checked together before
anything starts.

- ``--device cpu | cuda | cuda:N | auto``: ``auto`` is ``cuda:0`` when torch sees a CUDA
  device and ``cpu`` otherwise; ``cuda`` is ``cuda:0``. The ranks run the model there, the
  front end runs its no-cache reference there too.
- ``--kv device | host`` (``shmkv/serve/placement.py``): ``device``, the default, is one KV
  tensor per pool on the device that every rank of the pool attends over in place (on a
  GPU, shared through CUDA IPC; on the CPU, a shared-memory tensor every rank maps);
  ``host`` is the node-wide store in (pinned) shared memory, each rank keeping a cache of
  its running requests' blocks on its device and copying blocks in and out.
- ``--dtype float32 | bfloat16``: the model's and the KV cache's; by default bfloat16 for
  ``--model small`` on a GPU and float32 otherwise. In float32 every token must equal the
  reference's; in bfloat16 greedy flips are reported (``shmkv/serve/report.py``), not
  failed.

A replay (``--model none``) runs no model: none of the three applies to it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from shmkv.errors import UsageError

__all__ = ["DTYPES", "KV_PLACEMENTS", "RunDevice", "device_memory_used_bytes",
           "resolve_device", "resolve_run_device"]

KV_PLACEMENTS = ("device", "host")
DTYPES = ("float32", "bfloat16")
_CUDA = re.compile(r"cuda(?::(\d+))?")


def _cuda_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device(text: str, *, num_cuda_devices: int | None = None) -> str:
    """``cpu`` or ``cuda:N`` for ``--device text``. ``num_cuda_devices``: what torch sees
    (asked when None).

    Raises:
        UsageError: not one of the forms, or CUDA asked for where there is none (or not
            that many devices); the message names ``--device`` and the value.
    """
    if not isinstance(text, str):
        raise UsageError(f"--device must be cpu, cuda, cuda:N or auto, got {text!r}")
    if text == "cpu":
        return "cpu"
    count = _cuda_count() if num_cuda_devices is None else num_cuda_devices
    if text == "auto":
        return "cuda:0" if count else "cpu"
    m = _CUDA.fullmatch(text)
    if m is None:
        raise UsageError(f"--device must be cpu, cuda, cuda:N or auto, got {text!r}")
    index = int(m.group(1) or 0)
    if not count:
        raise UsageError(f"--device {text}: torch sees no CUDA device here "
                         "(torch.cuda.is_available() is False); use --device cpu or auto")
    if index >= count:
        raise UsageError(f"--device {text}: torch sees {count} CUDA device(s), "
                         f"cuda:0..cuda:{count - 1}")
    return f"cuda:{index}"


@dataclass(frozen=True)
class RunDevice:
    """The resolved ``--device`` / ``--kv`` / ``--dtype`` of a run."""

    device: str = "cpu"  # "cpu" or "cuda:N"
    kv: str = "device"
    dtype: str = "float32"

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def exact_tokens(self) -> bool:
        """Whether every token must equal the reference's (float32), or greedy flips are
        reported only (bfloat16)."""
        return self.dtype == "float32"


def resolve_run_device(device: str = "cpu", kv: str | None = None, dtype: str | None = None,
                       model: str = "tiny", *, num_cuda_devices: int | None = None
                       ) -> RunDevice:
    """Checks the three options together, with the model (``tiny``, ``small`` or ``none``);
    fills the defaults.

    Raises:
        UsageError: naming the argument, its value and the rule.
    """
    if kv is not None and kv not in KV_PLACEMENTS:
        raise UsageError(f"--kv must be one of {', '.join(KV_PLACEMENTS)}, got {kv!r}")
    if dtype is not None and dtype not in DTYPES:
        raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if model == "none":
        given = [f"--{k} {v}" for k, v in (("device", device), ("kv", kv), ("dtype", dtype))
                 if v is not None and not (k == "device" and v == "cpu")]
        if given:
            raise UsageError(f"--model none (a replay) runs no model, so {' and '.join(given)} "
                             "does not apply; leave it out or pick a model")
        return RunDevice()
    if model not in ("tiny", "small"):
        raise UsageError(f"--model must be one of tiny, small, none, got {model!r}")
    resolved = resolve_device(device, num_cuda_devices=num_cuda_devices)
    if dtype is None:
        dtype = "bfloat16" if model == "small" and resolved != "cpu" else "float32"
    return RunDevice(device=resolved, kv=kv or "device", dtype=dtype)


def device_memory_used_bytes(device: str) -> int | None:
    """Bytes in use on the GPU ``device`` by every process (total minus free, as
    ``nvidia-smi`` counts); None on the CPU."""
    if not device.startswith("cuda"):
        return None
    import torch

    free, total = torch.cuda.mem_get_info(torch.device(device))
    return int(total - free)
