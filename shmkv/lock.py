"""The pool lock: one POSIX semaphore per pool, with a holder record in the header.

Every mutation of the shared state happens under this lock, so the pool behaves as if the
calls of all processes ran one at a time in lock order. Within a process the lock is
re-entrant (a ``threading.RLock`` gates the process's threads in front of the semaphore), so
``with pool.lock():`` can wrap a whole scheduler step (lookups, touches, allocations) and
the public methods called inside it do not wait for themselves.

Holder record (header words ``holder``, ``holder_incarnation``, ``holder_since_ns``): the
holder writes it right after taking the semaphore and clears it right before posting it, so
a waiter that times out can name the holder, and (in the crash-safety layer) tell a dead
holder from a slow one. ``holder`` packs ``slot + 1`` in the low 32 bits and the pid in the
high 32, so one word says "free" (0) or who holds it.

``PoolLock`` is the pure-Python implementation; pools on the C kernel use
``shmkv._ckernel.CLock``, the same protocol (semaphore, holder record, re-entrancy per thread,
fence check) with its fast path in C. ``benchmarks/bench_locks.py`` compares them with an
OFD lock.

NOTE: a POSIX semaphore is not released when its holder dies; what happens then is the
crash-safety layer's business. Waits are always bounded (``timeout_s``).
"""

from __future__ import annotations

import threading
import time
from threading import get_ident

import posix_ipc

from shmkv import layout as L
from shmkv.errors import FencedError, LockTimeoutError

_H_HOLDER = L.H_HOLDER
_H_INCARNATION = L.H_HOLDER_INCARNATION
_H_SINCE = L.H_HOLDER_SINCE_NS
_monotonic_ns = time.monotonic_ns

DEFAULT_LOCK_TIMEOUT_S = 10.0


def lock_name(shm_name: str) -> str:
    """The semaphore's name: the segment's name with a ``.lock`` suffix."""
    return f"{shm_name}.lock"


def create_semaphore(shm_name: str) -> None:
    """Creates the pool's semaphore (value 1, mode 0600); it must not exist yet."""
    sem = posix_ipc.Semaphore(lock_name(shm_name), posix_ipc.O_CREX, mode=0o600, initial_value=1)
    sem.close()


def unlink_semaphore(shm_name: str) -> bool:
    try:
        posix_ipc.unlink_semaphore(lock_name(shm_name))
    except posix_ipc.ExistentialError:
        return False
    return True


def holder_word(slot: int, pid: int) -> int:
    """The ``holder`` header word of a process: ``slot + 1`` low, pid high (0 = free)."""
    return ((slot + 1) & 0xFFFF_FFFF) | (pid << 32)


def timeout_message(hdr64, timeout_s: float, describe_holder=None) -> str:
    """Why a wait for the pool lock timed out: who holds it, since when, alive or dead."""
    holder = decode_holder(hdr64[_H_HOLDER])
    if holder is None:
        who = "no holder is recorded (it may have died between taking and recording it)"
    else:
        slot, pid = holder
        since = hdr64[_H_SINCE]
        held_s = (_monotonic_ns() - since) / 1e9 if since else float("nan")
        who = f"held by slot {slot} (pid {pid}) for {held_s:.1f} s"
        if describe_holder is not None:
            who += f"; {describe_holder(slot, pid)}"
    return f"pool lock not acquired within {timeout_s} s: {who}"


def decode_holder(word: int) -> tuple[int, int] | None:
    """(slot, pid) from a ``holder`` word, or None when the lock is free."""
    if word == 0:
        return None
    return (word & 0xFFFF_FFFF) - 1, word >> 32


class PoolLock:
    """The pool's cross-process lock, re-entrant within this process.

    Args:
        shm_name: the pool's segment name (the semaphore is named after it).
        hdr64: flat int64 memoryview of the segment header.
        slot, pid, incarnation: this process's identity in the process table.
        timeout_s: the longest a caller waits before LockTimeoutError.
        describe_holder: callable(slot, pid) -> str, for the timeout message.
        enabled: False only in tests that prove the race detector works.
    """

    def __init__(self, shm_name: str, hdr64, slot: int, pid: int, incarnation: int,
                 timeout_s: float = DEFAULT_LOCK_TIMEOUT_S, describe_holder=None,
                 enabled: bool = True) -> None:
        try:
            self._sem = posix_ipc.Semaphore(lock_name(shm_name))
        except posix_ipc.ExistentialError:
            from shmkv.errors import SegmentError

            raise SegmentError(f"the pool's lock {lock_name(shm_name)} is missing") from None
        self._hdr64 = hdr64
        self._holder_word = holder_word(slot, pid)
        self._incarnation = incarnation
        self.timeout_s = timeout_s
        self._describe_holder = describe_holder
        self._enabled = enabled
        self._gate = threading.RLock()
        self._depth = 0
        self._owner_thread = 0
        # Statistics of this process's holds, for benchmarks and metrics.
        self.num_acquired = 0
        self.wait_ns_total = 0
        self.hold_ns_total = 0
        self._held_since = 0
        self.record: list[tuple[int, int]] | None = None  # (wait_ns, hold_ns) per hold
        self._fence_view = None
        self._fence_index = 0

    def set_identity(self, slot: int, incarnation: int, fence_view, fence_index: int) -> None:
        """Records this process's slot; from now on every acquire checks that the slot
        still carries ``incarnation`` (``fence_view[fence_index]``), or raises FencedError."""
        self._holder_word = ((slot + 1) & 0xFFFF_FFFF) | (self._holder_word >> 32 << 32)
        self._incarnation = incarnation
        self._fence_view = fence_view
        self._fence_index = fence_index

    def acquire(self) -> None:
        """Takes the lock (or one more level of it).

        Raises:
            LockTimeoutError: not acquired within ``timeout_s``; names the holder.
        """
        if self._depth and self._owner_thread == get_ident():
            self._depth += 1  # nested in this thread's hold: nothing else to do
            return
        gate = self._gate
        if not gate.acquire(False) and not gate.acquire(timeout=self.timeout_s):
            raise LockTimeoutError(
                f"pool lock: another thread of this process held it for over {self.timeout_s} s"
            )
        start = 0
        if self._enabled:
            try:
                self._sem.acquire(0)  # the uncontended case: no clock, no timed wait
            except posix_ipc.BusyError:
                start = _monotonic_ns()
                try:
                    self._sem.acquire(self.timeout_s)
                except posix_ipc.BusyError:
                    gate.release()
                    raise LockTimeoutError(self._timeout_message()) from None
        now = _monotonic_ns()
        fence = self._fence_view
        if fence is not None and fence[self._fence_index] != self._incarnation:
            if self._enabled:
                self._sem.release()
            self._gate.release()
            raise FencedError(
                "this process's slot in the pool was reclaimed (it was taken for dead); "
                "it must attach again"
            )
        hdr = self._hdr64
        hdr[_H_HOLDER] = self._holder_word
        hdr[_H_INCARNATION] = self._incarnation
        hdr[_H_SINCE] = now
        self._depth = 1
        self._owner_thread = get_ident()
        self._held_since = now
        waited = now - start if start else 0
        self.num_acquired += 1
        self.wait_ns_total += waited
        if self.record is not None:
            self.record.append((waited, 0))

    def release(self) -> None:
        """Gives back one level of the lock; the last level clears the holder record and
        posts the semaphore."""
        if self._depth > 1:
            self._depth -= 1  # still held by this thread's outer level
            return
        self._depth = 0
        self._owner_thread = 0
        hdr = self._hdr64
        hdr[_H_HOLDER] = 0
        hdr[_H_INCARNATION] = 0
        hdr[_H_SINCE] = 0
        if self._enabled:
            self._sem.release()
        held = _monotonic_ns() - self._held_since
        self.hold_ns_total += held
        if self.record is not None:
            self.record[-1] = (self.record[-1][0], held)
        self._gate.release()

    @property
    def held(self) -> bool:
        """Whether this process holds the lock (in the calling thread or another)."""
        return self._depth > 0

    def __enter__(self) -> PoolLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _timeout_message(self) -> str:
        return timeout_message(self._hdr64, self.timeout_s, self._describe_holder)

    def close(self) -> None:
        self._sem.close()
