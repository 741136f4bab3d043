"""The KV store: every layer's K and V over one POSIX shared-memory segment (the host tier).

One segment per pool, ``/shmkv_kv-<name>-v<KV_LAYOUT_VERSION>``, mode 0600: a 4 KiB header,
then the data, page-aligned (``cudaHostRegister`` wants pages).

Header fields (little-endian, ``KV_HEADER_DTYPE``): `magic` (u64, ``KV_MAGIC``, written last),
`layout_version` (u32), `header_bytes` (u32), `total_bytes` (u64), `num_layers`,
`num_blocks`, `block_size`, `num_kv_heads`, `head_size`, `element_bytes`, `creator_pid`,
`layout` (u32 each; `layout`: 0 layer-major, 1 block-major), `dtype` (S16, the torch dtype's
name); at byte 128 the owner record (``shmkv/pool/layout.py``, "Sibling segments": the
creator and the pool whose block ids index the store, for ``shmkv cleanup``).

The data, one of two layouts chosen at ``create`` (the same bytes in all, ``2 *
num_layers * num_blocks * block_size * num_kv_heads * head_size`` elements)::

    layer_major  kv: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_size]
                 layer l's K for every block, then its V, then layer l + 1 ...
                 key_cache[l] = kv[l, 0], contiguous: a model attends over it in place
                 (the CPU ranks of ``shmkv run``), slot s = block * block_size + offset.
    block_major  kv: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_size]
                 block b's K and V of every layer, then block b + 1 ...
                 key_cache[l] = kv[:, l, 0], a strided view ``[num_blocks, block_size,
                 ...]`` (index it by (block, offset)); one block is one contiguous range,
                 so moving a set of blocks to or from a GPU is one DMA per run of
                 consecutive ids (``shmkv/ranks/transfer.py``): the host tier for GPU ranks.

Block id ``b`` of the pool names block ``b`` of every layer (the host tier of DESIGN section
1). Who writes a block: the rank whose request holds it (a block is written only while one
request holds it alone, before it is cached; once cached it is only read), provided every
scheduler caches a step's blocks only after its rank has answered (``delay_cache_blocks``,
then ``cache_blocks``; see ``shmkv/serve/rank.py``), and a rank that computes on a GPU has
``store_blocks`` return before it answers.

The store has no protocol of its own: block ownership comes from the pool.

Changelog: kv v1: initial. kv v2: the owner record (versions and magics now in
``shmkv/pool/layout.py``). kv v3: the owner record grows to 112 bytes. kv v4: the header's
`layout` field (was padding) and the block-major layout.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from shmkv.errors import LayoutMismatchError, UsageError
from shmkv.pool import layout as L
from shmkv.pool.segment import Segment
from shmkv.pool.siblings import owner_record, write_owner
from shmkv.ranks import transfer
from shmkv.ranks._common import (
    DTYPE_NAMES,
    MAX_BLOCK_ID,
    Closed,
    LazyTorch,
    SegmentOwner,
    check_header,
    dtype_name,
    positive_int,
    torch_dtype,
)

torch = LazyTorch(globals())

KV_LAYOUT_VERSION = L.KV_LAYOUT_VERSION
KV_MAGIC = L.KV_MAGIC
KV_HEADER_BYTES = 4096  # the data starts page-aligned (cudaHostRegister wants pages)
LAYER_MAJOR = transfer.LAYER_MAJOR
BLOCK_MAJOR = transfer.BLOCK_MAJOR
KV_LAYOUTS = transfer.KV_LAYOUTS  # header code: the index

KV_HEADER_DTYPE = np.dtype([
    ("magic", "<u8"), ("layout_version", "<u4"), ("header_bytes", "<u4"),
    ("total_bytes", "<u8"), ("num_layers", "<u4"), ("num_blocks", "<u4"),
    ("block_size", "<u4"), ("num_kv_heads", "<u4"), ("head_size", "<u4"),
    ("element_bytes", "<u4"), ("creator_pid", "<u4"), ("layout", "<u4"),
    ("dtype", "S16"),
])


def kv_store_segment_name(name: str) -> str:
    return L.sibling_segment_name("kv", name, KV_LAYOUT_VERSION)


class KVStore(SegmentOwner):
    """Per layer K and V, ``[num_blocks, block_size, num_kv_heads, head_size]``, over one
    POSIX shared-memory segment that every process maps (the host tier).

    ``kv`` is the whole store in its layout (``layout``: ``"layer_major"`` or
    ``"block_major"``, see the module docstring); ``key_cache[l]`` / ``value_cache[l]`` are
    layer ``l``'s views in both. ``load_blocks`` / ``store_blocks`` copy blocks to and from
    a device cache (``allocate_device_cache``: layer-major on every layout)."""

    def __init__(self, segment: Segment, owner: bool) -> None:
        self._segment = segment
        self._owner = owner
        h = np.ndarray((1,), KV_HEADER_DTYPE, buffer=segment.buf)[0]
        self.num_layers = int(h["num_layers"])
        self.num_blocks = int(h["num_blocks"])
        self.block_size = int(h["block_size"])
        self.num_kv_heads = int(h["num_kv_heads"])
        self.head_size = int(h["head_size"])
        self.dtype = torch_dtype(bytes(h["dtype"]).decode())
        self.layout = KV_LAYOUTS[int(h["layout"])]
        del h
        block = (self.block_size, self.num_kv_heads, self.head_size)
        if self.layout == BLOCK_MAJOR:
            shape = (self.num_blocks, self.num_layers, 2, *block)
        else:
            shape = (self.num_layers, 2, self.num_blocks, *block)
        count = math.prod(shape)
        self.kv = torch.frombuffer(segment.buf, dtype=self.dtype, count=count,
                                   offset=KV_HEADER_BYTES).view(shape)
        if self.layout == BLOCK_MAJOR:
            self.key_cache = [self.kv[:, i, 0] for i in range(self.num_layers)]
            self.value_cache = [self.kv[:, i, 1] for i in range(self.num_layers)]
        else:
            self.key_cache = [self.kv[i, 0] for i in range(self.num_layers)]
            self.value_cache = [self.kv[i, 1] for i in range(self.num_layers)]
        self.name = segment.shm_name
        self._pinned = False
        self._copy_streams: dict[int, Any] = {}  # per CUDA device index

    @staticmethod
    def _total_bytes(num_layers, num_blocks, block_size, num_kv_heads, head_size,
                     element_bytes) -> int:
        data = 2 * num_layers * num_blocks * block_size * num_kv_heads * head_size * element_bytes
        return KV_HEADER_BYTES + data  # exact, so any changed size field shows

    @classmethod
    def create(cls, name: str, *, num_layers: int, num_blocks: int, block_size: int,
               num_kv_heads: int, head_size: int, dtype: object = "float32",
               pool: str | None = None, layout: str = LAYER_MAJOR) -> KVStore:
        """A new, zero-filled store. ``pool``: the pool whose block ids index it, recorded
        with this process as its owner (``shmkv cleanup`` keeps it while either lives).
        ``layout``: ``"layer_major"`` (a model attends over the store in place) or
        ``"block_major"`` (the host tier of GPU ranks: each block one contiguous range,
        copied at the bus's speed); see the module docstring.

        Raises:
            UsageError: a bad size or dtype (nothing is created).
            SegmentExistsError: a store of that name exists already.
            NoSpaceError: /dev/shm has no room for it (nothing is left behind).
        """
        shm_name = kv_store_segment_name(name)
        for what, v in [("num_layers", num_layers), ("num_blocks", num_blocks),
                        ("block_size", block_size), ("num_kv_heads", num_kv_heads),
                        ("head_size", head_size)]:
            positive_int(what, v)
        if num_blocks > MAX_BLOCK_ID:
            raise UsageError(f"num_blocks {num_blocks} exceeds {MAX_BLOCK_ID}")
        if layout not in KV_LAYOUTS:
            raise UsageError(f"layout {layout!r} is not one of {list(KV_LAYOUTS)}")
        dname = dtype_name(dtype)
        element_bytes = torch_dtype(dname).itemsize
        total = cls._total_bytes(num_layers, num_blocks, block_size, num_kv_heads, head_size,
                                 element_bytes)
        owner = owner_record(pool)
        seg = Segment.create(shm_name, total, "KV store")
        try:
            h = np.ndarray((1,), KV_HEADER_DTYPE, buffer=seg.buf)
            h["layout_version"] = KV_LAYOUT_VERSION
            h["header_bytes"] = KV_HEADER_BYTES
            h["total_bytes"] = total
            h["num_layers"] = num_layers
            h["num_blocks"] = num_blocks
            h["block_size"] = block_size
            h["num_kv_heads"] = num_kv_heads
            h["head_size"] = head_size
            h["element_bytes"] = element_bytes
            h["creator_pid"] = os.getpid()
            h["dtype"] = dname.encode()
            h["layout"] = KV_LAYOUTS.index(layout)
            write_owner(seg.buf, L.KV_OWNER_OFFSET, owner)
            h["magic"] = KV_MAGIC
            del h
            return cls(seg, owner=True)
        except BaseException:
            seg.close()
            Segment.unlink(shm_name)
            raise

    @classmethod
    def attach(cls, name: str) -> KVStore:
        """Maps an existing store, validating magic, version, dtype and sizes.

        Raises:
            SegmentNotFoundError, LayoutMismatchError.
        """
        seg = Segment.open(kv_store_segment_name(name))
        try:
            if seg.size_bytes < KV_HEADER_BYTES:
                raise LayoutMismatchError(
                    f"segment {seg.shm_name} is {seg.size_bytes} bytes, smaller than a KV-store "
                    f"header ({KV_HEADER_BYTES} bytes)")
            hdr = np.ndarray((1,), KV_HEADER_DTYPE, buffer=seg.buf)[0].copy()
            check_header(seg, hdr, KV_MAGIC, KV_LAYOUT_VERSION, KV_HEADER_BYTES, None)
            dname = bytes(hdr["dtype"]).decode(errors="replace")
            if dname not in DTYPE_NAMES:
                raise LayoutMismatchError(
                    f"segment {seg.shm_name}: header field dtype is {dname!r}, expected one of "
                    f"{sorted(DTYPE_NAMES)}")
            if int(hdr["layout"]) >= len(KV_LAYOUTS):
                raise LayoutMismatchError(
                    f"segment {seg.shm_name}: header field layout is {int(hdr['layout'])}, "
                    f"expected one of {list(range(len(KV_LAYOUTS)))} ({list(KV_LAYOUTS)})")
            itemsize = torch_dtype(dname).itemsize
            if int(hdr["element_bytes"]) != itemsize:
                raise LayoutMismatchError(
                    f"segment {seg.shm_name}: header field element_bytes is "
                    f"{int(hdr['element_bytes'])}, expected {itemsize}")
            want = cls._total_bytes(*(int(hdr[f]) for f in (
                "num_layers", "num_blocks", "block_size", "num_kv_heads", "head_size",
                "element_bytes")))
            check_header(seg, hdr, KV_MAGIC, KV_LAYOUT_VERSION, KV_HEADER_BYTES, want)
            return cls(seg, owner=False)
        except BaseException:
            seg.close()
            raise

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s (K, V), each ``[num_blocks, block_size, num_kv_heads, head_size]``."""
        return self.key_cache[i], self.value_cache[i]

    @property
    def num_bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def close(self) -> None:
        """Unpins (if pinned) and unmaps. Tensors handed out must be dropped first."""
        if self._segment.buf is None:
            return
        if self._pinned:
            self.unpin()
        self.kv = self.key_cache = self.value_cache = Closed(self.name)  # type: ignore
        self._segment.close()

    @staticmethod
    def unlink(name: str) -> bool:
        """Removes the store's name; False if there was none."""
        return Segment.unlink(kv_store_segment_name(name))

    # ------------------------------------------------------------------ CUDA (host tier)

    def pin(self) -> None:
        """Page-locks the store for this process (``cudaHostRegister``), so copies between
        it and a GPU are DMA. Every process that copies registers its own mapping.

        Raises:
            UsageError: no CUDA device; RuntimeError: the CUDA call failed.
        """
        if not torch.cuda.is_available():
            raise UsageError("pin() needs a CUDA device; torch.cuda.is_available() is False")
        if self._pinned:
            return
        err = torch.cuda.cudart().cudaHostRegister(self.kv.data_ptr(), self.num_bytes, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of {self.num_bytes} bytes failed: {err}")
        self._pinned = True

    def unpin(self) -> None:
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self.kv.data_ptr())
            self._pinned = False

    @property
    def is_pinned(self) -> bool:
        return self._pinned

    def allocate_device_cache(self, device: torch.device | str | int,
                              num_blocks: int | None = None) -> torch.Tensor:
        """A zeroed device cache, ``[num_layers, 2, num_blocks, block_size, num_kv_heads,
        head_size]`` (``num_blocks`` rows per layer and K/V; the store's by default), in the
        store's dtype, whatever the store's layout: what ``load_blocks`` fills."""
        n = self.num_blocks if num_blocks is None else num_blocks
        return torch.zeros((self.num_layers, 2, n, self.block_size, self.num_kv_heads,
                            self.head_size), dtype=self.dtype, device=device)

    def load_blocks(self, device_kv: torch.Tensor, block_ids: Sequence[int] | torch.Tensor,
                    device_block_ids: Sequence[int] | torch.Tensor | None = None) -> None:
        """Copies blocks host -> device for every layer, K and V: store block
        ``block_ids[i]`` to row ``device_block_ids[i]`` of ``device_kv`` (the same ids by
        default). Any set of ids, in any order; a store block may be loaded into several
        rows, a row is written once.

        ``device_kv``: ``[num_layers, 2, rows, block_size, num_kv_heads, head_size]`` in the
        store's dtype, on any device (``allocate_device_cache``). On a GPU with a
        block-major store the copies are one DMA per run of consecutive ids into a staging
        buffer and one index kernel per chunk (``shmkv/ranks/transfer.py``); asynchronous
        once ``pin()`` registered the store: kernels later queued on the current stream
        see the rows, the host must synchronize before reading them itself.

        Raises:
            UsageError: ``device_kv`` not a tensor of that shape and dtype, or one whose
                elements share memory (a stride 0: an expanded tensor), ids that are not a
                1-d sequence of ints, out of range, of different lengths, or a repeated row;
                nothing is copied then.
        """
        plan = self._plan(device_kv, block_ids, device_block_ids, unique="device")
        self._copy(device_kv, plan, to_device=True)

    def store_blocks(self, device_kv: torch.Tensor, block_ids: Sequence[int] | torch.Tensor,
                     device_block_ids: Sequence[int] | torch.Tensor | None = None) -> None:
        """Copies blocks device -> host (the inverse of ``load_blocks``: row
        ``device_block_ids[i]`` to store block ``block_ids[i]``; a store block is written
        once), then waits for the copies, so the store holds them when it returns.

        Raises:
            UsageError: as ``load_blocks`` (a repeated store block instead of a repeated
                row); nothing is copied then.
        """
        plan = self._plan(device_kv, block_ids, device_block_ids, unique="host")
        self._copy(device_kv, plan, to_device=False)

    def _plan(self, device_kv: object, block_ids: object, device_block_ids: object,
              unique: str) -> transfer.TransferPlan:
        if not isinstance(device_kv, torch.Tensor):
            raise UsageError(f"device_kv must be a torch.Tensor, got {type(device_kv).__name__}")
        want = (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_size)
        got = tuple(device_kv.shape)
        if len(got) != 6 or got[:2] + got[3:] != want:
            raise UsageError(
                f"device_kv of shape {got} does not match the store: expected (num_layers, 2, "
                f"rows, block_size, num_kv_heads, head_size) = ({want[0]}, 2, rows, "
                f"{', '.join(map(str, want[2:]))})")
        if device_kv.dtype != self.dtype:
            raise UsageError(f"device_kv has dtype {device_kv.dtype}; the store holds "
                             f"{self.dtype} (bytes are copied, never converted)")
        aliased = [d for d, (n, st) in enumerate(zip(got, device_kv.stride(), strict=True))
                   if n > 1 and st == 0]
        if aliased:  # an expanded tensor: its layers (rows...) are one memory
            raise UsageError(f"device_kv has overlapping memory: dim {aliased[0]} has stride 0 "
                             f"(an expanded tensor); a cache needs memory of its own per "
                             f"element")
        return transfer.plan_transfer(block_ids, device_block_ids, self.num_blocks, got[2],
                                      unique=unique)

    def _copy(self, device_kv: torch.Tensor, plan: transfer.TransferPlan,
              to_device: bool) -> None:
        nb = self._pinned and device_kv.is_cuda
        if device_kv.is_cuda and self.layout == BLOCK_MAJOR:
            transfer.copy_staged(self.kv, device_kv, plan, to_device=to_device,
                                 non_blocking=nb,
                                 copy_stream=self._copy_stream(device_kv.device))
        else:
            transfer.copy_direct(self.kv, self.layout, device_kv, plan, to_device=to_device,
                                 non_blocking=nb)

    def _copy_stream(self, device: torch.device):
        """This store's CUDA stream for host <-> ``device`` copies, made on first use."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = self._copy_streams.get(index)
        if stream is None:
            stream = self._copy_streams[index] = torch.cuda.Stream(device=index)
        return stream
