"""Liveness by OFD locks: a slot's byte is locked exactly while its process lives."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal

import numpy as np
import pytest

from shmkv.pool.liveness import AliveLocks, process_start_ticks


def _claim_and_wait(path: str, slot: int, ready, release) -> None:
    locks = AliveLocks(path, create=False)
    assert locks.claim(slot)
    ready.set()
    release.wait(30)


@pytest.fixture
def lock_path(tmp_path):
    path = str(tmp_path / "pool.alive")
    AliveLocks(path, create=True).close()
    return path


def _start_holder(path: str, slot: int):
    ctx = mp.get_context("spawn")
    ready, release = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_claim_and_wait, args=(path, slot, ready, release))
    child.start()
    assert ready.wait(30), "child did not claim its slot"
    return child, release


def test_slot_is_alive_while_holder_lives_and_free_after_sigkill(lock_path):
    """A SIGKILLed holder's byte is free at once; the slot can be claimed again."""
    child, _ = _start_holder(lock_path, 3)
    observer = AliveLocks(lock_path, create=False)
    try:
        assert observer.is_alive(3)
        assert not observer.is_alive(2)
        assert not observer.claim(3)  # a live process holds it
        os.kill(child.pid, signal.SIGKILL)
        child.join(30)
        assert child.exitcode == -signal.SIGKILL
        assert not observer.is_alive(3)
        assert observer.claim(3)
        assert observer.is_alive(3)
    finally:
        observer.close()
        if child.is_alive():
            child.kill()
            child.join(30)


def test_clean_exit_releases_and_own_slot_counts_as_alive(lock_path):
    """A holder that exits normally frees its byte; this process's own slot reads alive."""
    child, release = _start_holder(lock_path, 0)
    observer = AliveLocks(lock_path, create=False)
    try:
        assert observer.is_alive(0)
        release.set()
        child.join(30)
        assert child.exitcode == 0
        assert not observer.is_alive(0)
        assert observer.claim(5) and observer.is_alive(5)
        observer.release(5)
        assert not observer.is_alive(5)
    finally:
        observer.close()


def test_process_start_ticks_identifies_this_process():
    """The recorded start time is this process's, and 0 for a pid that does not exist."""
    assert process_start_ticks(os.getpid()) > 0
    assert process_start_ticks(2**22 + 12345) == 0


def _row(pid: int, start_ticks: int, pid_ns: int, state: int = 1):
    from shmkv.pool import layout as L

    row = np.zeros(1, L.PROC_DTYPE)[0]
    row["state"], row["pid"], row["start_ticks"], row["pid_ns"] = state, pid, start_ticks, pid_ns
    return row


def test_the_recorded_process_is_gone_only_where_this_process_can_tell():
    """A row's pid and start time are checked only in this pid namespace and in an active
    row: a dead pid or a start-time mismatch there reads gone; a row of another namespace
    (its pid means another process here) or one being filled in is left to the lock."""
    from shmkv.pool.liveness import own_pid_namespace, recorded_process_gone

    ns = own_pid_namespace()
    assert ns != 0
    me, ticks = os.getpid(), process_start_ticks(os.getpid())
    ctx = mp.get_context("spawn")
    dead = ctx.Process(target=os.getpid)
    dead.start()
    dead.join(30)
    assert dead.exitcode == 0
    assert not recorded_process_gone(_row(me, ticks, ns))
    assert recorded_process_gone(_row(me, ticks + 1, ns))  # a reused pid
    assert recorded_process_gone(_row(dead.pid, ticks, ns))  # no such process (reaped)
    assert not recorded_process_gone(_row(dead.pid, ticks, ns + 1))  # another namespace
    assert not recorded_process_gone(_row(dead.pid, ticks, 0))  # namespace unknown
    assert not recorded_process_gone(_row(dead.pid, ticks, ns, state=0))  # not active yet
    assert not recorded_process_gone(_row(me, 0, ns))  # no start time recorded


def _mark_and_wait(path: str, ready, release, result) -> None:
    locks = AliveLocks(path, create=False)
    mark = locks.claim_mark()
    locks.hold_mark(mark)
    result.put(mark)
    ready.set()
    release.wait(30)


def test_attach_marks_are_exclusive_and_die_with_their_process(lock_path):
    """An attach mark is one process's at a time; its mark and hold bytes read alive while
    it lives (from another process, whatever its pid namespace: only the kernel's lock is
    asked) and free at once after SIGKILL."""
    from shmkv.pool.liveness import MARK_FIRST_BYTE, is_mark

    ctx = mp.get_context("spawn")
    ready, release, result = ctx.Event(), ctx.Event(), ctx.Queue()
    child = ctx.Process(target=_mark_and_wait, args=(lock_path, ready, release, result))
    child.start()
    observer = AliveLocks(lock_path, create=False)
    try:
        assert ready.wait(30)
        theirs = result.get(timeout=30)
        assert theirs == MARK_FIRST_BYTE and is_mark(theirs) and not is_mark(3)
        assert observer.mark_alive(theirs) and observer.another_in_attach_hold()
        mine = observer.claim_mark()
        assert mine == theirs + 1  # not the same byte
        assert observer.mark_alive(mine)
        os.kill(child.pid, signal.SIGKILL)
        child.join(30)
        assert child.exitcode == -signal.SIGKILL
        assert not observer.mark_alive(theirs) and not observer.another_in_attach_hold()
        observer.hold_mark(mine)
        assert not observer.another_in_attach_hold()  # its own hold byte is not another's
        observer.release_mark(mine)
        assert observer.held_mark is None and observer.claim_mark() == theirs
    finally:
        observer.close()
        if child.is_alive():
            child.kill()
            child.join(10)
