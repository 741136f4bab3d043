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
    Closed,
    LazyTorch,
    SegmentOwner,
    align,
    check_header,
    positive_int,
)
from shmkv.ranks.table_header import (
    BT_HEADER_DTYPE,
    BT_LAYOUT_VERSION,
    BT_MAGIC,
    MAX_KV_CACHE_GROUPS,
    block_tables_segment_name,
)
from shmkv.ranks.table_header import SEQ_WORD as _SEQ_WORD
from shmkv.ranks.table_header import STEP_WORD as _STEP_WORD
from shmkv.ranks.table_writer import TableWriter

torch = LazyTorch(globals())

DEFAULT_READ_TIMEOUT_S = 5.0


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


class SharedBlockTables(TableWriter, SegmentOwner):
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
