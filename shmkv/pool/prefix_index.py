"""The prefix-cache index: vLLM's ``BlockHashToBlockMap`` as a chained hash table in shared memory.

Keys are ``(block_hash, group_id)``; values are blocks. ``index_buckets[b]`` holds the first
key row of bucket ``b`` and each key row's ``index_next`` the next one, so the table needs no
memory beyond one int32 per bucket and the key rows. Several blocks may hold the same key (vLLM
does not de-duplicate identical content, to keep block tables append-only). New entries join
at the tail of their chain, so the first block found for a key is the earliest inserted
still there: vLLM's ``get_one_block`` rule.

A block holds at most two keys: its own, stored in its own row (``block_hash``, ``group_id``,
``hash_num_tokens``), and an alias (a partial key, vLLM's secondary entry of
``cached_block_hashes_by_block``) in its alias row, key row ``num_blocks + 2 + block_id``
(region ``block_alias``, see ``shmkv/pool/layout.py``). ``hash_num_tokens == NO_HASH_TOKENS``
means the row holds no key. A key row is in a chain exactly when it holds a key (INV-HASH);
an alias row holds one only while its block's own row does (INV-ALIAS). Lookups answer with
the block, never the alias row.

NOTE: only this class writes ``index_buckets``, ``index_next`` and the hash fields of a row,
every write journaled first (``shmkv/pool/journal.py``). Callers hold the pool lock.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

import numpy as np

from shmkv.errors import InvariantViolation
from shmkv.pool import layout as L
from shmkv.pool.journal import Journal, JournaledColumn, JournaledView

_R = L.ROW_I32
_INEXT = L.F_INDEX_NEXT
_GROUP = L.F_GROUP
_HTOK = L.F_HASH_TOKENS
_HASH_BYTES = L.BLOCK_HASH_BYTES
_MASK64 = (1 << 64) - 1
_GROUP_MIX = L.GROUP_MIX
_NO_BLOCK = L.NO_BLOCK
_NO_HASH_TOKENS = L.NO_HASH_TOKENS
_ROW_BYTES = L.BLOCK_DTYPE.itemsize
_R64 = L.ROW_I64
_HASH_WORD = L.HASH_BYTE_OFFSET // 8
_read_u64 = struct.Struct("<Q").unpack_from


class BlockHashToBlockMap:
    """Shared-memory map from (block hash, group id) to blocks, several blocks per key.

    Args:
        mem: the segment's mmap (hash bytes are read and written by slicing it).
        i32: flat int32 memoryview of the key rows (``block_meta`` then ``block_alias``).
        buckets: int32 memoryview of ``index_buckets``.
        blocks: numpy view of the key rows (``Layout.key_rows``); buckets_np: numpy view of
            ``index_buckets``.
        layout: the pool's layout.
        journal: the pool's undo journal.

    The hot paths go through per-field strided views (``self._inext[b]`` is row ``b``'s
    ``index_next``), made once here and journaled; the ``*_raw`` ones are the same views
    unjournaled, for readers. :meth:`release` drops them, and must run before the views
    they are cut from are released.
    """

    def __init__(self, mem, i32, buckets, blocks: np.ndarray, buckets_np: np.ndarray,
                 layout: L.Layout, journal: Journal) -> None:
        meta = layout.offsets["block_meta"]
        idx = layout.offsets["index_buckets"]
        self._mem = mem
        self._journal = journal
        self.buckets_raw = buckets
        self._buckets = JournaledView(buckets, journal, idx, 4)
        self._blocks = blocks
        self._buckets_np = buckets_np
        self._mask = layout.config.num_index_buckets - 1
        self.num_blocks = layout.config.num_blocks
        self.alias0 = layout.alias_row(0)  # key row of block 0's alias
        self.has_aliases = layout.config.partial_keys  # the pool has alias rows
        self._hash0 = meta + L.HASH_BYTE_OFFSET
        self.inext_raw = i32[_INEXT::_R]
        self.group_raw = i32[_GROUP::_R]
        self._htok_raw = i32[_HTOK::_R]
        self._inext = JournaledView(self.inext_raw, journal, meta + 4 * _INEXT, _ROW_BYTES)
        self._group = JournaledView(self.group_raw, journal, meta + 4 * _GROUP, _ROW_BYTES)
        self._htok = JournaledView(self._htok_raw, journal, meta + 4 * _HTOK, _ROW_BYTES)
        self._columns = {
            name: JournaledColumn(blocks[name], journal, meta + blocks.dtype.fields[name][1])
            for name in ("index_next", "group_id", "hash_num_tokens")
        }
        self._buckets_col = JournaledColumn(buckets_np, journal, idx)
        # The first 8 hash bytes of each row as an int64: the bucket's word, read in place
        # (as a signed word it has the same low bits, so the same bucket).
        self._hword = i32.cast("B").cast("q")[_HASH_WORD::_R64]

    def release(self) -> None:
        """Releases the strided views (before the pool releases the views they come from);
        the map is unusable afterwards."""
        for view in (self.inext_raw, self.group_raw, self._htok_raw, self._hword):
            view.release()
        self._columns = self._buckets_col = None

    def initialize(self) -> None:
        """Empties the map and clears every block's key (a new pool, before it is READY:
        unjournaled)."""
        self._buckets_np[:] = _NO_BLOCK
        self._blocks["index_next"] = _NO_BLOCK
        self._blocks["group_id"] = 0
        self._blocks["hash_num_tokens"] = _NO_HASH_TOKENS
        self._blocks["block_hash"] = bytes(_HASH_BYTES)

    def clear(self) -> None:
        """Empties the map (``reset_prefix_cache``): unlinks every hashed block and clears
        its key fields, as :meth:`pop` does one by one. Writes, journaled, only the words
        that change. The hash bytes stay, meaningless once ``hash_num_tokens`` is 0."""
        hashed = np.flatnonzero(self._blocks["hash_num_tokens"] != _NO_HASH_TOKENS)
        self._buckets_col[np.flatnonzero(self._buckets_np != _NO_BLOCK)] = _NO_BLOCK
        self._columns["index_next"][hashed] = _NO_BLOCK
        self._columns["hash_num_tokens"][hashed] = _NO_HASH_TOKENS
        self._columns["group_id"][hashed] = 0

    def _chain_tail(self, cur: int) -> int:
        """The last block of the chain through ``cur`` (a corrupt, looping chain raises
        InvariantViolation rather than spinning, as the C kernel does)."""
        inext = self.inext_raw
        limit = len(inext)
        nxt = inext[cur]
        while nxt != _NO_BLOCK:
            cur = nxt
            nxt = inext[cur]
            limit -= 1
            if limit < 0:
                raise InvariantViolation([
                    "INV-FREE/INV-HASH: corrupt shared state: prefix-index chain leaves the "
                    f"blocks or loops (row {cur})"
                ])
        return cur

    def _write_hash(self, off: int, block_hash: bytes) -> None:
        save = self._journal.save
        for word in range(off, off + _HASH_BYTES, 8):
            save(word, 8)
        self._mem[off:off + _HASH_BYTES] = block_hash

    def bucket_of(self, block_hash: bytes, group_id: int) -> int:
        word = _read_u64(block_hash)[0]
        if group_id:
            word ^= (group_id * _GROUP_MIX) & _MASK64
        return word & self._mask

    def _matches(self, block_id: int, block_hash: bytes, group_id: int) -> bool:
        if self.group_raw[block_id] != group_id:
            return False
        off = self._hash0 + block_id * _ROW_BYTES
        return self._mem[off:off + _HASH_BYTES] == block_hash

    def get_one_block(self, block_hash: bytes, group_id: int) -> int:
        """The block of the first-inserted key row holding the key, or ``NO_BLOCK``."""
        # bucket_of and _matches, inlined: this is the prefix-cache lookup.
        word = _read_u64(block_hash)[0]
        if group_id:
            word ^= (group_id * _GROUP_MIX) & _MASK64
        cur = self.buckets_raw[word & self._mask]
        if cur == _NO_BLOCK:
            return _NO_BLOCK
        group_of, inext, mem, hash0 = self.group_raw, self.inext_raw, self._mem, self._hash0
        for _ in range(len(inext)):  # bounded: a corrupt chain may loop
            if group_of[cur] == group_id:
                off = hash0 + cur * _ROW_BYTES
                if mem[off:off + _HASH_BYTES] == block_hash:
                    return cur if cur < self.alias0 else cur - self.alias0
            cur = inext[cur]
            if cur == _NO_BLOCK:
                return _NO_BLOCK
        raise InvariantViolation([
            "INV-FREE/INV-HASH: corrupt shared state: prefix-index chain leaves the blocks "
            f"or loops (row {cur})"
        ])

    def contain(self, block_hash: bytes, group_id: int, block_id: int) -> bool:
        """Whether ``block_id`` holds the key, as its own or as its alias (it is then in the
        key's chain)."""
        key = (block_hash, group_id)
        return self.block_key(block_id) == key or self.alias_key(block_id) == key

    def insert(self, block_hash: bytes, group_id: int, block_id: int, num_tokens: int) -> None:
        """Gives a key row without a key (a block's own row, or its alias row) the key and
        links it at the tail of its bucket chain."""
        self._write_hash(self._hash0 + block_id * _ROW_BYTES, block_hash)
        self._group[block_id] = group_id
        self._htok[block_id] = num_tokens
        inext = self._inext
        inext[block_id] = _NO_BLOCK
        word = self._hword[block_id]  # the hash just written
        if group_id:
            word ^= (group_id * _GROUP_MIX) & _MASK64
        bucket = word & self._mask
        buckets = self._buckets
        cur = buckets[bucket]
        if cur == _NO_BLOCK:
            buckets[bucket] = block_id
            return
        inext[self._chain_tail(cur)] = block_id

    def insert_n(self, entries, group_id: int) -> None:
        """``insert(block_hash, group_id, block_id, num_tokens)`` for each
        ``(block_id, block_hash, num_tokens)`` of ``entries``, in order (one group)."""
        hash0, mask, buckets = self._hash0, self._mask, self._buckets
        group_of, htok, inext, hword = self._group, self._htok, self._inext, self._hword
        write_hash = self._write_hash
        mix = (group_id * _GROUP_MIX) & _MASK64 if group_id else 0
        for block_id, block_hash, num_tokens in entries:
            write_hash(hash0 + block_id * _ROW_BYTES, block_hash)
            group_of[block_id] = group_id
            htok[block_id] = num_tokens
            inext[block_id] = _NO_BLOCK
            bucket = (hword[block_id] ^ mix) & mask  # the hash just written
            cur = buckets[bucket]
            if cur == _NO_BLOCK:
                buckets[bucket] = block_id
                continue
            inext[self._chain_tail(cur)] = block_id

    def pop(self, block_id: int) -> tuple[bytes, int] | None:
        """Removes a key row's key from the map and the row (``block_id`` is a block's own
        row or an alias row); returns (hash, group) or None."""
        htok = self._htok
        if htok[block_id] == _NO_HASH_TOKENS:
            return None
        group_of = self._group
        off = self._hash0 + block_id * _ROW_BYTES
        block_hash = self._mem[off:off + _HASH_BYTES]
        group_id = group_of[block_id]
        # The bucket straight from the stored hash bytes (bucket_of, inlined).
        word = self._hword[block_id]
        if group_id:
            word ^= (group_id * _GROUP_MIX) & _MASK64
        bucket = word & self._mask
        inext, buckets = self._inext, self._buckets
        nxt = inext[block_id]
        cur = buckets[bucket]
        if cur == block_id:
            buckets[bucket] = nxt
        else:
            limit = rows = len(self.inext_raw)
            while True:
                after = inext[cur] if 0 <= cur < rows else _NO_BLOCK
                if after == block_id:
                    inext[cur] = nxt
                    break
                cur = after
                limit -= 1
                if cur == _NO_BLOCK or limit < 0:
                    raise InvariantViolation([
                        f"INV-HASH: corrupt shared state: block {block_id} is not in the "
                        f"chain of its bucket {bucket}"
                    ])
        inext[block_id] = _NO_BLOCK
        htok[block_id] = _NO_HASH_TOKENS
        group_of[block_id] = 0
        return block_hash, group_id

    def pop_all(self, block_id: int) -> list[tuple[bytes, int]]:
        """Removes every key of a block, its own first, then its alias (vLLM's order in
        ``_remove_cached_block_hashes``); returns the (hash, group) of each key removed."""
        own = self.pop(block_id)
        if own is None:  # an alias never outlives its block's own key (INV-ALIAS)
            return []
        if not self.has_aliases or self._htok_raw[self.alias0 + block_id] == _NO_HASH_TOKENS:
            return [own]
        return [own, self.pop(self.alias0 + block_id)]

    def block_key(self, block_id: int) -> tuple[bytes, int] | None:
        """(hash, group id) held by a key row (a block's own row or an alias row), or None."""
        if self._htok_raw[block_id] == _NO_HASH_TOKENS:
            return None
        off = self._hash0 + block_id * _ROW_BYTES
        return self._mem[off:off + _HASH_BYTES], self.group_raw[block_id]

    def iter_chain(self, bucket: int, limit: int) -> Iterator[int]:
        """Blocks of one bucket chain, at most ``limit`` of them (so a corrupt cycle ends)."""
        cur = self.buckets_raw[bucket]
        for _ in range(limit):
            if cur == _NO_BLOCK:
                return
            yield cur
            cur = self.inext_raw[cur]

    def alias_key(self, block_id: int) -> tuple[bytes, int] | None:
        """(hash, group id) of the block's alias key, or None."""
        if not self.has_aliases:
            return None
        return self.block_key(self.alias0 + block_id)

    def __len__(self) -> int:
        """Number of distinct keys, aliases included (O(num_blocks); for tests and tools)."""
        hashed = self._blocks[self._blocks["hash_num_tokens"] != _NO_HASH_TOKENS]
        keys = zip(hashed["block_hash"], hashed["group_id"], strict=True)
        return len({(bytes(h), int(g)) for h, g in keys})
