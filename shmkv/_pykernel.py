"""The reference kernel: BlockPool's hot loops in pure Python.

``shmkv/_ckernel.c`` is the same code in C and is used when it is built; this module is
the fallback and the reference it is tested against (the test suite runs every pool test
with both). Both kernels perform the same shared-memory writes in the same order, check
everything before their first write, and raise the same errors with the same messages.

Kernel interface (both kernels):

- ``allocate(n, caching, handles, make_handle, evicted_out) -> list[KVCacheBlock]``
- ``free(blocks, caching)`` / ``touch(blocks)``
- ``cache(blocks, fine_hashes, num_cached, ratio, block_size, group_id, block_mask,
  evicted_out) -> [(position, hash)]``
- ``get_cached(block_hash, group_ids, handles, make_handle) -> list | None``
- ``lookup(block_hash, group_id) -> int`` / ``insert(block_hash, group_id, block_id,
  num_tokens)`` / ``evict(block_id) -> (hash, group) | None``
- ``release()``
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from shmkv import layout as L
from shmkv.errors import OutOfBlocksError, UsageError
from shmkv.free_queue import BULK_MIN_BLOCKS, FreeKVCacheBlockQueue
from shmkv.prefix_index import BlockHashToBlockMap

_R = L.ROW_I32
_REF = L.F_REF
_PREV = L.F_PREV
_NEXT = L.F_NEXT
_HTOK = L.F_HASH_TOKENS
_NULL = L.NULL_BLOCK_ID
_NO_BLOCK = L.NO_BLOCK
_NO_HASH_TOKENS = L.NO_HASH_TOKENS
_HASH_BYTES = L.BLOCK_HASH_BYTES


class PyKernel:
    """BlockPool's mutations over the free queue and the prefix index, in Python."""

    def __init__(self, i32, queue: FreeKVCacheBlockQueue, index: BlockHashToBlockMap,
                 blocks: np.ndarray, ledger_row: np.ndarray, num_blocks: int) -> None:
        self._i32 = i32
        self._ledger_np = ledger_row
        self._ledger = memoryview(ledger_row)
        self._queue = queue
        self._index = index
        self._ref_col = blocks["ref_cnt"]
        self._htok_col = blocks["hash_num_tokens"]
        self._num_blocks = num_blocks

    def release(self) -> None:
        self._ledger.release()
        self._ledger = self._ledger_np = None
        self._i32 = self._queue = self._index = None
        self._ref_col = self._htok_col = None

    def _read_ids(self, blocks, what: str) -> list[int]:
        if not isinstance(blocks, (list, tuple)):
            blocks = list(blocks)
        try:
            ids = [b.block_id for b in blocks]
        except AttributeError:
            bad = next(b for b in blocks if not hasattr(b, "block_id"))
            raise UsageError(
                f"{what}() takes KVCacheBlock handles, got {type(bad).__name__}"
            ) from None
        n = self._num_blocks
        if ids and (min(ids) < 0 or max(ids) >= n):
            bad = next(b for b in ids if not 0 <= b < n)
            raise UsageError(f"{what}(): block id {bad} is out of range [0, {n})")
        return ids

    # ------------------------------------------------------------------ prefix index

    def lookup(self, block_hash: bytes, group_id: int) -> int:
        if type(block_hash) is not bytes:
            raise UsageError(f"block hash must be bytes, got {type(block_hash).__name__}")
        if len(block_hash) != _HASH_BYTES:
            raise UsageError(
                f"block hash must be {_HASH_BYTES} bytes (sha256), got {len(block_hash)}"
            )
        return self._index.get_one_block(block_hash, group_id)

    def get_cached(self, block_hash: bytes, group_ids, handles: list, make_handle) -> list | None:
        found = []
        for group_id in group_ids:
            block_id = self.lookup(block_hash, group_id)
            if block_id == _NO_BLOCK:
                return None
            found.append(handles[block_id] or make_handle(block_id))
        return found

    def insert(self, block_hash: bytes, group_id: int, block_id: int, num_tokens: int) -> None:
        self._index.insert(block_hash, group_id, block_id, num_tokens)

    def cache(self, blocks, fine_hashes, num_cached: int, ratio: int, block_size: int,
              group_id: int, block_mask, evicted_out: list | None) -> list[tuple[int, bytes]]:
        """Gives ``blocks`` (the range ``[num_cached, num_cached + len(blocks))`` of a request)
        their keys; null and masked-out blocks are skipped. Checks everything first.

        Returns:
            (block position in the request, hash) of each block cached, in order.
        """
        ids = self._read_ids(blocks, "cache_full_blocks")
        i32 = self._i32
        plan: list[tuple[int, int, bytes, int, bool]] = []
        planned: set[int] = set()
        for i, block_id in enumerate(ids):
            if block_id == _NULL or (block_mask is not None and not block_mask[i]):
                continue
            if block_id in planned:
                raise UsageError(
                    f"cache_full_blocks(): block {block_id} appears twice in the blocks to cache"
                )
            planned.add(block_id)
            position = num_cached + i
            block_hash = fine_hashes[(position + 1) * ratio - 1]
            if type(block_hash) is not bytes or len(block_hash) != _HASH_BYTES:
                raise UsageError(
                    f"cache_full_blocks(): block hash {position} must be {_HASH_BYTES} bytes, "
                    f"got {type(block_hash).__name__}"
                    + (f" of {len(block_hash)} bytes" if type(block_hash) is bytes else "")
                )
            num_tokens = (position + 1) * block_size
            held = i32[block_id * _R + _HTOK]
            if held != _NO_HASH_TOKENS and held >= num_tokens:
                raise UsageError(
                    f"cache_full_blocks(): block {block_id} is already cached "
                    f"({held} tokens, asked for {num_tokens})"
                )
            plan.append((position, block_id, block_hash, num_tokens, held != _NO_HASH_TOKENS))
        index = self._index
        for _, block_id, block_hash, num_tokens, rehash in plan:
            if rehash:  # a shorter key on the same block gives way to the full one
                key = index.pop(block_id)
                if evicted_out is not None:
                    evicted_out.append(key)
            index.insert(block_hash, group_id, block_id, num_tokens)
        return [(position, block_hash) for position, _, block_hash, _, _ in plan]

    def evict(self, block_id: int) -> tuple[bytes, int] | None:
        return self._index.pop(block_id)

    # ------------------------------------------------------------------ pool operations

    def allocate(self, n: int, caching: bool, handles: list, make_handle,
                 evicted_out: list | None) -> list:
        if n < 0 or n > self._queue.num_free_blocks:
            raise OutOfBlocksError(f"Cannot get {n} free blocks from the pool")
        ids, arr = self._queue.popleft_n_with_array(n)
        index = self._index
        ledger = self._ledger
        if arr is None:
            i32 = self._i32
            for block_id in ids:
                base = block_id * _R
                if caching and i32[base + _HTOK] != _NO_HASH_TOKENS:
                    key = index.pop(block_id)
                    if evicted_out is not None:
                        evicted_out.append(key)
                i32[base + _REF] = 1
                ledger[block_id] += 1
        else:
            if caching:
                for block_id in arr[self._htok_col[arr] != _NO_HASH_TOKENS].tolist():
                    key = index.pop(block_id)
                    if evicted_out is not None:
                        evicted_out.append(key)
            self._ref_col[arr] = 1
            self._ledger_np[arr] += 1
        return [handles[b] or make_handle(b) for b in ids]

    def free(self, blocks, caching: bool) -> None:
        ids = self._read_ids(blocks, "free_blocks")
        n = len(ids)
        unique = n < 2 or len(set(ids)) == n
        if n >= BULK_MIN_BLOCKS and unique:
            arr = np.array(ids, dtype=np.int64)
            arr = arr[arr != _NULL]
            refs = self._ref_col[arr]
            if (refs <= 0).any():
                self._raise_double_free(ids, int(arr[np.argmax(refs <= 0)]))
            held = self._ledger_np[arr]
            if (held <= 0).any():
                self._raise_not_held(ids, int(arr[np.argmax(held <= 0)]))
            refs -= 1
            self._ref_col[arr] = refs
            self._ledger_np[arr] = held - 1
            zero = arr[refs == 0]
            if caching:
                hashed = self._htok_col[zero] != _NO_HASH_TOKENS
                evict_first, evict_last = zero[~hashed], zero[hashed]
            else:
                evict_first, evict_last = zero, zero[:0]
        else:
            i32 = self._i32
            ledger = self._ledger
            if unique:
                for block_id in ids:
                    if block_id != _NULL and i32[block_id * _R + _REF] < 1:
                        self._raise_double_free(ids, block_id)
                for block_id in ids:
                    if block_id != _NULL and ledger[block_id] < 1:
                        self._raise_not_held(ids, block_id)
            else:
                seen: Counter[int] = Counter()
                for block_id in ids:
                    if block_id == _NULL:
                        continue
                    seen[block_id] += 1
                    if i32[block_id * _R + _REF] < seen[block_id]:
                        self._raise_double_free(ids, block_id)
                for block_id in ids:
                    if block_id != _NULL and ledger[block_id] < seen[block_id]:
                        self._raise_not_held(ids, block_id)
            evict_first, evict_last = [], []
            for block_id in ids:
                if block_id == _NULL:
                    continue
                base = block_id * _R
                ref = i32[base + _REF] - 1
                i32[base + _REF] = ref
                ledger[block_id] -= 1
                if ref == 0:
                    if caching and i32[base + _HTOK] != _NO_HASH_TOKENS:
                        evict_last.append(block_id)
                    else:
                        evict_first.append(block_id)
        if len(evict_first):
            self._queue.prepend_n(evict_first)
        if len(evict_last):
            self._queue.append_n(evict_last)

    def _raise_double_free(self, ids: list[int], block_id: int) -> None:
        ref = self._i32[block_id * _R + _REF]
        times = ids.count(block_id)
        raise UsageError(
            f"free_blocks(): block {block_id} has ref_cnt {ref} but is freed {times} time(s)"
            + (" (it is already free)" if ref == 0 else "")
        )

    def _raise_not_held(self, ids: list[int], block_id: int) -> None:
        raise UsageError(
            f"free_blocks(): block {block_id} is freed {ids.count(block_id)} time(s) but this "
            f"process holds {self._ledger[block_id]} reference(s) to it "
            f"(ref_cnt {self._i32[block_id * _R + _REF]})"
        )

    def touch(self, blocks) -> None:
        ids = self._read_ids(blocks, "touch")
        i32 = self._i32
        for block_id in ids:
            base = block_id * _R
            if block_id != _NULL and i32[base + _REF] == 0 and (
                i32[base + _PREV] == _NO_BLOCK or i32[base + _NEXT] == _NO_BLOCK
            ):
                raise UsageError(
                    f"touch(): block {block_id} has ref_cnt 0 but is not in the free queue"
                )
        remove = self._queue.remove
        ledger = self._ledger
        for block_id in ids:
            if block_id == _NULL:
                continue
            base = block_id * _R
            ref = i32[base + _REF]
            if ref == 0:
                remove(block_id)
            i32[base + _REF] = ref + 1
            ledger[block_id] += 1
