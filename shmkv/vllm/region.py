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
import time
from typing import NamedTuple

import numpy as np

from shmkv.errors import NoSpaceError, SegmentError
from shmkv.pool import layout as L
from shmkv.pool import lifecycle as LC
from shmkv.pool.block_pool import BlockPool
from shmkv.pool.segment import check_fd, open_checked, reserve
from shmkv.pool.siblings import discard_unused_tier
from shmkv.vllm.identity import check_identity, refuse_foreign_replica
from shmkv.vllm.replicas import ReplicaLocks, join, replica_key
from shmkv.vllm.tier import (
    REGION_MIXED,
    W_LRU_DIRTY,
    W_REGION_INODE,
    W_REGION_TAG,
    TierTable,
    open_pool,
    open_tier_table,
    table_bytes,
)

REGION_MAGIC = b"shmkv-kv-region1"  # 16 bytes
TRAILER_BYTES = os.sysconf("SC_PAGE_SIZE")
MAKER_WAIT_S = 120.0  # how long a worker waits for another to make the region


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


def _make_file(path: str, data_bytes: int, generation: bytes) -> tuple[str, int]:
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


def _forget_chunks(pool: BlockPool) -> None:
    """Drops the key of every chunk the tier described: their bytes were in a region that
    is gone (caller holds the pool lock). A chunk being stored keeps its hold: its storer's
    completion fails, since that replica maps the old region."""
    rows = pool.block_rows()
    keyed = np.flatnonzero(rows["hash_num_tokens"] != L.NO_HASH_TOKENS)
    del rows
    keyed = keyed[keyed > 0].tolist()
    if keyed:
        pool.evict_blocks(keyed)


def _bind_row(tier: TierTable, row: int, tag: int) -> None:
    """Records that a process of replica row ``row`` maps the region tagged ``tag``. The
    binding is per process: a row whose processes map different regions (one region was
    replaced between two workers' binds, or a worker bound again after a replacement while
    another still maps the old one) becomes REGION_MIXED, never the tier's tag, so the
    replica is lost until all of its processes are gone and it starts again."""
    mine = int(tier.replica_region[row])
    tier.replica_region[row] = tag if mine in (0, tag) else REGION_MIXED


def bind_region(pool: BlockPool, tier: TierTable, locks: ReplicaLocks, row: int,
                pool_name: str, data_bytes: int) -> int:
    """Makes sure the region file is the one the tier describes, making it if it is
    missing or not bound, and records it as replica row ``row``'s; returns its tag.

    Raises:
        SegmentError: a foreign or insecure file, no room, or another worker took longer
            than MAKER_WAIT_S to make the region.
    """
    path = region_path(pool_name)
    generation = pool.generation
    deadline = time.monotonic() + MAKER_WAIT_S
    while True:
        with pool.lock():
            bound = bound_tag(tier, path, data_bytes, generation)
            if bound:
                _bind_row(tier, row, bound)
                return bound
        if locks.try_region_maker():
            try:
                return _make_and_bind(pool, tier, row, path, data_bytes, generation)
            finally:
                locks.release_region_maker()
        if time.monotonic() > deadline:
            raise SegmentError(
                f"waited {MAKER_WAIT_S:.0f} s for another worker to make the offload tier's "
                f"data region {path}"
            )
        time.sleep(0.01)


def _make_and_bind(pool: BlockPool, tier: TierTable, row: int, path: str,
                   data_bytes: int, generation: bytes) -> int:
    with pool.lock():  # another maker may have bound it before this one got the byte
        bound = bound_tag(tier, path, data_bytes, generation)
        if bound:
            _bind_row(tier, row, bound)
            return bound
    # out of the lock: reserving pages takes time
    tmp, tag = _make_file(path, data_bytes, generation)
    try:
        with pool.lock():
            read_tag(path, data_bytes, generation)  # refuses a foreign file planted meanwhile
            os.rename(tmp, path)
            tier.words[W_REGION_INODE] = os.stat(path, follow_symlinks=False).st_ino
            # Whatever the tier described lived in another region (or none): no key of the
            # pool names bytes of this one, whether the table had a region bound or not.
            _forget_chunks(pool)
            if tier.words[W_REGION_TAG]:
                tier.words[W_LRU_DIRTY] = 1  # the next holder rebuilds the free stack (lru.py)
            tier.words[W_REGION_TAG] = tag
            _bind_row(tier, row, tag)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return tag


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


def join_as_worker(pool_name: str, num_chunks: int, max_processes: int, replica_id: str,
                   data_bytes: int, identity: dict | None = None
                   ) -> tuple[ReplicaLocks, RegionBinding]:
    """A GPU worker's start: checks its replica's ``identity`` against the tier's (and
    records it if it is the first), joins its replica's row (``replica_id``, one per engine
    start), binds the data region to the pool (making it if needed) and returns (its hold on the
    row, kept until the worker exits; the region's tag). The pool handle it needed is
    closed again: a worker takes no slot of the pool's process table.

    A worker whose identity differs touches nothing: it is refused before it sizes,
    joins or binds anything (vLLM builds its workers before its scheduler, so the worker
    is the first of a replica to meet the tier).

    Raises:
        LayoutMismatchError: the identity differs from the tier's (every field named).
        SegmentError: a foreign or insecure region file, or no room in /dev/shm.
    """
    process = {"label": "vllm-offload-worker"}
    if identity is not None:
        refuse_foreign_replica(pool_name, identity, process)
    _check_room(pool_name, num_chunks, data_bytes)
    pool, created = open_pool(pool_name, num_chunks, max_processes, None, process)
    generation = pool.generation
    refused = True
    try:
        tier = open_tier_table(pool, pool_name, num_chunks, created)
        try:
            with pool.lock():
                locks = ReplicaLocks(pool_name, generation)
        except BaseException:
            tier.close()
            raise
        try:
            with pool.lock():
                if identity is not None:
                    check_identity(tier, pool_name, identity)
                row = join(tier, locks, replica_key(replica_id), pool_name)
            tag = bind_region(pool, tier, locks, row, pool_name, data_bytes)
            with pool.lock():
                binding = RegionBinding(tag, generation, int(tier.words[W_REGION_INODE]))
        except BaseException:
            locks.close()
            raise
        finally:
            tier.close()
        refused = False
    finally:
        pool.close()
        if refused and created:  # nothing half made stays behind a refused start
            discard_unused_tier(pool_name, generation, BlockPool.TIERS)
    return locks, binding


def _check_room(pool_name: str, num_chunks: int, data_bytes: int) -> None:
    """Refuses a worker that would make the tier in a /dev/shm without room for its data
    region and table, before it makes anything (a replica joining a tier whose region is
    there needs no room).

    Raises:
        NoSpaceError: naming both sizes and what to do.
    """
    if os.path.lexists(region_path(pool_name)):
        return
    need = data_bytes + TRAILER_BYTES + table_bytes(num_chunks)
    st = os.statvfs(os.path.dirname(region_path(pool_name)))
    free = st.f_bavail * st.f_frsize
    if free < need:
        raise NoSpaceError(
            f"the offload tier {pool_name!r} needs at least {need:,} bytes in /dev/shm (its "
            f"data region and table) and {free:,} are free: lower cpu_bytes_to_use, or give "
            "/dev/shm more room (docker run --shm-size=...); nothing was made")
