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
``num_free_blocks``, ``queue_head_key``, ``queue_tail_key``). All methods take and return
block ids; callers hold the pool lock.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from shmkv import layout as L
from shmkv.errors import OutOfBlocksError, UsageError

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


class FreeKVCacheBlockQueue:
    """O(1) doubly linked free queue over the block rows of a pool segment.

    Args:
        i32: flat int32 memoryview of the ``block_meta`` region.
        i64: flat int64 memoryview of the ``block_meta`` region.
        hdr64: flat int64 memoryview of the header.
        blocks: numpy view of ``block_meta`` (for the bulk paths).
        layout: the pool's layout (sentinel rows).
    """

    def __init__(self, i32, i64, hdr64, blocks: np.ndarray, layout: L.Layout) -> None:
        self._i32 = i32
        self._i64 = i64
        self._hdr64 = hdr64
        self._prev_col = blocks["prev"]
        self._next_col = blocks["next"]
        self._key_col = blocks["queue_key"]
        self.head = layout.free_head
        self.tail = layout.free_tail

    def initialize(self, block_ids: Sequence[int]) -> None:
        """Links ``block_ids`` in order as the whole queue (a new pool only)."""
        ids = np.asarray(block_ids, dtype=np.int64)
        n = len(ids)
        chain = np.concatenate(([self.head], ids, [self.tail]))
        self._next_col[chain[:-1]] = chain[1:]
        self._prev_col[chain[1:]] = chain[:-1]
        self._key_col[ids] = np.arange(n, dtype=np.int64)
        self._hdr64[_H_NUM_FREE] = n
        self._hdr64[_H_HEAD_KEY] = 0
        self._hdr64[_H_TAIL_KEY] = n - 1

    @property
    def num_free_blocks(self) -> int:
        return self._hdr64[_H_NUM_FREE]

    def popleft(self) -> int:
        """Removes and returns the first free block.

        Raises:
            OutOfBlocksError: the queue is empty ("No free blocks available", as vLLM).
        """
        i32 = self._i32
        first = i32[self.head * _R + _NEXT]
        if first == self.tail:
            raise OutOfBlocksError("No free blocks available")
        nxt = i32[first * _R + _NEXT]
        i32[self.head * _R + _NEXT] = nxt
        i32[nxt * _R + _PREV] = self.head
        i32[first * _R + _PREV] = _NO_BLOCK
        i32[first * _R + _NEXT] = _NO_BLOCK
        self._hdr64[_H_NUM_FREE] -= 1
        return first

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
        num_free = self._hdr64[_H_NUM_FREE]
        if n > num_free:
            raise OutOfBlocksError(f"Cannot get {n} free blocks from the pool")
        i32 = self._i32
        cur = i32[self.head * _R + _NEXT]
        if n == 1:
            nxt = i32[cur * _R + _NEXT]
            i32[self.head * _R + _NEXT] = nxt
            i32[nxt * _R + _PREV] = self.head
            i32[cur * _R + _PREV] = _NO_BLOCK
            i32[cur * _R + _NEXT] = _NO_BLOCK
            self._hdr64[_H_NUM_FREE] = num_free - 1
            return [cur], None
        popped = [0] * n
        for k in range(n):
            popped[k] = cur
            cur = i32[cur * _R + _NEXT]
        i32[self.head * _R + _NEXT] = cur
        i32[cur * _R + _PREV] = self.head
        arr = None
        if n >= BULK_MIN_BLOCKS:
            arr = np.array(popped, dtype=np.int64)
            self._prev_col[arr] = _NO_BLOCK
            self._next_col[arr] = _NO_BLOCK
        else:
            for b in popped:
                i32[b * _R + _PREV] = _NO_BLOCK
                i32[b * _R + _NEXT] = _NO_BLOCK
        self._hdr64[_H_NUM_FREE] = num_free - n
        return popped, arr

    def remove(self, block_id: int) -> None:
        """Unlinks ``block_id`` from anywhere in the queue, in O(1).

        Raises:
            UsageError: the block is not in the queue.
        """
        i32 = self._i32
        base = block_id * _R
        prev = i32[base + _PREV]
        nxt = i32[base + _NEXT]
        if prev == _NO_BLOCK or nxt == _NO_BLOCK:
            raise UsageError(f"remove(): block {block_id} is not in the free queue")
        i32[prev * _R + _NEXT] = nxt
        i32[nxt * _R + _PREV] = prev
        i32[base + _PREV] = _NO_BLOCK
        i32[base + _NEXT] = _NO_BLOCK
        self._hdr64[_H_NUM_FREE] -= 1

    def append(self, block_id: int) -> None:
        """Adds ``block_id`` at the tail (evicted last)."""
        self.append_n((block_id,))

    def append_n(self, block_ids: Sequence[int] | np.ndarray) -> None:
        """Adds ``block_ids`` at the tail, keeping their order."""
        n = len(block_ids)
        if n == 0:
            return
        hdr = self._hdr64
        key0 = hdr[_H_TAIL_KEY] + 1
        last = self._i32[self.tail * _R + _PREV]
        self._link_run(last, block_ids, self.tail, key0)
        hdr[_H_TAIL_KEY] = key0 + n - 1
        hdr[_H_NUM_FREE] += n

    def prepend_n(self, block_ids: Sequence[int] | np.ndarray) -> None:
        """Adds ``block_ids`` at the head (evicted first), keeping their order."""
        n = len(block_ids)
        if n == 0:
            return
        hdr = self._hdr64
        key0 = hdr[_H_HEAD_KEY] - n
        first = self._i32[self.head * _R + _NEXT]
        self._link_run(self.head, block_ids, first, key0)
        hdr[_H_HEAD_KEY] = key0
        hdr[_H_NUM_FREE] += n

    def _link_run(self, before: int, block_ids, after: int, key0: int) -> None:
        """Links ``before <-> block_ids... <-> after`` with keys ``key0, key0 + 1, ...``."""
        n = len(block_ids)
        i32 = self._i32
        if n >= BULK_MIN_BLOCKS:
            ids = np.asarray(block_ids, dtype=np.int64)
            self._prev_col[ids[1:]] = ids[:-1]
            self._next_col[ids[:-1]] = ids[1:]
            self._key_col[ids] = np.arange(key0, key0 + n, dtype=np.int64)
            first, last = int(ids[0]), int(ids[-1])
        else:
            if isinstance(block_ids, np.ndarray):
                block_ids = block_ids.tolist()
            i64 = self._i64
            prev = before
            key = key0
            for b in block_ids:
                i32[b * _R + _PREV] = prev
                i32[prev * _R + _NEXT] = b
                i64[b * _R64 + _KEY] = key
                key += 1
                prev = b
            first, last = block_ids[0], prev
        i32[before * _R + _NEXT] = first
        i32[first * _R + _PREV] = before
        i32[last * _R + _NEXT] = after
        i32[after * _R + _PREV] = last

    def get_all_free_block_ids(self) -> list[int]:
        """Walks the queue head to tail. For tests and tools; O(num_free_blocks)."""
        i32 = self._i32
        out = []
        cur = i32[self.head * _R + _NEXT]
        limit = self.tail + 1
        while cur != self.tail and cur != _NO_BLOCK and len(out) < limit:
            out.append(cur)
            cur = i32[cur * _R + _NEXT]
        return out

    def __len__(self) -> int:
        return self.num_free_blocks
