"""Each pool has a random identity, drawn into its header at creation, and everything
derived from a pool is keyed on it (issue 15, item 7): a pool re-created under the same
name by a process with the same pid (containers reuse pids) is another pool."""

from __future__ import annotations

import pytest

from shmkv import BlockPool
from shmkv.pool.event_log import EventCursor

pytest.importorskip("zmq")  # shmkv.publisher imports it

from shmkv.publisher import _PublisherState, pool_identity, unlink_state  # noqa: E402


def _recreate(name: str, pool: BlockPool) -> BlockPool:
    pool.close()
    BlockPool.unlink(name)
    return BlockPool.create(name, 8)  # same name, same hash function, same creator pid


def test_a_recreated_pool_has_another_identity(pool_name):
    pool = BlockPool.create(pool_name, 8)
    first = pool_identity(pool)
    pool = _recreate(pool_name, pool)
    try:
        assert pool_identity(pool) != first
        assert len(bytes(pool.header_snapshot()["pool_id"]).strip(b"\0")) > 0
        assert pool_identity(BlockPool.attach(pool_name)) == pool_identity(pool)
    finally:
        pool.close()


def test_a_recreated_pool_does_not_resume_the_old_publisher_position(pool_name):
    """The old pool's publisher saved a position; the new pool of the same name and creator
    pid must not take it for its own (its log starts again at 0). It used to: the position
    was keyed on the creator pid and NONE_HASH."""
    pool = BlockPool.create(pool_name, 8)
    try:
        state = _PublisherState(pool)
        state.set_base(EventCursor(40, 4096))
        state.sent(41)
        assert state.saved() is not None
        state.close()
        pool = _recreate(pool_name, pool)
        state = _PublisherState(pool)
        try:
            assert state.saved() is None
        finally:
            state.close()
    finally:
        pool.close()
        unlink_state(pool_name)
