"""Replicas of the offload tier: one engine core and its GPU workers, alive or gone as one.

vLLM's engine core (scheduler side: the manager) decides which chunks a store or a load
uses; its GPU workers move the bytes. When the engine core is SIGKILLed its workers notice
through a pipe and stop only after their current step, so a chunk the core was storing into
may still be written for a while after the core is gone. The pool reaps the core's holds at
once (that is its job); what keeps the chunk out of another replica's hands is the chunk's
job bit (``TierTable.jobs``): bit ``r`` stays set while replica row ``r`` has a store, a load
or an unflushed reset on the chunk, and only a replica that is gone as a whole loses its
bits.

Membership is kernel-arbitrated and valid across pid namespaces: every process of replica
row ``r`` (engine core and workers) holds an OFD read lock on byte ``r`` of the replica lock
file ``/dev/shm/<tier table name>.replicas``. A row is gone when nobody holds its byte
(``F_OFD_GETLK``), whatever pids now run. A row is keyed by its replica's id: vLLM's
``engine_id`` (distinct per data-parallel rank) and the instance id vLLM makes once per engine
start, which the engine core and its workers share. A restart gets a row of its own even
under a user-fixed engine id, so a killed core's chunks come back as soon as its last worker
stops.

The file is bound to the tier table (its inode, recorded by the first process that joins a
row): a process that opens the path and finds another file (the first was removed, by hand
or by a tmp cleaner, and re-made) is refused, and a process whose descriptor is no longer the
file at the path takes every row as live. A missing or replaced file never makes a live
replica read as gone, which would hand its chunks out while its workers still write them.

Byte ``REGION_MAKER_BYTE`` (past every row) is taken, exclusively, by the one worker that
makes the tier's data region (region.py), so the others wait for it instead of each making
one.

Every function here that reads or writes the tier table runs under the pool lock.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import struct

import numpy as np

from shmkv.errors import PoolFullError, SegmentError
from shmkv.pool import layout as L
from shmkv.pool import lifecycle as LC
from shmkv.pool import tier_counters as TC
from shmkv.pool.segment import open_checked
from shmkv.vllm.tier import MAX_REPLICAS, W_REPLICA_FILE, ReplicaLabel, TierTable, write_label

REGION_MAKER_BYTE = MAX_REPLICAS
_FLOCK = struct.Struct("hhqqi4x")  # struct flock on Linux x86_64 / aarch64


def replica_locks_path(pool: str) -> str:
    """The replica lock file of a pool's tier, beside its table in /dev/shm."""
    return L.offload_replicas_path(pool)


def replica_key(engine_id: str) -> int:
    """The non-zero int64 a replica row is keyed by: a digest of the engine id."""
    word = int.from_bytes(hashlib.blake2b(engine_id.encode(), digest_size=8).digest(),
                          "little", signed=True)
    return word or 1


def _flock(lock_type: int, byte: int) -> bytes:
    return _FLOCK.pack(lock_type, os.SEEK_SET, byte, 1, 0)


class ReplicaLocks:
    """This process's descriptor of the replica lock file, and the rows it belongs to."""

    def __init__(self, pool: str, generation: bytes) -> None:
        """Opens the pool's replica lock file of the tier's ``generation``, making it (mode
        0600) if it is missing, or if the file there is a removed tier's that no process
        holds any more (caller holds the pool lock: ``shmkv/pool/lifecycle.py``, rule 1).

        Raises:
            SegmentError: the file is a link, another user's, or not mode 0600.
            LayoutMismatchError: the file is of another generation and processes hold it.
        """
        path = replica_locks_path(pool)
        what = "the tier's replica lock file"
        while True:
            try:
                fd = open_checked(path, os.O_RDWR, what)
            except FileNotFoundError:
                try:
                    LC.make_lock_file(path, generation)
                except FileExistsError:
                    pass
                continue
            found = LC.read_lock_file_generation(fd)
            if found == generation:
                break
            try:
                if LC.locked_bytes(fd):
                    LC.check_generation(what, path, found, generation, pool)
                stale = os.fstat(fd).st_ino
            finally:
                os.close(fd)
            if os.stat(path, follow_symlinks=False).st_ino == stale:
                os.unlink(path)  # a removed tier's, held by nobody: made again below
        self.path = path
        self._fd = fd
        self._inode = os.fstat(fd).st_ino
        self.rows: set[int] = set()

    def bind(self, tier: TierTable, pool: str) -> None:
        """Records this file as the tier's replica lock file, or checks that it is the one
        recorded (caller holds the pool lock).

        Raises:
            SegmentError: the recorded file was removed or replaced: the tier's rows are
                held on a file this process cannot see, so it could not tell a live
                replica from a gone one.
        """
        recorded = int(tier.words[W_REPLICA_FILE])
        if not recorded:
            tier.words[W_REPLICA_FILE] = self._inode
        elif recorded != self._inode:
            raise SegmentError(
                f"the offload tier's replica lock file {self.path} was removed or replaced "
                f"while the tier was in use (inode {self._inode}, the tier's {recorded}): "
                "the replicas' liveness cannot be told from it. Stop every replica of the "
                f"tier and run `shmkv unlink {pool}`, then start them again"
            )

    def _is_current(self) -> bool:
        """Whether this process's descriptor is still the file at the path."""
        try:
            return os.stat(self.path, follow_symlinks=False).st_ino == self._inode
        except FileNotFoundError:
            return False

    def _setlk(self, lock_type: int, byte: int) -> bool:
        try:
            fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, _flock(lock_type, byte))
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                return False
            raise
        return True

    def hold(self, row: int) -> None:
        """Joins row ``row``: a shared lock on its byte, for as long as this handle lives.
        The file's time records the join (``shmkv/pool/lifecycle.py``, rule 6)."""
        self._setlk(fcntl.F_RDLCK, row)
        self.rows.add(row)
        LC.record_presence(self._fd)

    def leave(self, row: int) -> None:
        """Leaves row ``row`` (drops this process's lock on its byte), recording the leave."""
        self._setlk(fcntl.F_UNLCK, row)
        self.rows.discard(row)
        LC.record_presence(self._fd)

    def is_gone(self, row: int) -> bool:
        """Whether no process holds row ``row`` (this process's own rows are live; every
        row is, once the file at the path is not this process's)."""
        if row in self.rows or not self._is_current():
            return False
        answer = fcntl.fcntl(self._fd, fcntl.F_OFD_GETLK, _flock(fcntl.F_WRLCK, row))
        return _FLOCK.unpack(answer)[0] == fcntl.F_UNLCK

    def try_region_maker(self) -> bool:
        """Takes the region maker's byte without waiting; False if another process has it."""
        return self._setlk(fcntl.F_WRLCK, REGION_MAKER_BYTE)

    def release_region_maker(self) -> None:
        self._setlk(fcntl.F_UNLCK, REGION_MAKER_BYTE)

    def close(self) -> None:
        """Closes the descriptor, which leaves every row this process held (recorded, if it
        held one)."""
        if self._fd >= 0:
            if self.rows:
                LC.record_presence(self._fd)
            os.close(self._fd)
            self._fd = -1
        self.rows.clear()


def release_row(tier: TierTable, row: int) -> list[int]:
    """Clears row ``row``'s job bits everywhere and frees the row; returns the blocks it
    had bits on (caller holds the pool lock, and knows the row is gone)."""
    bit = np.uint64(1 << row)
    jobs = tier.jobs
    held = np.flatnonzero(jobs & bit).tolist()
    if held:
        jobs &= ~bit
    tier.replica_keys[row] = 0
    tier.replica_region[row] = 0
    tier.counter_words[(row + 1) * TC.ROW_WORDS + TC.C_LIVE] = 0  # its counts stay, shown gone
    return held


def reap_gone(tier: TierTable, locks: ReplicaLocks) -> list[int]:
    """Releases every replica row whose processes are all gone; returns the blocks that
    left quarantine (caller holds the pool lock)."""
    freed: list[int] = []
    for row in np.flatnonzero(tier.replica_keys).tolist():
        if locks.is_gone(row):
            freed += release_row(tier, row)
    return freed


def join(tier: TierTable, locks: ReplicaLocks, key: int, pool: str,
         label: ReplicaLabel | None = None, core_pid: int = 0) -> int:
    """Joins the replica keyed ``key`` (its row, or a free one) and writes what ``label``
    and ``core_pid`` (the engine core's own pid; 0 for a GPU worker) say into the row's
    label (``tier.py``); returns the row (caller holds the pool lock).

    Raises:
        PoolFullError: all MAX_REPLICAS rows belong to live replicas.
        SegmentError: the replica lock file is not the one the tier's rows are held on.
    """
    locks.bind(tier, pool)
    keys = tier.replica_keys
    rows = np.flatnonzero(keys == key).tolist()
    if rows:
        row = rows[0]
        if locks.is_gone(row):  # an earlier incarnation of the same engine id, all dead
            release_row(tier, row)
    else:
        free = TC.row_preference(tier.counter_words, np.flatnonzero(keys == 0).tolist(), key)
        row = free[0] if free else -1
        if row < 0:
            for candidate in np.flatnonzero(keys).tolist():
                if locks.is_gone(candidate):
                    release_row(tier, candidate)
                    row = candidate
                    break
        if row < 0:
            raise PoolFullError(
                f"the offload tier has {MAX_REPLICAS} replica rows and every one belongs to a "
                "live replica (engine core or GPU worker); stop one, or use another shmkv_pool"
            )
    keys[row] = key
    if TC.reset_row(tier.counter_words, row + 1, key):  # another replica's row: from zero,
        tier.producer[tier.producer == row + 1] = 0  # and its chunks are not this one's
    write_label(tier, row, key, label, core_pid)
    locks.hold(row)
    return row
