"""The KV store: every layer's K and V over one POSIX shared-memory segment (the host tier).

One segment per pool, ``/shmkv_kv-<name>-v<KV_LAYOUT_VERSION>``: a 4 KiB header (`magic`,
`layout_version`, `header_bytes`, `total_bytes`, `num_layers`, `num_blocks`, `block_size`,
`num_kv_heads`, `head_size`, `element_bytes`, `dtype` name, `creator_pid`; at byte 128 the
owner record, as for block tables: ``shmkv/pool/layout.py``, "Sibling segments"), then one
page-aligned tensor ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_size]``:
``key_cache[l]`` is ``kv[l, 0]`` and ``value_cache[l]`` is ``kv[l, 1]``. Block id ``b`` of the
pool names row ``b`` of every layer (the host tier of DESIGN section 1). Who writes a block:
the rank whose request holds it (a block is written only while one request holds it alone,
before it is cached; once cached it is only read), provided every scheduler caches a
step's blocks only after its rank has answered (``delay_cache_blocks``, then
``cache_blocks``; see ``shmkv/serve/rank.py``).

The store has no protocol of its own: block ownership comes from the pool.

Changelog: kv v1: initial. kv v2: the owner record (versions and magics now in
``shmkv/pool/layout.py``). kv v3: the owner record grows to 112 bytes.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import numpy as np

from shmkv.errors import LayoutMismatchError, UsageError
from shmkv.pool import layout as L
from shmkv.pool.segment import Segment
from shmkv.pool.siblings import owner_record, write_owner
from shmkv.ranks._common import (
    DTYPE_NAMES,
    MAX_BLOCK_ID,
    Closed,
    LazyTorch,
    check_header,
    dtype_name,
    positive_int,
    torch_dtype,
)

torch = LazyTorch(globals())

KV_LAYOUT_VERSION = L.KV_LAYOUT_VERSION
KV_MAGIC = L.KV_MAGIC
KV_HEADER_BYTES = 4096  # the data starts page-aligned (cudaHostRegister wants pages)

KV_HEADER_DTYPE = np.dtype([
    ("magic", "<u8"), ("layout_version", "<u4"), ("header_bytes", "<u4"),
    ("total_bytes", "<u8"), ("num_layers", "<u4"), ("num_blocks", "<u4"),
    ("block_size", "<u4"), ("num_kv_heads", "<u4"), ("head_size", "<u4"),
    ("element_bytes", "<u4"), ("creator_pid", "<u4"), ("_pad0", "<u4"),
    ("dtype", "S16"),
])


def kv_store_segment_name(name: str) -> str:
    return L.sibling_segment_name("kv", name, KV_LAYOUT_VERSION)


class KVStore:
    """Per layer K and V, ``[num_blocks, block_size, num_kv_heads, head_size]``, over one
    POSIX shared-memory segment that every process maps (the host tier)."""

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
        del h
        shape = (self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads,
                 self.head_size)
        count = math.prod(shape)
        self.kv = torch.frombuffer(segment.buf, dtype=self.dtype, count=count,
                                   offset=KV_HEADER_BYTES).view(shape)
        self.key_cache = [self.kv[i, 0] for i in range(self.num_layers)]
        self.value_cache = [self.kv[i, 1] for i in range(self.num_layers)]
        self.name = segment.shm_name
        self._pinned = False

    @staticmethod
    def _total_bytes(num_layers, num_blocks, block_size, num_kv_heads, head_size,
                     element_bytes) -> int:
        data = 2 * num_layers * num_blocks * block_size * num_kv_heads * head_size * element_bytes
        return KV_HEADER_BYTES + data  # exact, so any changed size field shows

    @classmethod
    def create(cls, name: str, *, num_layers: int, num_blocks: int, block_size: int,
               num_kv_heads: int, head_size: int, dtype: object = "float32",
               pool: str | None = None) -> KVStore:
        """A new, zero-filled store. ``pool``: the pool whose block ids index it, recorded
        with this process as its owner (``shmkv cleanup`` keeps it while either lives).

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

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        name = self.name
        self.close()
        if self._owner:
            Segment.unlink(name)

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
        """A device tensor shaped like ``kv`` (``num_blocks`` rows per layer and K/V)."""
        n = self.num_blocks if num_blocks is None else num_blocks
        return torch.zeros((self.num_layers, 2, n, self.block_size, self.num_kv_heads,
                            self.head_size), dtype=self.dtype, device=device)

    def load_blocks(self, device_kv: torch.Tensor, block_ids: Sequence[int] | torch.Tensor,
                    device_block_ids: Sequence[int] | torch.Tensor | None = None) -> None:
        """Copies blocks host -> device for every layer, K and V: host block
        ``block_ids[i]`` to device block ``device_block_ids[i]`` (the same ids by default).

        ``device_kv`` is shaped like ``kv`` (``allocate_device_cache``). Runs of consecutive
        ids are copied as one contiguous slice each, straight from the store: once ``pin()``
        has registered it, each copy is an asynchronous DMA (no staging copy); call
        ``torch.cuda.synchronize()`` (or sync the stream) before reading the host side.
        """
        for src, dst, n in self._runs(block_ids, device_block_ids, device_kv):
            for layer in range(self.num_layers):
                for kv in (0, 1):
                    device_kv[layer, kv, dst:dst + n].copy_(self.kv[layer, kv, src:src + n],
                                                           non_blocking=self._pinned)

    def store_blocks(self, device_kv: torch.Tensor, block_ids: Sequence[int] | torch.Tensor,
                     device_block_ids: Sequence[int] | torch.Tensor | None = None) -> None:
        """Copies blocks device -> host (the inverse of ``load_blocks``), then waits for the
        copies, so the store holds them when it returns."""
        for dst, src, n in self._runs(block_ids, device_block_ids, device_kv):
            for layer in range(self.num_layers):
                for kv in (0, 1):
                    self.kv[layer, kv, dst:dst + n].copy_(device_kv[layer, kv, src:src + n],
                                                          non_blocking=self._pinned)
        if self._pinned and device_kv.is_cuda:
            torch.cuda.synchronize(device_kv.device)

    def _runs(self, host_ids, device_ids, device_kv) -> list[tuple[int, int, int]]:
        """(host start, device start, length) of the maximal runs where both id lists go up
        by one. Raises UsageError on ids out of range."""
        host = [int(b) for b in (host_ids.tolist() if hasattr(host_ids, "tolist") else host_ids)]
        dev = host if device_ids is None else [
            int(b) for b in (device_ids.tolist() if hasattr(device_ids, "tolist") else device_ids)]
        if len(dev) != len(host):
            raise UsageError(f"{len(host)} host block ids for {len(dev)} device block ids")
        if tuple(device_kv.shape[:2]) != (self.num_layers, 2) or (
                tuple(device_kv.shape[3:]) != tuple(self.kv.shape[3:])):
            raise UsageError(f"device KV of shape {tuple(device_kv.shape)} does not match the "
                             f"store's {tuple(self.kv.shape)} (but for the number of blocks)")
        for what, ids, limit in (("host", host, self.num_blocks),
                                 ("device", dev, device_kv.shape[2])):
            if ids and (min(ids) < 0 or max(ids) >= limit):
                raise UsageError(f"{what} block ids must lie in [0, {limit}), found "
                                 f"{min(ids)}..{max(ids)}")
        runs: list[list[int]] = []
        for h, d in zip(host, dev, strict=True):
            if runs and h == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
                runs[-1][2] += 1
            else:
                runs.append([h, d, 1])
        return [tuple(r) for r in runs]
