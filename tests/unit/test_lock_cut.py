"""An exception that lands inside the Python lock's protocol (KeyboardInterrupt, a signal
handler's SystemExit) never leaves the semaphore taken with neither a release nor a mark
that takeover reads (issue 15, item 2).

The exception is raised at the exact instruction by a profile hook (``sys.setprofile``): at
the return of the semaphore call that just took the unit, or of the RELEASING store, which
is where the interpreter's eval breaker would raise a pending Ctrl-C. Real processes check
that the rest of the pool goes on."""

from __future__ import annotations

import multiprocessing as mp
import sys
import threading

import posix_ipc
import pytest

from shmkv import BlockPool, LockTimeoutError
from shmkv.pool import layout as L
from tests.conftest import unique_pool_name

JOIN_S = 60


def _cut_after_semaphore_call(frame, event, arg):
    if (event == "c_return" and getattr(arg, "__name__", "") == "acquire"
            and isinstance(getattr(arg, "__self__", None), posix_ipc.Semaphore)):
        sys.setprofile(None)
        raise KeyboardInterrupt("cut right after the semaphore was taken")


def _cut_after_releasing_store(frame, event, arg):
    if (event == "return" and frame.f_code.co_name == "_set_phase"
            and frame.f_locals.get("phase") == L.PHASE_RELEASING):
        sys.setprofile(None)
        raise KeyboardInterrupt("cut right after the RELEASING store")


def _allocate_one(name: str) -> None:
    """Child: attaches (which takes the lock) and allocates a block, within 15 s."""
    try:
        pool = BlockPool.attach(name, lock_timeout_s=15.0, stuck_after_s=1.0)
    except LockTimeoutError:
        raise SystemExit(3) from None
    blocks = pool.get_new_blocks(1)
    pool.free_blocks(blocks)
    pool.check_invariants()
    pool.close()


def _run_child(name: str) -> int:
    child = mp.get_context("spawn").Process(target=_allocate_one, args=(name,))
    child.start()
    child.join(JOIN_S)
    if child.is_alive():
        child.kill()
        child.join(10)
    return child.exitcode


def test_interrupt_right_after_the_semaphore_is_taken_leaves_a_mark(pool_name):
    """Ctrl-C as the semaphore call returns: the unit is this process's but no HOLDING or
    holder was stored. The lock used to put the phase back to IDLE: semaphore taken, no
    holder, no mark, and every process (this one too) timed out for good. Now the row says
    ABANDONED and another process takes the lock over; so does this one."""
    pool = BlockPool.create(pool_name, 8, kernel="python", lock_timeout_s=15.0,
                            stuck_after_s=1.0)
    try:
        sys.setprofile(_cut_after_semaphore_call)
        try:
            with pytest.raises(KeyboardInterrupt):
                pool.get_new_blocks(1)
        finally:
            sys.setprofile(None)
        assert not pool.lock().held
        row = pool._procs[pool.slot]
        sem = posix_ipc.Semaphore(f"{L.segment_name(pool_name)}.lock")
        value = sem.value
        sem.close()
        assert value == 1 or int(row["lock_phase"]) == L.PHASE_ABANDONED
        assert _run_child(pool_name) == 0
        blocks = pool.get_new_blocks(2)  # this process goes on too
        pool.free_blocks(blocks)
        assert int(pool._procs[pool.slot]["lock_phase"]) == L.PHASE_IDLE
        pool.check_invariants()
    finally:
        pool.close()


def test_interrupt_in_release_still_posts_and_frees_the_gate(pool_name):
    """Ctrl-C right after the RELEASING store: the release used to stop there, with the
    journal uncommitted, the semaphore never posted and the thread gate held, so every
    other process and thread timed out. Now the rest of the release runs."""
    pool = BlockPool.create(pool_name, 8, kernel="python", lock_timeout_s=3.0,
                            stuck_after_s=1.0)
    try:
        sys.setprofile(_cut_after_releasing_store)
        try:
            with pytest.raises(KeyboardInterrupt):
                pool.get_new_blocks(1)
        finally:
            sys.setprofile(None)
        assert int(pool._hdr64[L.H_JOURNAL_LEN]) == 0
        assert int(pool._procs[pool.slot]["lock_phase"]) == L.PHASE_IDLE
        got = []
        other = threading.Thread(target=lambda: got.append(pool.get_new_blocks(1)))
        other.start()
        other.join(JOIN_S)
        assert not other.is_alive() and len(got) == 1, "another thread could not take the lock"
        assert _run_child(pool_name) == 0
        pool.check_invariants()
    finally:
        pool.close()


del unique_pool_name
