"""Create, attach, close and unlink the POSIX shared-memory segment of a pool.

``posix_ipc.SharedMemory`` + ``mmap``, mode 0600. Never ``multiprocessing.shared_memory``: on
Python < 3.13 its resource tracker unlinks a segment when any attaching process exits.
Attach validates the header in a fixed order and names the first field that is wrong.

Every file and segment shmkv opens (the pool segment, its liveness file, its semaphore, the
stats and publisher-state segments, channels and their doorbells, block tables) follows one
rule, :func:`check_fd` / :func:`check_path`: created exclusively (``O_EXCL``; shm_open adds
``O_NOFOLLOW``, plain files are opened with it), then ``fchmod`` 0600 whatever the umask;
opened only if it is a regular file owned by this user (the pool's owner: attach refuses a
pool segment of another uid) with mode exactly 0600. Anything else is refused with a
SegmentError naming the file: another user must not be able to plant one (a foreign
``.alive`` would let them block reaping and take-over).

Every segment is made by :func:`create_shm`, which reserves its pages at once
(``posix_fallocate``): a segment only sized with ``ftruncate`` is sparse, and the first
touch of a page /dev/shm has no room for kills the process with SIGBUS (Docker's default
/dev/shm is 64 MiB). No room is a :class:`NoSpaceError` at creation instead, naming the size
and the free space, with the new segment unlinked and its descriptor closed.
"""

from __future__ import annotations

import errno
import mmap
import os
import secrets
import stat

import numpy as np
import posix_ipc

from shmkv.errors import (
    LayoutMismatchError,
    NoSpaceError,
    SegmentError,
    SegmentExistsError,
    SegmentNotFoundError,
)
from shmkv.pool import layout as L

SEGMENT_MODE = 0o600
SHM_DIR = "/dev/shm"


def _problems(st: os.stat_result) -> list[str]:
    out = []
    if not stat.S_ISREG(st.st_mode):
        out.append("not a regular file")
    if st.st_uid != os.geteuid():
        out.append(f"owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})")
    mode = stat.S_IMODE(st.st_mode)
    if mode != SEGMENT_MODE:
        out.append(f"mode {mode:04o}, not {SEGMENT_MODE:04o}")
    return out


_FILE_TYPES = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
               (stat.S_ISLNK, "a symbolic link"), (stat.S_ISSOCK, "a socket"),
               (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def file_type(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, in words ("a FIFO", "a directory"...)."""
    return next((words for test, words in _FILE_TYPES if test(mode)), "a regular file")


def _shm_open(shm_name: str, what: str) -> posix_ipc.SharedMemory:
    """``posix_ipc.SharedMemory(shm_name)``, with a directory or a symbolic link planted at
    its path (posix_ipc's bare ``ValueError: Invalid parameter(s)``, ``[Errno 40]``) refused
    as a SegmentError naming the path and what is there."""
    try:
        return posix_ipc.SharedMemory(shm_name)
    except (ValueError, OSError) as exc:
        path = f"{SHM_DIR}/{shm_name.lstrip('/')}"
        try:
            kind = file_type(os.lstat(path).st_mode)
        except OSError:
            kind = "unreadable"
        raise SegmentError(f"{what} {path} is {kind}, not a shared-memory segment; refusing "
                           "to use it (not shmkv's: its owner, or root, can remove it)") from exc


def check_fd(fd: int, what: str) -> None:
    """Refuses an opened file or segment that is not a regular file of this user with mode
    0600 (SegmentError naming ``what``: kind and name)."""
    problems = _problems(os.fstat(fd))
    if problems:
        raise SegmentError(f"{what}: {'; '.join(problems)}; refusing to use it")


def open_checked(path: str, flags: int, what: str) -> int:
    """Opens ``path`` without following a link and without blocking (``O_NOFOLLOW |
    O_CLOEXEC | O_NONBLOCK`` added: a FIFO planted at the path never blocks the open; mode
    0600 when ``flags`` create it) and refuses it by ``check_fd``'s rule; returns the
    descriptor, blocking again. ``FileNotFoundError`` and ``FileExistsError`` pass through.

    Raises:
        SegmentError: naming ``what`` and ``path``: a link, a directory, a FIFO, another
            user's file, not a regular file, or not mode 0600.
    """
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, SEGMENT_MODE)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SegmentError(f"{what} {path} is a symbolic link; refusing to use it") from exc
        if exc.errno in (errno.EISDIR, errno.ENXIO, errno.ENODEV, errno.ENOTDIR):
            raise SegmentError(f"{what} {path} is not a regular file ({exc.strerror}); "
                               "refusing to use it") from exc
        raise
    try:
        if flags & os.O_CREAT:
            secure_new_fd(fd)
        check_fd(fd, f"{what} {path}")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_path(path: str, what: str) -> None:
    """``check_fd`` for a file known only by path (a POSIX semaphore, /dev/shm/sem.<name>),
    without following a symbolic link."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return  # the caller's open reports it missing
    problems = _problems(st)
    if problems:
        raise SegmentError(f"{what}: {'; '.join(problems)}; refusing to use it")


def semaphore_path(sem_name: str) -> str:
    """Where Linux keeps a named POSIX semaphore: /dev/shm/sem.<name without the slash>."""
    return f"{SHM_DIR}/sem.{sem_name.lstrip('/')}"


def secure_new_fd(fd: int) -> None:
    """A file or segment just created exclusively: mode 0600 whatever the umask."""
    os.fchmod(fd, SEGMENT_MODE)


def reserve(fd: int, size: int, what: str) -> None:
    """Reserves the pages of bytes ``[0, size)`` of an opened segment now, so that no room
    is an error here, never a SIGBUS on first touch. Already reserved pages cost nothing.

    Raises:
        NoSpaceError: /dev/shm (or the memory behind it) has no room; names ``what``, the
            size and the free space.
    """
    if size <= 0:
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in NO_SPACE_ERRNOS:
            raise
        raise no_space(what, size, exc.errno) from None


NO_SPACE_ERRNOS = (errno.ENOSPC, errno.ENOMEM, errno.EFBIG)


def no_space(what: str, size: int, err: int) -> NoSpaceError:
    """The NoSpaceError for ``what`` of ``size`` bytes, with /dev/shm's free space now."""
    try:
        st = os.statvfs(SHM_DIR)
        room = f"{st.f_bavail * st.f_frsize:,} bytes free of {st.f_blocks * st.f_frsize:,}"
    except OSError:
        room = "free space unknown"
    return NoSpaceError(
        f"{what}: no room in {SHM_DIR} for {size:,} bytes ({room}; {os.strerror(err)}): "
        "make it smaller, free space (shmkv ls, shmkv cleanup), or give /dev/shm more room "
        "(docker run --shm-size=...)"
    )


def create_shm(shm_name: str, size: int, what: str) -> posix_ipc.SharedMemory:
    """Creates a segment exclusively: ``size`` bytes, mode 0600 whatever the umask, its
    pages reserved. On any failure the new segment is unlinked and its descriptor closed.

    Raises:
        posix_ipc.ExistentialError: a segment of that name exists already.
        NoSpaceError: no room for it (``reserve``).
    """
    shm = posix_ipc.SharedMemory(shm_name, posix_ipc.O_CREX, mode=SEGMENT_MODE, size=size)
    try:
        secure_new_fd(shm.fd)
        reserve(shm.fd, size, f"{what} {shm_name}")
    except BaseException:
        shm.close_fd()
        try:
            posix_ipc.unlink_shared_memory(shm_name)
        except posix_ipc.ExistentialError:
            pass
        raise
    return shm


def open_shm(shm_name: str, what: str, *, create: bool = False,
             size: int = 0) -> posix_ipc.SharedMemory:
    """Opens a sibling shared-memory segment by the rule above: with ``create``, created
    exclusively if it does not exist (``size`` bytes, mode 0600), else the existing one;
    either way refused unless this user's with mode 0600.

    Raises:
        posix_ipc.ExistentialError: it does not exist (and ``create`` is False).
        SegmentError: naming the segment, when it is another user's, or not 0600.
        NoSpaceError: no room to create it (nothing is left behind).
    """
    shm = None
    if create:
        try:
            shm = create_shm(shm_name, size, what)
        except posix_ipc.ExistentialError:
            shm = None
    if shm is None:
        shm = _shm_open(shm_name, what)
    try:
        check_fd(shm.fd, f"{what} {shm_name}")
    except BaseException:
        shm.close_fd()
        raise
    return shm


class Segment:
    """One mapped shared-memory object. Only its owner unlinks it, explicitly."""

    def __init__(self, shm_name: str, mapping: mmap.mmap) -> None:
        self.shm_name = shm_name
        self.buf: mmap.mmap | None = mapping

    @property
    def size_bytes(self) -> int:
        return 0 if self.buf is None else len(self.buf)

    @classmethod
    def create(cls, shm_name: str, size_bytes: int, what: str = "segment") -> Segment:
        """Creates a new zero-filled segment of ``size_bytes``, its pages reserved;
        ``what`` names it in errors.

        Raises:
            SegmentExistsError: a segment of that name exists already.
            NoSpaceError: /dev/shm has no room for its pages (nothing is left behind).
        """
        try:
            shm = create_shm(shm_name, size_bytes, what)
        except posix_ipc.ExistentialError as exc:
            raise SegmentExistsError(
                f"shared-memory segment {shm_name} already exists; attach to it, or unlink it "
                "first if it is stale"
            ) from exc
        try:
            mapping = mmap.mmap(shm.fd, size_bytes)
        except BaseException:
            shm.close_fd()
            posix_ipc.unlink_shared_memory(shm_name)
            raise
        shm.close_fd()
        return cls(shm_name, mapping)

    @classmethod
    def open(cls, shm_name: str) -> Segment:
        """Maps an existing segment, whatever its size.

        Raises:
            SegmentNotFoundError: no segment of that name.
        """
        try:
            shm = _shm_open(shm_name, "segment")
        except posix_ipc.ExistentialError as exc:
            raise SegmentNotFoundError(f"no shared-memory segment named {shm_name}") from exc
        try:
            owner = os.fstat(shm.fd).st_uid
            if owner != os.geteuid():
                # Root would be let in whatever the mode bits say: check the owner ourselves.
                raise SegmentError(
                    f"segment {shm_name} is owned by uid {owner}, not by this user "
                    f"(uid {os.geteuid()}); refusing to attach"
                )
            check_fd(shm.fd, f"segment {shm_name}")
            if shm.size == 0:
                raise LayoutMismatchError(
                    f"segment {shm_name} is empty (0 bytes): not a shmkv segment"
                )
            mapping = mmap.mmap(shm.fd, shm.size)
        finally:
            shm.close_fd()
        return cls(shm_name, mapping)

    def close(self) -> None:
        """Unmaps the segment. Every view of it must be dropped first: a memoryview still
        exported keeps the mapping (it goes when the view does), but numpy arrays do not,
        and touching one after close() reads unmapped memory."""
        if self.buf is not None:
            try:
                self.buf.close()
            except BufferError:
                pass
            self.buf = None

    @staticmethod
    def unlink(shm_name: str) -> bool:
        """Removes the name; mappings stay valid until closed. False if it did not exist."""
        try:
            posix_ipc.unlink_shared_memory(shm_name)
        except posix_ipc.ExistentialError:
            return False
        return True


def write_header(buf: mmap.mmap, lay: L.Layout) -> None:
    """Writes the header of a new segment, in state INITIALIZING."""
    cfg = lay.config
    hdr = lay.view(buf, "header")[0]
    hdr["magic"] = L.MAGIC
    hdr["layout_version"] = L.LAYOUT_VERSION
    hdr["format_flags"] = cfg.format_flags
    hdr["header_bytes"] = L.HEADER_DTYPE.itemsize
    hdr["state"] = L.STATE_INITIALIZING
    hdr["total_bytes"] = lay.total_bytes
    hdr["num_blocks"] = cfg.num_blocks
    hdr["hash_block_size"] = cfg.hash_block_size
    hdr["num_index_buckets"] = cfg.num_index_buckets
    hdr["block_hash_bytes"] = L.BLOCK_HASH_BYTES
    hdr["creator_pid"] = os.getpid()
    hdr["medium"] = cfg.medium.encode()
    hdr["max_processes"] = cfg.max_processes
    hdr["event_log_bytes"] = cfg.event_log_bytes
    hdr["journal_entries"] = cfg.journal_entries
    hdr["hash_fn_name"] = cfg.hash_fn_name.encode()
    hdr["num_hash_lookahead_tokens"] = cfg.num_hash_lookahead_tokens
    hdr["pool_id"] = secrets.token_bytes(16)  # this pool, not another of its name or pid
    hdr["retention"] = L.RETENTION_SCOPED  # until mark_stays, once the pool is complete
    hdr["epoch"] = 1
    del hdr


def read_config(seg: Segment, expected: dict[str, object] | None = None,
                allow_poisoned: bool = False) -> L.Layout:
    """Validates a segment's header and returns its layout.

    Checks, in order: size >= header, magic, a header still being written (state
    INITIALIZING: the creator writes the magic first), layout version, format flags, header
    size, hash width, total size (header vs layout formula vs actual), the caller's expected
    config, state. ``expected`` maps PoolConfig field names to the values the caller requires.

    Raises:
        LayoutMismatchError: naming the field, the expected and the found value.
        SegmentError: the segment is still initialising or is poisoned.
    """
    name = seg.shm_name
    size = seg.size_bytes
    if size < L.HEADER_DTYPE.itemsize:
        raise LayoutMismatchError(
            f"segment {name} is {size} bytes, smaller than a shmkv header "
            f"({L.HEADER_DTYPE.itemsize} bytes): not a shmkv segment"
        )
    hdr = np.ndarray((1,), L.HEADER_DTYPE, buffer=seg.buf)[0].copy()

    def mismatch(field: str, want: object, found: object, what: str = "") -> LayoutMismatchError:
        return LayoutMismatchError(
            f"segment {name}: header field {field} is {found!r}, expected {want!r}{what}"
        )

    if int(hdr["magic"]) != L.MAGIC:
        raise mismatch("magic", hex(L.MAGIC), hex(int(hdr["magic"])), ": not a shmkv segment")
    if int(hdr["state"]) in (0, L.STATE_INITIALIZING):  # magic is written first: its creator
        raise SegmentError(  # is still writing the header, whose other fields mean nothing yet
            f"segment {name} is in state INITIALIZING, not READY: its creator has not "
            "finished (or died while) initialising it"
        )
    if int(hdr["layout_version"]) != L.LAYOUT_VERSION:
        raise mismatch(
            "layout_version", L.LAYOUT_VERSION, int(hdr["layout_version"]),
            " (made by another shmkv version)",
        )
    flags = int(hdr["format_flags"])
    known = L.FLAG_PREFIX_CACHING | L.FLAG_KV_EVENTS | L.FLAG_PARTIAL_KEYS
    if flags & ~known:
        raise mismatch("format_flags", f"a subset of {known:#x}", f"{flags:#x}")
    if int(hdr["header_bytes"]) != L.HEADER_DTYPE.itemsize:
        raise mismatch("header_bytes", L.HEADER_DTYPE.itemsize, int(hdr["header_bytes"]))
    if int(hdr["block_hash_bytes"]) != L.BLOCK_HASH_BYTES:
        raise mismatch("block_hash_bytes", L.BLOCK_HASH_BYTES, int(hdr["block_hash_bytes"]))
    num_blocks = int(hdr["num_blocks"])
    hash_block_size = int(hdr["hash_block_size"])
    if not 0 < num_blocks <= L.MAX_NUM_BLOCKS:
        raise mismatch("num_blocks", f"1..{L.MAX_NUM_BLOCKS}", num_blocks)
    if hash_block_size <= 0:
        raise mismatch("hash_block_size", "> 0", hash_block_size)
    config = L.PoolConfig(
        num_blocks=num_blocks,
        hash_block_size=hash_block_size,
        enable_caching=bool(flags & L.FLAG_PREFIX_CACHING),
        enable_kv_cache_events=bool(flags & L.FLAG_KV_EVENTS),
        partial_keys=bool(flags & L.FLAG_PARTIAL_KEYS),
        medium=bytes(hdr["medium"]).decode(errors="replace"),
        max_processes=int(hdr["max_processes"]),
        event_log_bytes=int(hdr["event_log_bytes"]),
        hash_fn_name=bytes(hdr["hash_fn_name"]).decode(errors="replace"),
        journal_entries=int(hdr["journal_entries"]),
        num_hash_lookahead_tokens=int(hdr["num_hash_lookahead_tokens"]),
    )
    if not 0 <= config.num_hash_lookahead_tokens <= L.MAX_HASH_LOOKAHEAD_TOKENS:
        raise mismatch(
            "num_hash_lookahead_tokens", f"0..{L.MAX_HASH_LOOKAHEAD_TOKENS}",
            config.num_hash_lookahead_tokens,
        )
    if not 1 <= config.max_processes <= L.MAX_PROCESSES:
        raise mismatch("max_processes", f"1..{L.MAX_PROCESSES}", config.max_processes)
    if not L.MIN_JOURNAL_ENTRIES <= config.journal_entries <= L.MAX_JOURNAL_ENTRIES:
        raise mismatch(
            "journal_entries", f"{L.MIN_JOURNAL_ENTRIES}..{L.MAX_JOURNAL_ENTRIES}",
            config.journal_entries,
        )
    lay = L.Layout.from_config(config)
    if int(hdr["num_index_buckets"]) != config.num_index_buckets:
        raise mismatch("num_index_buckets", config.num_index_buckets, int(hdr["num_index_buckets"]))
    if int(hdr["total_bytes"]) != lay.total_bytes:
        raise mismatch("total_bytes", lay.total_bytes, int(hdr["total_bytes"]))
    if size < lay.total_bytes:
        raise LayoutMismatchError(
            f"segment {name} is {size} bytes but its header describes {lay.total_bytes}"
        )
    if expected:
        wrong = [
            f"{field}: expected {want!r}, found {getattr(config, field)!r}"
            for field, want in expected.items()
            if want is not None and getattr(config, field) != want
        ]
        if wrong:
            raise LayoutMismatchError(
                f"segment {name} has another config: " + "; ".join(wrong)
            )
    state = int(hdr["state"])
    if state != L.STATE_READY and not (allow_poisoned and state == L.STATE_POISONED):
        label = L.STATE_NAMES.get(state, f"unknown ({state})")
        raise SegmentError(
            f"segment {name} is in state {label}, not READY"
            + (
                ": its creator has not finished (or died while) initialising it"
                if state == L.STATE_INITIALIZING
                else ": check_invariants found corruption in it"
                if state == L.STATE_POISONED
                else ""
            )
        )
    return lay
