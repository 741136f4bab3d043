"""The prefix-cache index: vLLM's ``BlockHashToBlockMap`` as a chained hash table in shared memory.

Keys are ``(block_hash, group_id)``; values are blocks. ``index_buckets[b]`` holds the first
block of bucket ``b`` and each block row's ``index_next`` the next one, so the table needs no
memory beyond one int32 per bucket and per block. Several blocks may hold the same key (vLLM
does not de-duplicate identical content, to keep block tables append-only). New entries join
at the tail of their chain, so the first block found for a key is the earliest inserted
still there: vLLM's ``get_one_block`` rule.

A block holds at most one key, stored in its own row (``block_hash``, ``group_id``,
``hash_num_tokens``); ``hash_num_tokens == NO_HASH_TOKENS`` means it holds none. A block is in
a chain exactly when it holds a key (INV-HASH).

NOTE: only this class writes ``index_buckets``, ``index_next`` and the hash fields of a row.
Callers hold the pool lock.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

import numpy as np

from shmkv import layout as L

_R = L.ROW_I32
_INEXT = L.F_INDEX_NEXT
_GROUP = L.F_GROUP
_HTOK = L.F_HASH_TOKENS
_HASH_BYTES = L.BLOCK_HASH_BYTES
_MASK64 = (1 << 64) - 1
_NO_BLOCK = L.NO_BLOCK
_NO_HASH_TOKENS = L.NO_HASH_TOKENS
_ROW_BYTES = L.BLOCK_DTYPE.itemsize
_read_u64 = struct.Struct("<Q").unpack_from


class BlockHashToBlockMap:
    """Shared-memory map from (block hash, group id) to blocks, several blocks per key.

    Args:
        mem: the segment's mmap (hash bytes are read and written by slicing it).
        i32: flat int32 memoryview of ``block_meta``.
        buckets: int32 memoryview of ``index_buckets``.
        blocks: numpy view of ``block_meta``; buckets_np: numpy view of ``index_buckets``.
        layout: the pool's layout.
    """

    def __init__(self, mem, i32, buckets, blocks: np.ndarray, buckets_np: np.ndarray,
                 layout: L.Layout) -> None:
        self._mem = mem
        self._i32 = i32
        self._buckets = buckets
        self._blocks = blocks
        self._buckets_np = buckets_np
        self._mask = layout.config.num_index_buckets - 1
        self._hash0 = layout.offsets["block_meta"] + L.HASH_BYTE_OFFSET

    def initialize(self) -> None:
        """Empties the map and clears every block's key (a new pool, or a reset)."""
        self._buckets_np[:] = _NO_BLOCK
        self._blocks["index_next"] = _NO_BLOCK
        self._blocks["group_id"] = 0
        self._blocks["hash_num_tokens"] = _NO_HASH_TOKENS
        self._blocks["block_hash"] = bytes(_HASH_BYTES)

    def bucket_of(self, block_hash: bytes, group_id: int) -> int:
        word = _read_u64(block_hash)[0]
        if group_id:
            word ^= (group_id * L.GROUP_MIX) & _MASK64
        return word & self._mask

    def _matches(self, block_id: int, block_hash: bytes, group_id: int) -> bool:
        if self._i32[block_id * _R + _GROUP] != group_id:
            return False
        off = self._hash0 + block_id * _ROW_BYTES
        return self._mem[off:off + _HASH_BYTES] == block_hash

    def get_one_block(self, block_hash: bytes, group_id: int) -> int:
        """The first-inserted block holding the key, or ``NO_BLOCK``."""
        i32 = self._i32
        cur = self._buckets[self.bucket_of(block_hash, group_id)]
        while cur != _NO_BLOCK:
            if self._matches(cur, block_hash, group_id):
                return cur
            cur = i32[cur * _R + _INEXT]
        return _NO_BLOCK

    def contain(self, block_hash: bytes, group_id: int, block_id: int) -> bool:
        """Whether ``block_id`` holds the key (it is then in the key's chain)."""
        return self.block_key(block_id) == (block_hash, group_id)

    def insert(self, block_hash: bytes, group_id: int, block_id: int, num_tokens: int) -> None:
        """Gives an unhashed block the key and links it at the tail of its bucket chain."""
        i32 = self._i32
        base = block_id * _R
        off = self._hash0 + block_id * _ROW_BYTES
        self._mem[off:off + _HASH_BYTES] = block_hash
        i32[base + _GROUP] = group_id
        i32[base + _HTOK] = num_tokens
        i32[base + _INEXT] = _NO_BLOCK
        bucket = self.bucket_of(block_hash, group_id)
        cur = self._buckets[bucket]
        if cur == _NO_BLOCK:
            self._buckets[bucket] = block_id
            return
        nxt = i32[cur * _R + _INEXT]
        while nxt != _NO_BLOCK:
            cur = nxt
            nxt = i32[cur * _R + _INEXT]
        i32[cur * _R + _INEXT] = block_id

    def pop(self, block_id: int) -> tuple[bytes, int] | None:
        """Removes a block's key from the map and the block; returns (hash, group) or None."""
        key = self.block_key(block_id)
        if key is None:
            return None
        i32 = self._i32
        bucket = self.bucket_of(*key)
        nxt = i32[block_id * _R + _INEXT]
        cur = self._buckets[bucket]
        if cur == block_id:
            self._buckets[bucket] = nxt
        else:
            while True:
                after = i32[cur * _R + _INEXT]
                if after == block_id:
                    i32[cur * _R + _INEXT] = nxt
                    break
                cur = after
        base = block_id * _R
        i32[base + _INEXT] = _NO_BLOCK
        i32[base + _HTOK] = _NO_HASH_TOKENS
        i32[base + _GROUP] = 0
        return key

    def block_key(self, block_id: int) -> tuple[bytes, int] | None:
        """(hash, group id) held by the block, or None."""
        i32 = self._i32
        base = block_id * _R
        if i32[base + _HTOK] == _NO_HASH_TOKENS:
            return None
        off = self._hash0 + block_id * _ROW_BYTES
        return self._mem[off:off + _HASH_BYTES], i32[base + _GROUP]

    def iter_chain(self, bucket: int, limit: int) -> Iterator[int]:
        """Blocks of one bucket chain, at most ``limit`` of them (so a corrupt cycle ends)."""
        cur = self._buckets[bucket]
        for _ in range(limit):
            if cur == _NO_BLOCK:
                return
            yield cur
            cur = self._i32[cur * _R + _INEXT]

    def __len__(self) -> int:
        """Number of distinct keys (O(num_blocks); for tests and tools)."""
        hashed = self._blocks[self._blocks["hash_num_tokens"] != _NO_HASH_TOKENS]
        return len({(bytes(h), int(g)) for h, g in zip(hashed["block_hash"], hashed["group_id"])})
