"""The SGLang page store (``shmkv.sglang.store``) on its own, without SGLang: its region is
mapped in at open, pages copied in and out, and what a subscriber of the pool's event log
learns of it."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest

from shmkv import BlockPool, SegmentError
from shmkv.errors import NoSpaceError
from shmkv.events import BlockRemoved, BlockStored, external_block_hash
from shmkv.pool import layout as L
from shmkv.pool.liveness import alive_path
from shmkv.pool.lock import lock_name
from shmkv.sglang.region import HEADER_BYTES, region_bytes, region_path
from shmkv.sglang.store import PENDING_GROUP, PageStore

PAGE_BYTES = 64 << 10
NOBODY = 65534
IDENTITY = {"model": "org/model", "page_bytes": PAGE_BYTES}



def make_store(name: str, num_pages: int = 8) -> PageStore:
    return PageStore(name, num_pages * PAGE_BYTES, PAGE_BYTES, dict(IDENTITY), 8)


def _rss_kib(path: str) -> int:
    """Resident KiB of this process's mapping of ``path`` (/proc/self/smaps)."""
    rss, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if "-" in line.split(" ", 1)[0] and not line.startswith(("Rss", "Size")):
                inside = line.rstrip().endswith(path)
            elif inside and line.startswith("Rss:"):
                rss += int(line.split()[1])
    return rss


def test_region_is_mapped_in_at_open(store_name):
    """Opening the store maps every page of its region into the process, so no copy pays
    first-touch faults."""
    store = make_store(store_name, num_pages=64)
    try:
        path = "/dev/shm/" + store.region.name.lstrip("/")
        assert _rss_kib(path) * 1024 >= 64 * PAGE_BYTES, _rss_kib(path)
        assert store.region.pages.size == 64 * PAGE_BYTES
        store.pool.check_invariants()
    finally:
        store.close()


def _key(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


def _ext(name: str) -> int:
    return external_block_hash(_key(name), True)


def _complete(store: PageStore) -> set[int]:
    """The external hashes of the pages the store holds complete (group 0)."""
    with store.pool.lock():
        rows = store.pool.block_rows()
        done = (rows["group_id"] == 0) & (rows["hash_num_tokens"] != L.NO_HASH_TOKENS)
        out = {external_block_hash(bytes(h), True) for h in rows["block_hash"][done]}
        del rows, done
    return out


class Subscriber:
    """What a subscriber of the pool's event log believes: its own attachment, a cursor
    from the log's start, every event decoded and replayed into the set of pages it would
    advertise."""

    def __init__(self, name: str) -> None:
        self.pool = BlockPool.attach(name, label="subscriber")
        self.cursor = self.pool.event_cursor(from_start=True)
        self.advertised: set[int] = set()
        self.events: list = []

    def poll(self) -> list:
        logged, lost = self.pool.read_events(self.cursor)
        assert lost == 0
        new = [e.event for e in logged]
        for ev in new:
            assert ev.medium == "L3" and ev.group_idx == 0, ev
            if isinstance(ev, BlockStored):
                assert not self.advertised & set(ev.block_hashes), ev  # stored once
                self.advertised |= set(ev.block_hashes)
            else:
                assert isinstance(ev, BlockRemoved), ev
                assert set(ev.block_hashes) <= self.advertised, ev  # only what it was told
                self.advertised -= set(ev.block_hashes)
        self.events += new
        return new


def test_subscriber_sees_complete_pages_only_and_each_eviction(store_name):
    """A page being written (or abandoned) is never in the event log; a completed page is
    one BlockStored; an evicted or cleared one is one BlockRemoved; at every step the
    subscriber's picture equals the store's complete pages."""
    store = make_store(store_name, num_pages=4)
    sub = Subscriber(store_name)
    try:
        names = ["a", "b", "c", "d", "e"]
        keys = [_key(n) for n in names]
        todo, blocks, _ = store.begin_store(keys[:2])
        assert len(blocks) == 2 and sub.poll() == []  # being written: not advertised
        assert store.prefix(keys[:2]) == 0
        store.finish_store(keys[:2], blocks)
        (stored,) = sub.poll()
        assert isinstance(stored, BlockStored) and stored.block_hashes == [_ext("a"), _ext("b")]
        assert sub.advertised == _complete(store) == {_ext("a"), _ext("b")}

        todo, blocks, _ = store.begin_store([keys[2]])
        store.finish_store([keys[2]], blocks, ok=False)  # abandoned: never advertised
        assert sub.poll() == [] and store.prefix([keys[2]]) == 0
        rows = store.pool.block_rows()
        assert not (rows["group_id"] == PENDING_GROUP).any()
        del rows

        for name in ("c", "d"):
            todo, blocks, _ = store.begin_store([_key(name)])
            store.finish_store([_key(name)], blocks)
        sub.poll()
        assert sub.advertised == _complete(store) == {_ext(n) for n in "abcd"}
        # Full: storing e evicts the least recently used page, a, in the same hold.
        todo, blocks, _ = store.begin_store([keys[4]])
        removed = sub.poll()
        assert [type(e) for e in removed] == [BlockRemoved]
        assert removed[0].block_hashes == [_ext("a")]
        assert _ext("e") not in sub.advertised  # still being written
        store.finish_store([keys[4]], blocks)
        sub.poll()
        assert sub.advertised == _complete(store) == {_ext(n) for n in "bcde"}

        pinned = store.pin([keys[1]])
        assert store.clear() is False  # b is pinned: it stays, the rest go
        sub.poll()
        assert sub.advertised == _complete(store) == {_ext("b")}
        store.unpin([b for b in pinned if b is not None])
        assert store.clear() is True
        sub.poll()
        assert sub.advertised == _complete(store) == set()
        assert sum(len(e.block_hashes) for e in sub.events if isinstance(e, BlockStored)) == 5
        assert sum(len(e.block_hashes) for e in sub.events if isinstance(e, BlockRemoved)) == 5
        store.pool.check_invariants()
    finally:
        sub.pool.close()
        store.close()


def test_files_are_0600_whatever_the_umask(store_name):
    """Made under umask 0277, the region and the pool's files are 0600, this user's; a
    second store handle opens them."""
    old = os.umask(0o277)
    try:
        store = make_store(store_name)
    finally:
        os.umask(old)
    try:
        seg = L.segment_name(store_name)
        paths = [region_path(store_name), "/dev/shm" + seg, alive_path(seg),
                 "/dev/shm/sem." + lock_name(seg).lstrip("/")]
        for path in paths:
            st = os.lstat(path)
            assert (oct(st.st_mode & 0o7777), st.st_uid) == (oct(0o600), os.geteuid()), path
        assert os.path.getsize(region_path(store_name)) == region_bytes(8, PAGE_BYTES, 8)
        assert region_bytes(8, PAGE_BYTES, 8) > HEADER_BYTES + 8 * PAGE_BYTES  # + counters
        make_store(store_name).close()
        store.pool.check_invariants()
    finally:
        store.close()


def _plant(path: str, how: str, tmp_path) -> None:
    if how == "symlink":
        target = tmp_path / "target"
        target.write_bytes(b"")
        os.symlink(target, path)
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, HEADER_BYTES + 8 * PAGE_BYTES)
    os.fchmod(fd, 0o644 if how == "mode" else 0o600)
    if how == "user":
        os.fchown(fd, NOBODY, NOBODY)
    os.close(fd)


@pytest.mark.parametrize("how,match", [
    ("symlink", "is a symbolic link"), ("mode", "mode 0644, not 0600"),
    pytest.param("user", f"owned by uid {NOBODY}", marks=pytest.mark.skipif(
        os.geteuid() != 0, reason="chown to another uid needs root")),
])
def test_a_planted_region_is_refused(store_name, tmp_path, how, match):
    """A file planted at the region's name (a link, another mode, another user's) is never
    used, written or replaced: opening the store refuses it, naming it."""
    path = region_path(store_name)
    _plant(path, how, tmp_path)
    before = os.lstat(path)
    with pytest.raises(SegmentError, match=f"data region {path}: .*{match}|{path} {match}"):
        make_store(store_name)
    after = os.lstat(path)
    assert (after.st_ino, after.st_mode, after.st_uid) == (
        before.st_ino, before.st_mode, before.st_uid)
    if how == "symlink":
        assert (tmp_path / "target").read_bytes() == b""
    os.unlink(path)
    with BlockPool.attach(store_name) as pool:
        pool.check_invariants()


def test_no_room_is_a_clear_error_and_leaves_nothing(store_name):
    """A region larger than /dev/shm's free space is refused before any page is reserved,
    naming the region and its size; no file of it is left."""
    page_bytes = 1 << 34
    store_bytes = (os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize
                   // page_bytes + 2) * page_bytes
    with pytest.raises(NoSpaceError, match=f"data region {region_path(store_name)}: no room"):
        PageStore(store_name, store_bytes, page_bytes, dict(IDENTITY), 8)
    assert not os.path.exists(region_path(store_name))
    with BlockPool.attach(store_name) as pool:
        pool.check_invariants()


assert np
