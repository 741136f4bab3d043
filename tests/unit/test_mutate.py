"""``lock.mutate``: the one savepoint mechanism of every mutating BlockPool call, on both
locks (``PoolLock``, the reference, and ``CLock.mutate``, its C twin): the call's writes and
queued events are rolled back when it raises, earlier work of the hold stands, a moved
savepoint keeps what came before it, and the lock is given back either way."""

from __future__ import annotations

import pytest

from shmkv import AllBlocksCleared, BlockPool
from tests.helpers import segment_image


@pytest.fixture
def pool(pool_name, kernel):
    with BlockPool.create(pool_name, 8, kernel=kernel, enable_kv_cache_events=True) as p:
        yield p


class Boom(Exception):
    pass


def test_returns_what_the_call_returns_and_releases(pool):
    lock = pool.lock()
    assert lock.mutate("touch", lambda a, b: (a, b), 1, 2) == (1, 2)
    assert not lock.held


def test_a_failing_call_changes_nothing(pool):
    lock = pool.lock()
    with lock:
        kept = pool.get_new_blocks(1)  # earlier in the same hold: stands
        image = segment_image(pool)

        def half_done():
            pool.get_new_blocks(2)
            pool._log_events([AllBlocksCleared()])
            raise Boom

        with pytest.raises(Boom):
            lock.mutate("allocate", half_done)
        assert segment_image(pool) == image
        assert pool.take_events() == []
        assert lock.held  # the outer hold is still ours
    assert not lock.held
    assert kept[0].ref_cnt == 1


def test_a_moved_savepoint_keeps_what_came_before(pool):
    lock = pool.lock()

    def first_stands():
        pool.get_new_blocks(1)
        lock.savepoint()
        pool.get_new_blocks(1)
        raise Boom

    free = pool.get_num_free_blocks()
    with pytest.raises(Boom):
        lock.mutate("allocate", first_stands)
    assert pool.get_num_free_blocks() == free - 1
    assert not lock.held


def test_a_failing_undo_is_raised_with_the_call_s_error_as_context(pool, monkeypatch):
    lock = pool.lock()
    calls = []

    def bad_undo(mark, num_events):
        calls.append((mark, num_events))
        raise KeyError("undo")

    lock.set_savepoint(pool._event_queue, bad_undo)
    try:
        with pytest.raises(KeyError) as info:
            lock.mutate("touch", lambda: (_ for _ in ()).throw(Boom()))
        assert isinstance(info.value.__context__, Boom)
        assert calls == [(0, 0)]
        assert not lock.held
    finally:
        lock.set_savepoint(pool._event_queue, pool._undo_since)
