"""The multi-process machinery seen from one process: slots, ledger, fencing, reaping,
the lock, the global event log, and their invariants (INV-LEDGER, INV-PROC, INV-LOG)."""

from __future__ import annotations

import os
import time

import pytest

from shmkv import BlockPool, InvariantViolation, OutOfBlocksError
from shmkv.errors import FencedError, LockTimeoutError, PoolFullError, SegmentError
from shmkv.events import BlockRemoved, BlockStored
from shmkv.pool import layout as L
from tests.helpers import make_request, segment_image


def _attach(pool, **kw):
    return BlockPool.attach(pool.pool_name, kernel=pool.kernel, **kw)


def test_each_attach_takes_a_slot_and_close_gives_it_back(make_pool):
    """Attachers get distinct slots with their labels; close frees the slot (keeping its
    label for readers such as the publisher); a never-labelled slot is taken before a
    released one."""
    pool = make_pool(16)
    a = _attach(pool, label="sched-a")
    b = _attach(pool, label="sched-b")
    try:
        table = {p["slot"]: (p["label"], p["alive"]) for p in pool.processes()}
        assert table == {0: ("creator", True), 1: ("sched-a", True), 2: ("sched-b", True)}
    finally:
        a.close()
    assert [p["slot"] for p in pool.processes()] == [0, 2]
    assert pool.process_table.labels() == {0: "creator", 1: "sched-a", 2: "sched-b"}
    b.close()
    c = _attach(pool)
    assert c.slot == 3
    c.close()
    pool.check_invariants()


def test_close_releases_exactly_the_closers_references(make_pool):
    """A block held by two processes stays held when one of them closes."""
    pool = make_pool(16)
    req = make_request(32)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(req, blocks, 0, 2, 16, 0)
    other = _attach(pool)
    hits = [other.get_cached_block(h, [0])[0] for h in req.block_hashes]
    other.touch(hits)
    other.get_new_blocks(4)
    assert [b.ref_cnt for b in blocks] == [2, 2, 1]
    other.close()
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.get_num_free_blocks() == 12
    pool.check_invariants()


def test_freeing_another_processes_reference_is_refused(make_pool):
    """A process may only free the references it holds (the ledger says which)."""
    pool = make_pool(16)
    blocks = pool.get_new_blocks(2)
    other = _attach(pool)
    try:
        before = segment_image(pool)
        with pytest.raises(ValueError, match="this process holds 0 reference"):
            other.free_blocks([other.blocks[blocks[0].block_id]])
        assert segment_image(pool) == before
    finally:
        other.close()


def test_pool_full_after_reaping_names_the_live_pids(make_pool):
    """When every slot is held by a live process, attach says so."""
    pool = make_pool(8, max_processes=2)
    other = _attach(pool)
    try:
        with pytest.raises(PoolFullError, match=r"all 2 process slots are held .*pids"):
            _attach(pool)
    finally:
        other.close()


def test_reap_dead_releases_a_dead_slots_references(make_pool):
    """A slot whose process is gone (its OFD byte is free) is reaped: refs and slot."""
    pool = make_pool(16)
    other = _attach(pool)
    held = other.get_new_blocks(5)
    ids = [b.block_id for b in held]
    # Simulate the death: drop its liveness lock without closing (what the kernel does).
    other._alive.close()
    assert pool.processes()[1]["alive"] is False
    assert pool.reap_dead() == 1
    assert pool.get_num_free_blocks() == 15
    assert pool.get_free_block_ids()[:5] == sorted(ids, reverse=True)
    assert int(pool._hdr64[L.H_NUM_REAPED]) == 1
    pool.check_invariants()
    # The reaped process is fenced: its next call fails and writes nothing.
    before = segment_image(pool)
    with pytest.raises(FencedError, match="reclaimed"):
        other.get_new_blocks(1)
    assert segment_image(pool) == before
    other.close()  # closing a fenced pool gives nothing back and does not raise
    pool.check_invariants()


def test_allocation_shortfall_reaps_first(make_pool):
    """get_new_blocks reaps dead processes before it gives up for lack of blocks."""
    pool = make_pool(8)
    other = _attach(pool)
    other.get_new_blocks(7)
    other._alive.close()
    assert len(pool.get_new_blocks(7)) == 7
    other.close()


def test_lock_timeout_names_the_holder(make_pool):
    """A wait past the timeout raises LockTimeoutError naming the holding slot and pid."""
    pool = make_pool(8)
    other = _attach(pool, lock_timeout_s=0.2)
    try:
        with pool.lock():
            start = time.monotonic()
            with pytest.raises(LockTimeoutError, match=rf"held by slot 0 \(pid {os.getpid()}\)"):
                other.get_new_blocks(1)
            assert 0.15 < time.monotonic() - start < 5
        assert len(other.get_new_blocks(1)) == 1
    finally:
        other.close()


def test_lock_is_reentrant_and_holder_record_is_cleared(make_pool):
    """pool.lock() nests with the public methods; the holder record names us inside and
    is empty outside."""
    pool = make_pool(8)
    assert pool.holder() is None
    with pool.lock():
        with pool.lock():
            assert pool.holder() == (pool.slot, os.getpid())
            pool.get_new_blocks(1)
        assert pool.holder() == (pool.slot, os.getpid())
    assert pool.holder() is None


def test_global_event_log_orders_every_processes_events(make_pool, monkeypatch):
    """Events of two processes land in one log with consecutive sequence numbers and the
    producing slot; take_events() stays per process."""
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    pool = make_pool(16, enable_kv_cache_events=True)
    other = _attach(pool)
    try:
        req = make_request(32)
        b0 = pool.get_new_blocks(2)
        pool.cache_full_blocks(req, b0, 0, 2, 16, 0)
        req2 = make_request(16, first_token=900)
        b1 = other.get_new_blocks(1)
        other.cache_full_blocks(req2, b1, 0, 1, 16, 0)
        pool.free_blocks(b0)
        other.get_new_blocks(14)  # evicts pool's two cached blocks
        cursor = other.event_cursor()
        logged, lost = other.read_events(cursor)
        assert lost == 0
        assert [e.seq for e in logged] == [0, 1, 2, 3]
        assert [e.slot for e in logged] == [0, 1, 1, 1]
        assert [type(e.event) for e in logged] == [BlockStored, BlockStored, BlockRemoved,
                                                  BlockRemoved]
        assert logged[0].event.block_hashes == req.block_hashes
        assert len(pool.take_events()) == 1 and len(other.take_events()) == 3
        assert other.read_events(cursor) == ([], 0)
        pool.check_invariants()
    finally:
        other.close()


def test_event_log_ring_wraps_and_reports_lost_events(make_pool, monkeypatch):
    """A small ring overwrites old records; a slow reader learns how many it lost and
    continues with consecutive sequence numbers; INV-LOG holds throughout."""
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")
    pool = make_pool(64, enable_kv_cache_events=True, event_log_bytes=4096)
    slow = pool.event_cursor()
    seen = []
    fast = pool.event_cursor()
    for i in range(60):
        req = make_request(16, first_token=1000 * i)
        blocks = pool.get_new_blocks(1)
        pool.cache_full_blocks(req, blocks, 0, 1, 16, 0)
        pool.free_blocks(blocks)
        got, lost = pool.read_events(fast)
        assert lost == 0
        seen += [e.seq for e in got]
        pool.check_invariants()
    total = pool._log.next_seq
    assert seen == list(range(total))
    events, lost = pool.read_events(slow)
    assert lost > 0 and lost + len(events) == total
    assert [e.seq for e in events] == list(range(lost, total))


def test_segment_owned_by_another_user_is_refused(make_pool):
    """Attach checks the segment's owner itself (root ignores mode bits)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to chown the segment to another user")
    pool = make_pool(8)
    path = f"/dev/shm{pool._segment.shm_name}"
    os.chown(path, 12345, -1)
    try:
        with pytest.raises(SegmentError, match="owned by uid 12345"):
            _attach(pool)
    finally:
        os.chown(path, os.geteuid(), -1)


def test_ledger_corruption_is_inv_ledger(make_pool):
    """A ledger entry that disagrees with ref_cnt is INV-LEDGER."""
    pool = make_pool(8)
    blocks = pool.get_new_blocks(2)
    pool._ledger[pool.slot, blocks[1].block_id] = 2
    with pytest.raises(InvariantViolation) as exc:
        pool.check_invariants()
    assert any(v.startswith("INV-LEDGER") and "block 2" in v for v in exc.value.violations)


def test_free_slot_with_references_is_inv_ledger_and_inv_proc(make_pool):
    """A free slot that still names a pid or holds references breaks INV-PROC/INV-LEDGER."""
    pool = make_pool(8)
    pool._procs[3]["pid"] = 777
    pool._ledger[3, 1] = 1
    with pytest.raises(InvariantViolation) as exc:
        pool.check_invariants()
    ids = {v.split(":")[0] for v in exc.value.violations}
    assert {"INV-PROC", "INV-LEDGER"} <= ids


def test_torn_event_log_is_inv_log(make_pool):
    """Event-log pointers out of order, or a damaged record, are INV-LOG."""
    pool = make_pool(8, enable_kv_cache_events=True)
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(make_request(16), blocks, 0, 1, 16, 0)
    pool._hdr64[L.H_NEXT_EVENT_SEQ] += 1
    with pytest.raises(InvariantViolation, match="INV-LOG"):
        pool.check_invariants()


def test_lock_serialises_threads_of_one_process(make_pool):
    """Two threads of one process never hold the pool lock at once; nesting stays
    per thread."""
    import threading

    pool = make_pool(8)
    inside = []
    overlap = []

    def worker():
        for _ in range(300):
            with pool.lock():
                inside.append(1)
                if len(inside) > 1:
                    overlap.append(1)
                with pool.lock():
                    pool.get_num_free_blocks()
                inside.pop()

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert overlap == [] and pool.holder() is None


def test_a_shortfall_reaps_the_dead_and_the_reap_stands_even_if_it_is_not_enough(make_pool):
    """An allocation that finds too few free blocks reaps the dead first; if that is still
    not enough it raises OutOfBlocksError, but the reap is not undone with it."""
    pool = make_pool(16)
    other = _attach(pool)
    other.get_new_blocks(4)
    other._alive.close()  # dies without close()
    with pytest.raises(OutOfBlocksError):
        pool.get_new_blocks(16)
    assert pool.get_num_free_blocks() == 15  # the dead process's four came back
    assert int(pool._hdr64[L.H_NUM_REAPED]) == 1
    assert [p["slot"] for p in pool.processes()] == [pool.slot]
    pool.check_invariants()
    other.close()


def test_a_released_slot_is_reused_once_no_fresh_one_is_left(pool_name, kernel):
    """With every free slot keeping a label, attach takes the lowest one and writes its
    own label there."""
    pool = BlockPool.create(pool_name, 8, max_processes=3, kernel=kernel)
    try:
        for label in ("first", "second"):
            _attach(pool, label=label).close()
        assert pool.process_table.labels() == {0: "creator", 1: "first", 2: "second"}
        third = _attach(pool, label="third")
        assert third.slot == 1
        assert pool.process_table.labels() == {0: "creator", 1: "third", 2: "second"}
        third.close()
        pool.check_invariants()
    finally:
        pool.close()
