"""Liveness by OFD locks: a slot's byte is locked exactly while its process lives."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal

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
