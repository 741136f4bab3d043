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

Protocol of one hold, every store in this order (the fault points of ``shmkv/pool/fault.py``):

1. acquire: fence check (a reclaimed slot raises ``FencedError`` and writes nothing); own
   ``lock_phase = ACQUIRING``; the semaphore, waited for in slices of ``WAIT_SLICE_S``, with
   ``on_stall()`` after each (the take-over of a dead holder, ``shmkv/pool/takeover.py``);
   ``lock_phase = HOLDING`` at once; the holder record; ``lock_seq += 1``; then, if the lock
   was taken over or the undo journal is not empty, ``on_dirty(took_over)``: the repair,
   before the caller's critical section.
2. release: ``lock_phase = RELEASING``; ``journal_len = 0`` (the commit); the holder record
   cleared; the semaphore posted; ``lock_phase = IDLE``.
3. an exception (KeyboardInterrupt, a signal handler's SystemExit) that cuts an acquire
   short never leaves the semaphore taken without a mark: a unit surely taken is posted
   back; one perhaps taken (the exception came as the semaphore call returned) leaves
   ``lock_phase = ABANDONED``, which takeover reads like a dead waiter's ACQUIRING (and the
   process keeps that mark through its next waits until it holds the lock again). A cut
   release still commits, posts and marks IDLE (nested ``finally``).

``PoolLock`` is the pure-Python implementation; pools on the C kernel use
``shmkv.pool._ckernel.CLock``, the same protocol with its fast path in C.
``benchmarks/bench_locks.py`` compares them with an OFD lock.

NOTE: a POSIX semaphore is not released when its holder dies; ``lock_phase``, the holder
record and ``lock_seq`` are what let a waiter find out that it did. Waits are always
bounded (``timeout_s``).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
import time
from threading import get_ident

import posix_ipc

from shmkv.errors import FencedError, InvariantViolation, LockTimeoutError
from shmkv.pool import fault as _fault
from shmkv.pool import layout as L

_H_HOLDER = L.H_HOLDER
_H_INCARNATION = L.H_HOLDER_INCARNATION
_H_SINCE = L.H_HOLDER_SINCE_NS
_H_LOCK_SEQ = L.H_LOCK_SEQ
_H_JOURNAL_LEN = L.H_JOURNAL_LEN
_PHASE_IDLE = L.PHASE_IDLE
_PHASE_ACQUIRING = L.PHASE_ACQUIRING
_PHASE_HOLDING = L.PHASE_HOLDING
_PHASE_ABANDONED = L.PHASE_ABANDONED
_monotonic_ns = time.monotonic_ns
_FENCED = (
    "this process's slot in the pool was reclaimed (it was taken for dead); it must attach "
    "again"
)

DEFAULT_LOCK_TIMEOUT_S = 10.0
# What an acquire has so far (PoolLock._stage), for an exception that cuts it short.
_STAGE_NONE = 0  # not the unit
_STAGE_IN_WAIT = 1  # in (or just out of) the semaphore call: perhaps the unit
_STAGE_IN_STALL = 2  # in on_stall: the unit iff the holder record is this process's
_STAGE_HELD = 3  # surely the unit (HOLDING is stored)
# Waits are cut in slices this long; after each, the waiter checks for a dead holder.
WAIT_SLICE_S = 0.02
# A waiter first polls the semaphore this long before it sleeps on it (``PoolLock._spin``).
SPIN_S = 20e-6


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _sem_clockwait = _libc.sem_clockwait  # glibc >= 2.30
    _sem_open, _sem_close = _libc.sem_open, _libc.sem_close
    _sem_open.restype = ctypes.c_void_p
    _sem_open.argtypes = [ctypes.c_char_p, ctypes.c_int]
    _sem_close.argtypes = [ctypes.c_void_p]
    _sem_clockwait.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(_Timespec)]
except (OSError, AttributeError):
    _sem_clockwait = None


class MonotonicWait:
    """Timed waits on a named POSIX semaphore with the deadline on CLOCK_MONOTONIC.

    posix_ipc's timed acquire (like ``sem_timedwait``) takes a wall-clock deadline: a step of
    the wall clock back during the wait stretches it by the step (an NTP correction, a VM
    resumed, an operator's ``date``). ``sem_clockwait`` (glibc >= 2.30) waits on the
    monotonic clock, which never steps; the C kernel's lock uses it too. Without it (another
    libc), a wait polls the semaphore every millisecond, sleeping on the monotonic clock.
    """

    POLL_S = 0.001

    def __init__(self, name: str, sem: posix_ipc.Semaphore) -> None:
        self._poll_sem = sem
        self._handle = None
        if _sem_clockwait is not None:
            handle = _sem_open(name.encode(), 0)
            if handle:  # SEM_FAILED is NULL in glibc
                self._handle = handle

    def wait(self, wait_s: float) -> bool:
        """Takes the semaphore within ``wait_s`` (monotonic) seconds: True, else False (the
        time ran out, or a signal came; its Python handler runs when this returns)."""
        if self._handle is None:
            return self._poll(wait_s)
        deadline = time.clock_gettime_ns(time.CLOCK_MONOTONIC) + max(0, int(wait_s * 1e9))
        until = _Timespec(deadline // 1_000_000_000, deadline % 1_000_000_000)
        if _sem_clockwait(self._handle, time.CLOCK_MONOTONIC, ctypes.byref(until)) == 0:
            return True
        err = ctypes.get_errno()
        if err in (errno.ETIMEDOUT, errno.EINTR):
            return False
        raise OSError(err, f"sem_clockwait: {os.strerror(err)}")

    def _poll(self, wait_s: float) -> bool:
        deadline = _monotonic_ns() + int(wait_s * 1e9)
        sem = self._poll_sem
        while True:
            try:
                sem.acquire(0)
                return True
            except posix_ipc.BusyError:
                pass
            left = (deadline - _monotonic_ns()) / 1e9
            if left <= 0:
                return False
            time.sleep(min(self.POLL_S, left))

    def close(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            _sem_close(handle)


def lock_name(shm_name: str) -> str:
    """The semaphore's name: the segment's name with a ``.lock`` suffix."""
    return f"{shm_name}.lock"


def create_semaphore(shm_name: str) -> None:
    """Creates the pool's semaphore (value 1, mode 0600 whatever the umask); it must not
    exist yet (SegmentError naming it if it does)."""
    from shmkv.errors import SegmentError
    from shmkv.pool.segment import NO_SPACE_ERRNOS, SEGMENT_MODE, no_space, semaphore_path

    try:
        sem = posix_ipc.Semaphore(lock_name(shm_name), posix_ipc.O_CREX, mode=0o600,
                                  initial_value=1)
    except OSError as exc:  # a semaphore is a page of /dev/shm, written when made
        if exc.errno in NO_SPACE_ERRNOS:
            raise no_space(f"the pool's semaphore {lock_name(shm_name)}", mmap.PAGESIZE,
                           exc.errno) from None
        raise
    except posix_ipc.ExistentialError:
        raise SegmentError(
            f"the pool's semaphore {lock_name(shm_name)} exists already (left by an earlier "
            "pool of this name, or planted): remove it (shmkv cleanup) and create the pool "
            "again"
        ) from None
    sem.close()
    os.chmod(semaphore_path(lock_name(shm_name)), SEGMENT_MODE)


def check_semaphore(shm_name: str) -> None:
    """Refuses the pool's semaphore unless it is this user's, mode 0600 (segment.py)."""
    from shmkv.pool.segment import check_path, semaphore_path

    name = lock_name(shm_name)
    check_path(semaphore_path(name), f"the pool's semaphore {name}")


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
        on_stall: callable() -> bool, asked after each empty wait slice; True when it took
            the lock over from a dead holder.
        on_dirty: callable(took_over), called right after a hold starts that took the lock
            over or found the undo journal non-empty: the repair.
        slice_s: the wait slice.
        spin_s: how long a waiter polls the semaphore before its first sleep on it (0:
            never); settable.
    """

    def __init__(self, shm_name: str, hdr64, slot: int, pid: int, incarnation: int,
                 timeout_s: float = DEFAULT_LOCK_TIMEOUT_S, describe_holder=None,
                 enabled: bool = True, on_stall=None, on_dirty=None,
                 slice_s: float = WAIT_SLICE_S, spin_s: float = SPIN_S) -> None:
        try:
            self._sem = posix_ipc.Semaphore(lock_name(shm_name))
        except posix_ipc.ExistentialError:
            from shmkv.errors import SegmentError

            raise SegmentError(f"the pool's lock {lock_name(shm_name)} is missing") from None
        self._timed = MonotonicWait(lock_name(shm_name), self._sem)
        self._hdr64 = hdr64
        self._holder_word = holder_word(slot, pid)
        self._incarnation = incarnation
        self.timeout_s = timeout_s
        self.slice_s = slice_s
        self._spin_s = 0.0
        self.spin_s = spin_s
        self._describe_holder = describe_holder
        self._enabled = enabled
        self._on_stall = on_stall or (lambda: False)
        self._on_dirty = on_dirty
        self._gate = threading.RLock()
        self._depth = 0
        self._owner_thread = 0
        # Statistics of this process's holds, for benchmarks and metrics.
        self.num_acquired = 0
        self.wait_ns_total = 0
        self.hold_ns_total = 0
        self._held_since = 0
        self.record: list[tuple[int, int]] | None = None  # (wait_ns, hold_ns) per hold
        self._proc64 = None
        self._fence_index = 0
        self._phase_index = 0
        # The savepoint of the call running under mutate(): (journal_len, queued events).
        self._events: list = []
        self._undo = None
        self._mark = (0, 0)
        self._stage = _STAGE_NONE
        self._abandoned = False  # a cut acquire may still hold the unit (PHASE_ABANDONED)
        self._forked: Exception | None = None  # set in a forked child: what use raises

    def mark_forked(self, error: Exception) -> None:
        """In a forked child: every later acquire or release raises ``error`` and touches
        nothing (a hold inherited from the parent is not the child's to give back)."""
        self._forked = error
        self._depth = 0
        self._owner_thread = 0
        self._proc64 = None

    def set_identity(self, slot: int, incarnation: int, proc64, fence_index: int | None,
                     phase_index: int) -> None:
        """Records this process's slot: the lock keeps its ``lock_phase``
        (``proc64[phase_index]``) and, given a ``fence_index``, checks on every acquire
        that the slot still carries ``incarnation`` (``proc64[fence_index]``), or raises
        FencedError."""
        self._holder_word = ((slot + 1) & 0xFFFF_FFFF) | (self._holder_word >> 32 << 32)
        self._incarnation = incarnation
        self._proc64 = proc64
        self._fence_index = fence_index
        self._phase_index = phase_index

    def _set_phase(self, phase: int) -> None:
        if self._proc64 is not None:
            if _fault.armed:
                _fault.tick()
            self._proc64[self._phase_index] = phase

    def acquire(self) -> None:
        """Takes the lock (or one more level of it).

        No exception (KeyboardInterrupt, a signal handler's SystemExit...) can leave the
        semaphore taken with neither a release nor a mark that takeover reads: an exception
        from the moment the semaphore may be ours posts it back if it surely is, or else
        leaves ``lock_phase = PHASE_ABANDONED`` (the unit may be here), which takeover
        treats like a dead waiter's ACQUIRING mark (``shmkv/pool/takeover.py``).

        Raises:
            LockTimeoutError: not acquired within ``timeout_s``; names the holder.
            FencedError: this process's slot was reclaimed.
        """
        if self._depth and self._owner_thread == get_ident():
            self._depth += 1  # nested in this thread's hold: nothing else to do
            return
        if self._forked is not None:
            raise self._forked
        gate = self._gate
        if not gate.acquire(False) and not gate.acquire(timeout=self.timeout_s):
            raise LockTimeoutError(
                f"pool lock: another thread of this process held it for over {self.timeout_s} s"
            )
        armed = _fault.armed  # constant for the call (fault.begin / fault.end bracket it)
        try:
            took_over = self._take_semaphore(armed)
            now = _monotonic_ns()
            hdr = self._hdr64
            if armed:
                _fault.tick()
            hdr[_H_HOLDER] = self._holder_word
            if armed:
                _fault.tick()
            hdr[_H_INCARNATION] = self._incarnation
            if armed:
                _fault.tick()
            hdr[_H_SINCE] = now
            if armed:
                _fault.tick()
            hdr[_H_LOCK_SEQ] += 1
            self._depth = 1
            self._owner_thread = get_ident()
            self._stage = _STAGE_NONE  # held: from here release() gives it back
        except BaseException:
            self._abort_acquire()
            raise
        self._held_since = now
        self.num_acquired += 1
        if self.record is not None:
            self.record.append((self._waited, 0))
        if (took_over or hdr[_H_JOURNAL_LEN]) and self._on_dirty is not None:
            try:
                self._on_dirty(took_over)
            except BaseException:
                self.release()
                raise

    def _abort_acquire(self) -> None:
        """An exception cut an acquire short. Its stage says what this process has: nothing
        (phase back to IDLE), surely the unit (holder record cleared, the semaphore posted,
        IDLE), or perhaps the unit (the exception came right after the semaphore call
        returned: ABANDONED, for takeover, and this lock remembers it). Every step runs
        even if another exception lands in the one before; the gate is always released."""
        stage, self._stage = self._stage, _STAGE_NONE
        hdr, mine = self._hdr64, self._holder_word
        if stage == _STAGE_IN_STALL:  # on_stall may have taken the lock over, then been cut
            stage = _STAGE_HELD if hdr[_H_HOLDER] == mine else _STAGE_NONE
        try:
            if stage == _STAGE_HELD:
                if hdr[_H_HOLDER] == mine:
                    hdr[_H_HOLDER] = 0
                    hdr[_H_INCARNATION] = 0
                    hdr[_H_SINCE] = 0
                if self._enabled:
                    self._sem.release()
        finally:
            try:
                if stage == _STAGE_IN_WAIT:
                    self._abandoned = True
                proc = self._proc64
                if proc is not None:
                    proc[self._phase_index] = (
                        L.PHASE_ABANDONED if self._abandoned else L.PHASE_IDLE
                    )
            finally:
                self._gate.release()

    def _take_semaphore(self, armed: bool) -> bool:
        """Fence check, phase, semaphore, HOLDING, fence check again. Returns True if the
        lock was taken over. Runs every hold, so the phase stores are inline (no ``_set_phase``),
        ``armed`` is the fault flag read once by the caller.

        ``self._stage`` tracks, with plain attribute stores (no bytecode between them and
        the calls they bracket can raise), whether the unit may be this process's."""
        proc, fence, phase = self._proc64, self._fence_index, self._phase_index
        if proc is not None and fence is not None and proc[fence] != self._incarnation:
            raise FencedError(_FENCED)  # a reclaimed slot: touch nothing, not even its phase
        if proc is not None:
            if armed:
                _fault.tick()
            # ABANDONED instead of ACQUIRING while an earlier, cut acquire may hold the unit.
            proc[phase] = _PHASE_ABANDONED if self._abandoned else _PHASE_ACQUIRING
        self._waited = 0
        took_over = False
        if self._enabled:
            self._stage = _STAGE_IN_WAIT
            try:
                self._sem.acquire(0)  # the uncontended case: no clock, no timed wait
            except posix_ipc.BusyError:
                self._stage = _STAGE_NONE
                took_over = self._wait()
                proc, fence, phase = self._proc64, self._fence_index, self._phase_index
        # The first thing with the unit (see shmkv/pool/takeover.py): no call between the
        # semaphore and this store but the fault tick.
        if armed:
            _fault.tick()
        if proc is not None:
            proc[phase] = _PHASE_HOLDING
        self._stage = _STAGE_HELD
        self._abandoned = False
        if proc is not None and fence is not None and proc[fence] != self._incarnation:
            self._give_back_fenced()  # reclaimed while it waited
        return took_over

    def _wait(self) -> bool:
        """The semaphore was taken: spin, then wait in slices. Returns True if the lock was
        taken over (``_stage`` as around the semaphore calls)."""
        start = _monotonic_ns()
        took_over = not self._spin(start) and self._wait_in_slices(start)
        self._waited = _monotonic_ns() - start
        self.wait_ns_total += self._waited
        return took_over

    def _give_back_fenced(self) -> None:
        """The slot was reclaimed while this process waited: give the unit back, touch
        nothing more, raise FencedError."""
        self._stage = _STAGE_NONE
        try:
            if self._enabled:
                self._sem.release()
        finally:
            self._set_phase(L.PHASE_IDLE)
        raise FencedError(_FENCED)

    @property
    def spin_s(self) -> float:
        """How long a waiter polls the semaphore before it sleeps on it (0: never)."""
        return self._spin_s

    @spin_s.setter
    def spin_s(self, value: float) -> None:
        if not 0 <= value <= 0.01:  # a spin is for a hold's microseconds, not for a wait
            raise ValueError("spin_s must be between 0 and 0.01 s")
        self._spin_s = float(value)

    def _spin(self, start: int) -> bool:
        """Polls the semaphore for up to ``spin_s`` before the first sleep on it. A hold
        lasts microseconds and the holder usually runs on another core, so the unit comes
        back sooner than a sleep and a wake-up (two context switches) would take; a holder
        that was preempted is then waited for asleep. Returns True when it took the unit
        (``_stage`` as around the first try: the unit may be this process's in the call)."""
        until = start + int(self._spin_s * 1e9)
        sem = self._sem
        while _monotonic_ns() < until:
            if sem.value > 0:
                self._stage = _STAGE_IN_WAIT
                try:
                    sem.acquire(0)
                    return True
                except posix_ipc.BusyError:
                    self._stage = _STAGE_NONE
        return False

    def _wait_in_slices(self, start: int) -> bool:
        deadline = start + int(self.timeout_s * 1e9)
        while True:
            left = (deadline - _monotonic_ns()) / 1e9
            wait_s = max(0.0, min(self.slice_s, left))
            self._stage = _STAGE_IN_WAIT
            # The deadline on CLOCK_MONOTONIC (MonotonicWait). False: the time ran out, or a
            # signal cut the wait short; its Python handler runs at the next bytecode, Ctrl-C
            # raising from here.
            if self._timed.wait(wait_s):
                return False
            self._stage = _STAGE_NONE
            self._stage = _STAGE_IN_STALL
            if self._on_stall():
                return True
            self._stage = _STAGE_NONE
            if _monotonic_ns() >= deadline:
                raise LockTimeoutError(self._timeout_message())

    def release(self) -> None:
        """Gives back one level of the lock; the last level commits the undo journal,
        clears the holder record and posts the semaphore. An exception landing anywhere in
        it (KeyboardInterrupt) still lets every later step run: the commit, the post, the
        IDLE mark and the gate."""
        if self._depth > 1:
            self._depth -= 1  # still held by this thread's outer level
            return
        if self._forked is not None:
            raise self._forked
        self._depth = 0
        self._owner_thread = 0
        hdr = self._hdr64
        try:
            self._set_phase(L.PHASE_RELEASING)
        finally:
            try:
                armed = _fault.armed
                if hdr[_H_JOURNAL_LEN]:  # commit: the hold's writes stand
                    if armed:
                        _fault.tick()
                    hdr[_H_JOURNAL_LEN] = 0
                if armed:
                    _fault.tick()
                hdr[_H_HOLDER] = 0
                if armed:
                    _fault.tick()
                hdr[_H_INCARNATION] = 0
                if armed:
                    _fault.tick()
                hdr[_H_SINCE] = 0
                # The hold ends at the post: read the clock before it, for the post may wake
                # a waiter that preempts this process before the next line runs.
                held = _monotonic_ns() - self._held_since
                if self._enabled:
                    self._sem.release()
            finally:
                try:
                    if _fault.armed:
                        _fault.tick()
                    proc = self._proc64
                    if proc is not None:
                        proc[self._phase_index] = _PHASE_IDLE
                finally:
                    self._gate.release()
        self.hold_ns_total += held
        if self.record is not None:
            self.record[-1] = (self.record[-1][0], held)

    # ------------------------------------------------------------------ one call's hold

    def set_savepoint(self, events: list, undo) -> None:
        """What :meth:`mutate` needs to roll a failed call back: the pool's list of queued
        events, and ``undo(journal_len, num_events)``, which puts back every word written
        since the journal stood at ``journal_len`` and drops the events queued since; called with
        a third argument, True, when the call raised InvariantViolation: repair the pool too."""
        self._events = events
        self._undo = undo

    def mutate(self, op: str, fn, *args):
        """Runs ``fn(*args)`` as one call that changes the pool: all of it, or nothing.

        The one mechanism of every mutating ``BlockPool`` method: counts the stores of
        ``op`` for fault injection (``shmkv/pool/fault.py``), takes the lock, marks a
        savepoint (the journal's length and the number of queued events), runs ``fn``; if
        ``fn`` raises (bad input found half way, KeyboardInterrupt...), undoes what it wrote
        since the savepoint and re-raises, so the call changes nothing; gives the lock back.
        An ``InvariantViolation`` (corrupt shared state: a looping chain...) also has the
        undo repair the pool (``undo(mark, num_events, True)``) before the lock is given
        back, so the next call finds it sound.
        Calls made before it in the same hold stand. ``CLock.mutate`` is the same in C.

        Args:
            op: the operation's name for fault injection ("allocate", "free"...).
            fn: the call's work, run under the lock.
            *args: its arguments.

        Returns:
            what ``fn`` returned.

        Raises:
            whatever ``fn`` raised (after the undo); LockTimeoutError or FencedError from
            taking the lock.
        """
        counting = _fault.planned is not None and _fault.begin(op)
        me = get_ident()
        depth0 = self._depth if self._owner_thread == me else 0
        outer = self._mark
        try:
            self.acquire()
            # From here the finally gives the level back, even if an exception (Ctrl-C)
            # lands right after acquire() returned.
            self._mark = (self._hdr64[_H_JOURNAL_LEN], len(self._events))
            try:
                return fn(*args)
            except BaseException as exc:
                if isinstance(exc, InvariantViolation):  # corrupt state: undo, then repair
                    self._undo(*self._mark, True)
                else:
                    self._undo(*self._mark)
                raise
        finally:
            self._mark = outer
            try:
                if self._depth > depth0 and self._owner_thread == me:
                    self.release()
            finally:
                if counting:
                    _fault.end()

    def savepoint(self) -> None:
        """Moves the savepoint of the running :meth:`mutate` call to here: what the call
        wrote so far stands even if the rest of it fails (the reap before an allocation)."""
        self._mark = (self._hdr64[_H_JOURNAL_LEN], len(self._events))

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
        self._proc64 = None
        self._timed.close()
        self._sem.close()
