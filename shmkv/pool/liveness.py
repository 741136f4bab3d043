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

``pid_alive`` is the plain pid test (``kill(pid, 0)``), for the few places that only have a
pid to go on: a lock holder recorded without a slot, a channel's peer, the front end of a
run, a run's leftover segments. It can be fooled by a reused pid, which is why the process
table does not use it.

Linux only (``fcntl.F_OFD_*``, Linux >= 3.15).
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct

from shmkv.errors import SegmentError
from shmkv.pool.layout import MAX_PROCESSES
from shmkv.pool.segment import check_fd, secure_new_fd

ARBITER_BYTE = MAX_PROCESSES  # past the last possible slot byte

# struct flock on Linux x86_64 / aarch64: short l_type, short l_whence, off_t l_start,
# off_t l_len, pid_t l_pid, padded to 32 bytes. l_pid must be 0 for OFD locks.
_FLOCK = struct.Struct("hhqqi4x")


def alive_path(shm_name: str) -> str:
    """The lock file of a pool, beside its segment in /dev/shm."""
    return f"/dev/shm{shm_name}.alive"


def _flock(lock_type: int, byte: int) -> bytes:
    return _FLOCK.pack(lock_type, os.SEEK_SET, byte, 1, 0)


class AliveLocks:
    """This process's view of the pool's lock file: claim a slot, test other slots."""

    def __init__(self, path: str, *, create: bool) -> None:
        # Created exclusively, never through a link, then owner/mode checked (segment.py).
        flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | (os.O_CREAT | os.O_EXCL if create else 0)
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

    def claim(self, slot: int) -> bool:
        """Takes the lock on byte ``slot``; False if a live process holds it."""
        try:
            fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_WRLCK, slot))
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                return False
            raise
        self.held_slot = slot
        return True

    def release(self, slot: int) -> None:
        """Drops this process's lock on byte ``slot``."""
        fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_UNLCK, slot))
        if self.held_slot == slot:
            self.held_slot = None

    def try_arbiter(self) -> bool:
        """Takes the take-over arbiter byte without waiting; False if another process has
        it."""
        try:
            fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_WRLCK, ARBITER_BYTE))
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                return False
            raise
        return True

    def release_arbiter(self) -> None:
        fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_UNLCK, ARBITER_BYTE))

    def is_alive(self, slot: int) -> bool:
        """Whether some process (this one included) holds byte ``slot``."""
        if slot == self.held_slot:
            return True
        answer = fcntl.fcntl(self._fd, fcntl.F_OFD_GETLK, _flock(fcntl.F_WRLCK, slot))
        return _FLOCK.unpack(answer)[0] != fcntl.F_UNLCK

    def drop_after_fork(self) -> None:
        """In a forked child: closes the inherited descriptor WITHOUT unlocking. The OFD
        lock belongs to the open file description the parent still uses (an F_UNLCK here
        would drop the parent's lock); closing only drops the child's reference to it, so
        the lock goes when the parent dies, whatever the child does (a child that kept the
        descriptor would keep a SIGKILLed parent looking alive: no reap, no take-over)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self.held_slot = None

    def close(self) -> None:
        """Closes the descriptor, which drops every lock this process held on the file."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            self.held_slot = None


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


def process_start_ticks(pid: int) -> int:
    """Field 22 of /proc/<pid>/stat (start time in clock ticks since boot), 0 if unknown.

    Recorded with the pid so a reader can tell a reused pid from the original process.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return 0
    # The command name (field 2) may contain spaces; fields after it follow the last ')'.
    return int(stat.rsplit(b")", 1)[1].split()[19])
