"""Every file and segment shmkv opens is created exclusively, opened without following a
link, and refused unless it is this user's with mode 0600, with an error naming it
(issue 15, item 5). Another user is simulated by chown-ing a file to uid 65534 (the
tests run as root in CI; without root those tests are skipped, the mode and link ones
still run)."""

from __future__ import annotations

import os

import numpy as np
import posix_ipc
import pytest

from shmkv import BlockPool, SegmentError
from shmkv.errors import SegmentNotFoundError
from shmkv.messages import Channel, channel_segment_name
from shmkv.pool import layout as L
from shmkv.pool.liveness import alive_path
from shmkv.pool.lock import lock_name
from shmkv.publisher import saved_position, state_segment_name
from shmkv.stats import PoolStats, stats_segment_name
from tests.conftest import unique_pool_name

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


def semaphore_path(sem_name: str) -> str:
    return f"/dev/shm/sem.{sem_name.lstrip('/')}"


def _shm(name: str) -> str:
    return f"/dev/shm{name}"


@pytest.fixture
def pool(pool_name):
    p = BlockPool.create(pool_name, 8, kernel="python")
    yield p
    p.close()


@needs_root
def test_a_foreign_alive_file_is_refused(pool, pool_name):
    """A liveness file of another user (who could hold its bytes and block reaping and
    take-over) makes attach refuse, naming the file. It used to be opened."""
    path = alive_path(L.segment_name(pool_name))
    os.chown(path, NOBODY, NOBODY)
    with pytest.raises(SegmentError, match=f"lock file {path}: owned by uid {NOBODY}"):
        BlockPool.attach(pool_name)
    os.chown(path, 0, 0)
    BlockPool.attach(pool_name).close()


@needs_root
def test_a_planted_alive_file_stops_create(pool_name):
    """A liveness file planted before the pool is created (another user's) is never opened:
    create refuses, naming it. O_CREAT without O_EXCL used to take it."""
    path = alive_path(L.segment_name(pool_name))
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
    os.close(fd)
    os.chown(path, NOBODY, NOBODY)
    try:
        with pytest.raises(SegmentError, match=f"lock file {path} exists already"):
            BlockPool.create(pool_name, 8)
        with pytest.raises(SegmentNotFoundError):
            BlockPool.attach(pool_name)  # nothing half-made was left
    finally:
        if os.path.lexists(path):
            os.unlink(path)


def test_an_alive_symlink_or_wrong_mode_is_refused(pool, pool_name, tmp_path):
    """The liveness file replaced by a link (to a file of this user's) or made 0644: both
    refused, naming it."""
    path = alive_path(L.segment_name(pool_name))
    os.chmod(path, 0o644)
    with pytest.raises(SegmentError, match=f"lock file {path}: mode 0644, not 0600"):
        BlockPool.attach(pool_name)
    os.chmod(path, 0o600)
    target = tmp_path / "elsewhere"
    target.write_bytes(b"")
    target.chmod(0o600)
    os.rename(path, path + ".real")
    os.symlink(target, path)
    try:
        with pytest.raises(SegmentError, match=f"lock file {path} is a symbolic link"):
            BlockPool.attach(pool_name)
    finally:
        os.unlink(path)
        os.rename(path + ".real", path)


@needs_root
def test_a_foreign_pool_semaphore_is_refused(pool, pool_name):
    sem = semaphore_path(lock_name(L.segment_name(pool_name)))
    os.chown(sem, NOBODY, NOBODY)
    try:
        with pytest.raises(SegmentError, match="pool's semaphore .*owned by uid 65534"):
            BlockPool.attach(pool_name)
    finally:
        os.chown(sem, 0, 0)


@needs_root
def test_a_foreign_stats_segment_is_refused(pool, pool_name):
    """A stats segment planted by another user: PoolStats.open refuses it, naming it (it
    used to open whatever was there)."""
    name = stats_segment_name(pool_name)
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=4096)
    os.fchown(shm.fd, NOBODY, NOBODY)
    shm.close_fd()
    try:
        with pytest.raises(SegmentError, match=f"stats segment {name}: owned by uid"):
            PoolStats.open(pool)
    finally:
        posix_ipc.unlink_shared_memory(name)


@needs_root
def test_a_foreign_publisher_state_is_refused(pool, pool_name):
    name = state_segment_name(pool_name)
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=4096)
    os.fchown(shm.fd, NOBODY, NOBODY)
    shm.close_fd()
    try:
        with pytest.raises(SegmentError, match=f"publisher state {name}: owned by uid"):
            saved_position(pool_name)
    finally:
        posix_ipc.unlink_shared_memory(name)


@needs_root
def test_a_foreign_channel_is_refused():
    name = unique_pool_name("ch")
    Channel.create(name, 4096).close()
    try:
        shm = posix_ipc.SharedMemory(channel_segment_name(name))
        os.fchown(shm.fd, NOBODY, NOBODY)
        shm.close_fd()
        with pytest.raises(SegmentError, match="channel .*owned by uid 65534"):
            Channel.open(name)
    finally:
        Channel.unlink(name)


def test_channel_open_does_not_trust_the_doorbell_name_in_the_segment(pool, pool_name):
    """A channel header rewritten to name the pool's own semaphore as its doorbell:
    open() refuses it instead of opening (and later posting) that semaphore."""
    name = unique_pool_name("ch")
    Channel.create(name, 4096).close()
    try:
        shm = posix_ipc.SharedMemory(channel_segment_name(name))
        import mmap

        with mmap.mmap(shm.fd, shm.size) as mem:
            hdr = np.ndarray((1,), L.CHANNEL_HEADER_DTYPE, buffer=mem)
            hdr[0]["doorbell"] = lock_name(L.segment_name(pool_name)).encode()
            del hdr
        shm.close_fd()
        with pytest.raises(SegmentError, match="not a shmkv doorbell name"):
            Channel.open(name)
    finally:
        Channel.unlink(name)


def test_files_are_0600_whatever_the_umask(pool_name):
    """Created under umask 0277, every file of the pool is still 0600 (the umask used to
    leave the segment 0400), and a second process can attach."""
    old = os.umask(0o277)
    try:
        pool = BlockPool.create(pool_name, 8, kernel="python")
    finally:
        os.umask(old)
    try:
        seg = L.segment_name(pool_name)
        for path in (_shm(seg), alive_path(seg), semaphore_path(lock_name(seg))):
            assert oct(os.stat(path).st_mode & 0o777) == oct(0o600), path
        BlockPool.attach(pool_name).close()
        pool.check_invariants()
    finally:
        pool.close()
