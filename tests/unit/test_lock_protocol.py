"""The C lock (``_ckernel.CLock``) against the reference protocol, the Python ``PoolLock``
(``shmkv/pool/lock.py``): the same observations, made on each (issue 15, item 4)."""

from __future__ import annotations

import threading
import time

import pytest

from shmkv import BlockPool, LockTimeoutError
from shmkv.pool import layout as L
from shmkv.pool.lock import SPIN_S


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


def test_the_spin_setting_is_the_same_on_both_locks(make_pool):
    """``spin_s`` (how long a waiter polls the semaphore before it sleeps on it): the pool's
    default on both locks; a value outside [0, 0.01] s is refused with the same message and
    changes nothing."""
    pool = make_pool(8)
    lock = pool.lock()
    assert lock.spin_s == SPIN_S > 0
    for bad in (-1e-6, 0.011, float("nan")):
        with pytest.raises(ValueError, match=r"^spin_s must be between 0 and 0\.01 s$"):
            lock.spin_s = bad
        assert lock.spin_s == SPIN_S
    lock.spin_s = 0
    assert lock.spin_s == 0
    pool.free_blocks(pool.get_new_blocks(2))
    pool.check_invariants()


@pytest.mark.parametrize("spin_s", [0.0, 0.01])
def test_a_second_attachment_waits_for_the_holder_with_or_without_spinning(make_pool, spin_s):
    """A waiter of another attachment (its own slot, its own lock) that spins up to 10 ms
    or not at all before it sleeps: it takes the lock once the holder lets go, stays
    ACQUIRING (never HOLDING) while it waits, and leaves the pool sound."""
    pool = make_pool(8, lock_timeout_s=5.0)
    other = BlockPool.attach(pool.pool_name, kernel=pool.kernel, label="waiter")
    try:
        other.lock().spin_s = spin_s
        got, seen = [], []
        with pool.lock():
            b = threading.Thread(target=lambda: got.append(other.get_new_blocks(1)))
            b.start()
            deadline = time.monotonic() + 10  # until B is seen waiting, then 50 looks more
            while L.PHASE_ACQUIRING not in seen[:-50] and time.monotonic() < deadline:
                seen.append(int(other._procs[other.slot]["lock_phase"]))
                time.sleep(0.001)
            assert not got
        b.join(30)
        assert not b.is_alive() and len(got) == 1
        assert L.PHASE_HOLDING not in seen and L.PHASE_ACQUIRING in seen
        assert int(other._procs[other.slot]["lock_phase"]) == L.PHASE_IDLE
        other.free_blocks(got[0])
        pool.check_invariants()
    finally:
        other.close()
