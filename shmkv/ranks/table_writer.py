"""The writer side of a scheduler's block tables: vLLM's row edits, validated in full before
anything is written, inside the seqlock (``shmkv/ranks/tables.py``'s docstring: an odd `seq`
before the first store of a step, the rows, then ``commit`` publishes `step` and makes `seq`
even). Only the scheduler writes; numpy only, so a scheduler never loads torch."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from shmkv.errors import UsageError
from shmkv.pool.barriers import fence as _fence
from shmkv.ranks._common import MAX_BLOCK_ID
from shmkv.ranks.table_header import SEQ_WORD as _SEQ_WORD
from shmkv.ranks.table_header import STEP_WORD as _STEP_WORD

try:  # the writer's one-pass row scatter; numpy below is the reference and the fallback
    from shmkv.pool._ckernel import scatter_rows as _c_scatter_rows
except ImportError:  # pure-Python install
    _c_scatter_rows = None

_ROW_BY_ROW_MAX = 24  # add_rows / append_rows with at most this many rows go row by row


class TableWriter:
    """The row edits and ``commit`` of ``SharedBlockTables`` (its base class), over the
    numpy views its ``__init__`` makes: ``_tables_np``, ``_num_blocks_np``, ``_words`` /
    ``_swords`` (the header as u64 / i64 words), ``_tables_c`` (the C helper's operand),
    ``_writing``, ``_seqlock``, and the sizes."""

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
