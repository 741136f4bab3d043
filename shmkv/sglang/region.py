"""The page store's data region: one sibling segment ``/shmkv_sglang-<pool>-v1`` holding
the store's identity and the bytes of every page, named after the pool whose blocks
describe them.

Layout (little-endian):

    byte 0      magic (u64, SGLANG_STORE_MAGIC), written last: the header is complete
    byte 8      version (u32)
    byte 16     num_pages (u64): the pool's blocks less the null block
    byte 24     page_bytes (u64)
    byte 32     length of the identity JSON at byte IDENTITY_OFFSET
    byte 64     the identity (identity.py), up to the owner record
    byte 3968   the owner record (``siblings.owner_record``): the pool it belongs to, by
                name, creator pid, inode and ``pool_id``; no creator, so the region lives
                exactly as long as its pool (``shmkv cleanup`` / ``shmkv unlink``)
    byte 4096   page slots: block id ``b`` (1..num_pages) owns bytes
                ``[4096 + (b - 1) * page_bytes, 4096 + b * page_bytes)``

A region whose owner record names another ``pool_id`` was left by an earlier pool of the
name: it is never believed, but replaced (under the pool lock, so by one process), and the
keys the pool held are dropped, since their bytes are gone. The segment is created
exclusively, mode 0600, its pages reserved (``segment.create_shm``).
"""

from __future__ import annotations

import errno
import mmap
import struct
from collections.abc import Callable

import numpy as np

from shmkv.errors import LayoutMismatchError, SegmentNotFoundError
from shmkv.pool import layout as L
from shmkv.pool.block_pool import BlockPool
from shmkv.pool.segment import Segment
from shmkv.pool.siblings import owner_record, pool_identity, write_owner
from shmkv.sglang.events import complete_keys, log_removed

HEADER_BYTES = 4096
IDENTITY_OFFSET = 64
IDENTITY_MAX = L.SGLANG_STORE_OWNER_OFFSET - IDENTITY_OFFSET
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14
_FIELDS = struct.Struct("<QI4xQQQ")  # magic, version, num_pages, page_bytes, identity length


def populate(mapping: mmap.mmap) -> None:
    """Maps every page of ``mapping`` into this process now (``MADV_POPULATE_WRITE``), so
    that no copy pays first-touch faults. The pages are reserved already; on a kernel older
    than 5.14 (EINVAL) they are mapped on first touch instead."""
    try:
        mapping.madvise(MADV_POPULATE_WRITE)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOSYS):
            raise


def region_name(pool: str) -> str:
    """The POSIX name of a pool's page store: ``/shmkv_sglang-<pool>-v<version>``."""
    return L.sibling_segment_name("sglang", pool, L.SGLANG_STORE_VERSION)


class PageRegion:
    """One process's mapping of the page store: the header fields and a uint8 view of the
    page slots."""

    def __init__(self, seg: Segment, num_pages: int, page_bytes: int) -> None:
        self._seg = seg
        self.num_pages = num_pages
        self.page_bytes = page_bytes
        self.pages = np.frombuffer(seg.buf, np.uint8, num_pages * page_bytes, HEADER_BYTES)
        populate(seg.buf)

    @property
    def name(self) -> str:
        return self._seg.shm_name

    def identity(self) -> bytes:
        size = _FIELDS.unpack_from(self._seg.buf, 0)[4]
        return bytes(self._seg.buf[IDENTITY_OFFSET:IDENTITY_OFFSET + size])

    def close(self) -> None:
        del self.pages
        self._seg.close()


def _fill(seg: Segment, pool_name: str, num_pages: int, page_bytes: int,
          identity: bytes) -> None:
    write_owner(seg.buf, L.SGLANG_STORE_OWNER_OFFSET, owner_record(pool_name, creator=False))
    seg.buf[IDENTITY_OFFSET:IDENTITY_OFFSET + len(identity)] = identity
    _FIELDS.pack_into(seg.buf, 0, 0, L.SGLANG_STORE_VERSION, num_pages, page_bytes,
                      len(identity))
    seg.buf[0:8] = L.SGLANG_STORE_MAGIC.to_bytes(8, "little")  # last: complete


def _belongs(seg: Segment, pool_name: str) -> bool:
    """Whether the region's owner record names the pool of this name as it is now."""
    if len(seg.buf) < HEADER_BYTES:
        return False
    rec = np.frombuffer(seg.buf, L.OWNER_DTYPE, 1, L.SGLANG_STORE_OWNER_OFFSET)[0]
    now = pool_identity(pool_name)
    ok = now is not None and int(rec["owner_magic"]) == L.OWNER_MAGIC and (
        bytes(rec["pool_id"]) == now[2])
    del rec
    return ok


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


def open_region(pool: BlockPool, pool_name: str, page_bytes: int, identity: bytes,
                check_identity: Callable[[bytes], None]) -> PageRegion:
    """Maps the pool's page store, making it (with ``identity``) if it is missing or was
    left by an earlier pool of the name, then hands the identity found to
    ``check_identity`` (which raises to refuse it). Runs under the pool lock, so one
    process makes it.

    Raises:
        LayoutMismatchError: a region of another version, magic or geometry (both named).
        UsageError: the identity is too long to record.
    """
    if len(identity) > IDENTITY_MAX:
        raise LayoutMismatchError(
            f"the SGLang store identity is {len(identity)} bytes; at most {IDENTITY_MAX} fit")
    num_pages = pool.num_gpu_blocks - 1
    name = region_name(pool_name)
    size = HEADER_BYTES + num_pages * page_bytes
    with pool.lock():
        try:
            seg = Segment.open(name)
        except SegmentNotFoundError:
            seg = None
        if seg is not None and not _belongs(seg, pool_name):
            seg.close()
            Segment.unlink(name)
            seg = None
        if seg is None:
            seg = Segment.create(name, size, "SGLang page store")
            try:
                _fill(seg, pool_name, num_pages, page_bytes, identity)
                _forget_pages(pool)
            except BaseException:
                seg.close()
                Segment.unlink(name)
                raise
        try:
            magic, version, found_pages, found_bytes, id_len = _FIELDS.unpack_from(seg.buf, 0)
            if magic != L.SGLANG_STORE_MAGIC or version != L.SGLANG_STORE_VERSION:
                raise LayoutMismatchError(
                    f"{name}: magic {magic:#x} version {version}, expected "
                    f"{L.SGLANG_STORE_MAGIC:#x} version {L.SGLANG_STORE_VERSION}: not a "
                    "shmkv SGLang page store of this version")
            check_identity(bytes(seg.buf[IDENTITY_OFFSET:IDENTITY_OFFSET + id_len]))
            if found_pages != num_pages or len(seg.buf) < size:
                raise LayoutMismatchError(
                    f"{name}: holds {found_pages} pages in {len(seg.buf)} bytes, the pool "
                    f"{num_pages} pages ({size} bytes)")
            if found_bytes != page_bytes:
                raise LayoutMismatchError(
                    f"store {pool_name!r}: field page_bytes differs: the store has "
                    f"{found_bytes}, this instance {page_bytes}")
            return PageRegion(seg, num_pages, page_bytes)
        except BaseException:
            seg.close()
            raise
