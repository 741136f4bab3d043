"""The C lock (``_ckernel.CLock``) against the reference protocol, the Python ``PoolLock``
(``shmkv/pool/lock.py``): the same observations, made on each (issue 15, item 4)."""

from __future__ import annotations

import threading
import time

import pytest

from shmkv import LockTimeoutError
from shmkv.pool import layout as L


def _phase(pool) -> int:
    return int(pool._procs[pool.slot]["lock_phase"])


def test_a_waiting_thread_never_overwrites_the_holders_phase(make_pool):
    """Thread A holds the lock; thread B of the same process waits for it. The process's
    lock_phase (what takeover reads) stays HOLDING the whole time, and B gets the lock once
    A lets go. The C lock's waiters used to store ACQUIRING over A's HOLDING (and IDLE when
    they gave up)."""
    pool = make_pool(8, lock_timeout_s=5.0)
    seen, got = [], []
    with pool.lock():
        assert _phase(pool) == L.PHASE_HOLDING
        b = threading.Thread(target=lambda: got.append(pool.get_new_blocks(1)))
        b.start()
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            seen.append(_phase(pool))
            time.sleep(0.005)
        assert not got  # B is still waiting
    b.join(30)
    assert not b.is_alive() and len(got) == 1
    assert set(seen) == {L.PHASE_HOLDING}, f"phases seen while B waited: {sorted(set(seen))}"
    assert _phase(pool) == L.PHASE_IDLE
    pool.free_blocks(got[0])
    pool.check_invariants()


def test_a_thread_that_gives_up_waiting_leaves_the_holder_alone(make_pool):
    """B gives up (LockTimeoutError, naming another thread of this process, on both
    locks alike); the holder's phase and holder record are untouched."""
    pool = make_pool(8, lock_timeout_s=0.3)
    errors = []

    def waiter():
        try:
            pool.get_new_blocks(1)
        except LockTimeoutError as exc:
            errors.append(str(exc))

    with pool.lock():
        word = int(pool._hdr64[L.H_HOLDER])
        b = threading.Thread(target=waiter)
        b.start()
        b.join(30)
        assert not b.is_alive()
        assert _phase(pool) == L.PHASE_HOLDING
        assert int(pool._hdr64[L.H_HOLDER]) == word
    assert errors == ["pool lock: another thread of this process held it for over 0.3 s"]
    assert _phase(pool) == L.PHASE_IDLE
    pool.check_invariants()
