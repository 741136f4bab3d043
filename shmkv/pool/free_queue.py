"""The free-block queue: vLLM's ``FreeKVCacheBlockQueue`` on int32 links in shared memory.

A doubly linked list threaded through the ``prev``/``next`` fields of the block rows, with two
sentinel rows (``layout.free_head``, ``layout.free_tail``) that are never popped, so every
queued block has a neighbour on each side. Removing from the middle is O(1), which is why a
deque will not do: ``BlockPool.touch`` pulls prefix-cache hits out of the queue.

Eviction order, head first::

    free_head <-> [unhashed blocks, reused first] <-> [hashed blocks, least recently freed
    first] <-> free_tail

The queue keeps no order of its own; ``BlockPool.free_blocks`` decides what goes to the front
(``prepend_n``) and what to the back (``append_n``).

Every queued block also carries a ``queue_key`` that strictly increases from head to tail:
``append*`` hands out keys above the largest so far, ``prepend_n`` keys below the smallest. The
keys are redundant with the links, on purpose: sorting the free blocks by key rebuilds the
queue when the links cannot be trusted (INV-QKEY).

NOTE: only this class writes ``prev``, ``next`` and ``queue_key`` (and the header's
``num_free_blocks``, ``queue_head_key``, ``queue_tail_key``), every write journaled first
(``shmkv/pool/journal.py``). All methods take and return block ids; callers hold the pool lock.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from shmkv.errors import InvariantViolation, OutOfBlocksError, UsageError
from shmkv.pool import layout as L
from shmkv.pool.journal import Journal, JournaledColumn, JournaledView

# Below this many blocks a Python loop over the links beats numpy's per-call overhead.
BULK_MIN_BLOCKS = 24

_R = L.ROW_I32
_PREV = L.F_PREV
_NEXT = L.F_NEXT
_R64 = L.ROW_I64
_KEY = L.F_QUEUE_KEY
_NO_BLOCK = L.NO_BLOCK
_H_NUM_FREE = L.H_NUM_FREE
_H_HEAD_KEY = L.H_QUEUE_HEAD_KEY
_H_TAIL_KEY = L.H_QUEUE_TAIL_KEY


class FreeListEnd:
    """The head or the tail of the free list as vLLM's code sees its sentinel nodes
    (``fake_free_list_head`` / ``fake_free_list_tail``): its links read the queue's shared
    rows, like a block handle's ``prev_free_block`` / ``next_free_block``."""

    __slots__ = ("_queue", "block_id")

    def __init__(self, queue: FreeKVCacheBlockQueue, block_id: int) -> None:
        self._queue = queue
        self.block_id = block_id

    @property
    def prev_free_block(self):
        return self._queue.linked(self._queue.prev_raw[self.block_id])

    @property
    def next_free_block(self):
        return self._queue.linked(self._queue.next_raw[self.block_id])

    def __repr__(self) -> str:
        end = "head" if self.block_id == self._queue.head else "tail"
        return f"FreeListEnd({end})"


def _corrupt(what: str, row: int) -> InvariantViolation:
    """The C kernel's error for a free-queue link that leaves the rows (``corrupt()``)."""
    return InvariantViolation([f"INV-FREE/INV-HASH: corrupt shared state: {what} (row {row})"])


_NOT_FREE = "free queue links to a row that is not a free block"
_OUTSIDE = "free queue links outside the block rows"


class FreeKVCacheBlockQueue:
    """O(1) doubly linked free queue over the block rows of a pool segment.

    Args:
        i32: flat int32 memoryview of the ``block_meta`` region.
        i64: flat int64 memoryview of the ``block_meta`` region.
        hdr64: flat int64 memoryview of the header.
        blocks: numpy view of ``block_meta`` (for the bulk paths).
        layout: the pool's layout (sentinel rows).
        journal: the pool's undo journal.

    The hot paths go through per-field strided views (``self._next[b]`` is row ``b``'s
    ``next``), made once here and journaled; ``prev_raw``/``next_raw`` are the same views
    unjournaled, for readers. :meth:`release` drops them, and must run before the views
    they are cut from are released.
    """

    def __init__(self, i32, i64, hdr64, blocks: np.ndarray, layout: L.Layout,
                 journal: Journal) -> None:
        meta = layout.offsets["block_meta"]
        row = L.BLOCK_DTYPE.itemsize
        self._blocks = blocks
        self._hdr_raw = hdr64
        self._hdr64 = JournaledView(hdr64, journal, 0, 8)
        self._prev_col = JournaledColumn(blocks["prev"], journal, meta + 4 * _PREV)
        self._next_col = JournaledColumn(blocks["next"], journal, meta + 4 * _NEXT)
        self._key_col = JournaledColumn(blocks["queue_key"], journal, meta + 8 * _KEY)
        self.prev_raw = i32[_PREV::_R]
        self.next_raw = i32[_NEXT::_R]
        self._key_raw = i64[_KEY::_R64]
        self._prev = JournaledView(self.prev_raw, journal, meta + 4 * _PREV, row)
        self._next = JournaledView(self.next_raw, journal, meta + 4 * _NEXT, row)
        self._key = JournaledView(self._key_raw, journal, meta + 8 * _KEY, row)
        self.head = layout.free_head
        self.tail = layout.free_tail
        #: block id -> the pool's ``KVCacheBlock`` handle; set by the pool that owns the queue.
        self.block_handle = None
        self.fake_free_list_head = FreeListEnd(self, self.head)
        self.fake_free_list_tail = FreeListEnd(self, self.tail)

    def release(self) -> None:
        """Releases the strided views (before the pool releases the views they come from);
        the queue is unusable afterwards."""
        for view in (self.prev_raw, self.next_raw, self._key_raw):
            view.release()
        self._blocks = None

    def initialize(self, block_ids: Sequence[int]) -> None:
        """Links ``block_ids`` in order as the whole queue (a new pool, before it is READY:
        unjournaled)."""
        ids = np.asarray(block_ids, dtype=np.int64)
        n = len(ids)
        chain = np.concatenate(([self.head], ids, [self.tail]))
        blocks, hdr = self._blocks, self._hdr_raw
        blocks["next"][chain[:-1]] = chain[1:]
        blocks["prev"][chain[1:]] = chain[:-1]
        blocks["queue_key"][ids] = np.arange(n, dtype=np.int64)
        hdr[_H_NUM_FREE] = n
        hdr[_H_HEAD_KEY] = 0
        hdr[_H_TAIL_KEY] = n - 1

    @property
    def num_free_blocks(self) -> int:
        return self._hdr_raw[_H_NUM_FREE]

    def popleft(self) -> int:
        """Removes and returns the first free block.

        Raises:
            OutOfBlocksError: the queue is empty ("No free blocks available", as vLLM).
        """
        if self._next[self.head] == self.tail:
            raise OutOfBlocksError("No free blocks available")
        return self._popleft_one()

    def popleft_n(self, n: int) -> list[int]:
        """Removes and returns the first ``n`` free blocks, in queue order.

        Raises:
            OutOfBlocksError: fewer than ``n`` blocks are free; nothing is popped.
        """
        return self.popleft_n_with_array(n)[0]

    def popleft_n_with_array(self, n: int) -> tuple[list[int], np.ndarray | None]:
        """``popleft_n``, also returning the ids as an int64 array when ``n`` is bulk-sized."""
        if n == 0:
            return [], None
        hdr = self._hdr64
        num_free = hdr[_H_NUM_FREE]
        if n > num_free:
            raise OutOfBlocksError(f"Cannot get {n} free blocks from the pool")
        nxt_of, prev_of, head = self._next, self._prev, self.head
        cur = nxt_of[head]
        # Links are shared memory: checked before the first write, as the C kernel does.
        if n == 1:
            if not 0 < cur < head:
                raise _corrupt(_NOT_FREE, cur)
            nxt = nxt_of[cur]
            if not 0 <= nxt <= head + 1:
                raise _corrupt(_OUTSIDE, nxt)
            nxt_of[head] = nxt
            prev_of[nxt] = head
            prev_of[cur] = _NO_BLOCK
            nxt_of[cur] = _NO_BLOCK
            hdr[_H_NUM_FREE] = num_free - 1
            return [cur], None
        popped = []
        for _ in range(n):
            if not 0 < cur < head:
                raise _corrupt(_NOT_FREE, cur)
            popped.append(cur)
            cur = nxt_of[cur]
        if not 0 <= cur <= head + 1:
            raise _corrupt(_OUTSIDE, cur)
        # Relink the head first, then clear the run's links (the order matters only to a
        # corrupt queue that loops, and stays the one it always was).
        nxt_of[head] = cur
        prev_of[cur] = head
        arr = None
        if n >= BULK_MIN_BLOCKS:
            arr = np.fromiter(popped, dtype=np.int64, count=n)  # ints read from the links
            self._prev_col[arr] = _NO_BLOCK
            self._next_col[arr] = _NO_BLOCK
        else:
            for b in popped:
                prev_of[b] = _NO_BLOCK
                nxt_of[b] = _NO_BLOCK
        hdr[_H_NUM_FREE] = num_free - n
        return popped, arr

    def _popleft_one(self) -> int:
        """``popleft_n(1)[0]`` without the checks: the caller has made sure a block is free."""
        nxt_of, prev_of, head = self._next, self._prev, self.head
        first = nxt_of[head]
        if not 0 < first < head:
            raise _corrupt(_NOT_FREE, first)
        nxt = nxt_of[first]
        if not 0 <= nxt <= head + 1:
            raise _corrupt(_OUTSIDE, nxt)
        nxt_of[head] = nxt
        prev_of[nxt] = head
        prev_of[first] = _NO_BLOCK
        nxt_of[first] = _NO_BLOCK
        self._hdr64[_H_NUM_FREE] -= 1
        return first

    def remove(self, block_id: int) -> None:
        """Unlinks ``block_id`` from anywhere in the queue, in O(1).

        Raises:
            UsageError: the block is not in the queue.
        """
        prev_of, nxt_of = self._prev, self._next
        prev = prev_of[block_id]
        nxt = nxt_of[block_id]
        if prev == _NO_BLOCK or nxt == _NO_BLOCK:
            raise UsageError(f"remove(): block {block_id} is not in the free queue")
        nxt_of[prev] = nxt
        prev_of[nxt] = prev
        prev_of[block_id] = _NO_BLOCK
        nxt_of[block_id] = _NO_BLOCK
        self._hdr64[_H_NUM_FREE] -= 1

    def remove_n(self, block_ids: Sequence[int]) -> None:
        """Unlinks every block of ``block_ids`` (a block listed twice is removed once),
        writing the free count once. Checks them all first.

        Raises:
            UsageError: a block is not in the queue (the first such); nothing is changed.
        """
        prev_of, nxt_of = self._prev, self._next
        for block_id in block_ids:
            if prev_of[block_id] == _NO_BLOCK or nxt_of[block_id] == _NO_BLOCK:
                raise UsageError(f"remove(): block {block_id} is not in the free queue")
        self._unlink_n(block_ids)

    def _unlink_n(self, block_ids: Sequence[int]) -> None:
        """``remove_n`` without the checks: the caller has made sure every block is queued.
        A repeated block is already unlinked (``prev == NO_BLOCK``) and skipped."""
        prev_of, nxt_of = self._prev, self._next
        n = len(block_ids)
        for block_id in block_ids:
            prev = prev_of[block_id]
            if prev == _NO_BLOCK:
                n -= 1
                continue
            nxt = nxt_of[block_id]
            nxt_of[prev] = nxt
            prev_of[nxt] = prev
            prev_of[block_id] = _NO_BLOCK
            nxt_of[block_id] = _NO_BLOCK
        self._hdr64[_H_NUM_FREE] -= n

    def _unlink_bulk(self, ids: np.ndarray) -> bool:
        """``_unlink_n`` with numpy, for distinct queued blocks that form one run of the
        queue (a prefix hit that was freed together: the usual case). Returns False, having
        written nothing, when they do not (several runs, or links that do not agree)."""
        prev_col, next_col = self._prev_col, self._next_col
        prevs = prev_col[ids]
        nexts = next_col[ids]
        if (next_col[prevs] != ids).any() or (prev_col[nexts] != ids).any():
            return False
        srt = np.sort(ids)
        n = len(ids)
        pos = np.searchsorted(srt, prevs)
        pos[pos == n] = 0
        starts = srt[pos] != prevs  # blocks whose prev stays: the run starts there
        pos = np.searchsorted(srt, nexts)
        pos[pos == n] = 0
        ends = srt[pos] != nexts  # blocks whose next stays: the run ends there
        if starts.sum() != 1 or ends.sum() != 1:
            return False
        before = int(prevs[np.argmax(starts)])
        after = int(nexts[np.argmax(ends)])
        self._next[before] = after
        self._prev[after] = before
        prev_col[ids] = _NO_BLOCK
        next_col[ids] = _NO_BLOCK
        self._hdr64[_H_NUM_FREE] -= n
        return True

    def append(self, block_id: int) -> None:
        """Adds ``block_id`` at the tail (evicted last)."""
        hdr, prev_of, tail = self._hdr64, self._prev, self.tail
        key = hdr[_H_TAIL_KEY] + 1
        last = prev_of[tail]
        prev_of[block_id] = last
        self._next[last] = block_id
        self._key[block_id] = key
        self._next[block_id] = tail
        prev_of[tail] = block_id
        hdr[_H_TAIL_KEY] = key
        hdr[_H_NUM_FREE] += 1

    def prepend(self, block_id: int) -> None:
        """Adds ``block_id`` at the head (evicted first)."""
        hdr, nxt_of, head = self._hdr64, self._next, self.head
        key = hdr[_H_HEAD_KEY] - 1
        first = nxt_of[head]
        self._prev[block_id] = head
        nxt_of[head] = block_id
        self._key[block_id] = key
        nxt_of[block_id] = first
        self._prev[first] = block_id
        hdr[_H_HEAD_KEY] = key
        hdr[_H_NUM_FREE] += 1

    def append_n(self, block_ids: Sequence[int] | np.ndarray) -> None:
        """Adds ``block_ids`` at the tail, keeping their order."""
        n = len(block_ids)
        if n == 0:
            return
        hdr = self._hdr64
        key0 = hdr[_H_TAIL_KEY] + 1
        self._link_run(self._prev[self.tail], block_ids, self.tail, key0)
        hdr[_H_TAIL_KEY] = key0 + n - 1
        hdr[_H_NUM_FREE] += n

    def prepend_n(self, block_ids: Sequence[int] | np.ndarray) -> None:
        """Adds ``block_ids`` at the head (evicted first), keeping their order."""
        n = len(block_ids)
        if n == 0:
            return
        hdr = self._hdr64
        key0 = hdr[_H_HEAD_KEY] - n
        self._link_run(self.head, block_ids, self._next[self.head], key0)
        hdr[_H_HEAD_KEY] = key0
        hdr[_H_NUM_FREE] += n

    def _link_run(self, before: int, block_ids, after: int, key0: int) -> None:
        """Links ``before <-> block_ids... <-> after`` with keys ``key0, key0 + 1, ...``."""
        n = len(block_ids)
        prev_of, nxt_of = self._prev, self._next
        if n >= BULK_MIN_BLOCKS:
            ids = np.asarray(block_ids, dtype=np.int64)
            self._prev_col[ids[1:]] = ids[:-1]
            self._next_col[ids[:-1]] = ids[1:]
            self._key_col[ids] = np.arange(key0, key0 + n, dtype=np.int64)
            first, last = int(ids[0]), int(ids[-1])
        else:
            if isinstance(block_ids, np.ndarray):
                block_ids = block_ids.tolist()
            key_of = self._key
            last = before
            for key, b in enumerate(block_ids, key0):
                prev_of[b] = last
                nxt_of[last] = b
                key_of[b] = key
                last = b
            first = block_ids[0]
        nxt_of[before] = first
        prev_of[first] = before
        nxt_of[last] = after
        prev_of[after] = last

    def get_all_free_block_ids(self) -> list[int]:
        """Walks the queue head to tail. For tests and tools; O(num_free_blocks)."""
        nxt_of = self.next_raw
        out = []
        cur = nxt_of[self.head]
        limit = self.tail + 1
        while cur != self.tail and cur != _NO_BLOCK and len(out) < limit:
            out.append(cur)
            cur = nxt_of[cur]
        return out

    def get_all_free_blocks(self) -> list:
        """The free blocks as the pool's handles, head (evicted first) to tail: vLLM's call of
        the same name. For tests and tools; O(num_free_blocks).

        Raises:
            UsageError: the queue is not a pool's (no ``block_handle`` was set).
        """
        return [self._handle_of(b) for b in self.get_all_free_block_ids()]

    def iter_blocks_after(self, cursor) -> Iterator:
        """Yields the free blocks (the pool's handles) in eviction order after ``cursor``, a
        block on the queue, or from the head if it is None: vLLM's call of the same name.

        The walk reads the links as it goes, so the caller holds the pool lock while it
        iterates (``with pool.lock(): ...``) if other processes may change the queue.

        Raises:
            UsageError: ``cursor`` is not a free block of this pool, or the queue is not a
                pool's.
        """
        nxt_of = self.next_raw
        if cursor is None:
            cur = nxt_of[self.head]
        else:
            block_id = getattr(cursor, "block_id", None)
            if (not isinstance(block_id, int) or not 0 < block_id < self.head
                    or nxt_of[block_id] == _NO_BLOCK):
                raise UsageError(f"iter_blocks_after(): {cursor!r} is not a free block")
            cur = nxt_of[block_id]
        steps = 0
        while cur != self.tail and cur != _NO_BLOCK and steps <= self.tail:
            yield self._handle_of(cur)
            cur = nxt_of[cur]
            steps += 1

    def linked(self, block_id: int):
        """What a link names: a block's handle, one of the list's two ends, or None (a
        block that is not on the queue links nowhere, and neither do the ends outward)."""
        if block_id == _NO_BLOCK:
            return None
        if block_id == self.head:
            return self.fake_free_list_head
        if block_id == self.tail:
            return self.fake_free_list_tail
        return self._handle_of(block_id)

    def _handle_of(self, block_id: int):
        if self.block_handle is None:
            raise UsageError("this free queue belongs to no pool: it has no block handles")
        return self.block_handle(block_id)

    def __len__(self) -> int:
        return self.num_free_blocks
