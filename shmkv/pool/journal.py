"""The undo journal: every write under the pool lock first records the old value.

Protocol (region ``journal`` and header word ``journal_len``, see ``shmkv/pool/layout.py``): to
write a word, the lock holder stores ``(where, old)`` at ``journal[journal_len]``, then
bumps ``journal_len``, then writes the word. A kill between any two of those stores leaves
entries ``[0, journal_len)`` that restore every word the hold changed (an entry written but
not yet counted guards a word not yet written). The holder commits by zeroing
``journal_len`` on release, before it clears the holder record; whoever takes the lock with
``journal_len != 0`` repairs first: :func:`undo` restores the words, earliest entry first
for a word written twice, so the pool is exactly what it was when the dead hold began. A
hold that writes more words than the journal has entries sets ``journal_len`` to
``JOURNAL_OVERFLOWED`` and goes on unjournaled; its repair is ``recovery.rebuild``.

The C kernel (``_ckernel.c``) writes the same entries for its own stores. Here, the Python
side writes through :class:`JournaledView` (single words, for the hot paths) and
:class:`JournaledColumn` (numpy fancy-index writes, journaled in one vectorised append).
"""

from __future__ import annotations

import struct

import numpy as np

from shmkv.pool import fault as _fault
from shmkv.pool import layout as L

_H_LEN = L.H_JOURNAL_LEN
_OVERFLOWED = L.JOURNAL_OVERFLOWED
_PACKERS: dict[int, struct.Struct] = {}  # save_words: entries -> their packer


class Journal:
    """This process's writer of the pool's undo journal (callers hold the pool lock)."""

    def __init__(self, buf, layout: L.Layout, hdr64) -> None:
        mem = memoryview(buf)
        self._seg32 = mem.cast("i")
        self._seg64 = mem.cast("q")
        off = layout.offsets["journal"]
        cap = layout.config.journal_entries
        self._ent = mem[off:off + 16 * cap].cast("q")  # where, old, where, old, ...
        self._entries = layout.view(buf, "journal")
        self._seg32_np = np.frombuffer(buf, dtype="<i4")
        self._seg64_np = np.frombuffer(buf, dtype="<i8")
        self._hdr = hdr64
        self.capacity = cap

    def release(self) -> None:
        for view in (self._ent, self._seg32, self._seg64):
            view.release()
        self._entries = self._seg32_np = self._seg64_np = None

    def save(self, offset: int, width: int) -> None:
        """Records the ``width``-byte word (4 or 8) at byte ``offset`` before a write."""
        if _fault.armed:
            return self._save_counted(offset, width)
        hdr = self._hdr
        n = hdr[_H_LEN]
        if 0 <= n < self.capacity:
            ent = self._ent
            ent[2 * n] = offset << 4 | width
            ent[2 * n + 1] = self._seg32[offset >> 2] if width == 4 else self._seg64[offset >> 3]
            hdr[_H_LEN] = n + 1
        elif n >= 0:
            hdr[_H_LEN] = _OVERFLOWED

    def _save_counted(self, offset: int, width: int) -> None:
        """``save`` with a fault point before each of its stores and before the caller's."""
        hdr = self._hdr
        n = hdr[_H_LEN]
        _fault.tick()
        if 0 <= n < self.capacity:
            ent = self._ent
            ent[2 * n] = offset << 4 | width
            ent[2 * n + 1] = self._seg32[offset >> 2] if width == 4 else self._seg64[offset >> 3]
            _fault.tick()
            hdr[_H_LEN] = n + 1
        elif n >= 0:
            hdr[_H_LEN] = _OVERFLOWED
        _fault.tick()  # the write the caller makes next

    def save_words(self, words: list[int]) -> None:
        """Records several words before the writes that follow, all in one go: ``words`` is
        ``[where, old, where, old, ...]`` (``where = byte_offset << 4 | width``, ``old`` the
        word's value now). The entries are written first, then ``journal_len`` once for all of
        them (a kill before that store leaves no word written; after it, entries of words not
        yet written restore the value they still have), so a one-block call pays one length
        store instead of one per word. The caller knows the old values (it has just read
        them to decide its writes), and writes nothing it has not recorded here."""
        hdr = self._hdr
        n = hdr[_H_LEN]
        k = len(words) >> 1
        if _fault.armed:  # one fault point per entry, then the length's
            if 0 <= n and n + k <= self.capacity:
                ent = self._ent
                for i in range(0, 2 * k, 2):
                    _fault.tick()
                    ent[2 * n + i] = words[i]
                    ent[2 * n + i + 1] = words[i + 1]
                _fault.tick()
                hdr[_H_LEN] = n + k
            elif n >= 0:
                _fault.tick()
                hdr[_H_LEN] = _OVERFLOWED
            return
        if 0 <= n and n + k <= self.capacity:
            packer = _PACKERS.get(k)
            if packer is None:
                packer = _PACKERS[k] = struct.Struct(f"<{2 * k}q")
            packer.pack_into(self._ent, 16 * n, *words)
            hdr[_H_LEN] = n + k
        elif n >= 0:
            hdr[_H_LEN] = _OVERFLOWED

    def reserve(self, entries: int) -> None:
        """Declares that the hold is about to journal ``entries`` more words; if they will
        not fit, marks the journal overflowed now rather than fill it on the way (a bulk
        write then skips gathering old values it could not keep)."""
        hdr = self._hdr
        n = hdr[_H_LEN]
        if n >= 0 and n + entries > self.capacity:
            if _fault.armed:
                _fault.tick()
            hdr[_H_LEN] = _OVERFLOWED

    def save_many(self, offsets: np.ndarray, width: int) -> None:
        """Records the words at byte ``offsets`` (an int64 array) before a bulk write."""
        hdr = self._hdr
        n = hdr[_H_LEN]
        if n < 0:  # overflowed: nothing more is kept, nothing to gather
            return
        k = len(offsets)
        if _fault.armed:
            _fault.tick()
        if n + k <= self.capacity:
            entries = self._entries
            entries["where"][n:n + k] = offsets << 4 | width
            if width == 4:
                entries["old"][n:n + k] = self._seg32_np[offsets >> 2]
            else:
                entries["old"][n:n + k] = self._seg64_np[offsets >> 3]
            if _fault.armed:
                _fault.tick()
            hdr[_H_LEN] = n + k
        else:
            hdr[_H_LEN] = _OVERFLOWED
        if _fault.armed:
            _fault.tick()

    def save_bytes(self, offset: int, nbytes: int) -> None:
        """Records ``nbytes`` (a multiple of 8, 8-aligned) from byte ``offset`` as words."""
        if nbytes == 8:
            self.save(offset, 8)
        else:
            self.save_many(np.arange(offset, offset + nbytes, 8, dtype=np.int64), 8)


class JournaledView:
    """A flat or strided memoryview whose item writes are journaled first.

    Args:
        view: the memoryview (format "i" or "q").
        journal: the pool's journal.
        base: byte offset in the segment of item 0.
        stride: bytes between items.
    """

    __slots__ = ("_view", "_journal", "_hdr", "_ent", "_cap", "_base", "_stride", "_width")

    def __init__(self, view, journal: Journal, base: int, stride: int) -> None:
        self._view = view
        self._journal = journal
        self._hdr = journal._hdr
        self._ent = journal._ent
        self._cap = journal.capacity
        self._base = base
        self._stride = stride
        self._width = view.itemsize

    def __getitem__(self, i):
        return self._view[i]

    def __setitem__(self, i: int, value: int) -> None:
        # Journal.save, inlined (the Python kernel's every write comes here); the old value
        # is read from this view, which names the same word.
        hdr = self._hdr
        n = hdr[_H_LEN]
        if _fault.armed or not 0 <= n < self._cap:
            self._journal.save(self._base + i * self._stride, self._width)
        else:
            ent = self._ent
            ent[2 * n] = (self._base + i * self._stride) << 4 | self._width
            ent[2 * n + 1] = self._view[i]
            hdr[_H_LEN] = n + 1
        self._view[i] = value

    def __len__(self) -> int:
        return len(self._view)

    def release(self) -> None:
        self._view.release()


class JournaledColumn:
    """A numpy column (one field of a structured array, or a plain int array) whose
    fancy-index writes are journaled first, in one vectorised append."""

    __slots__ = ("_col", "_journal", "_base", "_stride", "_width")

    def __init__(self, col: np.ndarray, journal: Journal, base: int) -> None:
        self._col = col
        self._journal = journal
        self._base = base
        self._stride = col.strides[0]
        self._width = col.dtype.itemsize

    def __getitem__(self, idx):
        return self._col[idx]

    def __setitem__(self, idx, value) -> None:
        journal = self._journal
        if journal._hdr[_H_LEN] >= 0:
            idx = np.asarray(idx, dtype=np.int64)
            journal.save_many(self._base + idx * self._stride, self._width)
        self._col[idx] = value


def undo(buf, layout: L.Layout, hdr64, start: int = 0) -> int:
    """Restores every word the journal records from entry ``start`` on (0: the whole hold)
    and truncates it to ``start``; returns the entries undone. Idempotent until
    ``journal_len`` is set, which it does last, so a repairer that dies half way leaves the
    same work to the next one. The caller holds the lock and has seen
    ``start < journal_len``."""
    n = hdr64[_H_LEN]
    entries = layout.view(buf, "journal")[start:n]
    where = entries["where"]
    # Earliest entry of each word: its value before the hold.
    _, first = np.unique(where, return_index=True)
    where, old = where[first], entries["old"][first]
    offsets, widths = where >> 4, where & 15
    seg32 = np.frombuffer(buf, dtype="<i4")
    seg64 = np.frombuffer(buf, dtype="<i8")
    four = widths == 4
    seg32[offsets[four] >> 2] = old[four].astype(np.int32)
    eight = widths == 8
    seg64[offsets[eight] >> 3] = old[eight]
    hdr64[_H_LEN] = start
    return int(n - start)
