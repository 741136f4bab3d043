"""What a pool's prefix cache holds, block by block (``BlockPool.cached_blocks``, read by
``shmkv inspect NAME --keys``): each cached block's KV-cache group, hash, reference count,
place in the eviction (LRU) order, and the processes holding references to it.

Read in one hold of the pool lock, at a bounded cost: four columns of the block rows are
copied (O(num_blocks), vectorised), then the hashes and ledger columns of at most
``limit`` blocks (O(limit x max_processes)). Nothing is written.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from shmkv.errors import UsageError
from shmkv.pool import layout as L

__all__ = ["CachedBlock", "CachedBlocks", "list_cached_blocks"]


class CachedBlock(NamedTuple):
    """One cached block (a block whose row holds a prefix-cache key)."""

    block_id: int
    group_id: int  # KV-cache group of its key
    block_hash: bytes  # the chained block hash (32 bytes)
    num_tokens: int  # prefix tokens the hash covers
    ref_cnt: int
    # Its place in the free queue: 0 is evicted first; None while a request holds it.
    lru_position: int | None
    holders: tuple[tuple[int, int, int], ...]  # (slot, pid, references) per holder


class CachedBlocks(NamedTuple):
    """A listing: the first ``limit`` cached blocks, evictable ones in eviction order and
    then held ones by block id, and how many there are in all."""

    blocks: list[CachedBlock]
    num_cached: int  # cached blocks in the pool (the listing may stop before)
    num_free: int  # blocks in the free queue, cached or not


def list_cached_blocks(views, lock, num_blocks: int, limit: int) -> CachedBlocks:
    """The listing of ``BlockPool.cached_blocks`` (``views``: the pool's ``segment_views``;
    ``lock``: its lock, taken here).

    Raises:
        UsageError: ``limit`` is not an int >= 0.
    """
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise UsageError(f"cached_blocks(): limit must be an int >= 0, got {limit!r}")
    with lock:
        meta = views.blocks[:num_blocks]
        ref = np.array(meta["ref_cnt"])
        htok = np.array(meta["hash_num_tokens"])
        qkey = np.array(meta["queue_key"])
        ids = np.arange(num_blocks)
        real = ids != L.NULL_BLOCK_ID
        free_ids = ids[real & (ref == 0)]
        order = free_ids[np.argsort(qkey[free_ids], kind="stable")]  # head: evicted first
        position = np.full(num_blocks, -1, dtype=np.int64)
        position[order] = np.arange(len(order))
        cached = real & (htok != L.NO_HASH_TOKENS)
        evictable = order[cached[order]]
        held = ids[cached & (ref > 0)]
        chosen = np.concatenate([evictable, held])[:limit]
        out = []
        for b in chosen.tolist():
            row = meta[b]
            holders = ()
            if ref[b] > 0:
                column = views.ledger[:, b]
                holders = tuple((int(s), int(views.procs[s]["pid"]), int(column[s]))
                                for s in np.flatnonzero(column > 0).tolist())
            out.append(CachedBlock(
                block_id=b, group_id=int(row["group_id"]), block_hash=bytes(row["block_hash"]),
                num_tokens=int(htok[b]), ref_cnt=int(ref[b]),
                lru_position=None if position[b] < 0 else int(position[b]),
                holders=holders))
        return CachedBlocks(out, int(cached.sum()), len(order))
