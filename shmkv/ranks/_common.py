"""What the modules of ``shmkv.ranks`` share: torch imported on first use, the header check of
their segments, argument checks, the with-block of a segment's owner, and the stand-in for a
closed mapping."""

from __future__ import annotations

from typing import Any, TypeVar

import numpy as np

from shmkv.errors import LayoutMismatchError, PoolClosedError, UsageError
from shmkv.pool import layout as L
from shmkv.pool.segment import Segment

MAX_BLOCK_ID = (1 << 31) - 1
DTYPE_NAMES = ("float32", "float16", "bfloat16", "float64", "float8_e4m3fn", "uint8")


_Owner = TypeVar("_Owner", bound="SegmentOwner")


class SegmentOwner:
    """The with-block of an object over one segment (``name``, ``close()``, ``_owner``): it
    closes the object, and the creator's with-block removes the segment's name too."""

    name: str
    _owner: bool

    def __enter__(self: _Owner) -> _Owner:
        return self

    def __exit__(self, *exc: object) -> None:
        name = self.name
        self.close()
        if self._owner:
            Segment.unlink(name)


class LazyTorch:
    """torch, imported on first use: a scheduler that only writes rows never loads it.

    Each module binds its own (``torch = LazyTorch(globals())``); the first attribute read
    puts the real module in that module's globals, so later reads cost nothing."""

    def __init__(self, namespace: dict[str, Any]) -> None:
        self._namespace = namespace

    def __getattr__(self, name: str) -> Any:
        import torch as real

        self._namespace["torch"] = real
        return getattr(real, name)


def torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


def align(n: int, to: int = L.ALIGN_BYTES) -> int:
    return (n + to - 1) // to * to


def positive_int(what: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise UsageError(f"{what} must be a positive int, got {value!r}")
    return value


def dtype_name(dtype: object) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_NAMES:
        raise UsageError(f"dtype {dtype!r} is not one of {sorted(DTYPE_NAMES)}")
    return name


def check_header(seg: Segment, hdr: np.void, magic: int, version: int,
                 header_bytes: int, total_bytes: int | None) -> None:
    """Magic, version, header size, total size: in this order, naming the field."""
    name = seg.shm_name

    def mismatch(field: str, want: object, found: object, what: str = "") -> LayoutMismatchError:
        return LayoutMismatchError(
            f"segment {name}: header field {field} is {found!r}, expected {want!r}{what}")

    if int(hdr["magic"]) != magic:
        raise mismatch("magic", hex(magic), hex(int(hdr["magic"])),
                       ": not a segment of this kind")
    if int(hdr["layout_version"]) != version:
        raise mismatch("layout_version", version, int(hdr["layout_version"]),
                       " (made by another shmkv version)")
    if int(hdr["header_bytes"]) != header_bytes:
        raise mismatch("header_bytes", header_bytes, int(hdr["header_bytes"]))
    if total_bytes is not None and int(hdr["total_bytes"]) != total_bytes:
        raise mismatch("total_bytes", total_bytes, int(hdr["total_bytes"]))
    if seg.size_bytes < int(hdr["total_bytes"]):
        raise LayoutMismatchError(
            f"segment {name} is {seg.size_bytes} bytes but its header describes "
            f"{int(hdr['total_bytes'])}")


class Closed:
    """Stands in for the views of a closed mapping: any use raises PoolClosedError."""

    def __init__(self, name: str) -> None:
        self._name = name

    def _fail(self, *args: object, **kwargs: object):
        raise PoolClosedError(f"{self._name} was closed; attach again")

    __getitem__ = __setitem__ = __getattr__ = __iter__ = __len__ = _fail
