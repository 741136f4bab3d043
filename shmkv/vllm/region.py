"""The tier's data region: vLLM's shared offload file, bound to the pool that describes it.

Every replica's workers map ONE file, ``/dev/shm/vllm_offload_<engine id>.mmap`` with the
engine id named after the pool, through vLLM's own ``SharedOffloadRegion``. The file is one
page longer than vLLM maps: its trailer holds ``REGION_MAGIC``, a random non-zero tag and
the tier's generation (its pool's ``pool_id``: ``shmkv/pool/lifecycle.py``), and the tier
table holds the tag of the region its chunk metadata describes. So:

- a region and a pool belong together only when the tags and the generations agree. A
  region left by an earlier pool of the name, or a pool whose region was removed, is never
  believed: the worker that finds it so makes a fresh region (all zeros, pages reserved),
  binds its tag, and drops every chunk the tier described, since their bytes are gone;
- each replica row records the tag its workers mapped, per process: a row whose workers
  mapped different regions is marked mixed (``_bind_row``); a replica whose workers map
  another region than the tier's (the file was replaced under them, under one of them) gets
  no hit, stores nothing, completes nothing and loads nothing from then on (manager.py);
- the file is made by one worker (the replica lock file's maker byte), under a temporary
  name, exclusively, mode 0600, with its pages reserved (``posix_fallocate``: no room is an
  error here, never a SIGBUS later), and renamed into place; a file of another user, of
  another mode, or a link is refused, naming it.
"""

from __future__ import annotations

import os
import secrets
from typing import NamedTuple

from shmkv.errors import SegmentError
from shmkv.pool import layout as L
from shmkv.pool import lifecycle as LC
from shmkv.pool.segment import check_fd, open_checked, reserve
from shmkv.vllm.tier import (
    W_REGION_INODE,
    W_REGION_TAG,
    TierTable,
)

REGION_MAGIC = b"shmkv-kv-region1"  # 16 bytes
TRAILER_BYTES = os.sysconf("SC_PAGE_SIZE")
def region_path(pool: str) -> str:
    """The data region's path (the first of vLLM's files for its engine id)."""
    return f"/dev/shm/vllm_offload_{L.offload_data_region_engine_id(pool)}.mmap"


def bound_tag(tier: TierTable, path: str, data_bytes: int, generation: bytes) -> int:
    """The tag of the tier's bound region if the file at ``path`` is that very region (its
    trailer's tag and generation, and the inode the binding recorded); 0 otherwise
    (caller holds the pool lock)."""
    bound = tier.words[W_REGION_TAG]
    if not bound or read_tag(path, data_bytes, generation) != bound:
        return 0
    try:
        inode = os.stat(path, follow_symlinks=False).st_ino
    except FileNotFoundError:
        return 0
    return bound if inode == tier.words[W_REGION_INODE] else 0


def read_tag(path: str, data_bytes: int, generation: bytes) -> int | None:
    """The tag in the region file's trailer; None if there is no file; 0 if it is not a
    region of ``data_bytes`` bytes made by shmkv for the tier's ``generation`` (a removed
    tier's region is never believed: ``shmkv/pool/lifecycle.py``).

    Raises:
        SegmentError: the file is a link, another user's, or not mode 0600.
    """
    try:
        fd = open_checked(path, os.O_RDONLY, "the offload tier's data region")
    except FileNotFoundError:
        return None
    try:
        if os.fstat(fd).st_size != data_bytes + TRAILER_BYTES:
            return 0
        trailer = os.pread(fd, LC.REGION_TRAILER.size, data_bytes)
    finally:
        os.close(fd)
    if len(trailer) < LC.REGION_TRAILER.size:
        return 0
    magic, tag, found = LC.REGION_TRAILER.unpack(trailer)
    if magic != REGION_MAGIC or found != generation:
        return 0
    return tag


def make_file(path: str, data_bytes: int, generation: bytes) -> tuple[str, int]:
    """A new region file under a temporary name beside ``path``: (its path, its tag)."""
    tmp = f"{path}.making-{secrets.token_hex(6)}"
    size = data_bytes + TRAILER_BYTES
    st = os.statvfs(os.path.dirname(path))
    free = st.f_bavail * st.f_frsize
    if free < size:
        raise SegmentError(
            f"the offload tier's data region needs {size} bytes in /dev/shm and {free} are "
            "free: lower cpu_bytes_to_use, or give /dev/shm more room (docker --shm-size)"
        )
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        reserve(fd, size, f"the offload tier's data region {path}")  # NoSpaceError
        tag = secrets.randbits(63) or 1
        os.pwrite(fd, LC.REGION_TRAILER.pack(REGION_MAGIC, tag, generation), data_bytes)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    return tmp, tag


class RegionBinding(NamedTuple):
    """The region a worker bound: its tag, the tier's generation, the file's inode."""

    tag: int
    generation: bytes
    inode: int


def check_mapped(fd: int, path: str, data_bytes: int, binding: RegionBinding) -> None:
    """Checks that the file vLLM's region opened (``fd``) is the bound region.

    Raises:
        SegmentError: it is another file (replaced between the binding and vLLM's open).
    """
    check_fd(fd, f"the offload tier's data region {path}")
    trailer = os.pread(fd, LC.REGION_TRAILER.size, data_bytes)
    if (trailer != LC.REGION_TRAILER.pack(REGION_MAGIC, binding.tag, binding.generation)
            or os.fstat(fd).st_ino != binding.inode):
        raise SegmentError(f"the offload tier's data region {path} was replaced while this "
                           "worker mapped it; start the worker again")


