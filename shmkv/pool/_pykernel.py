"""The reference kernel: BlockPool's hot loops in pure Python.

``shmkv/pool/_ckernel.c`` is the same code in C and is used when it is built; this module is
the fallback and the reference it is tested against (the test suite runs every pool test
with both). Both kernels perform the same shared-memory writes in the same order, check
everything before their first write, and raise the same errors with the same messages.

Kernel interface (both kernels):

- ``allocate(n, caching, handles, make_handle, evicted_out) -> list[KVCacheBlock]``
- ``free(blocks, caching)`` / ``unpin(blocks)`` / ``touch(blocks)``
- ``cache(blocks, fine_hashes, num_cached, ratio, block_size, group_id, block_mask,
  evicted_out) -> [(position, hash)]``
- ``get_cached(block_hash, group_ids, handles, make_handle) -> list | None``
- ``prefix(block_hashes, group_id, max_blocks, handles, make_handle) -> list``
- ``lookup(block_hash, group_id) -> int`` / ``insert(block_hash, group_id, block_id,
  num_tokens)`` / ``evict(block_id) -> (hash, group) | None``
- ``release()``
"""

from __future__ import annotations

import operator
import struct
from collections import Counter

import numpy as np

from shmkv.errors import InvariantViolation, OutOfBlocksError, UsageError
from shmkv.pool import fault as _fault
from shmkv.pool import layout as L
from shmkv.pool.free_queue import (
    _NOT_FREE,
    _OUTSIDE,
    BULK_MIN_BLOCKS,
    FreeKVCacheBlockQueue,
    _corrupt,
)
from shmkv.pool.journal import Journal, JournaledColumn, JournaledView
from shmkv.pool.prefix_index import BlockHashToBlockMap

_R = L.ROW_I32
_REF = L.F_REF
_HTOK = L.F_HASH_TOKENS
_NULL = L.NULL_BLOCK_ID
_NO_BLOCK = L.NO_BLOCK
_NO_HASH_TOKENS = L.NO_HASH_TOKENS
_HASH_BYTES = L.BLOCK_HASH_BYTES
_H_NUM_FREE = L.H_NUM_FREE
_H_HEAD_KEY = L.H_QUEUE_HEAD_KEY
_H_TAIL_KEY = L.H_QUEUE_TAIL_KEY
_ROW_BYTES = L.BLOCK_DTYPE.itemsize
_GROUP_MIX = L.GROUP_MIX
_MASK64 = (1 << 64) - 1
_SEQUENCES = (list, tuple)
_INT32_MAX = (1 << 31) - 1
_read_u64 = struct.Struct("<Q").unpack_from
_GROUP_LIMIT = 1 << 31  # group ids are ints in [0, 2**31): the rows' group_id field


def _where(offset: int, width: int) -> int:
    """A journal entry's ``where`` word (``shmkv/pool/journal.py``)."""
    return offset << 4 | width


# Journal ``where`` of a header word, and the step between two block rows' same field.
_W_NUM_FREE = _where(8 * _H_NUM_FREE, 8)
_W_HEAD_KEY = _where(8 * _H_HEAD_KEY, 8)
_W_TAIL_KEY = _where(8 * _H_TAIL_KEY, 8)
_W_ROW = _ROW_BYTES << 4


def check_group(group_id) -> None:
    """Refuses a KV-cache group id that is not an int in [0, 2**31), with the C kernel's
    message (``read_group`` in _ckernel.c): neither kernel truncates or wraps it."""
    if not (isinstance(group_id, int) and 0 <= group_id < _GROUP_LIMIT):
        raise UsageError(f"kv_cache_group_id {group_id!r} is not an int in [0, 2**31)")


def check_hash(block_hash) -> None:
    """Refuses a block hash that is not 32 bytes of ``bytes``, with the C kernel's message."""
    if type(block_hash) is not bytes:
        raise UsageError(f"block hash must be bytes, got {type(block_hash).__name__}")
    if len(block_hash) != _HASH_BYTES:
        raise UsageError(f"block hash must be {_HASH_BYTES} bytes (sha256), got {len(block_hash)}")


_INT_ONLY = {int}


def block_id_int(value, what: str) -> int:
    """A handle's ``block_id`` that is not a plain int, as one (a numpy integer), or a
    UsageError naming ``what``: a bool, float, None, str... is not a block id. The C
    kernel's ``read_ids`` gives the same answer and message."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise UsageError(f"{what}(): block id {value!r} is not an int")


class PyKernel:
    """BlockPool's mutations over the free queue and the prefix index, in Python.

    Single fields are read and written through per-field strided memoryviews
    (``self._ref[b]`` is block ``b``'s ``ref_cnt``), about twice as fast as indexing the flat
    int32 view; its writes (and the ledger's) are journaled (``shmkv/pool/journal.py``). Writes to
    the links and to the index go through the queue and the map, which own them; the kernel
    only reads those fields. :meth:`release` releases every strided view (the queue's and the
    map's too) before the pool releases the views they are cut from.
    """

    def __init__(self, i32, queue: FreeKVCacheBlockQueue, index: BlockHashToBlockMap,
                 blocks: np.ndarray, ledger_row: np.ndarray, num_blocks: int,
                 journal: Journal, meta_offset: int, ledger_offset: int) -> None:
        self._i32 = i32
        # This process's ledger row: the references it holds on each block.
        self._led_np = JournaledColumn(ledger_row, journal, ledger_offset)
        self._led_view = memoryview(ledger_row)
        self._led = JournaledView(self._led_view, journal, ledger_offset, 4)
        self._queue = queue
        self._index = index
        self._ref_col = JournaledColumn(blocks["ref_cnt"], journal, meta_offset)
        self._htok_col = blocks["hash_num_tokens"]
        self._num_blocks = num_blocks
        self._chain_steps = range(len(index.inext_raw) + 1)  # key rows (aliases included)
        self._alias0 = index.alias0
        self._ref_view = i32[_REF::_R]
        self._ref = JournaledView(self._ref_view, journal, meta_offset + 4 * _REF, _ROW_BYTES)
        self._htok = i32[_HTOK::_R]
        self._hdr64 = queue._hdr_raw
        # Read-only use of the queue's and the map's views (both release them).
        self._prev = queue.prev_raw
        self._next = queue.next_raw
        self._buckets = index.buckets_raw
        self._igroup = index.group_raw
        self._inext = index.inext_raw
        self._mem = index._mem
        self._hash0 = index._hash0
        self._mask = index._mask
        # The one-block allocate and free (the decode step's calls) journal their few words
        # in one ``Journal.save_words`` and then write through the raw views: journal
        # ``where`` of each field of block 0 (block b: + b * _W_ROW; ledger: + b * 64).
        self._journal = journal
        self._head = queue.head
        self._tail = queue.tail
        self._key_raw = queue._key_raw
        self._w_ref = _where(meta_offset + 4 * _REF, 4)
        self._w_prev = _where(meta_offset + 4 * L.F_PREV, 4)
        self._w_next = _where(meta_offset + 4 * L.F_NEXT, 4)
        self._w_key = _where(meta_offset + 8 * L.F_QUEUE_KEY, 8)
        self._w_led = _where(ledger_offset, 4)

    def release(self) -> None:
        if self._queue is None:
            return
        self._ref_view.release()
        self._htok.release()
        self._led_view.release()
        self._led = self._led_np = self._led_view = self._ref_view = None
        self._queue.release()
        self._index.release()
        self._i32 = self._queue = self._index = None
        self._ref_col = self._htok_col = None
        self._ref = self._htok = self._hdr64 = self._prev = self._next = None
        self._key_raw = self._journal = None
        self._buckets = self._igroup = self._inext = self._mem = None

    def _read_ids(self, blocks, what: str) -> list[int]:
        if not isinstance(blocks, _SEQUENCES):
            blocks = list(blocks)
        n = self._num_blocks
        if len(blocks) == 1:  # the same checks, for one block
            block = blocks[0]
            try:
                block_id = block.block_id
            except AttributeError:
                raise UsageError(
                    f"{what}() takes KVCacheBlock handles, got {type(block).__name__}"
                ) from None
            if type(block_id) is not int:
                block_id = block_id_int(block_id, what)
            if block_id < 0 or block_id >= n:
                raise UsageError(f"{what}(): block id {block_id} is out of range [0, {n})")
            return [block_id]
        ids = self._block_ids(blocks, what)
        if ids and (min(ids) < 0 or max(ids) >= n):
            self._raise_out_of_range(ids, what)
        return ids

    def _read_ids_array(self, blocks, what: str) -> tuple[list[int], np.ndarray | None]:
        """``_read_ids``, plus the ids as an int64 array when there are ``BULK_MIN_BLOCKS``
        or more (the range check then runs on the array)."""
        if not isinstance(blocks, _SEQUENCES):
            blocks = list(blocks)
        if len(blocks) < BULK_MIN_BLOCKS:
            return self._read_ids(blocks, what), None
        ids = self._block_ids(blocks, what)
        arr = np.array(ids)
        if arr.dtype != np.int64 or arr.ndim != 1:  # ids past int64: the list check
            n = self._num_blocks
            if min(ids) < 0 or max(ids) >= n:
                self._raise_out_of_range(ids, what)
            return ids, None
        if arr.min() < 0 or arr.max() >= self._num_blocks:
            self._raise_out_of_range(ids, what)
        return ids, arr

    @staticmethod
    def _block_ids(blocks, what: str) -> list[int]:
        """The handles' ids, each a plain int (``block_id_int``), unchecked for range."""
        try:
            if len(blocks) < BULK_MIN_BLOCKS:  # a loop beats a comprehension's set-up here
                ids = []
                for b in blocks:
                    ids.append(b.block_id)
            else:
                ids = [b.block_id for b in blocks]
        except AttributeError:
            bad = next(b for b in blocks if not hasattr(b, "block_id"))
            raise UsageError(
                f"{what}() takes KVCacheBlock handles, got {type(bad).__name__}"
            ) from None
        if set(map(type, ids)) != _INT_ONLY:  # not all plain ints: convert or refuse each
            ids = [b if type(b) is int else block_id_int(b, what) for b in ids]
        return ids

    def _raise_out_of_range(self, ids: list, what: str) -> None:
        n = self._num_blocks
        bad = next(b for b in ids if not 0 <= b < n)
        raise UsageError(f"{what}(): block id {bad} is out of range [0, {n})")

    # ------------------------------------------------------------------ prefix index

    def lookup(self, block_hash: bytes, group_id: int) -> int:
        check_group(group_id)
        check_hash(block_hash)
        return self._index.get_one_block(block_hash, group_id)

    def lookup_many(self, block_hashes: list, group_ids: list, fallback_bit: int) -> list[int]:
        if (type(block_hashes) is not list or type(group_ids) is not list
                or len(block_hashes) != len(group_ids)):
            raise UsageError("lookup_many(): block_hashes and group_ids must be lists of one "
                             "length")
        check_group(fallback_bit)
        for block_hash, group_id in zip(block_hashes, group_ids, strict=True):  # checked first
            check_group(group_id)
            check_hash(block_hash)
        get = self._index.get_one_block
        out = []
        for block_hash, group_id in zip(block_hashes, group_ids, strict=True):
            found = get(block_hash, group_id)
            if found < 0 and fallback_bit:
                other = get(block_hash, group_id | fallback_bit)
                found = -2 - other if other >= 0 else -1
            out.append(found)
        return out

    def get_cached(self, block_hash: bytes, group_ids, handles: list, make_handle) -> list | None:
        check_hash(block_hash)
        word = _read_u64(block_hash)[0]
        found = []
        for group_id in group_ids:
            if not (isinstance(group_id, int) and 0 <= group_id < _GROUP_LIMIT):
                check_group(group_id)  # raises
            # BlockHashToBlockMap.get_one_block, inlined (reads only).
            if group_id:
                cur = self._buckets[(word ^ ((group_id * _GROUP_MIX) & _MASK64)) & self._mask]
            else:
                cur = self._buckets[word & self._mask]
            if cur == _NO_BLOCK:
                return None
            group_of, inext, mem, hash0 = self._igroup, self._inext, self._mem, self._hash0
            for _ in self._chain_steps:  # bounded: a corrupt chain may loop
                if group_of[cur] == group_id:
                    off = hash0 + cur * _ROW_BYTES
                    if mem[off:off + _HASH_BYTES] == block_hash:
                        break
                cur = inext[cur]
                if cur == _NO_BLOCK:
                    return None
            else:
                raise InvariantViolation([
                    "INV-FREE/INV-HASH: corrupt shared state: prefix-index chain leaves the "
                    f"blocks or loops (row {cur})"
                ])
            if cur >= self._alias0:  # an alias row: its block
                cur -= self._alias0
            found.append(handles[cur] or make_handle(cur))
        return found

    def prefix(self, block_hashes, group_id: int, max_blocks: int, handles: list,
               make_handle) -> list:
        """Handles of the longest run of leading hashes cached in the group."""
        check_group(group_id)
        if max_blocks >= 0:
            block_hashes = block_hashes[:max_blocks]
        found = []
        for i, block_hash in enumerate(block_hashes):
            if type(block_hash) is not bytes or len(block_hash) != _HASH_BYTES:
                raise UsageError(
                    f"block hash {i} must be {_HASH_BYTES} bytes (sha256), got "
                    f"{type(block_hash).__name__}"
                )
            hit = self.get_cached(block_hash, (group_id,), handles, make_handle)
            if hit is None:
                break
            found.append(hit[0])
        return found

    def insert(self, block_hash: bytes, group_id: int, block_id: int, num_tokens: int) -> None:
        check_group(group_id)
        self._index.insert(block_hash, group_id, block_id, num_tokens)

    def cache(self, blocks, fine_hashes, num_cached: int, ratio: int, block_size: int,
              group_id: int, block_mask, evicted_out: list | None) -> list[tuple[int, bytes]]:
        """Gives ``blocks`` (the range ``[num_cached, num_cached + len(blocks))`` of a request)
        their keys; null and masked-out blocks are skipped. Checks everything first.

        Returns:
            (block position in the request, hash) of each block cached, in order.
        """
        check_group(group_id)
        ids = self._read_ids(blocks, "cache_full_blocks")
        htok = self._htok
        start = num_cached + 1
        n = len(ids)
        if (block_mask is None and type(fine_hashes) is list and ratio > 0 and num_cached >= 0
                and _NULL not in ids and (n < 2 or len(set(ids)) == n)):
            # The usual call: every block distinct, new to the cache, with a valid hash. Check
            # that much in one light pass; anything else takes the full loop below.
            first = start * ratio - 1
            hashes = fine_hashes[first:first + n * ratio:ratio]
            if len(hashes) == n:
                for block_id, block_hash in zip(ids, hashes, strict=True):
                    if (type(block_hash) is not bytes or len(block_hash) != _HASH_BYTES
                            or htok[block_id] != _NO_HASH_TOKENS):
                        break
                else:
                    self._index.insert_n(
                        zip(ids, hashes, range(start * block_size, (start + n) * block_size,
                                               block_size), strict=True),
                        group_id,
                    )
                    return list(zip(range(num_cached, num_cached + n), hashes, strict=True))
        cached: list[tuple[int, bytes]] = []
        entries: list[tuple[int, bytes, int]] = []
        rehash: set[int] = set()  # blocks whose shorter key gives way to the full one
        planned: set[int] = set()
        for end, block_id in enumerate(ids, start):  # end = position + 1
            if block_id == _NULL or (block_mask is not None and not block_mask[end - start]):
                continue
            if block_id in planned:
                raise UsageError(
                    f"cache_full_blocks(): block {block_id} appears twice in the blocks to cache"
                )
            planned.add(block_id)
            block_hash = fine_hashes[end * ratio - 1]
            if type(block_hash) is not bytes or len(block_hash) != _HASH_BYTES:
                position = end - 1
                raise UsageError(
                    f"cache_full_blocks(): block hash {position} must be {_HASH_BYTES} bytes, "
                    f"got {type(block_hash).__name__}"
                    + (f" of {len(block_hash)} bytes" if type(block_hash) is bytes else "")
                )
            num_tokens = end * block_size
            held = htok[block_id]
            if held != _NO_HASH_TOKENS:
                if held >= num_tokens:
                    raise UsageError(
                        f"cache_full_blocks(): block {block_id} is already cached "
                        f"({held} tokens, asked for {num_tokens})"
                    )
                rehash.add(block_id)
            cached.append((end - 1, block_hash))
            entries.append((block_id, block_hash, num_tokens))
        index = self._index
        if not rehash:
            index.insert_n(entries, group_id)
        else:
            for block_id, block_hash, num_tokens in entries:
                if block_id in rehash:  # a partial key (and any alias) gives way
                    keys = index.pop_all(block_id)
                    if evicted_out is not None:
                        evicted_out.extend(keys)
                index.insert(block_hash, group_id, block_id, num_tokens)
        return cached

    def evict(self, block_id: int) -> list[tuple[bytes, int]]:
        """Removes every key of the block (its own, then its alias); returns them."""
        return self._index.pop_all(block_id)

    # ------------------------------------------------------------------ pool operations

    def allocate(self, n: int, caching: bool, handles: list, make_handle,
                 evicted_out: list | None) -> list:
        if n < 0 or n > self._hdr64[_H_NUM_FREE]:
            raise OutOfBlocksError(f"Cannot get {n} free blocks from the pool")
        if n == 1:
            first = self._next[self._head]
            if not caching or not 0 < first < self._head or (
                self._htok[first] == _NO_HASH_TOKENS
            ):
                block_id = self._allocate_one()  # nothing to evict (or corrupt: it raises)
                return [handles[block_id] or make_handle(block_id)]
            block_id = self._queue._popleft_one()
            if caching and self._htok[block_id] != _NO_HASH_TOKENS:
                keys = self._index.pop_all(block_id)
                if evicted_out is not None:
                    evicted_out.extend(keys)
            self._ref[block_id] = 1
            self._led[block_id] += 1
            return [handles[block_id] or make_handle(block_id)]
        ids, arr = self._queue.popleft_n_with_array(n)
        if arr is not None:
            if caching:
                pop_all = self._index.pop_all
                for block_id in arr[self._htok_col[arr] != _NO_HASH_TOKENS].tolist():
                    keys = pop_all(block_id)
                    if evicted_out is not None:
                        evicted_out.extend(keys)
            self._ref_col[arr] = 1
            self._led_np[arr] += 1
            return [handles[b] or make_handle(b) for b in ids]
        ref = self._ref
        led = self._led
        out = []  # evict, take a reference and make the handle in one pass
        if caching:
            htok = self._htok
            for block_id in ids:
                if htok[block_id] != _NO_HASH_TOKENS:
                    keys = self._index.pop_all(block_id)
                    if evicted_out is not None:
                        evicted_out.extend(keys)
                ref[block_id] = 1
                led[block_id] += 1
                out.append(handles[block_id] or make_handle(block_id))
        else:
            for block_id in ids:
                ref[block_id] = 1
                led[block_id] += 1
                out.append(handles[block_id] or make_handle(block_id))
        return out

    def _allocate_one(self) -> int:
        """Pops the head block of the free queue (which holds no key) and gives it its
        reference: ``FreeKVCacheBlockQueue._popleft_one``, then ``ref_cnt`` and the ledger,
        the same words written in the same order, journaled together first."""
        nxt_of, prev_of, head, hdr = self._next, self._prev, self._head, self._hdr64
        first = nxt_of[head]
        if not 0 < first < head:
            raise _corrupt(_NOT_FREE, first)
        nxt = nxt_of[first]
        if not 0 <= nxt <= head + 1:
            raise _corrupt(_OUTSIDE, nxt)
        num_free = hdr[_H_NUM_FREE]
        ref_of, led_of = self._ref_view, self._led_view
        led = led_of[first]
        row = first * _W_ROW
        self._journal.save_words([
            self._w_next + head * _W_ROW, first,
            self._w_prev + nxt * _W_ROW, prev_of[nxt],
            self._w_prev + row, prev_of[first],
            self._w_next + row, nxt,
            _W_NUM_FREE, num_free,
            self._w_ref + row, ref_of[first],
            self._w_led + first * 64, led,
        ])
        armed = _fault.armed  # then a fault point before each write, as JournaledView's
        if armed:
            _fault.tick()
        nxt_of[head] = nxt
        if armed:
            _fault.tick()
        prev_of[nxt] = head
        if armed:
            _fault.tick()
        prev_of[first] = _NO_BLOCK
        if armed:
            _fault.tick()
        nxt_of[first] = _NO_BLOCK
        if armed:
            _fault.tick()
        hdr[_H_NUM_FREE] = num_free - 1
        if armed:
            _fault.tick()
        ref_of[first] = 1
        if armed:
            _fault.tick()
        led_of[first] = led + 1
        return first

    def _free_one(self, block_id: int, to_tail: bool) -> None:
        """Drops the last reference of ``block_id`` (checked by the caller) and queues it:
        at the tail when it holds a key (``FreeKVCacheBlockQueue.append``), else at the head
        (``prepend``); the same words in the same order as the ``ref_cnt``, ledger and queue
        writes one by one, journaled together first."""
        prev_of, nxt_of, key_of, hdr = self._prev, self._next, self._key_raw, self._hdr64
        ref_of, led_of = self._ref_view, self._led_view
        led = led_of[block_id]
        row = block_id * _W_ROW
        num_free = hdr[_H_NUM_FREE]
        if to_tail:
            end, w_end_key, end_key = self._tail, _W_TAIL_KEY, hdr[_H_TAIL_KEY]
            key = end_key + 1
            before = prev_of[end]  # the block goes between `before` and `after`
            after = end
        else:
            end, w_end_key, end_key = self._head, _W_HEAD_KEY, hdr[_H_HEAD_KEY]
            key = end_key - 1
            before = end
            after = nxt_of[end]
        self._journal.save_words([
            self._w_ref + row, ref_of[block_id],
            self._w_led + block_id * 64, led,
            self._w_prev + row, prev_of[block_id],
            self._w_next + before * _W_ROW, nxt_of[before],
            self._w_key + row, key_of[block_id],
            self._w_next + row, nxt_of[block_id],
            self._w_prev + after * _W_ROW, prev_of[after],
            w_end_key, end_key,
            _W_NUM_FREE, num_free,
        ])
        armed = _fault.armed  # then a fault point before each write, as JournaledView's
        if armed:
            _fault.tick()
        ref_of[block_id] = 0
        if armed:
            _fault.tick()
        led_of[block_id] = led - 1
        if armed:
            _fault.tick()
        prev_of[block_id] = before
        if armed:
            _fault.tick()
        nxt_of[before] = block_id
        if armed:
            _fault.tick()
        key_of[block_id] = key
        if armed:
            _fault.tick()
        nxt_of[block_id] = after
        if armed:
            _fault.tick()
        prev_of[after] = block_id
        if armed:
            _fault.tick()
        hdr[_H_TAIL_KEY if to_tail else _H_HEAD_KEY] = key
        if armed:
            _fault.tick()
        hdr[_H_NUM_FREE] = num_free + 1

    def free(self, blocks, caching: bool) -> None:
        if type(blocks) is list and len(blocks) == 1:  # one block: _read_ids, inlined
            try:
                block_id = blocks[0].block_id
            except AttributeError:
                block_id = -1
            if type(block_id) is not int or block_id < 0 or block_id >= self._num_blocks:
                block_id = self._read_ids(blocks, "free_blocks")[0]  # raises its error
            if block_id == _NULL:
                return
            ref = self._ref_view[block_id]  # reads: the raw views
            if ref < 1:
                self._raise_double_free([block_id], block_id)
            if self._led_view[block_id] < 1:
                self._raise_not_held([block_id], block_id)
            if ref == 1:
                self._free_one(block_id, caching and self._htok[block_id] != _NO_HASH_TOKENS)
                return
            self._ref[block_id] = ref - 1
            self._led[block_id] -= 1
            return
        ids, arr = self._read_ids_array(blocks, "free_blocks")
        if (_NULL in ids) if arr is None else (arr == _NULL).any():  # the null block is skipped
            ids = [b for b in ids if b != _NULL]
            if arr is not None:
                arr = arr[arr != _NULL]
        n = len(ids)
        if not n:
            return
        if arr is not None:
            srt = np.sort(arr)
            unique = not (srt[1:] == srt[:-1]).any()
        else:
            unique = n == 1 or len(set(ids)) == n
        if n >= BULK_MIN_BLOCKS and unique:
            if arr is None:
                arr = np.array(ids, dtype=np.int64)
            refs = self._ref_col[arr]
            if (refs <= 0).any():
                self._raise_double_free(ids, int(arr[np.argmax(refs <= 0)]))
            held = self._led_np[arr]
            if (held <= 0).any():
                self._raise_not_held(ids, int(arr[np.argmax(held <= 0)]))
            refs -= 1
            self._ref_col[arr] = refs
            self._led_np[arr] = held - 1
            zero = arr[refs == 0]
            if caching:
                hashed = self._htok_col[zero] != _NO_HASH_TOKENS
                evict_first, evict_last = zero[~hashed], zero[hashed]
            else:
                evict_first, evict_last = zero, zero[:0]
        else:
            ref_of = self._ref
            led = self._led
            evict_first, evict_last = [], []
            if unique:
                refs = []  # each block's ref_cnt, read once
                for block_id in ids:
                    refs.append(ref_of[block_id])
                if min(refs) < 1:
                    for block_id, ref in zip(ids, refs, strict=True):
                        if ref < 1:
                            self._raise_double_free(ids, block_id)
                for block_id in ids:
                    if led[block_id] < 1:
                        self._raise_not_held(ids, block_id)
            else:
                seen: Counter[int] = Counter()
                for block_id in ids:
                    seen[block_id] += 1
                    if ref_of[block_id] < seen[block_id]:
                        self._raise_double_free(ids, block_id)
                for block_id in ids:
                    if led[block_id] < seen[block_id]:
                        self._raise_not_held(ids, block_id)
                refs = None
            if refs is None:  # a block listed twice: read each ref_cnt as it changes
                htok = self._htok
                for block_id in ids:
                    ref = ref_of[block_id] - 1
                    ref_of[block_id] = ref
                    led[block_id] -= 1
                    if ref == 0:
                        if caching and htok[block_id] != _NO_HASH_TOKENS:
                            evict_last.append(block_id)
                        else:
                            evict_first.append(block_id)
            elif caching:
                htok = self._htok
                for block_id, ref in zip(ids, refs, strict=True):
                    ref_of[block_id] = ref - 1
                    led[block_id] -= 1
                    if ref == 1:
                        if htok[block_id] != _NO_HASH_TOKENS:
                            evict_last.append(block_id)
                        else:
                            evict_first.append(block_id)
            else:
                for block_id, ref in zip(ids, refs, strict=True):
                    ref_of[block_id] = ref - 1
                    led[block_id] -= 1
                    if ref == 1:
                        evict_first.append(block_id)
        if len(evict_first):
            self._queue.prepend_n(evict_first)
        if len(evict_last):
            self._queue.append_n(evict_last)

    def unpin(self, blocks) -> None:
        """``free`` for vLLM's ``unpin_blocks``: every block reaching ref_cnt 0 joins the
        tail of the free queue, hashed or not, and the null block is refused, not skipped."""
        ids = self._read_ids(blocks, "unpin_blocks")
        if _NULL in ids:
            raise UsageError("unpin_blocks(): block 0 is the null block")
        ref_of = self._ref
        led = self._led
        seen: Counter[int] = Counter()
        for block_id in ids:
            seen[block_id] += 1
            if ref_of[block_id] < seen[block_id]:
                self._raise_double_free(ids, block_id, "unpin_blocks", "unpinned")
        seen.clear()
        for block_id in ids:
            seen[block_id] += 1
            if led[block_id] < seen[block_id]:
                self._raise_not_held(ids, block_id, "unpin_blocks", "unpinned")
        released = []
        for block_id in ids:
            ref = ref_of[block_id] - 1
            ref_of[block_id] = ref
            led[block_id] -= 1
            if ref == 0:
                released.append(block_id)
        if released:
            self._queue.append_n(released)

    def _raise_double_free(self, ids: list[int], block_id: int, call: str = "free_blocks",
                           verb: str = "freed") -> None:
        """A block dropped more often than it is referenced (free_blocks, unpin_blocks)."""
        ref = self._ref[block_id]
        times = ids.count(block_id)
        already = " (it is already free)" if ref == 0 and call == "free_blocks" else ""
        raise UsageError(
            f"{call}(): block {block_id} has ref_cnt {ref} but is {verb} {times} time(s)"
            + already
        )

    def _raise_not_held(self, ids: list[int], block_id: int, call: str = "free_blocks",
                        verb: str = "freed") -> None:
        """A block dropped more often than this process holds it."""
        raise UsageError(
            f"{call}(): block {block_id} is {verb} {ids.count(block_id)} time(s) but this "
            f"process holds {self._led[block_id]} reference(s) to it "
            f"(ref_cnt {self._ref[block_id]})"
        )

    def touch(self, blocks) -> None:
        ref_of = self._ref
        if type(blocks) is list and len(blocks) == 1:  # one block: _read_ids, inlined
            try:
                block_id = blocks[0].block_id
            except AttributeError:
                block_id = -1
            if type(block_id) is not int or block_id < 0 or block_id >= self._num_blocks:
                block_id = self._read_ids(blocks, "touch")[0]  # raises its error
            if block_id == _NULL:
                return
            ref = ref_of[block_id]
            if ref == 0:
                if self._prev[block_id] == _NO_BLOCK or self._next[block_id] == _NO_BLOCK:
                    raise UsageError(
                        f"touch(): block {block_id} has ref_cnt 0 but is not in the free queue"
                    )
                self._queue.remove(block_id)
            ref_of[block_id] = ref + 1
            self._led[block_id] += 1
            return
        ids, arr = self._read_ids_array(blocks, "touch")
        if (_NULL in ids) if arr is None else (arr == _NULL).any():  # the null block is skipped
            ids = [b for b in ids if b != _NULL]
            if arr is not None:
                arr = arr[arr != _NULL]
        if arr is not None and len(arr) >= BULK_MIN_BLOCKS and self._touch_bulk(ids, arr):
            return
        prev_of, nxt_of = self._prev, self._next
        queued = []  # the ref-0 blocks, to take out of the free queue
        for block_id in ids:
            if ref_of[block_id] == 0:
                if prev_of[block_id] == _NO_BLOCK or nxt_of[block_id] == _NO_BLOCK:
                    raise UsageError(
                        f"touch(): block {block_id} has ref_cnt 0 but is not in the free queue"
                    )
                queued.append(block_id)
        if queued:
            self._queue._unlink_n(queued)  # checked above; a repeated block goes once
        led = self._led
        for block_id in ids:
            ref_of[block_id] += 1
            led[block_id] += 1

    def _touch_bulk(self, ids: list, arr: np.ndarray) -> bool:
        """``touch`` of the blocks ``ids`` (``arr`` as an array; no null block) with numpy;
        returns False, having checked and written nothing, when they are not distinct."""
        srt = np.sort(arr)
        if (srt[1:] == srt[:-1]).any():
            return False
        refs = self._ref_col[arr]
        if refs.max() >= _INT32_MAX:
            return False  # the loop raises where the count overflows, as it always did
        at_zero = np.flatnonzero(refs == 0)
        if len(at_zero):
            zero = arr[at_zero]
            queue = self._queue
            bad = (queue._prev_col[zero] == _NO_BLOCK) | (queue._next_col[zero] == _NO_BLOCK)
            if bad.any():
                block_id = ids[at_zero[np.argmax(bad)]]  # the first, as the loop finds it
                raise UsageError(
                    f"touch(): block {block_id} has ref_cnt 0 but is not in the free queue"
                )
            if not queue._unlink_bulk(zero):
                queue._unlink_n(zero.tolist())
        refs += 1
        self._ref_col[arr] = refs
        self._led_np[arr] += 1
        return True
