"""The tier's worker on vLLM's CPU platform: KV bytes between vLLM's CPU KV cache and the
tier's shared data region, by plain copies.

vLLM's own ``CPUOffloadingWorker`` runs only on CUDA-alike and XPU devices: its transfer
handler copies on device streams, waits on ``torch.Event`` s and calls a copy op the CPU
build of vLLM does not ship. On the CPU platform the "device" KV cache is host memory
already, so a transfer is a set of memory copies, and ``SharedCPUOffloadingSpec`` gives
vLLM this worker instead (``spec.py``; nothing of vLLM is patched).

Geometry (the same as vLLM's handler, so either side reads what the other wrote):

    device tensor t:  [num_blocks, page_t]          one row per vLLM KV block
    region view t:    [num_chunks, bpc * page_t]    this worker's slot of each chunk row
                                                     (row stride: every worker's slots)

A transfer names, per KV-cache group g, ``group_sizes[g]`` device blocks and the chunks that
hold them (vLLM up to 0.33 passes the device side as a ``GPULoadStoreSpec`` of block ids;
0.34 as ``DevicePointers``, one address per group, layer reference and block, which the
worker turns back into block ids of its own tensors, refusing an address that is not the
start of one of their rows); the group's first block sits ``block_indices[g] % bpc``
sub-blocks into its first chunk (a chunk holds ``bpc`` blocks). Device block k of the group
is sub-block ``skip + k`` of the group's chunk list. For each layer reference of the group,
the first ``page_size_bytes`` of the block's row are copied (the rest of a padded row is not
KV).

Copies are batched by runs: consecutive device blocks that land on consecutive sub-blocks
(within a chunk, or across chunks when the region view's rows are contiguous) move as one
``copy_`` of a 2-D slice. A transfer completes inside ``submit_*``: on a CPU server the copy
competes with the model's threads for the same cores, so a background thread would not
overlap it with anything; the result is reported by the next ``get_finished`` as vLLM's
handler does.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from shmkv.errors import UsageError
from shmkv.vllm.compat import DevicePointers


def copy_runs(device_ids: np.ndarray, sub_ids: np.ndarray,
              spans_chunks: bool, blocks_per_chunk: int
              ) -> list[tuple[int, int, int]]:
    """Splits a transfer's (device block, sub-block) pairs into runs that one 2-D slice
    copy moves: ``(first device block, first sub-block, length)``. A run goes on while both
    ids grow by one, and crosses a chunk boundary only when ``spans_chunks``."""
    n = len(device_ids)
    if n == 0:
        return []
    breaks = np.flatnonzero((np.diff(device_ids) != 1) | (np.diff(sub_ids) != 1)) + 1
    if not spans_chunks and blocks_per_chunk > 1:
        chunk_start = np.flatnonzero(sub_ids[1:] % blocks_per_chunk == 0) + 1
        breaks = np.union1d(breaks, chunk_start)
    starts = np.concatenate(([0], breaks)).astype(np.int64)
    ends = np.concatenate((breaks, [n])).astype(np.int64)
    return [(int(device_ids[s]), int(sub_ids[s]), int(e - s))
            for s, e in zip(starts.tolist(), ends.tolist(), strict=True)]


class _Tensors:
    """One KV tensor's two sides as int8 views: ``device[block]`` and the region's
    ``sub-block`` rows."""

    __slots__ = ("device", "region", "page_bytes", "blocks_per_chunk", "flat")

    def __init__(self, device: torch.Tensor, page_bytes: int, region: torch.Tensor,
                 blocks_per_chunk: int) -> None:
        self.device = device.view(torch.int8).view(-1, page_bytes)
        self.page_bytes = page_bytes
        self.blocks_per_chunk = blocks_per_chunk
        num_chunks, row_bytes = region.shape
        if row_bytes != page_bytes * blocks_per_chunk:
            raise UsageError(
                f"the offload region's rows are {row_bytes} bytes and a chunk of "
                f"{blocks_per_chunk} blocks of {page_bytes} bytes needs "
                f"{page_bytes * blocks_per_chunk}: the tier's geometry differs from vLLM's"
            )
        self.region = region.view(num_chunks, blocks_per_chunk, page_bytes)
        # Sub-block s = chunk * bpc + j is row s of one strided view when the region's rows
        # are contiguous, or a chunk is one block (rows a worker's slot apart).
        self.flat: torch.Tensor | None = None
        if region.stride(0) == row_bytes:
            self.flat = region.reshape(num_chunks * blocks_per_chunk, page_bytes)
        elif blocks_per_chunk == 1:
            self.flat = region

    def sub_rows(self, first_sub: int, length: int) -> torch.Tensor:
        """``length`` consecutive sub-block rows from ``first_sub`` (within one chunk,
        unless ``flat``)."""
        if self.flat is not None:
            return self.flat[first_sub:first_sub + length]
        chunk, j = divmod(first_sub, self.blocks_per_chunk)
        return self.region[chunk, j:j + length]


class CPUTransferWorker(OffloadingWorker):
    """vLLM's ``OffloadingWorker`` for the CPU platform: stores (device KV to the tier's
    region) and loads (back) by memory copies, one per run of consecutive blocks.

    Owns the region mapping it is given, and releases it at :meth:`shutdown`.
    """

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int,
                 mmap_region: Any) -> None:
        """Args:
            kv_caches: vLLM's canonical KV caches (host tensors on the CPU platform).
            blocks_per_chunk: vLLM blocks per tier chunk.
            mmap_region: vLLM's ``SharedOffloadRegion`` over the tier's data region.

        Raises:
            UsageError: a KV tensor not in host memory, or a region whose rows do not
                hold ``blocks_per_chunk`` blocks of a tensor's page.
        """
        self._region = mmap_region
        self._bpc = blocks_per_chunk
        self._groups = [[(ref.tensor_idx, ref.page_size_bytes) for ref in refs]
                        for refs in kv_caches.group_data_refs]
        self._tensors: list[_Tensors] = []
        # Per tensor: its first byte's address and its row stride in bytes (what vLLM 0.34's
        # device pointers are made of).
        self._rows: list[tuple[int, int]] = []
        for kv in kv_caches.tensors:
            if kv.tensor.device.type != "cpu":
                raise UsageError(
                    f"shmkv's CPU transfer worker got a KV tensor on {kv.tensor.device}; it "
                    "serves vLLM's CPU platform only"
                )
            view = mmap_region.create_next_worker_view(kv.page_size_bytes * blocks_per_chunk)
            self._tensors.append(_Tensors(kv.tensor, kv.page_size_bytes, view,
                                          blocks_per_chunk))
            self._rows.append((kv.tensor.data_ptr(),
                               kv.tensor.stride(0) * kv.tensor.element_size()))
        self._num_blocks = min((t.device.shape[0] for t in self._tensors), default=0)
        self._num_chunks = min((t.region.shape[0] for t in self._tensors), default=0)
        self._finished: list[TransferResult] = []

    def _block_ids_of(self, ptrs: Any) -> tuple[np.ndarray, Sequence[int], Sequence[int]]:
        """vLLM 0.34's ``DevicePointers`` as (device block ids, group sizes, block indices),
        the form of a ``GPULoadStoreSpec``.

        Raises:
            UsageError: another number of groups or of layer references per group than
                the worker's, an address that is not the start of a row of the reference's
                tensor, a size that is not the reference's page, or references of one group
                naming different blocks.
        """
        counts = tuple(ptrs.group_block_counts)
        refs_per_group = tuple(ptrs.group_data_ref_counts)
        if len(counts) != len(self._groups) or len(refs_per_group) != len(self._groups):
            raise UsageError(f"a transfer names {len(counts)} KV-cache groups, the worker "
                             f"has {len(self._groups)}")
        addrs = np.asarray(ptrs.ptrs, dtype=np.uint64)
        sizes = np.asarray(ptrs.sizes, dtype=np.uint64)
        ids: list[np.ndarray] = []
        at = 0
        for g, (count, num_refs) in enumerate(zip(counts, refs_per_group, strict=True)):
            if not count:
                continue
            refs = self._groups[g]
            if num_refs != len(refs):
                raise UsageError(f"a transfer names {num_refs} layer references of KV-cache "
                                 f"group {g}, the worker has {len(refs)}")
            group_ids = None
            for t_idx, page_bytes in refs:
                if at + count > len(addrs):
                    raise UsageError(f"a transfer of {len(addrs)} device pointers is short "
                                     f"of its groups' {list(counts)} blocks")
                base, stride = self._rows[t_idx]
                offsets = addrs[at:at + count].astype(np.int64) - np.int64(base)
                copied = sizes[at:at + count]
                if (copied != page_bytes).any():
                    raise UsageError(f"a transfer copies {sorted(set(copied.tolist()))} bytes "
                                     f"per block of KV tensor {t_idx}, whose page is "
                                     f"{page_bytes} bytes")
                block_ids, rest = np.divmod(offsets, stride)
                num_rows = self._tensors[t_idx].device.shape[0]
                if (rest != 0).any() or (offsets < 0).any() or (block_ids >= num_rows).any():
                    raise UsageError(f"a transfer names device addresses that are not rows of "
                                     f"KV tensor {t_idx} (base {base:#x}, row {stride} bytes)")
                if group_ids is None:
                    group_ids = block_ids
                elif not np.array_equal(group_ids, block_ids):
                    raise UsageError(f"a transfer names different blocks for the layers of "
                                     f"KV-cache group {g}")
                at += count
            ids.append(group_ids)
        if at != len(addrs):
            raise UsageError(f"a transfer of {len(addrs)} device pointers does not match its "
                             f"groups' {list(counts)} blocks (they need {at})")
        device_ids = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
        return device_ids, counts, tuple(ptrs.block_indices)

    def _pairs(self, gpu: Any, chunks: LoadStoreSpec
               ) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """Per KV-cache group with blocks: (group, device block ids, sub-block ids).
        ``gpu`` is a ``GPULoadStoreSpec`` or (vLLM 0.34) ``DevicePointers``.

        Raises:
            UsageError: the specs' block counts do not match the groups.
        """
        bpc = self._bpc
        if DevicePointers is not None and isinstance(gpu, DevicePointers):
            device_ids, sizes, indices = self._block_ids_of(gpu)
        else:
            device_ids = np.asarray(gpu.block_ids, dtype=np.int64)
            sizes, indices = gpu.group_sizes, gpu.block_indices
        chunk_ids = np.asarray(chunks.block_ids, dtype=np.int64)
        if len(sizes) != len(self._groups):
            raise UsageError(f"a transfer names {len(sizes)} KV-cache groups, the worker "
                             f"has {len(self._groups)}")
        out = []
        dev_at = chunk_at = 0
        for g, (size, index) in enumerate(zip(sizes, indices, strict=True)):
            if not size:
                continue
            skip = index % bpc
            num_chunks = -(-(skip + size) // bpc)
            if dev_at + size > len(device_ids) or chunk_at + num_chunks > len(chunk_ids):
                dev_at, chunk_at = dev_at + size, chunk_at + num_chunks
                break
            group_chunks = chunk_ids[chunk_at:chunk_at + num_chunks]
            logical = np.arange(skip, skip + size, dtype=np.int64)
            subs = group_chunks[logical // bpc] * bpc + logical % bpc
            out.append((g, device_ids[dev_at:dev_at + size], subs))
            dev_at += size
            chunk_at += num_chunks
        if dev_at != len(device_ids) or chunk_at != len(chunk_ids):
            raise UsageError(
                f"a transfer of {len(device_ids)} blocks and {len(chunk_ids)} chunks does not "
                f"match its group sizes {list(sizes)} (they need {dev_at} and {chunk_at})"
            )
        for what, ids, bound in (("device block", device_ids, self._num_blocks),
                                 ("chunk", chunk_ids, self._num_chunks)):
            if len(ids) and (ids.min() < 0 or ids.max() >= bound):
                raise UsageError(f"a transfer names {what} ids in [{ids.min()}, {ids.max()}]; "
                                 f"there are {bound}")
        return out

    def _transfer(self, job_id: int, gpu: Any, chunks: LoadStoreSpec,
                  store: bool) -> bool:
        start = time.perf_counter()
        moved = 0
        for g, device_ids, subs in self._pairs(gpu, chunks):
            refs = self._groups[g]
            for t_idx, page_bytes in refs:
                side = self._tensors[t_idx]
                for first_dev, first_sub, length in copy_runs(
                        device_ids, subs, side.flat is not None, self._bpc):
                    dev = side.device[first_dev:first_dev + length, :page_bytes]
                    reg = side.sub_rows(first_sub, length)[:, :page_bytes]
                    if store:
                        reg.copy_(dev)
                    else:
                        dev.copy_(reg)
                    moved += length * page_bytes
        self._finished.append(TransferResult(job_id=job_id, success=True, transfer_size=moved,
                                             transfer_time=time.perf_counter() - start))
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec | Any,
                     dst_spec: LoadStoreSpec) -> bool:
        """Copies the device blocks of ``src_spec`` (block ids, or vLLM 0.34's device
        pointers) into the chunks of ``dst_spec``."""
        return self._transfer(job_id, src_spec, dst_spec, store=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec,
                    dst_spec: GPULoadStoreSpec | Any, expedited: bool = False) -> bool:
        """Copies the chunks of ``src_spec`` into the device blocks of ``dst_spec`` (block
        ids, or vLLM 0.34's device pointers)."""
        return self._transfer(job_id, dst_spec, src_spec, store=False)

    def get_finished(self) -> list[TransferResult]:
        """The transfers done since the last call (every submitted one: copies are
        synchronous)."""
        done, self._finished = self._finished, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        """Nothing to wait for: a transfer is done when ``submit_*`` returns."""

    def shutdown(self) -> None:
        """Drops the views and releases the region mapping."""
        self._tensors.clear()
        if self._region is not None:
            self._region.cleanup()
            self._region = None


__all__ = ["CPUTransferWorker", "copy_runs"]
