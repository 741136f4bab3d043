"""Process liveness that pid reuse cannot fool: one OFD lock per process-table slot.

Every attached process holds an open-file-description (OFD) write lock on byte ``slot`` of
the pool's lock file (``/dev/shm/<segment name>.alive``) for as long as it is attached. The
kernel drops the lock when the last descriptor of that open file goes away, which includes
the process dying by any signal. Another process asks the kernel whether byte ``slot`` is
still locked (``F_OFD_GETLK``): a free byte means the slot's owner is gone, whatever pid now
runs. This is LMDB's reader-table trick, with OFD locks so that closing some other
descriptor of the file never drops a lock by accident.

Byte ``ARBITER_BYTE`` (past every slot) arbitrates the take-over of a dead lock holder:
the waiters that find the holder dead race for it, non-blocking, and only the winner takes
over (``shmkv/pool/takeover.py``).

Attach marks: a process that is attaching holds the pool lock before the row it claims is
its own (it may have no slot at all: a full table, where it reaps under the lock, or a
claimed slot it gives back when the row turns out taken). So for its whole ``attach()`` it
holds one of ``NUM_MARKS`` mark bytes (``MARK_FIRST_BYTE`` on, exclusively, taken before it
waits for the lock), and the lock's ``holder`` word names that byte instead of a slot; a
waiter takes such a holder for dead only when its mark byte is free. While it is inside its
attach hold it also locks the mark's hold byte (``byte + NUM_MARKS``): a process with no row
marks no ``lock_phase``, and a locked hold byte is how a waiter knows that the lock may be
taken by a live process that recorded no holder yet, or no more (``shmkv/pool/takeover.py``,
rule 2). Kernel-arbitrated like the slot bytes, so valid across pid namespaces, where a
pid test means nothing.

The liveness rule (the one every liveness decision of the package goes through,
``AliveLocks.is_alive``): a slot is live while byte ``slot`` is locked AND, when the reader
is in the pid namespace the row records (``pid_ns``), the row's ``pid`` runs, is not a
zombie, and started at the row's ``start_ticks``. The lock alone can be kept by a process
that is not the slot's: a child forked without Python's at-fork hooks (a raw ``fork()`` from
C) inherits the open file description, and with it the lock, for as long as it lives. The
pid test alone can be fooled by a reused pid, and means nothing in another pid namespace
(a pool shared across containers), where the lock is the only word.

``pid_alive`` is the plain pid test (``kill(pid, 0)``), for the few places that only have a
pid to go on (never a take-over of the pool lock): a channel's peer, the front end of a
run, a run's leftover segments. It can be fooled by a reused pid, which is why the process
table does not use it.

Linux only (``fcntl.F_OFD_*``, Linux >= 3.15).
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct

import numpy as np

from shmkv.errors import SegmentError
from shmkv.pool.layout import MAX_PROCESSES, SLOT_ACTIVE
from shmkv.pool.lifecycle import record_presence
from shmkv.pool.segment import check_fd, secure_new_fd

ARBITER_BYTE = MAX_PROCESSES  # past the last possible slot byte
MARK_FIRST_BYTE = ARBITER_BYTE + 1  # the attach marks: [MARK_FIRST_BYTE, + NUM_MARKS)
NUM_MARKS = 4096  # processes that can be attaching to one pool at once

# struct flock on Linux x86_64 / aarch64: short l_type, short l_whence, off_t l_start,
# off_t l_len, pid_t l_pid, padded to 32 bytes. l_pid must be 0 for OFD locks.
_FLOCK = struct.Struct("hhqqi4x")


def alive_path(shm_name: str) -> str:
    """The lock file of a pool, beside its segment in /dev/shm."""
    return f"/dev/shm{shm_name}.alive"


def _flock(lock_type: int, byte: int, length: int = 1) -> bytes:
    return _FLOCK.pack(lock_type, os.SEEK_SET, byte, length, 0)


def is_mark(byte: int) -> bool:
    """Whether a ``holder`` word's slot field names an attach mark byte, not a slot."""
    return MARK_FIRST_BYTE <= byte < MARK_FIRST_BYTE + NUM_MARKS


class AliveLocks:
    """This process's view of the pool's lock file: claim a slot, test other slots."""

    def __init__(self, path: str, *, create: bool, procs: np.ndarray | None = None) -> None:
        """Opens (or creates) the lock file ``path``. ``procs`` is the pool's process table
        (``PROC_DTYPE`` rows), read by ``is_alive`` for the pid and start-time half of the
        liveness rule; without it only the lock counts."""
        # Created exclusively, never through a link, then owner/mode checked (segment.py).
        flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK | (
            os.O_CREAT | os.O_EXCL if create else 0)
        try:
            self._fd = os.open(path, flags, 0o600)
        except FileNotFoundError as exc:
            raise SegmentError(f"the pool's lock file {path} is missing") from exc
        except FileExistsError as exc:
            raise SegmentError(
                f"the pool's lock file {path} exists already (left by an earlier pool of this "
                "name, or planted): remove it (shmkv cleanup) and create the pool again"
            ) from exc
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise SegmentError(f"the pool's lock file {path} is a symbolic link; refusing "
                                   "to use it") from exc
            raise
        try:
            if create:
                secure_new_fd(self._fd)
            check_fd(self._fd, f"the pool's lock file {path}")
        except BaseException:
            os.close(self._fd)
            raise
        self.path = path
        self.held_slot: int | None = None
        self.held_mark: int | None = None  # this process's attach mark, while it attaches
        self.procs = procs

    def claim(self, slot: int) -> bool:
        """Takes the lock on byte ``slot``; False if a live process holds it. Taken, the
        file's time records the join (``shmkv/pool/lifecycle.py``, rule 6)."""
        if not self._try_lock(slot):
            return False
        self.held_slot = slot
        record_presence(self._fd)
        return True

    def release(self, slot: int) -> None:
        """Drops this process's lock on byte ``slot``."""
        fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_UNLCK, slot))
        if self.held_slot == slot:
            self.held_slot = None

    def try_arbiter(self) -> bool:
        """Takes the take-over arbiter byte without waiting; False if another process has
        it."""
        return self._try_lock(ARBITER_BYTE)

    def release_arbiter(self) -> None:
        fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_UNLCK, ARBITER_BYTE))

    # ------------------------------------------------------------------ attach marks

    def claim_mark(self, named_by_holder=None) -> int | None:
        """Takes a free attach mark byte (module docstring) and returns it; None if all
        ``NUM_MARKS`` are held.

        ``named_by_holder(byte)`` says whether the lock's ``holder`` word names the byte. A
        free byte that it names is a dead holder's mark (only the process holding a mark
        writes a word naming it), which is how the waiters tell that holder is dead: taking
        it would make the dead holder look alive. Asked once the byte is locked, so that no
        holder can write such a word after the look."""
        for byte in range(MARK_FIRST_BYTE, MARK_FIRST_BYTE + NUM_MARKS):
            if self._try_lock(byte):
                if named_by_holder is not None and named_by_holder(byte):
                    fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_UNLCK, byte))
                    continue
                self.held_mark = byte
                return byte
        return None

    def hold_mark(self, byte: int) -> None:
        """Locks the hold byte of this process's mark ``byte`` (it holds the pool lock)."""
        if not self._try_lock(byte + NUM_MARKS):  # pragma: no cover - the mark is ours
            raise SegmentError(f"the hold byte of attach mark {byte} of {self.path} is taken")

    def release_mark(self, byte: int) -> None:
        """Drops this process's mark ``byte`` and its hold byte."""
        fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_UNLCK, byte + NUM_MARKS))
        fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_UNLCK, byte))
        if self.held_mark == byte:
            self.held_mark = None

    def mark_alive(self, byte: int) -> bool:
        """Whether the process of attach mark ``byte`` is alive: the byte is locked (by
        this process, or by another: one ``F_OFD_GETLK``)."""
        return byte == self.held_mark or self._locked_by_other(byte, 1)

    def another_in_attach_hold(self) -> bool:
        """Whether another process has locked the hold byte of its attach mark: it is
        inside an attach hold of the pool lock, perhaps between the semaphore and its
        ``holder`` word, which no ``lock_phase`` row shows."""
        return self._locked_by_other(MARK_FIRST_BYTE + NUM_MARKS, NUM_MARKS)

    def _try_lock(self, byte: int) -> bool:
        try:
            fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_WRLCK, byte))
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                return False
            raise
        return True

    def _locked_by_other(self, byte: int, length: int) -> bool:
        answer = fcntl.fcntl(self._fd, fcntl.F_OFD_GETLK, _flock(fcntl.F_WRLCK, byte, length))
        return _FLOCK.unpack(answer)[0] != fcntl.F_UNLCK

    def is_alive(self, slot: int) -> bool:
        """Whether the process of ``slot`` is alive, by the liveness rule (module
        docstring): this process's own slot is; another is while some process holds byte
        ``slot`` and the row's recorded process (pid + start time, when this process can
        tell) is still the one running."""
        if slot == self.held_slot:
            return True
        answer = fcntl.fcntl(self._fd, fcntl.F_OFD_GETLK, _flock(fcntl.F_WRLCK, slot))
        if _FLOCK.unpack(answer)[0] == fcntl.F_UNLCK:
            return False
        return self.procs is None or not recorded_process_gone(self.procs[slot])

    def drop_after_fork(self) -> None:
        """In a forked child: closes the inherited descriptor WITHOUT unlocking. The OFD
        lock belongs to the open file description the parent still uses (an F_UNLCK here
        would drop the parent's lock); closing only drops the child's reference to it, so
        the lock goes when the parent dies, whatever the child does (a child that kept the
        descriptor would keep a SIGKILLed parent looking alive: no reap, no take-over)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self.held_slot = self.held_mark = None
        self.procs = None

    def close(self) -> None:
        """Closes the descriptor, which drops every lock this process held on the file; a
        process that held a slot records its leave first (``lifecycle.py``, rule 6)."""
        if self._fd >= 0:
            if self.held_slot is not None:
                record_presence(self._fd)
            os.close(self._fd)
            self._fd = -1
            self.held_slot = self.held_mark = None
        self.procs = None  # a view of the segment, which is about to be unmapped


def pid_alive(pid: int, start_ticks: int = 0) -> bool:
    """Whether a process with this pid exists (``kill(pid, 0)``; a zombie counts), and, when
    ``start_ticks`` is given, whether it is the process that started then.

    The one pid test of the package. Without ``start_ticks`` a reused pid reads as alive, so
    this only says that *some* process has the pid now; slots of the process table are tested
    with ``AliveLocks``.

    Args:
        pid: the process id; 0 and negative ids (process groups to ``kill``) are no process.
        start_ticks: the process's start time as ``process_start_ticks`` read it when the pid
            was recorded; 0 if unknown (then any process with the pid counts).

    Returns:
        True if the process exists, also when it belongs to another user (``EPERM``), and,
        with ``start_ticks``, started at that tick.
    """
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    if start_ticks:
        ticks = process_start_ticks(pid)
        return ticks == 0 or ticks == start_ticks  # 0: /proc unreadable, trust the pid
    return True


_own_ns: tuple[int, int] = (0, 0)  # (pid, namespace inode) of the last look


def own_pid_namespace() -> int:
    """The inode of this process's pid namespace, 0 when it cannot be told (no /proc, or a
    /proc mounted from another namespace, where /proc/self is not this process). Looked up
    once per process (a forked child looks again)."""
    global _own_ns
    pid = os.getpid()
    if _own_ns[0] != pid:
        try:
            ns = os.stat("/proc/self/ns/pid").st_ino if os.readlink("/proc/self") == str(pid) else 0
        except OSError:
            ns = 0
        _own_ns = (pid, ns)
    return _own_ns[1]


def recorded_process_gone(row) -> bool:
    """Whether the process a process-table row records is provably gone: the row is active,
    names a pid of this process's pid namespace, and that pid no longer runs, is a zombie
    (dead, not yet waited for: it holds nothing), or runs a process started at another tick
    than the row's ``start_ticks`` (a reused pid). False whenever it cannot be told: a row
    being filled in (not yet active), a row of another pid namespace, no /proc."""
    if int(row["state"]) != SLOT_ACTIVE:
        return False
    return process_gone(int(row["pid"]), int(row["start_ticks"]), int(row["pid_ns"]))


def process_gone(pid: int, start_ticks: int, pid_ns: int) -> bool:
    """Whether the process recorded as ``pid`` (started at ``start_ticks``, 0 if unknown) in
    the pid namespace ``pid_ns`` is provably gone: the namespace is this process's, and the
    pid no longer runs, is a zombie, or runs a process started at another tick. False
    whenever it cannot be told: no pid, a namespace of 0 (unknown) or another one, no
    /proc."""
    if pid <= 0 or pid_ns == 0 or pid_ns != own_pid_namespace():
        return False
    status = _proc_stat(pid)
    if status is None:
        return True  # no such process
    state, ticks = status
    if state in (b"Z", b"X"):
        return True
    return start_ticks != 0 and ticks != 0 and ticks != start_ticks


def _proc_stat(pid: int) -> tuple[bytes, int] | None:
    """(state letter, start ticks) from /proc/<pid>/stat; None if no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:
        return b"?", 0  # there, but unreadable: nothing to compare
    # The command name (field 2) may contain spaces; fields after it follow the last ')'.
    fields = stat.rsplit(b")", 1)[1].split()
    return fields[0], int(fields[19])


def process_start_ticks(pid: int) -> int:
    """Field 22 of /proc/<pid>/stat (start time in clock ticks since boot), 0 if unknown.

    Recorded with the pid so a reader can tell a reused pid from the original process.
    """
    status = _proc_stat(pid)
    return status[1] if status else 0
