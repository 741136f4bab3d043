"""The life of a shared tier: its objects are made, joined, bound and removed as ONE thing.

The vLLM offload tier is four objects in /dev/shm, and every rule that keeps a replica from
loading another tier's bytes is about how they live together:

    object               name                                               generation kept in
    pool (the root)      /shmkv-<pool>-v<LAYOUT_VERSION>                    header `pool_id`
    tier table           /shmkv_offload-<pool>-v<OFFLOAD_TIER_VERSION>      words 12-13
    replica lock file    <tier table path>.replicas                         bytes 0-15 (content)
    data region          vllm_offload_shmkv_offload<v>_data-<pool>.mmap     its trailer

The rules, each stated once, here:

1. **A generation binds a tier.** The generation is the pool's `pool_id`, 16 random bytes
   drawn when the pool is made. Every other object records the generation it was made for;
   every attach compares it (:func:`check_generation`); an object of another generation is
   never believed: a stale one (left by a removed pool of the same name) is made afresh
   when nothing holds it, and a process is refused, naming the object and both generations,
   when something still does.
2. **Versions never meet.** The format version is in every object's name (the pool's layout
   version, the table's and the lock file's tier version, the region's prefix), so a release
   of another format finds none of this one's objects and makes its own: a rolling upgrade or
   a rollback costs a cold tier for the other version, and memory for both. A new format of
   any object of a tier bumps the pool's layout version with it: the pool holds the tier's
   keys, so two releases sharing it would each load the other's keys from their own region
   (tier table v5 came with pool v10; the SGLang store follows the pool's version).
3. **A table is made with its pool.** The process that made the pool makes the table. A
   pool found without its table (the table removed alone) has keys whose bytes nothing
   vouches for: the table is made again only while nobody else holds the tier, and the pool
   forgets every key in the same lock hold; while others hold it, the process is refused.
4. **Held.** A tier is held while a process is attached to its pool, or holds any byte of
   its replica lock file: every engine core and GPU worker of a replica takes its row's byte
   the moment it joins, before it maps the region, and a worker making the data region takes
   the maker's byte. :func:`holders` says who.
5. **Removed whole, root first.** The pool goes first; then each other object goes only if
   it records the removed generation (or none, being unfinished), so a tier made again
   meanwhile under the same name keeps its objects. Never while the tier is held, unless
   forced (``shmkv unlink --force``), which names what the running replicas lose.
6. **Idle since.** A tier nothing holds (rule 4) has been idle since a process last joined
   or left it. Each process records that moment itself, as the modification time of the
   file it locks a byte of (:func:`record_presence`): the pool's liveness file (``.alive``,
   locked by every process attached to the pool) as it takes and gives back its slot, and
   the replica lock file (locked by every engine core and GPU worker) as it joins and
   leaves its row. :func:`idle_since` reads the newest of those times (the pool segment's
   own for a pool that has neither file). What follows from it:

   - held is judged by the kernel's locks, never by a clock: a tier held now is in use
     whatever its times say, so no clock step makes a busy tier idle;
   - file times are wall-clock (``CLOCK_REALTIME``): a step forward makes an idle tier
     look idle longer than it was (``shmkv cleanup --idle-for`` removes it that much
     sooner); a step back makes it look idle for less (a time in the future reads as 0 s)
     and keeps it longer;
   - a process that is killed (SIGKILL, the OOM killer) gives its bytes back without a
     word: the time is then the last join or leave before it, so the tier reads idle for
     longer than it is, by as long as that process ran after it joined. A pool whose
     process table still has rows of dead processes shows it, and cleanup says "up to";
   - a process that attaches to look (``shmkv stats``, ``inspect``) joins and leaves like
     any other; ``shmkv ls``, ``cleanup`` and the replicas' start-up notice read without
     attaching and record nothing;
   - the table's and the region's times are never read, the segment's only for want of
     both files: they move when a page is first written through a mapping, not when the
     tier is used.

Who calls what: ``shmkv/vllm/tier.py`` (the table), ``shmkv/vllm/replicas.py`` (the lock
file), ``shmkv/vllm/region.py`` (the region) check and record generations through this
module; ``shmkv/pool/liveness.py`` (the pool's slots) and ``replicas.py`` (the rows) record
joins and leaves through it; ``shmkv/pool/siblings.py`` (``shmkv cleanup``, ``shmkv unlink``)
asks it who holds a tier and since when it is idle, and removes through it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import stat
import struct

from shmkv.errors import LayoutMismatchError
from shmkv.pool import layout as L

SHM_DIR = "/dev/shm"
GENERATION_BYTES = 16
LOCK_FILE_GENERATION_AT = 0  # the lock file's content; its rows' locks are byte ranges
_FLOCK = struct.Struct("hhqqi4x")  # struct flock on Linux x86_64 / aarch64
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def generation_text(generation: bytes) -> str:
    """A generation as operators see it (``shmkv ls``, errors): its first 6 bytes in hex;
    'none' for an object that records none."""
    return generation[:6].hex() if any(generation) else "none"


def check_generation(what: str, path: str, found: bytes, expected: bytes, pool: str) -> None:
    """Refuses an object of another generation than the tier's pool.

    Raises:
        LayoutMismatchError: naming the object, both generations and what to do.
    """
    if found != expected:
        raise LayoutMismatchError(
            f"pool {pool!r}: {what} {path} belongs to generation {generation_text(found)}, "
            f"the pool to {generation_text(expected)}: it was left by a removed tier of the "
            "same name whose processes still hold it. Stop the replicas started before the "
            f"tier was removed (`shmkv ls` shows the holders), or use another shmkv_pool; "
            f"`shmkv unlink --force {pool}` removes both"
        )


# ------------------------------------------------------------------ names

def table_name(pool: str, version: int = L.OFFLOAD_TIER_VERSION) -> str:
    """The tier table's POSIX name."""
    return L.sibling_segment_name("offload", pool, version)


def lock_file_path(pool: str, version: int = L.OFFLOAD_TIER_VERSION) -> str:
    """The replica lock file, beside the table."""
    return f"{SHM_DIR}{table_name(pool, version)}{L.OFFLOAD_REPLICAS_SUFFIX}"


def region_paths(pool: str, prefix: str = L.OFFLOAD_DATA_REGION_PREFIX) -> list[str]:
    """The tier's data region files in /dev/shm (made, or being made), sorted."""
    try:
        entries = os.listdir(SHM_DIR)
    except OSError:
        return []
    return [f"{SHM_DIR}/{e}" for e in sorted(entries)
            if L.offload_data_region_pool(e, prefix) == pool]


# ------------------------------------------------------------------ the lock file

def read_lock_file_generation(fd: int) -> bytes:
    """The generation a replica lock file records (zeros: none yet)."""
    data = os.pread(fd, GENERATION_BYTES, LOCK_FILE_GENERATION_AT)
    return data.ljust(GENERATION_BYTES, b"\0")


def make_lock_file(path: str, generation: bytes) -> None:
    """Puts a replica lock file recording ``generation`` at ``path``, complete or not at
    all (written under a temporary name, then linked into place).

    Raises:
        FileExistsError: a file is at ``path`` already.
    """
    tmp = f"{path}.making-{secrets.token_hex(6)}"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.pwrite(fd, generation, LOCK_FILE_GENERATION_AT)
        os.link(tmp, path)
    finally:
        os.close(fd)
        os.unlink(tmp)


def locked_bytes(fd: int, first: int = 0, count: int = 0) -> bool:
    """Whether another open file description holds a lock on bytes ``[first, first +
    count)`` of ``fd``'s file (``count`` 0: to its end)."""
    answer = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET,
                                                            first, count, 0))
    return _FLOCK.unpack(answer)[0] != fcntl.F_UNLCK


def open_read(path: str) -> int | None:
    """A read-only descriptor of ``path`` (never through a link, never blocking); None if
    it cannot be opened."""
    try:
        return os.open(path, _READ)
    except OSError:
        return None


# ------------------------------------------------------------------ who holds a tier

def holders(pool: str, generation: bytes | None = None) -> list[str]:
    """Why the offload tier of ``pool`` is held beyond its pool's attached processes (which
    the caller judges): a replica lock file some process holds a byte of (every engine core
    and GPU worker of a replica, from the moment it joins; a worker making the data region
    also holds the maker's byte, so a region under its temporary name is held while it is
    being made, and a stale one, its maker dead, is not).
    ``generation``: only a lock file of that generation counts (one of another holds
    another tier). Empty: nothing but the pool's own processes can hold it."""
    reasons = []
    path = lock_file_path(pool)
    fd = open_read(path)
    if fd is not None:
        try:
            mine = generation is None or read_lock_file_generation(fd) == generation
            if mine and locked_bytes(fd):
                reasons.append(f"replica processes (engine cores, GPU workers) hold {path}")
        except OSError:
            reasons.append(f"{path} cannot be read for locks: kept")
        finally:
            os.close(fd)
    return reasons


# ------------------------------------------------------------------ idle since (rule 6)

def record_presence(fd: int) -> None:
    """Records that a process joins or leaves the tier now: sets the modification time of
    ``fd``'s file (a file whose bytes the tier's processes lock) to now. A record is advice:
    a file that cannot take it keeps its older time."""
    try:
        os.utime(fd)
    except OSError:
        pass


def presence_paths(pool: str) -> list[str]:
    """The files whose modification time records when a process last joined or left the
    tier of ``pool``: the pool's liveness file and the replica lock file."""
    return [f"{SHM_DIR}{L.segment_name(pool)}.alive", lock_file_path(pool)]


def idle_since(pool: str, segment_mtime: float) -> float:
    """When a process last joined or left the tier of ``pool`` (seconds since the epoch,
    wall-clock): the newest time of :func:`presence_paths` that are regular files of this
    user, else ``segment_mtime`` (the pool segment's). Meaningful only for a tier nothing
    holds (rule 6: what a clock step and a killed process do to it)."""
    times = []
    for path in presence_paths(pool):
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
            times.append(st.st_mtime)
    return max(times, default=segment_mtime)


# ------------------------------------------------------------------ removal

def remove_objects(pool: str, generation: bytes | None, *, past: bool = True) -> list[str]:
    """Removes the offload tier's table, data region and replica lock file once its pool is
    gone (root first: the caller removed the pool, or found none). An object recording
    another generation than ``generation`` belongs to a tier made again meanwhile and stays;
    ``generation`` None: the pool is gone and its generation unknown, so every object goes.
    A region still being made goes only with its generation's table. ``past``: also the
    earlier versions' objects. Returns what was removed, one phrase each."""
    removed: list[str] = []

    def ours(found: bytes) -> bool:
        return generation is None or not any(found) or found == generation

    name = table_name(pool)
    table_gen = _table_generation(name)
    if table_gen is not None and ours(table_gen) and _unlink(SHM_DIR + name):
        removed.append("offload tier table")
    for path in region_paths(pool):
        if L.OFFLOAD_REGION_MAKING in path and table_gen is not None and not ours(table_gen):
            continue
        if ours(_region_generation(path)) and _unlink(path) and \
                "offload data region" not in removed:  # one file per rank: said once
            removed.append("offload data region")
    path = lock_file_path(pool)
    fd = open_read(path)
    if fd is not None:
        try:
            mine = ours(read_lock_file_generation(fd))
        finally:
            os.close(fd)
        if mine and _unlink(path):
            removed.append("offload replica locks")
    if past:
        for prefix, versions in L.PAST_OFFLOAD_DATA_REGION_PREFIXES.items():
            what = f"offload data region ({versions})"
            for path in region_paths(pool, prefix):
                if _unlink(path) and what not in removed:
                    removed.append(what)
    return removed


def _unlink(path: str) -> bool:
    """Removes ``path`` if it is a regular file of this user (a link, a FIFO, a directory or
    another user's file planted at a tier's name is never removed); True if it did."""
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return False
        os.unlink(path)
        return True
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            return False
        raise


TABLE_GENERATION_WORD = 12  # the tier table's header words 12-13 (shmkv/vllm/tier.py)
REGION_TRAILER = struct.Struct("<16sq16s")  # magic, tag, generation (shmkv/vllm/region.py)


def _table_generation(name: str) -> bytes | None:
    """The generation a tier table records; None if there is no table (or not a file)."""
    fd = open_read(SHM_DIR + name)
    if fd is None:
        return None
    try:
        data = os.pread(fd, GENERATION_BYTES, 8 * TABLE_GENERATION_WORD)
    finally:
        os.close(fd)
    return data.ljust(GENERATION_BYTES, b"\0")


def _region_generation(path: str) -> bytes:
    """The generation a data region's trailer records (zeros: none, or not a region)."""
    fd = open_read(path)
    if fd is None:
        return bytes(GENERATION_BYTES)
    try:
        size = os.fstat(fd).st_size
        page = os.sysconf("SC_PAGE_SIZE")
        if size < page:
            return bytes(GENERATION_BYTES)
        trailer = os.pread(fd, REGION_TRAILER.size, size - page)
    finally:
        os.close(fd)
    if len(trailer) < REGION_TRAILER.size:
        return bytes(GENERATION_BYTES)
    return REGION_TRAILER.unpack(trailer)[2]
