"""A scheduler's block tables in shared memory, which its rank processes map.

torch is imported on first use only: a scheduler process that just writes rows (numpy)
never loads it.

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
``swap_row``, ``clear``), writes the rows, then on ``commit(step)`` stores `step` and makes
`seq` even. A reader reads `seq` (retrying while odd), copies what it needs, reads `step`,
and accepts the copy only if `seq` is unchanged (``read``). A zero-copy reader (``reading``)
waits for an even `seq` and the step it was told about, uses the shared tensors in place,
and checks on exit that `seq` did not move: the scheduler must not write while its rank
computes (the step handshake; ``TornReadError`` if it did). Fences
(``shmkv/pool/barriers.py``) order the odd `seq` before the row stores, the rows before
`step` and the even `seq`, and on the reader's side `seq` before the rows and the rows
before the re-read of `seq`, so this holds on weakly ordered CPUs (aarch64) too, not only on
x86-64 (TSO).

Crash behaviour: a writer killed mid-step leaves `seq` odd; readers then time out with
``TornReadError`` until a successor (the scheduler's replacement, attached to the same
tables) rewrites the rows it needs and commits; its first write keeps `seq` odd.

Changelog: bt v1: initial. bt v2: the owner record (versions and magics now in
``shmkv/pool/layout.py``). bt v3: the owner record grows to 112 bytes.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from shmkv.errors import LayoutMismatchError, TornReadError, UsageError
from shmkv.pool import layout as L
from shmkv.pool.barriers import fence as _fence
from shmkv.pool.segment import Segment
from shmkv.pool.siblings import owner_record, write_owner
from shmkv.ranks import slot_mapping as sm
from shmkv.ranks._common import (
    MAX_BLOCK_ID,
    Closed,
    LazyTorch,
    align,
    check_header,
    positive_int,
)

try:  # the writer's one-pass row scatter; numpy below is the reference and the fallback
    from shmkv.pool._ckernel import scatter_rows as _c_scatter_rows
except ImportError:  # pure-Python install
    _c_scatter_rows = None

torch = LazyTorch(globals())

BT_LAYOUT_VERSION = L.BT_LAYOUT_VERSION
BT_MAGIC = L.BT_MAGIC  # bytes all different, like the pool's MAGIC
MAX_KV_CACHE_GROUPS = 8
DEFAULT_READ_TIMEOUT_S = 5.0
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


def block_tables_segment_name(name: str) -> str:
    return L.sibling_segment_name("bt", name, BT_LAYOUT_VERSION)


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
        return [sm.compute_slot_mapping(t, req_indices, positions, bs)
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
        off = align(BT_HEADER_DTYPE.itemsize)
        out = [(off, 4 * num_groups * max_num_reqs)]
        off = align(off + out[-1][1])
        for w in widths:
            out.append((off, 4 * max_num_reqs * w))
            off = align(off + out[-1][1])
        return out

    @classmethod
    def _total_bytes(cls, num_groups: int, max_num_reqs: int, widths: Sequence[int]) -> int:
        off, size = cls._region_offsets(num_groups, max_num_reqs, widths)[-1]
        return align(off + size)

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
        positive_int("max_num_reqs", max_num_reqs)
        positive_int("max_model_len", max_model_len)
        block_sizes = list(block_sizes)
        if not 1 <= len(block_sizes) <= MAX_KV_CACHE_GROUPS:
            raise UsageError(
                f"block_sizes must name 1..{MAX_KV_CACHE_GROUPS} KV-cache groups, got "
                f"{len(block_sizes)}")
        for bs in block_sizes:
            positive_int("each block size", bs)
        if max_num_blocks_per_req is None:
            widths = [math.ceil(max_model_len / bs) for bs in block_sizes]
        else:
            widths = list(max_num_blocks_per_req)
            if len(widths) != len(block_sizes):
                raise UsageError(
                    f"max_num_blocks_per_req has {len(widths)} entries for "
                    f"{len(block_sizes)} block sizes")
            for w in widths:
                positive_int("each max_num_blocks_per_req", w)
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
            check_header(seg, hdr, BT_MAGIC, BT_LAYOUT_VERSION, BT_HEADER_DTYPE.itemsize, None)
            num_groups = int(hdr["num_groups"])
            if not 1 <= num_groups <= MAX_KV_CACHE_GROUPS:
                raise LayoutMismatchError(
                    f"segment {seg.shm_name}: header field num_groups is {num_groups}, "
                    f"expected 1..{MAX_KV_CACHE_GROUPS}")
            widths = [int(x) for x in hdr["max_num_blocks_per_req"][:num_groups]]
            want = cls._total_bytes(num_groups, int(hdr["max_num_reqs"]), widths)
            check_header(seg, hdr, BT_MAGIC, BT_LAYOUT_VERSION, BT_HEADER_DTYPE.itemsize, want)
            return cls(seg, owner=False)
        except BaseException:
            seg.close()
            raise

    def close(self) -> None:
        """Unmaps the tables (the tensors handed out keep their pages until dropped); any
        later call raises PoolClosedError."""
        if self._segment.buf is None:
            return
        self._hdr = self._words = self._swords = Closed(self.name)  # type: ignore[assignment]
        self._num_blocks_np = self._tables_np = Closed(self.name)  # type: ignore[assignment]
        self._tables_c = None
        self._views = (Closed(self.name), Closed(self.name))
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
            idx = sm.as_int64(rows)
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
        operands = (sm.c_operand(rows), sm.c_operand(req_indices), sm.c_operand(positions))
        if (sm.c_slot_mappings is not None and self._tables_c is not None
                and all(x is not None for x in operands)
                and sm.c_slot_mappings(self._tables_c, self.block_sizes, *operands, None)):
            result = self._c_slot_mappings(operands, min_step, timeout_s)
            if result is not None:
                return result
        rows_np = sm.as_numpy_int64(rows)
        if rows_np.size and (int(rows_np.min()) < 0 or int(rows_np.max()) >= self.max_num_reqs):
            raise UsageError(
                f"rows must lie in [0, {self.max_num_reqs}), got {int(rows_np.min())}.."
                f"{int(rows_np.max())}")
        req = sm.as_numpy_int64(req_indices)
        if req.size and (int(req.min()) < 0 or int(req.max()) >= rows_np.size):
            raise UsageError(f"req_indices must lie in [0, {rows_np.size}), got "
                             f"{int(req.min())}..{int(req.max())}")
        token_rows = rows_np.take(req)
        positions = sm.as_numpy_int64(positions)
        if positions.size != token_rows.size:
            raise UsageError(f"{token_rows.size} req_indices but {positions.size} positions")
        if positions.size:
            lo, hi = int(positions.min()), int(positions.max())
            for table, bs in zip(self._tables_np, self.block_sizes, strict=True):
                sm.check_slot_inputs(lo, hi, 0, table.shape, bs)
        deadline = time.monotonic() + timeout_s
        while True:
            seq = self._wait_even(deadline, min_step) if self._seqlock else 0
            slots = [torch.from_numpy(sm.slots_np(table, token_rows, positions, bs))
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
            if not sm.c_slot_mappings(self._tables_c, self.block_sizes, *operands, out):
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
