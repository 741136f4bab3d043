"""BlockPool.block_rows() and BlockPool.log_events(): the two read/log hooks layers above
the pool (the vLLM offload tier) use instead of the pool's private members."""

from __future__ import annotations

import numpy as np
import pytest

from shmkv import BlockRemoved, BlockStored, UsageError
from tests.helpers import make_request


def test_block_rows_is_a_read_only_live_view(make_pool):
    """block_rows() shows every block's ref count and key as they change, and refuses
    writes."""
    pool = make_pool(6, hash_block_size=4)
    rows = pool.block_rows()
    assert rows.shape == (6,) and not rows.flags.writeable
    blocks = pool.get_new_blocks(2)
    req = make_request(8, block_size=4)
    pool.cache_full_blocks(req, blocks, 0, 2, 4, 0)
    ids = [b.block_id for b in blocks]
    assert rows["ref_cnt"][ids].tolist() == [1, 1]
    assert [bytes(h) for h in rows["block_hash"][ids]] == list(req.block_hashes[:2])
    assert np.count_nonzero(rows["hash_num_tokens"]) == 2
    with pytest.raises(ValueError):
        rows["ref_cnt"][1] = 5
    del rows
    pool.free_blocks(blocks)
    pool.check_invariants()


def test_log_events_reach_the_global_log_only(make_pool):
    """Logged events are read back from the global log in order and are not queued for
    take_events(); a non-event is refused and nothing is logged."""
    pool = make_pool(4, enable_kv_cache_events=True)
    cursor, probe = pool.event_cursor(from_start=False), pool.event_cursor(from_start=False)
    stored = BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=[],
                         block_size=0, lora_id=None, medium="CPU", lora_name=None)
    removed = BlockRemoved(block_hashes=[1], medium="CPU")
    with pytest.raises(UsageError, match="str is not a KV-cache event"):
        pool.log_events([stored, "x"])
    assert pool.read_events(probe)[0] == []  # the refused call logged nothing
    assert pool.log_events([stored, removed]) == 0
    events, lost = pool.read_events(cursor)
    assert [e.event for e in events] == [stored, removed] and lost == 0
    assert pool.take_events() == []


def test_log_events_without_a_log_drops_them(make_pool):
    """A pool made without a global log reports every event as not logged."""
    pool = make_pool(4)
    assert pool.log_events([BlockRemoved(block_hashes=[1], medium="CPU")]) == 1
    assert pool.log_events([]) == 0
