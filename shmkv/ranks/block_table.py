"""Shared block tables, slot mapping and the KV store: what the GPU ranks read.

The only module of ``shmkv`` that imports torch (``import shmkv`` does not import it), and
only on first use: a scheduler process that just writes rows (numpy) never loads torch.

Block tables (``SharedBlockTables``)
------------------------------------

One segment per scheduler, ``/shmkv_bt-<name>-v<BT_LAYOUT_VERSION>``, mode 0600. Its
scheduler is the only writer; its rank processes map it read-only in spirit and see the
tables as torch tensors over the segment (``torch.from_numpy`` of numpy views of the
mapping: no copy, no serialisation).

| # | region            | dtype       | shape                                   | written by | read by |
|---|-------------------|-------------|-----------------------------------------|------------|---------|
| 0 | `header`          | BT_HEADER   | `[1]` (256 B)                           | creator; `seq`, `step`: the writer | ranks |
| 1 | `num_blocks_per_row` | int32    | `[num_groups, max_num_reqs]`            | the writer | ranks |
| 2 | `block_table_<g>` | int32       | `[max_num_reqs, max_num_blocks_per_req[g]]`, one per KV-cache group | the writer | ranks |

Header fields (little-endian): `magic` (u64, ``BT_MAGIC``), `layout_version` (u32),
`header_bytes` (u32), `total_bytes` (u64), `num_groups` (u32), `max_num_reqs` (u32),
`max_model_len` (u32), `creator_pid` (u32), `seq` (u64: the seqlock word), `step` (i64: the
last published step, -1 before the first), `block_sizes` (u32[8]), `max_num_blocks_per_req`
(u32[8]), then at byte 128 the owner record (``shmkv/pool/layout.py``, "Sibling segments":
the creator and the pool the tables serve, for ``shmkv cleanup``).

Ordering (the seqlock). The writer makes `seq` odd before its first store of a step
(``add_row``, ``append_row``, ``add_rows``, ``append_rows``, ``clear_row``, ``move_row``,
``swap_row``, ``clear``), writes the rows, then on ``commit(step)`` stores `step` and makes `seq` even. A reader reads `seq`
(retrying while odd), copies what it needs, reads `step`, and accepts the copy only if `seq`
is unchanged (``read``). A zero-copy reader (``reading``) waits for an even `seq` and the
step it was told about, uses the shared tensors in place, and checks on exit that `seq`
did not move: the scheduler must not write while its rank computes (the step handshake;
``TornReadError`` if it did). Fences (``shmkv/pool/barriers.py``) order the odd `seq`
before the row stores, the rows before `step` and the even `seq`, and on the reader's side
`seq` before the rows and the rows before the re-read of `seq`, so this holds on weakly
ordered CPUs (aarch64) too, not only on x86-64 (TSO).

KV store (``KVStore``)
----------------------

One segment per pool, ``/shmkv_kv-<name>-v<KV_LAYOUT_VERSION>``: a 4 KiB header (`magic`,
`layout_version`, `header_bytes`, `total_bytes`, `num_layers`, `num_blocks`, `block_size`,
`num_kv_heads`, `head_size`, `element_bytes`, `dtype` name, `creator_pid`; at byte 128 the
owner record, as for block tables), then one
page-aligned tensor ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_size]``:
``key_cache[l]`` is ``kv[l, 0]`` and ``value_cache[l]`` is ``kv[l, 1]``. Block id ``b`` of the
pool names row ``b`` of every layer (the host tier of DESIGN section 1). Who writes a block:
the rank whose request holds it (a block is written only while one request holds it alone,
before it is cached; once cached it is only read), provided every scheduler caches a
step's blocks only after its rank has answered (``delay_cache_blocks``, then
``cache_blocks``; see ``shmkv/serve/rank.py``).

Crash behaviour: a writer killed mid-step leaves `seq` odd; readers then time out with
``TornReadError`` until a successor (the scheduler's replacement, attached to the same
tables) rewrites the rows it needs and commits; its first write keeps `seq` odd. The KV store
has no protocol of its own: block ownership comes from the pool.

Changelog: bt v1, kv v1: initial. bt v2, kv v2: the owner record (versions and magics now in
``shmkv/pool/layout.py``).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import pickle
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from shmkv.errors import LayoutMismatchError, PoolClosedError, TornReadError, UsageError
from shmkv.pool import layout as L
from shmkv.pool.barriers import fence as _fence
from shmkv.pool.segment import Segment
from shmkv.pool.siblings import owner_record, write_owner

try:  # the rank side's one-pass helpers; numpy below is the reference and the fallback
    from shmkv.pool._ckernel import scatter_rows as _c_scatter_rows
    from shmkv.pool._ckernel import slot_mappings as _c_slot_mappings
    from shmkv.pool._ckernel import token_indices as _c_token_indices
except ImportError:  # pure-Python install
    _c_scatter_rows = _c_slot_mappings = _c_token_indices = None


class _LazyTorch:
    """torch, imported on first use: a scheduler that only writes rows never loads it."""

    def __getattr__(self, name: str):
        import torch as real

        globals()["torch"] = real
        return getattr(real, name)


torch = _LazyTorch()

BT_LAYOUT_VERSION = L.BT_LAYOUT_VERSION
KV_LAYOUT_VERSION = L.KV_LAYOUT_VERSION
BT_MAGIC = L.BT_MAGIC  # bytes all different, like the pool's MAGIC
KV_MAGIC = L.KV_MAGIC
MAX_KV_CACHE_GROUPS = 8
KV_HEADER_BYTES = 4096  # the data starts page-aligned (cudaHostRegister wants pages)
MAX_BLOCK_ID = (1 << 31) - 1
DEFAULT_READ_TIMEOUT_S = 5.0
PAD_SLOT_ID = -1  # vLLM's PAD_ID for slots of padding tokens
_ROW_BY_ROW_MAX = 24  # add_rows / append_rows with at most this many rows go row by row

BT_HEADER_DTYPE = np.dtype([
    ("magic", "<u8"), ("layout_version", "<u4"), ("header_bytes", "<u4"),
    ("total_bytes", "<u8"), ("num_groups", "<u4"), ("max_num_reqs", "<u4"),
    ("max_model_len", "<u4"), ("creator_pid", "<u4"), ("seq", "<u8"), ("step", "<i8"),
    ("block_sizes", "<u4", (MAX_KV_CACHE_GROUPS,)),
    ("max_num_blocks_per_req", "<u4", (MAX_KV_CACHE_GROUPS,)),
    ("_pad", "V", 256 - 56 - 8 * MAX_KV_CACHE_GROUPS),
])
assert BT_HEADER_DTYPE.itemsize == 256
_SEQ_WORD = BT_HEADER_DTYPE.fields["seq"][1] // 8
_STEP_WORD = BT_HEADER_DTYPE.fields["step"][1] // 8

KV_HEADER_DTYPE = np.dtype([
    ("magic", "<u8"), ("layout_version", "<u4"), ("header_bytes", "<u4"),
    ("total_bytes", "<u8"), ("num_layers", "<u4"), ("num_blocks", "<u4"),
    ("block_size", "<u4"), ("num_kv_heads", "<u4"), ("head_size", "<u4"),
    ("element_bytes", "<u4"), ("creator_pid", "<u4"), ("_pad0", "<u4"),
    ("dtype", "S16"),
])

_DTYPE_NAMES = ("float32", "float16", "bfloat16", "float64", "float8_e4m3fn", "uint8")


def _torch_dtype(name: str):
    return getattr(torch, name)


def block_tables_segment_name(name: str) -> str:
    return L.sibling_segment_name("bt", name, BT_LAYOUT_VERSION)


def kv_store_segment_name(name: str) -> str:
    return L.sibling_segment_name("kv", name, KV_LAYOUT_VERSION)


def _align(n: int, to: int = L.ALIGN_BYTES) -> int:
    return (n + to - 1) // to * to


def _positive_int(what: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise UsageError(f"{what} must be a positive int, got {value!r}")
    return value


def _dtype_name(dtype: object) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPE_NAMES:
        raise UsageError(f"dtype {dtype!r} is not one of {sorted(_DTYPE_NAMES)}")
    return name


def _check_header(seg: Segment, hdr: np.void, magic: int, version: int,
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


# --------------------------------------------------------------------------- slot mapping

def _as_int64(x: Sequence[int] | np.ndarray | torch.Tensor) -> torch.Tensor:
    """A 1-d int64 tensor; lists go through numpy (several times cheaper than torch's own
    list conversion)."""
    if isinstance(x, torch.Tensor):
        return x.reshape(-1).to(torch.int64)
    return torch.from_numpy(np.asarray(x, dtype=np.int64).reshape(-1))


def _as_numpy_int64(x: Sequence[int] | np.ndarray | torch.Tensor) -> np.ndarray:
    """A 1-d int64 array; a CPU tensor is read in place (no copy if already int64)."""
    if isinstance(x, torch.Tensor):
        return x.reshape(-1).to(torch.int64).numpy()
    return np.asarray(x, dtype=np.int64).reshape(-1)


def _c_operand(x: object) -> object:
    """``x`` as the C helpers take it (a list, a tuple, a 1-d ndarray; a CPU int64 tensor as
    its numpy view), or None: the numpy path then takes it. The helpers refuse anything
    else they cannot read exactly as numpy would (a float, a 2-d or strided array...)."""
    kind = type(x)
    if kind is list or kind is tuple:
        return x
    if kind is np.ndarray:
        return x if x.ndim == 1 else None
    if isinstance(x, torch.Tensor) and x.dtype == torch.int64 and x.device.type == "cpu":
        return x.numpy() if x.dim() == 1 else None
    return None


def compute_slot_mapping(block_table: torch.Tensor, req_indices: torch.Tensor,
                         positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Slots of a batch's tokens: ``block_table[req, pos // bs] * bs + pos % bs`` (int64).

    ``block_table`` is int32 ``[num_rows, width]`` (a snapshot's gathered rows, or the shared
    table itself); token ``t`` belongs to row ``req_indices[t]`` at position
    ``positions[t]``. Vectorised, no Python loop. Like vLLM, the block number comes from the
    position, not from the token's index. A padding token (``req_indices[t] < 0``) gets
    ``PAD_SLOT_ID``. A table on the CPU is computed in numpy, as vLLM's worker does (a
    decode batch is a few hundred tokens, where each torch call's fixed cost would
    dominate); one on a GPU in torch, on its device.

    Raises:
        UsageError: a position past the table's width or a row out of range.
    """
    if block_table.device.type != "cpu":
        return _slot_mapping_on_device(block_table, req_indices, positions, block_size)
    req = _as_numpy_int64(req_indices)
    pos = _as_numpy_int64(positions)
    if pos.size == 0:
        return torch.empty(0, dtype=torch.int64)
    _check_slot_inputs(int(pos.min()), int(pos.max()), int(req.max()), block_table.shape,
                       block_size)
    pad = req < 0 if int(req.min()) < 0 else None
    slots = _slots_np(block_table.numpy(), np.maximum(req, 0) if pad is not None else req,
                      pos, block_size)
    if pad is not None:
        slots[pad] = PAD_SLOT_ID
    return torch.from_numpy(slots)


def _slots_np(table: np.ndarray, rows: np.ndarray, pos: np.ndarray, block_size: int
              ) -> np.ndarray:
    """The slot formula on checked inputs (rows and positions in range)."""
    flat = rows * table.shape[1]
    flat += pos // block_size
    slots = table.reshape(-1).take(flat).astype(np.int64)
    slots *= block_size
    slots += pos % block_size
    return slots


def _check_slot_inputs(pos_lo: int, pos_hi: int, req_hi: int, table_shape, block_size: int
                       ) -> None:
    rows, width = table_shape
    if pos_lo < 0 or pos_hi >= width * block_size:
        raise UsageError(
            f"positions must lie in [0, {width * block_size}) for a table {width} blocks "
            f"wide of block size {block_size}; found {pos_lo}..{pos_hi}")
    if req_hi >= rows:
        raise UsageError(f"row index {req_hi} out of range for a table of {rows} rows")


def _slot_mapping_on_device(block_table: torch.Tensor, req_indices: torch.Tensor,
                            positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """``compute_slot_mapping`` in torch, on the table's device."""
    device = block_table.device
    width = block_table.shape[1]
    req_indices = _as_int64(req_indices).to(device)
    positions = _as_int64(positions).to(device)
    if positions.numel() == 0:
        return torch.empty(0, dtype=torch.int64, device=device)
    lo, hi = (int(x) for x in torch.aminmax(positions))
    req_lo, req_hi = (int(x) for x in torch.aminmax(req_indices))
    _check_slot_inputs(lo, hi, req_hi, block_table.shape, block_size)
    pad = req_indices < 0 if req_lo < 0 else None
    rows = req_indices.clamp(min=0) if pad is not None else req_indices
    flat = rows * width
    flat += torch.div(positions, block_size, rounding_mode="floor")
    slots = block_table.reshape(-1).index_select(0, flat).to(torch.int64)
    slots *= block_size
    slots += torch.remainder(positions, block_size)
    return slots if pad is None else slots.masked_fill_(pad, PAD_SLOT_ID)


def batch_token_indices(num_scheduled_tokens: Sequence[int] | torch.Tensor,
                        start_positions: Sequence[int] | torch.Tensor,
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(req_indices, positions)`` of a batch whose request ``i`` schedules
    ``num_scheduled_tokens[i]`` tokens starting at position ``start_positions[i]``: one
    entry per token, request-major (vLLM's ``query_start_loc`` order). Works for prefill
    (many tokens per request) and decode (one) alike. One C pass when the kernel is built
    (the same answers; anything it does not take goes the numpy way, which says what is
    wrong)."""
    counts_c, starts_c = _c_operand(num_scheduled_tokens), _c_operand(start_positions)
    if _c_token_indices is not None and counts_c is not None and starts_c is not None:
        size = len(counts_c)  # the decode case: one token per request
        req, pos = np.empty(size, np.int64), np.empty(size, np.int64)
        total = _c_token_indices(counts_c, starts_c, req, pos)
        if total > size:  # prefill: sized now, written now (unless a thread changed the lists)
            req, pos = np.empty(total, np.int64), np.empty(total, np.int64)
            if _c_token_indices(counts_c, starts_c, req, pos) != total:
                total = -1
        if total >= 0:
            return torch.from_numpy(req[:total]), torch.from_numpy(pos[:total])
    counts = np.asarray(num_scheduled_tokens, dtype=np.int64)
    starts = np.asarray(start_positions, dtype=np.int64)
    if counts.shape != starts.shape or counts.ndim != 1:
        raise UsageError(
            f"num_scheduled_tokens and start_positions must be 1-d of one length, got "
            f"{tuple(counts.shape)} and {tuple(starts.shape)}")
    if not counts.size:
        return torch.from_numpy(counts), torch.from_numpy(starts)
    lo = int(counts.min())
    if lo < 0 or int(starts.min()) < 0:
        raise UsageError("token counts and start positions must be >= 0")
    if lo == 1 and int(counts.max()) == 1:  # decode
        return torch.arange(counts.size), torch.from_numpy(starts)
    # numpy for the bookkeeping (vLLM's worker does the same): cheaper per call than torch.
    req_indices = np.repeat(np.arange(counts.size), counts)
    offsets = np.arange(req_indices.size) - np.repeat(np.cumsum(counts) - counts, counts)
    return torch.from_numpy(req_indices), torch.from_numpy(starts[req_indices] + offsets)


# --------------------------------------------------------------------------- block tables

class _Closed:
    """Stands in for the views of a closed mapping: any use raises PoolClosedError."""

    def __init__(self, name: str) -> None:
        self._name = name

    def _fail(self, *args: object, **kwargs: object):
        raise PoolClosedError(f"{self._name} was closed; attach again")

    __getitem__ = __setitem__ = __getattr__ = __iter__ = __len__ = _fail

@dataclass
class BlockTableSnapshot:
    """A consistent copy of some rows of every group's table, as of ``step``.

    ``block_tables[g]``: int32 ``[len(rows), max_num_blocks_per_req[g]]``;
    ``num_blocks[g, i]``: blocks in row ``rows[i]`` of group ``g``."""

    step: int
    rows: torch.Tensor
    block_tables: list[torch.Tensor]
    num_blocks: torch.Tensor
    block_sizes: tuple[int, ...]

    def slot_mappings(self, req_indices: torch.Tensor,
                      positions: torch.Tensor) -> list[torch.Tensor]:
        """One slot mapping per group; ``req_indices`` index this snapshot's rows."""
        return [compute_slot_mapping(t, req_indices, positions, bs)
                for t, bs in zip(self.block_tables, self.block_sizes, strict=True)]


class SharedBlockTables:
    """A scheduler's block tables in shared memory, one int32 table per KV-cache group.

    The scheduler (one writer) edits rows the way vLLM's ``MultiGroupBlockTable`` does and
    publishes them with ``commit(step)``; rank processes ``attach`` and read consistent
    snapshots (``read``) or use the shared tensors in place (``reading``). See the module
    docstring for the protocol.
    """

    def __init__(self, segment: Segment, owner: bool) -> None:
        self._segment = segment
        self._owner = owner
        buf = segment.buf
        self._hdr = np.ndarray((1,), BT_HEADER_DTYPE, buffer=buf)
        self._words = np.ndarray((BT_HEADER_DTYPE.itemsize // 8,), "<u8", buffer=buf)
        self._swords = self._words.view("<i8")
        h = self._hdr[0]
        self.num_groups = int(h["num_groups"])
        self.max_num_reqs = int(h["max_num_reqs"])
        self.max_model_len = int(h["max_model_len"])
        self.block_sizes = tuple(int(x) for x in h["block_sizes"][: self.num_groups])
        self.max_num_blocks_per_req = tuple(
            int(x) for x in h["max_num_blocks_per_req"][: self.num_groups])
        offsets = self._region_offsets(self.num_groups, self.max_num_reqs,
                                       self.max_num_blocks_per_req)
        off, _ = offsets[0]
        self._num_blocks_np = np.ndarray((self.num_groups, self.max_num_reqs), "<i4",
                                         buffer=buf, offset=off)
        self._tables_np = [
            np.ndarray((self.max_num_reqs, w), "<i4", buffer=buf, offset=o)
            for (o, _), w in zip(offsets[1:], self.max_num_blocks_per_req, strict=True)
        ]
        self._views: tuple | None = None  # the torch views, made on first use (_t)
        self._tables_c = tuple(self._tables_np)  # what the C helper reads (None: closed)
        self._writing = False
        self._seqlock = True  # tests turn it off to show the torn-read check fails
        self.name = segment.shm_name

    # ------------------------------------------------------------------ lifecycle

    @staticmethod
    def _region_offsets(num_groups: int, max_num_reqs: int,
                        widths: Sequence[int]) -> list[tuple[int, int]]:
        off = _align(BT_HEADER_DTYPE.itemsize)
        out = [(off, 4 * num_groups * max_num_reqs)]
        off = _align(off + out[-1][1])
        for w in widths:
            out.append((off, 4 * max_num_reqs * w))
            off = _align(off + out[-1][1])
        return out

    @classmethod
    def _total_bytes(cls, num_groups: int, max_num_reqs: int, widths: Sequence[int]) -> int:
        off, size = cls._region_offsets(num_groups, max_num_reqs, widths)[-1]
        return _align(off + size)

    @classmethod
    def create(cls, name: str, *, max_num_reqs: int, max_model_len: int,
               block_sizes: Sequence[int],
               max_num_blocks_per_req: Sequence[int] | None = None,
               pool: str | None = None) -> SharedBlockTables:
        """A new, zeroed set of tables: group ``g`` is ``cdiv(max_model_len,
        block_sizes[g])`` blocks wide unless ``max_num_blocks_per_req`` says otherwise.
        ``pool``: the pool whose blocks they hold, recorded with this process as their
        owner (``shmkv cleanup`` keeps them while either lives).

        Raises:
            UsageError: a bad name or size (nothing is created).
            SegmentExistsError: tables of that name exist already.
            NoSpaceError: /dev/shm has no room for them (nothing is left behind).
        """
        shm_name = block_tables_segment_name(name)
        _positive_int("max_num_reqs", max_num_reqs)
        _positive_int("max_model_len", max_model_len)
        block_sizes = list(block_sizes)
        if not 1 <= len(block_sizes) <= MAX_KV_CACHE_GROUPS:
            raise UsageError(
                f"block_sizes must name 1..{MAX_KV_CACHE_GROUPS} KV-cache groups, got "
                f"{len(block_sizes)}")
        for bs in block_sizes:
            _positive_int("each block size", bs)
        if max_num_blocks_per_req is None:
            widths = [math.ceil(max_model_len / bs) for bs in block_sizes]
        else:
            widths = list(max_num_blocks_per_req)
            if len(widths) != len(block_sizes):
                raise UsageError(
                    f"max_num_blocks_per_req has {len(widths)} entries for "
                    f"{len(block_sizes)} block sizes")
            for w in widths:
                _positive_int("each max_num_blocks_per_req", w)
        total = cls._total_bytes(len(block_sizes), max_num_reqs, widths)
        owner = owner_record(pool)
        seg = Segment.create(shm_name, total, "block tables")
        try:
            h = np.ndarray((1,), BT_HEADER_DTYPE, buffer=seg.buf)
            h["layout_version"] = BT_LAYOUT_VERSION
            h["header_bytes"] = BT_HEADER_DTYPE.itemsize
            h["total_bytes"] = total
            h["num_groups"] = len(block_sizes)
            h["max_num_reqs"] = max_num_reqs
            h["max_model_len"] = max_model_len
            h["creator_pid"] = os.getpid()
            h["step"] = -1
            h[0]["block_sizes"][: len(block_sizes)] = block_sizes
            h[0]["max_num_blocks_per_req"][: len(widths)] = widths
            write_owner(seg.buf, L.BT_OWNER_OFFSET, owner)
            h["magic"] = BT_MAGIC  # last: a half-made segment is never taken for one
            del h
            return cls(seg, owner=True)
        except BaseException:
            seg.close()
            Segment.unlink(shm_name)
            raise

    @classmethod
    def attach(cls, name: str) -> SharedBlockTables:
        """Maps existing tables, validating magic, version and sizes (errors name the
        field).

        Raises:
            SegmentNotFoundError, LayoutMismatchError.
        """
        seg = Segment.open(block_tables_segment_name(name))
        try:
            if seg.size_bytes < BT_HEADER_DTYPE.itemsize:
                raise LayoutMismatchError(
                    f"segment {seg.shm_name} is {seg.size_bytes} bytes, smaller than a block-"
                    f"table header ({BT_HEADER_DTYPE.itemsize} bytes)")
            hdr = np.ndarray((1,), BT_HEADER_DTYPE, buffer=seg.buf)[0].copy()
            _check_header(seg, hdr, BT_MAGIC, BT_LAYOUT_VERSION, BT_HEADER_DTYPE.itemsize, None)
            num_groups = int(hdr["num_groups"])
            if not 1 <= num_groups <= MAX_KV_CACHE_GROUPS:
                raise LayoutMismatchError(
                    f"segment {seg.shm_name}: header field num_groups is {num_groups}, "
                    f"expected 1..{MAX_KV_CACHE_GROUPS}")
            widths = [int(x) for x in hdr["max_num_blocks_per_req"][:num_groups]]
            want = cls._total_bytes(num_groups, int(hdr["max_num_reqs"]), widths)
            _check_header(seg, hdr, BT_MAGIC, BT_LAYOUT_VERSION, BT_HEADER_DTYPE.itemsize, want)
            return cls(seg, owner=False)
        except BaseException:
            seg.close()
            raise

    def close(self) -> None:
        """Unmaps the tables (the tensors handed out keep their pages until dropped); any
        later call raises PoolClosedError."""
        if self._segment.buf is None:
            return
        self._hdr = self._words = self._swords = _Closed(self.name)  # type: ignore[assignment]
        self._num_blocks_np = self._tables_np = _Closed(self.name)  # type: ignore[assignment]
        self._tables_c = None
        self._views = (_Closed(self.name), _Closed(self.name))
        self._segment.close()

    @staticmethod
    def unlink(name: str) -> bool:
        """Removes the tables' name; False if there was none."""
        return Segment.unlink(block_tables_segment_name(name))

    def __enter__(self) -> SharedBlockTables:
        return self

    def __exit__(self, *exc: object) -> None:
        name = self.name
        self.close()
        if self._owner:
            Segment.unlink(name)

    # ------------------------------------------------------------------ zero-copy views

    def _t(self) -> tuple:
        """(num_blocks_per_row, [table per group]) as torch tensors sharing the numpy
        views' memory (``torch.from_numpy``: no copy)."""
        if self._views is None:
            self._views = (torch.from_numpy(self._num_blocks_np),
                           [torch.from_numpy(a) for a in self._tables_np])
        return self._views

    def block_table(self, group: int) -> torch.Tensor:
        """Group ``group``'s whole table: an int32 tensor over the segment (no copy)."""
        return self._t()[1][group]

    @property
    def num_blocks_per_row(self) -> torch.Tensor:
        """int32 ``[num_groups, max_num_reqs]`` over the segment (no copy)."""
        return self._t()[0]

    @property
    def step(self) -> int:
        """The last published step (-1 before the first commit)."""
        return int(self._swords[_STEP_WORD])

    @property
    def seq(self) -> int:
        return int(self._words[_SEQ_WORD])

    # ------------------------------------------------------------------ writer side

    def _begin_write(self) -> None:
        if not self._writing:
            # Odd: readers keep off. Already odd when a writer died mid-step: its successor
            # keeps it odd until its own commit.
            if self._seqlock and int(self._words[_SEQ_WORD]) % 2 == 0:
                self._words[_SEQ_WORD] += 1
                _fence()  # odd seq before the first row store
            self._writing = True

    def _check_row(self, row: object, what: str = "row") -> int:
        if isinstance(row, bool) or not isinstance(row, (int, np.integer)):
            raise UsageError(f"{what} must be an int, got {row!r}")
        if not 0 <= row < self.max_num_reqs:
            raise UsageError(f"{what} {row} out of range [0, {self.max_num_reqs})")
        return int(row)

    def _check_ids(self, block_ids_per_group: Sequence[Sequence[int]], row: int,
                   appending: bool) -> list[tuple[Sequence[int], int, int]]:
        """Validates every group's ids before anything is written; returns per group
        (ids, start, count). Plain Python on purpose: rows are short, numpy's per-call
        overhead is not."""
        if len(block_ids_per_group) != self.num_groups:
            raise UsageError(
                f"block ids for {len(block_ids_per_group)} KV-cache groups; these tables "
                f"have {self.num_groups}")
        out = []
        lengths = self._num_blocks_list(row) if appending else None
        for g, ids in enumerate(block_ids_per_group):
            if not isinstance(ids, (list, tuple)) and hasattr(ids, "tolist"):
                ids = ids.reshape(-1).tolist()  # an array or a tensor
            n = len(ids)
            start = lengths[g] if lengths is not None else 0
            if start + n > self.max_num_blocks_per_req[g]:
                raise UsageError(
                    f"group {g}, row {row}: {start} + {n} blocks exceed the table's "
                    f"width of {self.max_num_blocks_per_req[g]}")
            if n:
                lo, hi = min(ids), max(ids)
                if not isinstance(lo, (int, np.integer)) or not isinstance(hi, (int, np.integer)):
                    raise UsageError(f"group {g}, row {row}: block ids must be ints, got {ids!r}")
                if lo < 0 or hi > MAX_BLOCK_ID:
                    raise UsageError(
                        f"group {g}, row {row}: block ids must lie in [0, {MAX_BLOCK_ID}], "
                        f"found {lo}..{hi}")
            out.append((ids, start, n))
        return out

    def _num_blocks_list(self, row: int) -> list[int]:
        return self._num_blocks_np[:, row].tolist()

    def append_row(self, block_ids_per_group: Sequence[Sequence[int]], row: int) -> None:
        """Appends each group's ids after the row's current blocks (vLLM's append_row).

        Raises:
            UsageError: wrong number of groups, a row out of range, a row overflowing its
                width, a negative id; nothing is written then.
        """
        row = self._check_row(row)
        checked = self._check_ids(block_ids_per_group, row, appending=True)
        self._begin_write()
        self._write_checked(row, checked)

    def add_row(self, block_ids_per_group: Sequence[Sequence[int]], row: int) -> None:
        """Replaces the row with each group's ids (vLLM's add_row). Raises as append_row."""
        row = self._check_row(row)
        checked = self._check_ids(block_ids_per_group, row, appending=False)
        self._begin_write()
        self._write_checked(row, checked)

    def _write_checked(self, row: int, checked: list[tuple[Sequence[int], int, int]]) -> None:
        for g, (ids, start, n) in enumerate(checked):
            if n:
                self._tables_np[g][row, start:start + n] = ids
            self._num_blocks_np[g, row] = start + n

    def add_rows(self, block_ids_per_row: Sequence[Sequence[Sequence[int]]],
                 rows: Sequence[int]) -> None:
        """``add_row`` for many rows at once, vectorised (a step's new requests)."""
        self._write_rows(block_ids_per_row, rows, appending=False)

    def append_rows(self, block_ids_per_row: Sequence[Sequence[Sequence[int]]],
                    rows: Sequence[int]) -> None:
        """``append_row`` for many rows at once, vectorised (a step's new blocks)."""
        self._write_rows(block_ids_per_row, rows, appending=True)

    def _write_rows(self, block_ids_per_row, rows, appending: bool) -> None:
        """Validates every row of every group first (UsageError, nothing written), then
        scatters all ids of a group with one numpy store. With the C kernel built, plain
        lists of valid ints are checked and stored in one C pass; what it refuses takes
        this path, whose checks name the row and group at fault."""
        if (_c_scatter_rows is not None and self._tables_c is not None
                and _c_scatter_rows(self._tables_c, self._num_blocks_np, rows,
                                    block_ids_per_row, appending, MAX_BLOCK_ID,
                                    self._begin_write)):
            return
        is_array = not isinstance(rows, (list, tuple)) and hasattr(rows, "tolist")
        rows_list = rows.tolist() if is_array else list(rows)
        if len(block_ids_per_row) != len(rows_list):
            raise UsageError(f"{len(block_ids_per_row)} rows of block ids for "
                             f"{len(rows_list)} row indices")
        if not rows_list:
            return
        lo, hi = min(rows_list), max(rows_list)
        if lo < 0 or hi >= self.max_num_reqs:
            raise UsageError(f"rows must lie in [0, {self.max_num_reqs}), got {lo}..{hi}")
        if len(set(rows_list)) != len(rows_list):
            raise UsageError("a row appears twice in one call")
        for r, ids in zip(rows_list, block_ids_per_row, strict=True):
            if len(ids) != self.num_groups:
                raise UsageError(
                    f"row {r}: block ids for {len(ids)} KV-cache groups; "
                    f"these tables have {self.num_groups}")
        if len(rows_list) <= _ROW_BY_ROW_MAX:  # few rows: numpy's fixed costs would dominate
            plans = self._plan_few_rows(block_ids_per_row, rows_list, appending)
            if plans is not None:  # plain lists of valid ints: one store per group
                self._begin_write()
                for g, (rr, cc, flat, ends) in enumerate(plans):
                    if flat:
                        self._tables_np[g][rr, cc] = flat
                    self._num_blocks_np[g, rows_list] = ends
                return
            # Something to refuse (or ids that are not lists): row by row, whose checks
            # name the row and group at fault.
            checked = [self._check_ids(ids, self._check_row(r), appending)
                       for r, ids in zip(rows_list, block_ids_per_row, strict=True)]
            self._begin_write()
            for r, c in zip(rows_list, checked, strict=True):
                self._write_checked(r, c)
            return
        rows_arr = np.asarray(rows_list, dtype=np.int64)
        plans = []
        for g in range(self.num_groups):
            lists = [ids[g] for ids in block_ids_per_row]
            counts = np.fromiter(map(len, lists), np.int64, rows_arr.size)
            total = int(counts.sum())
            flat = np.fromiter(itertools.chain.from_iterable(lists), np.int64, total)
            starts = (self._num_blocks_np[g, rows_arr].astype(np.int64) if appending
                      else np.zeros(rows_arr.size, np.int64))
            ends = starts + counts
            if int(ends.max()) > self.max_num_blocks_per_req[g]:
                i = int(np.flatnonzero(ends > self.max_num_blocks_per_req[g])[0])
                raise UsageError(
                    f"group {g}, row {int(rows_arr[i])}: {int(starts[i])} + {int(counts[i])} "
                    f"blocks exceed the table's width of {self.max_num_blocks_per_req[g]}")
            if total and (int(flat.min()) < 0 or int(flat.max()) > MAX_BLOCK_ID):
                raise UsageError(
                    f"group {g}: block ids must lie in [0, {MAX_BLOCK_ID}], found "
                    f"{int(flat.min())}..{int(flat.max())}")
            plans.append((counts, total, flat, starts, ends))
        self._begin_write()
        for g, (counts, total, flat, starts, ends) in enumerate(plans):
            if total:
                first = np.repeat(np.cumsum(counts) - counts - starts, counts)
                cols = np.arange(total) - first
                self._tables_np[g][np.repeat(rows_arr, counts), cols] = flat
            self._num_blocks_np[g, rows_arr] = ends

    def _plan_few_rows(self, block_ids_per_row, rows_list: list, appending: bool
                       ) -> list[tuple[list, list, list, list]] | None:
        """The stores of a few rows' writes, per group: (table rows, columns, ids, new
        lengths), in plain Python (a decode step appends one id to a handful of rows, where
        each numpy call's fixed cost would dominate). None when anything would be refused
        or the ids are not lists or tuples of ints: the row-by-row checks then say why."""
        if not all(type(r) is int for r in rows_list):
            return None
        lengths = self._num_blocks_np[:, rows_list].tolist() if appending else None
        plans = []
        for g in range(self.num_groups):
            rr: list[int] = []
            cc: list[int] = []
            flat: list[int] = []
            ends: list[int] = []
            starts = lengths[g] if appending else [0] * len(rows_list)
            for r, ids, start in zip(rows_list, block_ids_per_row, starts, strict=True):
                ids = ids[g]
                if type(ids) is not list and type(ids) is not tuple:
                    return None
                n = len(ids)
                if n:
                    flat.extend(ids)
                    rr.extend([r] * n)
                    cc.extend(range(start, start + n))
                ends.append(start + n)
            if flat:
                lo, hi = min(flat), max(flat)
                if type(lo) is not int or type(hi) is not int or lo < 0 or hi > MAX_BLOCK_ID:
                    return None
            if max(ends) > self.max_num_blocks_per_req[g]:
                return None
            plans.append((rr, cc, flat, ends))
        return plans

    def clear_row(self, row: int) -> None:
        """Zeroes the row's blocks (the null block) and its lengths."""
        row = self._check_row(row)
        self._begin_write()
        for g in range(self.num_groups):
            self._tables_np[g][row, : int(self._num_blocks_np[g, row])] = 0
            self._num_blocks_np[g, row] = 0

    def move_row(self, src: int, tgt: int) -> None:
        """Copies row ``src`` to ``tgt`` and clears ``src`` (vLLM's move_row; as there,
        ``src == tgt`` leaves the row empty)."""
        src, tgt = self._check_row(src, "src"), self._check_row(tgt, "tgt")
        self._begin_write()
        for g in range(self.num_groups):
            n = int(self._num_blocks_np[g, src])
            self._tables_np[g][tgt, :n] = self._tables_np[g][src, :n]
            self._num_blocks_np[g, tgt] = n
            self._tables_np[g][src, :n] = 0
            self._num_blocks_np[g, src] = 0

    def swap_row(self, src: int, tgt: int) -> None:
        """Swaps two rows in every group."""
        src, tgt = self._check_row(src, "src"), self._check_row(tgt, "tgt")
        self._begin_write()
        for g in range(self.num_groups):
            self._tables_np[g][[src, tgt]] = self._tables_np[g][[tgt, src]]
            self._num_blocks_np[g, [src, tgt]] = self._num_blocks_np[g, [tgt, src]]

    def clear(self) -> None:
        """Zeroes every table and length."""
        self._begin_write()
        for t in self._tables_np:
            t[:] = 0
        self._num_blocks_np[:] = 0

    def commit(self, step: int) -> None:
        """Publishes every row written since the last commit as ``step``.

        Raises:
            UsageError: ``step`` not greater than the last published one (nothing changes;
                the rows stay unpublished).
        """
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
            raise UsageError(f"step must be an int, got {step!r}")
        if step <= self.step:
            raise UsageError(f"step {step} is not after the last published step {self.step}")
        self._begin_write()
        _fence()  # the rows before step and the even seq that publish them
        self._swords[_STEP_WORD] = step
        if self._seqlock:
            _fence()
            self._words[_SEQ_WORD] += 1  # even: published
        self._writing = False

    # ------------------------------------------------------------------ reader side

    def _wait_even(self, deadline: float, min_step: int | None) -> int:
        spins = 0
        while True:
            seq = int(self._words[_SEQ_WORD])
            if seq % 2 == 0 and (min_step is None or self.step >= min_step):
                _fence()  # seq (and step) before the rows read after it
                return seq
            if time.monotonic() > deadline:
                raise TornReadError(
                    f"block tables {self.name}: no consistent state in time (seq {seq}, "
                    f"step {self.step}" + (f", waiting for step {min_step})" if min_step
                                           is not None else ")"))
            spins += 1
            if spins > 64:
                time.sleep(0)

    def read(self, rows: Sequence[int] | torch.Tensor | None = None, *,
             min_step: int | None = None,
             timeout_s: float = DEFAULT_READ_TIMEOUT_S) -> BlockTableSnapshot:
        """A consistent copy of ``rows`` (all rows if None) of every group, taken under the
        seqlock: retried until no write overlapped it. ``min_step``: wait until at least
        that step is published.

        Raises:
            UsageError: a row out of range.
            TornReadError: no consistent copy within ``timeout_s``.
        """
        if rows is None:
            idx = torch.arange(self.max_num_reqs)
        else:
            idx = _as_int64(rows)
            if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.max_num_reqs):
                raise UsageError(
                    f"rows must lie in [0, {self.max_num_reqs}), got {int(idx.min())}.."
                    f"{int(idx.max())}")
        deadline = time.monotonic() + timeout_s
        while True:
            seq = self._wait_even(deadline, min_step) if self._seqlock else 0
            tables = [t.index_select(0, idx) for t in self._t()[1]]
            num_blocks = self._t()[0].index_select(1, idx)
            _fence()  # the rows before the seq re-read that validates them
            step = int(self._swords[_STEP_WORD])
            if not self._seqlock or int(self._words[_SEQ_WORD]) == seq:
                return BlockTableSnapshot(step, idx, tables, num_blocks, self.block_sizes)

    def compute_slot_mappings(self, rows: Sequence[int] | torch.Tensor,
                              req_indices: torch.Tensor, positions: torch.Tensor, *,
                              min_step: int | None = None,
                              timeout_s: float = DEFAULT_READ_TIMEOUT_S,
                              ) -> tuple[int, list[torch.Tensor]]:
        """``(step, slot mapping per group)`` computed straight from the shared tables
        (zero-copy: no row is gathered first), under the seqlock. Token ``t`` is in table
        row ``rows[req_indices[t]]`` at ``positions[t]``.

        Raises:
            UsageError: a row or position out of range.
            TornReadError: no consistent state within ``timeout_s``.
        """
        operands = (_c_operand(rows), _c_operand(req_indices), _c_operand(positions))
        if (_c_slot_mappings is not None and self._tables_c is not None
                and all(x is not None for x in operands)
                and _c_slot_mappings(self._tables_c, self.block_sizes, *operands, None)):
            result = self._c_slot_mappings(operands, min_step, timeout_s)
            if result is not None:
                return result
        rows_np = _as_numpy_int64(rows)
        if rows_np.size and (int(rows_np.min()) < 0 or int(rows_np.max()) >= self.max_num_reqs):
            raise UsageError(
                f"rows must lie in [0, {self.max_num_reqs}), got {int(rows_np.min())}.."
                f"{int(rows_np.max())}")
        req = _as_numpy_int64(req_indices)
        if req.size and (int(req.min()) < 0 or int(req.max()) >= rows_np.size):
            raise UsageError(f"req_indices must lie in [0, {rows_np.size}), got "
                             f"{int(req.min())}..{int(req.max())}")
        token_rows = rows_np.take(req)
        positions = _as_numpy_int64(positions)
        if positions.size != token_rows.size:
            raise UsageError(f"{token_rows.size} req_indices but {positions.size} positions")
        if positions.size:
            lo, hi = int(positions.min()), int(positions.max())
            for table, bs in zip(self._tables_np, self.block_sizes, strict=True):
                _check_slot_inputs(lo, hi, 0, table.shape, bs)
        deadline = time.monotonic() + timeout_s
        while True:
            seq = self._wait_even(deadline, min_step) if self._seqlock else 0
            slots = [torch.from_numpy(_slots_np(table, token_rows, positions, bs))
                     for table, bs in zip(self._tables_np, self.block_sizes, strict=True)]
            _fence()  # the rows before the seq re-read that validates them
            step = int(self._swords[_STEP_WORD])
            if not self._seqlock or int(self._words[_SEQ_WORD]) == seq:
                return step, slots

    def _c_slot_mappings(self, operands: tuple, min_step: int | None, timeout_s: float
                         ) -> tuple[int, list[torch.Tensor]] | None:
        """compute_slot_mappings in one C pass per try, on operands it has checked; None
        if a try refuses them after all (another thread changed the caller's lists)."""
        out = np.empty((self.num_groups, len(operands[2])), np.int64)
        deadline = time.monotonic() + timeout_s
        while True:
            seq = self._wait_even(deadline, min_step) if self._seqlock else 0
            if not _c_slot_mappings(self._tables_c, self.block_sizes, *operands, out):
                return None
            _fence()  # the rows before the seq re-read that validates them
            step = int(self._swords[_STEP_WORD])
            if not self._seqlock or int(self._words[_SEQ_WORD]) == seq:
                return step, [torch.from_numpy(slots) for slots in out]

    @contextlib.contextmanager
    def reading(self, step: int | None = None, *,
                timeout_s: float = DEFAULT_READ_TIMEOUT_S) -> Iterator[BlockTableSnapshot]:
        """Zero-copy access for the step handshake: waits until ``step`` (or any step) is
        published with no write in progress, yields the shared tensors themselves (all
        rows), and raises ``TornReadError`` on exit if a write began meanwhile."""
        seq = self._wait_even(time.monotonic() + timeout_s, step)
        yield BlockTableSnapshot(self.step, torch.arange(self.max_num_reqs),
                                 list(self._t()[1]), self._t()[0], self.block_sizes)
        _fence()
        if int(self._words[_SEQ_WORD]) != seq:
            raise TornReadError(
                f"block tables {self.name} were written during a zero-copy read (seq {seq} -> "
                f"{int(self._words[_SEQ_WORD])}): the scheduler broke the step handshake")

    def data_address_range(self) -> tuple[int, int]:
        """[start, end) addresses of the mapping, to show a tensor lies inside it."""
        start = self._hdr.ctypes.data
        return start, start + self._segment.size_bytes


# --------------------------------------------------------------------------- KV store

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
        self.dtype = _torch_dtype(bytes(h["dtype"]).decode())
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
            _positive_int(what, v)
        if num_blocks > MAX_BLOCK_ID:
            raise UsageError(f"num_blocks {num_blocks} exceeds {MAX_BLOCK_ID}")
        dname = _dtype_name(dtype)
        element_bytes = _torch_dtype(dname).itemsize
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
            _check_header(seg, hdr, KV_MAGIC, KV_LAYOUT_VERSION, KV_HEADER_BYTES, None)
            dname = bytes(hdr["dtype"]).decode(errors="replace")
            if dname not in _DTYPE_NAMES:
                raise LayoutMismatchError(
                    f"segment {seg.shm_name}: header field dtype is {dname!r}, expected one of "
                    f"{sorted(_DTYPE_NAMES)}")
            itemsize = _torch_dtype(dname).itemsize
            if int(hdr["element_bytes"]) != itemsize:
                raise LayoutMismatchError(
                    f"segment {seg.shm_name}: header field element_bytes is "
                    f"{int(hdr['element_bytes'])}, expected {itemsize}")
            want = cls._total_bytes(*(int(hdr[f]) for f in (
                "num_layers", "num_blocks", "block_size", "num_kv_heads", "head_size",
                "element_bytes")))
            _check_header(seg, hdr, KV_MAGIC, KV_LAYOUT_VERSION, KV_HEADER_BYTES, want)
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
        self.kv = self.key_cache = self.value_cache = _Closed(self.name)  # type: ignore
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


# --------------------------------------------------------------------------- CUDA IPC (device)

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
