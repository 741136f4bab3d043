"""What a subscriber of the pool's event log learns of the SGLang page store: complete
pages only (store.py). Every function here runs with the pool lock held, in the hold that
makes the change, so the log's order is the pool's."""

from __future__ import annotations

import numpy as np

from shmkv.events import BlockRemoved, BlockStored, external_block_hash, use_int_block_hashes
from shmkv.pool import layout as L
from shmkv.pool.block_pool import BlockPool

MEDIUM = "L3"


def complete_keys(pool: BlockPool, block_ids: list[int]) -> list[bytes]:
    """The keys of the complete pages among ``block_ids``."""
    if not block_ids:
        return []
    rows = pool.block_rows()[np.asarray(block_ids, np.int64)]
    done = (rows["group_id"] == 0) & (rows["hash_num_tokens"] != L.NO_HASH_TOKENS)
    return [bytes(h) for h in rows["block_hash"][done]]


def log_stored(pool: BlockPool, hashes: list[bytes]) -> None:
    """One ``BlockStored`` (group 0) for pages just completed."""
    if hashes:
        as_int = use_int_block_hashes()
        pool.log_events([BlockStored(
            block_hashes=[external_block_hash(h, as_int) for h in hashes],
            parent_block_hash=None, token_ids=[], block_size=1, lora_id=None,
            medium=MEDIUM, lora_name=None, group_idx=0)])


def log_removed(pool: BlockPool, hashes: list[bytes]) -> None:
    """One ``BlockRemoved`` listing the keys of the complete pages that go in this hold, in
    the order they go (one event per batch, not per key: each logged event costs a journal
    record under the lock; subscribers read every hash of the list)."""
    if hashes:
        as_int = use_int_block_hashes()
        pool.log_events([BlockRemoved(
            block_hashes=[external_block_hash(h, as_int) for h in hashes], medium=MEDIUM,
            group_idx=0)])
