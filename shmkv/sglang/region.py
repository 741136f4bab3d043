"""The page store's data region: one sibling segment ``/shmkv_sglang-<pool>-v<version>``
holding the store's identity and the bytes of every page, named after the pool whose blocks
describe them. The store is a tier of two objects with one life (``shmkv/pool/lifecycle.py``):
its generation is the pool's ``pool_id``, which the region records in its owner record, and
the format version is in both names (the pool's layout version, the region's store version),
so a release of another format never opens this one's store, nor removes it: each makes its
own.

Layout (little-endian):

    byte 0      magic (u64, SGLANG_STORE_MAGIC), written last: the header is complete
    byte 8      version (u32)
    byte 16     num_pages (u64): the pool's blocks less the null block
    byte 24     page_bytes (u64)
    byte 32     length of the identity JSON at byte IDENTITY_OFFSET
    byte 40     counter rows (u64): the pool's process-table slots
    byte 64     the identity (identity.py), up to the owner record
    byte 3968   the owner record (``siblings.owner_record``): the pool it belongs to, by
                name, creator pid, inode and ``pool_id``; no creator, so the region lives
                exactly as long as its pool (``shmkv cleanup`` / ``shmkv unlink``)
    byte 4096   page slots: block id ``b`` (1..num_pages) owns bytes
                ``[4096 + (b - 1) * page_bytes, 4096 + b * page_bytes)``
    then        (64-byte aligned) the counter block (``shmkv/pool/tier_counters.py``): the
                node's row, then one per process-table slot: pages stored, loaded, loaded
                from another slot's stores; then producer: int32 [num_pages + 1], 1 + the
                slot whose store completed the page (advice only)

A region whose owner record names another ``pool_id`` was left by an earlier pool of the
name: it is never believed, but replaced, and the keys the pool held are dropped, since
their bytes are gone. A process maps only a region that names the pool it attached, and
makes one only for that pool: if the pool was replaced (unlinked, made again) since it
attached, opening the region is a SegmentError and the new pool's region is left alone.

Making it (``open_region``): one process makes the region, the others wait for it. Under
the pool lock the maker creates the file exclusively (``O_EXCL | O_NOFOLLOW``, mode 0600
whatever the umask) and takes an OFD write lock on it; it then reserves the pages
(``posix_fallocate``, after a ``statvfs`` check: no room is a NoSpaceError naming both
sizes, never a SIGBUS later) and writes the header OUTSIDE the lock, since reserving
gigabytes takes seconds that would stall every other process past its lock timeout; last,
under the lock, it drops the pool's keys and writes the magic, then releases its OFD lock.
A process that finds a file without magic waits while its maker's OFD lock is held; once
it is not (the maker died: the kernel drops its locks), the file is unlinked and made
afresh. A file of another user, of another mode, or a link is refused, naming it. Every
process maps the pages in when it opens the region (``MADV_POPULATE_WRITE``), so no copy
pays first-touch faults.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import struct
import time
from collections.abc import Callable

import numpy as np

from shmkv.errors import LayoutMismatchError, SegmentError
from shmkv.pool import layout as L
from shmkv.pool import tier_counters as TC
from shmkv.pool.block_pool import BlockPool
from shmkv.pool.segment import SHM_DIR, Segment, no_space, open_checked, reserve
from shmkv.pool.siblings import owner_record, pool_identity, write_owner
from shmkv.sglang.events import complete_keys, log_removed

HEADER_BYTES = 4096
IDENTITY_OFFSET = 64
IDENTITY_MAX = L.SGLANG_STORE_OWNER_OFFSET - IDENTITY_OFFSET
MAKER_WAIT_S = 120.0  # how long a process waits for another to make the region
WHAT = "the SGLang page store's data region"
_FLOCK = struct.Struct("hhqqi4x")  # struct flock (Linux x86_64 / aarch64), whole file
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14
_FIELDS = TC.SGLANG_HEADER  # magic, version, num_pages, page_bytes, identity length, rows


def populate(mapping: mmap.mmap) -> None:
    """Maps every page of ``mapping`` into this process now (``MADV_POPULATE_WRITE``), so
    that no copy pays first-touch faults. The pages are reserved already; on a kernel older
    than 5.14 (EINVAL) they are mapped on first touch instead."""
    try:
        mapping.madvise(MADV_POPULATE_WRITE)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOSYS):
            raise


def region_bytes(num_pages: int, page_bytes: int, num_rows: int) -> int:
    """The region's size: header, pages, counter block and page producers."""
    return (TC.sglang_counters_offset(num_pages, page_bytes) + TC.block_bytes(num_rows)
            + 4 * (num_pages + 1))


def region_name(pool: str) -> str:
    """The POSIX name of a pool's page store: ``/shmkv_sglang-<pool>-v<version>``."""
    return L.sibling_segment_name("sglang", pool, L.SGLANG_STORE_VERSION)


def region_path(pool: str) -> str:
    return SHM_DIR + region_name(pool)


class PageRegion:
    """One process's mapping of the page store: the header fields and a uint8 view of the
    page slots."""

    def __init__(self, seg: Segment, num_pages: int, page_bytes: int, path: str = "",
                 ino: int = -1, num_rows: int = 0) -> None:
        self._seg = seg
        self.path, self.ino = path, ino  # the file mapped, and its inode
        self.num_pages = num_pages
        self.page_bytes = page_bytes
        self.pages = np.frombuffer(seg.buf, np.uint8, num_pages * page_bytes, HEADER_BYTES)
        populate(seg.buf)
        at = TC.sglang_counters_offset(num_pages, page_bytes)
        self._mv = memoryview(seg.buf)
        # tier_counters.py: row 0 the node, row s + 1 process-table slot s
        self.counter_words = self._mv[at:at + TC.block_bytes(num_rows)].cast("q")
        at += TC.block_bytes(num_rows)
        self.producer_words = self._mv[at:at + 4 * (num_pages + 1)].cast("i")

    @property
    def name(self) -> str:
        return self._seg.shm_name

    def check_current(self, pool: BlockPool, pool_name: str) -> None:
        """Raises SegmentError if another file is the region of ``pool`` (this process's
        pool) now: this one was removed, and another process made a new one and dropped the
        pool's keys, which then name the new file's bytes. While this process maps the old
        file its inode lives, so a new file never has its number. A process whose pool was
        replaced too (unlinked, made again) shares its pool and region with no newcomer, and
        goes on. Pool lock held."""
        try:
            ino = os.stat(self.path).st_ino
        except FileNotFoundError:
            return  # whoever makes one drops the pool's keys first, under the lock
        if ino != self.ino and (pool_identity(pool_name) or (0, 0, b""))[2] == _pool_id(pool):
            raise SegmentError(
                f"{WHAT} {self.path} was replaced (or removed) since this process mapped it: "
                "its pages are not the pool's any more; open the store again")

    def identity(self) -> bytes:
        size = _FIELDS.unpack_from(self._seg.buf, 0)[4]
        return bytes(self._seg.buf[IDENTITY_OFFSET:IDENTITY_OFFSET + size])

    def close(self) -> None:
        del self.pages
        self.counter_words.release()
        self.producer_words.release()
        self._mv.release()
        self._seg.close()


def _maker_lock(fd: int, lock_type: int) -> None:
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(lock_type, 0, 0, 0, 0))


def _maker_alive(fd: int) -> bool:
    """Whether some open file description holds a lock on the file (its maker's)."""
    answer = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _FLOCK.pack(fcntl.F_WRLCK, 0, 0, 0, 0))
    return _FLOCK.unpack(answer)[0] != fcntl.F_UNLCK


def _pool_id(pool: BlockPool) -> bytes:
    """The ``pool_id`` of the pool segment this process has attached (not the name's now)."""
    return bytes(pool.header_snapshot()["pool_id"])


def _belongs(head: bytes, pool_id: bytes) -> bool:
    """Whether the region's owner record names the pool whose ``pool_id`` is given."""
    if len(head) < HEADER_BYTES:
        return False
    rec = np.frombuffer(head, L.OWNER_DTYPE, 1, L.SGLANG_STORE_OWNER_OFFSET)[0]
    return int(rec["owner_magic"]) == L.OWNER_MAGIC and bytes(rec["pool_id"]) == pool_id


def _check_current(pool_name: str, pool_id: bytes) -> None:
    """Raises SegmentError unless the pool named ``pool_name`` now is the one attached."""
    now = pool_identity(pool_name)
    if now is None or now[2] != pool_id:
        raise _replaced(pool_name)


def _replaced(pool_name: str) -> SegmentError:
    return SegmentError(
            f"pool {pool_name!r} was replaced (unlinked, and made again or not) after this "
            f"process attached to it: {WHAT} {region_path(pool_name)} is not the attached "
            "pool's; open the store again")


def _forget_pages(pool: BlockPool) -> None:
    """Drops every key the pool holds: the bytes they named are gone (pool lock held). The
    complete pages among them are logged removed."""
    rows = pool.block_rows()
    keyed = np.flatnonzero(rows["hash_num_tokens"] != L.NO_HASH_TOKENS)
    del rows
    keyed = keyed[keyed > 0].tolist()
    if keyed:
        log_removed(pool, complete_keys(pool, keyed))
        pool.evict_blocks(keyed)


def _unlink_if(path: str, fd: int) -> None:
    """Unlinks ``path`` if it is still the file open at ``fd``."""
    try:
        if os.lstat(path).st_ino == os.fstat(fd).st_ino:
            os.unlink(path)
    except FileNotFoundError:
        pass


def _find_or_claim(path: str, pool: BlockPool, pool_name: str) -> tuple[int, bool] | None:
    """Under the pool lock: (descriptor, True) of a new file this process now makes,
    (descriptor, False) of a complete region, or None while another process makes it.
    A region of an earlier pool, or one whose maker died, is unlinked and claimed. A process
    whose pool was replaced since it attached maps, unlinks and makes nothing.

    Raises:
        SegmentError: the file is a link, another user's, or not mode 0600; the attached
            pool is no longer the one of its name.
        LayoutMismatchError: a header of another magic (named).
    """
    mine = _pool_id(pool)
    _check_current(pool_name, mine)
    try:
        fd = open_checked(path, os.O_RDWR, WHAT)
    except FileNotFoundError:
        fd = -1
    if fd >= 0:
        ready = False
        try:
            head = os.pread(fd, HEADER_BYTES, 0)
            magic = int.from_bytes(head[:8], "little") if len(head) >= 8 else 0
            if magic not in (0, L.SGLANG_STORE_MAGIC):
                raise LayoutMismatchError(
                    f"{path}: magic {magic:#x}, expected {L.SGLANG_STORE_MAGIC:#x}: not a "
                    "shmkv SGLang page store")
            ready = magic != 0 and _belongs(head, mine)
            if ready:
                return fd, False
            if magic == 0 and _maker_alive(fd):
                return None  # being made
            os.unlink(path)  # an earlier pool's, or its maker died making it
        finally:
            if not ready:
                os.close(fd)
    fd = open_checked(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, WHAT)
    try:
        _maker_lock(fd, fcntl.F_WRLCK)
    except BaseException:
        _unlink_if(path, fd)
        os.close(fd)
        raise
    return fd, True


def _make(pool: BlockPool, fd: int, path: str, pool_name: str, num_pages: int,
          page_bytes: int, identity: bytes) -> None:
    """Reserves and fills the region claimed at ``fd`` (out of the pool lock), then drops
    the pool's keys and writes the magic under it, and releases the maker's lock. On
    failure the file is unlinked."""
    num_rows = pool.layout.config.max_processes
    size = region_bytes(num_pages, page_bytes, num_rows)
    try:
        st = os.statvfs(SHM_DIR)
        if st.f_bavail * st.f_frsize < size:
            raise no_space(f"{WHAT} {path}", size, errno.ENOSPC)
        reserve(fd, size, f"{WHAT} {path}")
        head = bytearray(HEADER_BYTES)
        # the owner is the pool attached, never whatever pool bears the name now
        owner = owner_record(pool_name, creator=False) if pool_identity(pool_name) else None
        if owner is None or bytes(owner[0]["pool_id"]) != _pool_id(pool):
            raise _replaced(pool_name)
        write_owner(head, L.SGLANG_STORE_OWNER_OFFSET, owner)
        head[IDENTITY_OFFSET:IDENTITY_OFFSET + len(identity)] = identity
        _FIELDS.pack_into(head, 0, 0, L.SGLANG_STORE_VERSION, num_pages, page_bytes,
                          len(identity), num_rows)
        os.pwrite(fd, bytes(head), 0)
        with pool.lock():
            _forget_pages(pool)
            os.pwrite(fd, L.SGLANG_STORE_MAGIC.to_bytes(8, "little"), 0)  # last: complete
        _maker_lock(fd, fcntl.F_UNLCK)
    except BaseException:
        _unlink_if(path, fd)
        raise


def open_region(pool: BlockPool, pool_name: str, page_bytes: int, identity: bytes,
                check_identity: Callable[[bytes], None]) -> PageRegion:
    """Maps the pool's page store, making it (with ``identity``) if it is missing, left by
    an earlier pool of the name, or left half made by a dead maker, then hands the identity
    found to ``check_identity`` (which raises to refuse it). One process makes it; the
    pool lock is held only for short steps (see the module docstring).

    Raises:
        LayoutMismatchError: a region of another version, magic or geometry (both named),
            or an identity too long to record.
        SegmentError: the file is a link, another user's or not mode 0600; another process
            took longer than MAKER_WAIT_S to make it.
        NoSpaceError: /dev/shm has no room for it (nothing is left behind).
    """
    if len(identity) > IDENTITY_MAX:
        raise LayoutMismatchError(
            f"the SGLang store identity is {len(identity)} bytes; at most {IDENTITY_MAX} fit")
    num_pages = pool.num_gpu_blocks - 1
    name, path = region_name(pool_name), region_path(pool_name)
    num_rows = pool.layout.config.max_processes
    size = region_bytes(num_pages, page_bytes, num_rows)
    deadline = time.monotonic() + MAKER_WAIT_S
    while True:
        with pool.lock():
            found = _find_or_claim(path, pool, pool_name)
        if found is not None:
            break
        if time.monotonic() > deadline:
            raise SegmentError(f"waited {MAKER_WAIT_S:.0f} s for another process to make {WHAT} "
                               f"{path}")
        time.sleep(0.01)
    fd, making = found
    try:
        if making:
            _make(pool, fd, path, pool_name, num_pages, page_bytes, identity)
        head = os.pread(fd, HEADER_BYTES, 0)
        magic, version, found_pages, found_bytes, id_len, found_rows = _FIELDS.unpack_from(
            head, 0)
        if version != L.SGLANG_STORE_VERSION:
            raise LayoutMismatchError(
                f"{name}: version {version}, expected {L.SGLANG_STORE_VERSION}: not a shmkv "
                "SGLang page store of this version")
        check_identity(head[IDENTITY_OFFSET:IDENTITY_OFFSET + id_len])
        length = os.fstat(fd).st_size
        if found_pages != num_pages or found_rows != num_rows or length < size:
            raise LayoutMismatchError(
                f"{name}: holds {found_pages} pages and {found_rows} counter rows in "
                f"{length} bytes, the pool {num_pages} pages and {num_rows} process slots "
                f"({size} bytes)")
        if found_bytes != page_bytes:
            raise LayoutMismatchError(
                f"store {pool_name!r}: field page_bytes differs: the store has "
                f"{found_bytes}, this instance {page_bytes}")
        seg = Segment(name, mmap.mmap(fd, size))
        ino = os.fstat(fd).st_ino
    finally:
        os.close(fd)
    try:
        return PageRegion(seg, num_pages, page_bytes, path, ino, num_rows)
    except BaseException:
        seg.close()
        raise
