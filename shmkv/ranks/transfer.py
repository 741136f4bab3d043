"""Block copies between the KV store (host) and a rank's device cache, at the bus's speed.

The device cache is what the model attends over: ``[num_layers, 2, rows, block_size,
num_kv_heads, head_size]`` (``KVStore.allocate_device_cache``), so one block's bytes there
are ``2 * num_layers`` pieces, one per layer and K/V. What makes a copy fast is the host side:

- a ``block_major`` store keeps each block's K/V for every layer contiguous, so a run of
  consecutive host ids is ONE contiguous range of the store;
- a ``layer_major`` store (each layer's K and V contiguous over the blocks: what a CPU rank
  attends over in place) splits each block into ``2 * num_layers`` pieces there too.

Plan (``plan_transfer``): the ids are validated, then sorted by host id (the pairs stay
pairs), and cut into maximal runs: ``host_runs`` (consecutive host ids: one contiguous
range of a block-major store each) and ``pair_runs`` (host AND device ids consecutive).

Paths, chosen by ``KVStore.load_blocks`` / ``store_blocks``:

- ``copy_staged`` (a block-major store and a CUDA cache): per chunk of blocks, one DMA per
  host run between the store and a contiguous staging buffer on the device (on the store's
  copy stream, asynchronous once ``pin()`` registered the store), and one index kernel
  between the staging buffer and the cache's rows (on the caller's current stream). The
  DMA of chunk ``k + 1`` overlaps the index kernel of chunk ``k``; a device-to-device pass
  costs a few percent of the bus time. The same function runs on the CPU (no streams), which
  is how the tests check its bytes without a GPU.
- ``copy_direct`` (anything else): one strided copy per pair run between the store and the
  cache (on the CPU: one numpy assignment, one pass, no staging); for a layer-major store
  and a CUDA cache, one copy per pair run, layer and K/V, each a contiguous range on both
  sides (slow for scattered ids: that is why the block-major layout exists).

Bytes are copied as raw integers (the widest integer type dividing a row of ``head_size``
elements), so every dtype (float8 included) moves bit for bit, and the index kernels move
8 bytes per element rather than 2.

Ordering on CUDA: ``load`` returns once the copies are queued; the caller's current stream
is ordered after them (the index kernel runs on it), so kernels it launches later read the
loaded rows without a host sync; the store's bytes must stay unchanged until then (they do:
a cached block is only read). ``store`` waits for its copies: the store holds the bytes when
it returns (the step handshake: a block is cached only after its K/V is in the store).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from shmkv.errors import UsageError
from shmkv.ranks._common import LazyTorch

torch = LazyTorch(globals())

LAYER_MAJOR = "layer_major"
BLOCK_MAJOR = "block_major"
KV_LAYOUTS = (LAYER_MAJOR, BLOCK_MAJOR)  # their header codes are their indices
STAGING_CHUNK_BYTES = 32 << 20  # a staged copy's unit of overlap (DMA k+1 || index kernel k)


@dataclass(frozen=True)
class TransferPlan:
    """Validated ids, sorted by host id, and their runs.

    ``host_ids[i]`` pairs with ``device_ids[i]``. ``host_runs``: int64 ``[num_runs, 3]``,
    each ``(position in the sorted ids, first host id, length)`` of a maximal run of
    consecutive host ids. ``pair_runs``: the same with ``(first host id, first device id,
    length)`` where both ids go up by one."""

    host_ids: np.ndarray
    device_ids: np.ndarray
    host_runs: np.ndarray
    pair_runs: np.ndarray

    @property
    def num_blocks(self) -> int:
        return int(self.host_ids.size)


def _ids(what: str, ids: object) -> np.ndarray:
    """``ids`` as a 1-d int64 array; refuses anything but integers."""
    if hasattr(ids, "detach") and hasattr(ids, "cpu"):  # a tensor, on any device
        ids = ids.detach().cpu().numpy()
    try:
        arr = np.asarray(ids)
    except (TypeError, ValueError) as exc:  # ragged lists
        raise UsageError(f"{what} must be a 1-d sequence of ints: {exc}") from None
    if arr.size == 0:
        return np.zeros(0, np.int64)
    if arr.dtype.kind not in "iu" or arr.ndim != 1:
        sample = arr.reshape(-1)[:4].tolist()
        raise UsageError(f"{what} must be a 1-d sequence of ints, got {arr.ndim}-d "
                         f"{arr.dtype} values {sample}...")
    return arr.reshape(-1).astype(np.int64, copy=False)


def plan_transfer(host_ids: Sequence[int] | np.ndarray, device_ids: object,
                  num_host_blocks: int, num_device_blocks: int, *,
                  unique: str) -> TransferPlan:
    """Checks a copy's ids and plans its runs.

    Args:
        host_ids: the store's block ids.
        device_ids: the cache's rows, paired with ``host_ids`` (None: the same ids).
        num_host_blocks, num_device_blocks: the valid ranges, ``[0, n)``.
        unique: ``"device"`` (a load: two host blocks must not land in one row) or
            ``"host"`` (a store: two rows must not land in one host block). The other side
            may repeat (one host block loaded into two rows).

    Raises:
        UsageError: ids that are not ints, lists of different lengths, an id out of range,
            a repeated destination; the message names the list, the value and the rule.
    """
    host = _ids("block_ids", host_ids)
    dev = host if device_ids is None else _ids("device_block_ids", device_ids)
    if dev.size != host.size:
        raise UsageError(f"{host.size} block_ids for {dev.size} device_block_ids: they pair "
                         f"one to one")
    for what, ids, limit in (("block_ids", host, num_host_blocks),
                             ("device_block_ids", dev, num_device_blocks)):
        if ids.size:
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= limit:
                bad = lo if lo < 0 else hi
                raise UsageError(f"{what} must lie in [0, {limit}): found {bad} (ids "
                                 f"{lo}..{hi})")
    if unique not in ("host", "device"):
        raise UsageError(f"unique must be 'host' or 'device', got {unique!r}")
    order = np.argsort(host, kind="stable")
    host, dev = host[order], dev[order]
    dest, what = (host, "block_ids") if unique == "host" else (np.sort(dev), "device_block_ids")
    if dest.size > 1:
        same = np.flatnonzero(dest[1:] == dest[:-1])
        if same.size:
            raise UsageError(f"{what} repeats {int(dest[same[0]])}: a destination block is "
                             f"written once per call")
    return TransferPlan(host, dev, _runs(host), _pair_runs(host, dev))


def _runs(host: np.ndarray) -> np.ndarray:
    if host.size == 0:
        return np.zeros((0, 3), np.int64)
    starts = np.flatnonzero(np.diff(host, prepend=host[0] - 2) != 1)
    lengths = np.diff(starts, append=host.size)
    return np.stack([starts, host[starts], lengths], axis=1)


def _pair_runs(host: np.ndarray, dev: np.ndarray) -> np.ndarray:
    if host.size == 0:
        return np.zeros((0, 3), np.int64)
    step = (np.diff(host, prepend=host[0] - 2) == 1) & (np.diff(dev, prepend=dev[0] - 2) == 1)
    starts = np.flatnonzero(~step)
    lengths = np.diff(starts, append=host.size)
    return np.stack([host[starts], dev[starts], lengths], axis=1)


def raw(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as the widest integer type that divides its last dimension (a view, no
    copy); ``t`` itself if its layout allows no wider view."""
    if t.dim() == 0 or t.stride(-1) != 1:
        return t
    nbytes = t.shape[-1] * t.element_size()
    for dtype, width in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2), (torch.uint8, 1)):
        if nbytes % width:
            continue
        if width == t.element_size() and not t.dtype.is_floating_point:
            return t
        if all((s * t.element_size()) % width == 0 for s in t.stride()[:-1]) and (
                t.storage_offset() * t.element_size()) % width == 0:
            return t.view(dtype)
    return t


def _chunks(plan: TransferPlan, blocks_per_chunk: int
            ) -> Iterator[tuple[int, int, list[tuple[int, int, int]]]]:
    """``(first position, end position, [(position, host id, length)])`` per chunk of at
    most ``blocks_per_chunk`` sorted ids, the host runs cut at chunk borders."""
    runs: list[tuple[int, int, int]] = []
    first = 0
    for pos, host_id, n in plan.host_runs.tolist():
        while n:
            take = min(n, first + blocks_per_chunk - pos)
            runs.append((pos, host_id, take))
            pos, host_id, n = pos + take, host_id + take, n - take
            if pos - first == blocks_per_chunk:
                yield first, pos, runs
                first, runs = pos, []
    if runs:
        yield first, plan.num_blocks, runs


def copy_staged(host_blocks: torch.Tensor, device_kv: torch.Tensor, plan: TransferPlan, *,
                to_device: bool, non_blocking: bool = False, copy_stream=None,
                chunk_bytes: int = STAGING_CHUNK_BYTES) -> None:
    """A block-major store's blocks to or from a cache's rows through a contiguous staging
    buffer on the cache's device: one copy per host run, one index kernel per chunk.

    ``host_blocks``: the store, ``[num_blocks, num_layers, 2, block_size, heads, size]``;
    ``device_kv``: ``[num_layers, 2, rows, block_size, heads, size]``. ``copy_stream``: the
    CUDA stream of the host <-> device copies (None on the CPU)."""
    if plan.num_blocks == 0:
        return
    host, dev = raw(host_blocks), raw(device_kv)
    if host.dtype != dev.dtype:  # a cache whose strides allow no wider view
        host, dev = host_blocks, device_kv
    rows = dev.permute(2, 0, 1, 3, 4, 5)  # the cache by row: [rows, layers, 2, ...]
    device = device_kv.device
    block_bytes = math.prod(rows.shape[1:]) * rows.element_size()
    per_chunk = max(1, chunk_bytes // block_bytes)
    index = torch.from_numpy(plan.device_ids)
    cuda = copy_stream is not None
    current = torch.cuda.current_stream(device) if cuda else None
    if cuda:  # from pinned memory: no host sync on the current stream's queued work
        index = index.pin_memory().to(device, non_blocking=True)
    for first, end, runs in _chunks(plan, per_chunk):
        shape = (end - first, *rows.shape[1:])
        if to_device:
            with _on(copy_stream):
                staging = torch.empty(shape, dtype=rows.dtype, device=device)
                for pos, host_id, n in runs:
                    staging[pos - first:pos - first + n].copy_(host[host_id:host_id + n],
                                                               non_blocking=non_blocking)
                if cuda:
                    done = copy_stream.record_event()
            if cuda:
                current.wait_event(done)
                staging.record_stream(current)
            rows.index_copy_(0, index[first:end], staging)
        else:
            staging = torch.empty(shape, dtype=rows.dtype, device=device)
            torch.index_select(rows, 0, index[first:end], out=staging)
            if cuda:
                copy_stream.wait_event(current.record_event())
                staging.record_stream(copy_stream)
            with _on(copy_stream):
                for pos, host_id, n in runs:
                    host[host_id:host_id + n].copy_(staging[pos - first:pos - first + n],
                                                    non_blocking=non_blocking)
    if cuda and not to_device:
        copy_stream.synchronize()  # the store holds the bytes on return


def copy_direct(host_kv: torch.Tensor, layout: str, device_kv: torch.Tensor,
                plan: TransferPlan, *, to_device: bool, non_blocking: bool = False) -> None:
    """One copy per pair run between the store and the cache, without staging: on the CPU
    one numpy assignment per run (a few microseconds each, where a torch call costs tens);
    on a CUDA cache with a layer-major store, one copy per pair run, layer and K/V."""
    host, dev = raw(host_kv), raw(device_kv)
    if host.dtype != dev.dtype:
        host, dev = host_kv, device_kv
    block_major = layout == BLOCK_MAJOR
    runs = plan.pair_runs.tolist()
    if device_kv.device.type == "cpu" and not (host.dtype.is_floating_point
                                               or dev.dtype.is_floating_point):
        h, d = host.numpy(), dev.numpy()  # views: no copy
        for host_id, dev_id, n in runs:
            rows = d[:, :, dev_id:dev_id + n]
            blocks = (h[host_id:host_id + n].transpose(1, 2, 0, 3, 4, 5) if block_major
                      else h[:, :, host_id:host_id + n])
            if to_device:
                rows[...] = blocks
            else:
                blocks[...] = rows
        return
    per_layer = device_kv.device.type != "cpu" and not block_major
    for host_id, dev_id, n in runs:
        d = dev[:, :, dev_id:dev_id + n]
        if block_major:
            h = host[host_id:host_id + n].permute(1, 2, 0, 3, 4, 5)
        else:
            h = host[:, :, host_id:host_id + n]
        if not per_layer:
            (d if to_device else h).copy_(h if to_device else d, non_blocking=non_blocking)
            continue
        for layer in range(d.shape[0]):
            for kv in (0, 1):
                src, dst = (h[layer, kv], d[layer, kv]) if to_device else (d[layer, kv],
                                                                            h[layer, kv])
                dst.copy_(src, non_blocking=non_blocking)
    if not to_device and non_blocking and device_kv.is_cuda:
        torch.cuda.current_stream(device_kv.device).synchronize()


class _on:
    """``torch.cuda.stream(s)``, or nothing for ``s`` None (the CPU)."""

    def __init__(self, stream) -> None:
        self._ctx = None if stream is None else torch.cuda.stream(stream)

    def __enter__(self) -> None:
        if self._ctx is not None:
            self._ctx.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(*exc)
