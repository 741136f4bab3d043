"""The device placement's building block: one CUDA tensor that the processes driving a GPU
share through CUDA IPC (the exporter keeps it alive; the others map it)."""

from __future__ import annotations

import pickle

from shmkv.errors import UsageError
from shmkv.ranks._common import LazyTorch

torch = LazyTorch(globals())


def export_device_tensor(tensor: torch.Tensor) -> bytes:
    """A handle to a CUDA tensor that another process on the node opens with
    ``open_device_tensor`` (CUDA IPC; the exporter must keep ``tensor`` alive)."""
    if not tensor.is_cuda:
        raise UsageError(f"export_device_tensor needs a CUDA tensor, got one on {tensor.device}")
    from torch.multiprocessing.reductions import reduce_tensor

    return pickle.dumps(reduce_tensor(tensor))


def open_device_tensor(handle: bytes) -> torch.Tensor:
    """The CUDA tensor behind ``export_device_tensor``'s handle, mapped into this process."""
    rebuild, args = pickle.loads(handle)
    return rebuild(*args)
