"""The SGLang page store (``shmkv.sglang.store``) on its own, without SGLang: its region is
mapped in at open, pages copied in and out, and what a subscriber of the pool's event log
learns of it."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest

from shmkv import BlockPool
from shmkv.events import BlockRemoved, BlockStored, external_block_hash
from shmkv.pool import layout as L
from shmkv.sglang.store import PENDING_GROUP, PageStore
from tests.conftest import unique_pool_name
from tests.sglang_host import remove_store

PAGE_BYTES = 64 << 10
IDENTITY = {"model": "org/model", "page_bytes": PAGE_BYTES}


@pytest.fixture
def store_name():
    name = unique_pool_name("sgls")
    yield name
    remove_store(name)
    assert not [e for e in os.listdir("/dev/shm") if name in e]


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
                assert isinstance(ev, BlockRemoved) and len(ev.block_hashes) == 1, ev
                assert ev.block_hashes[0] in self.advertised, ev  # only what it was told
                self.advertised.discard(ev.block_hashes[0])
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
        assert sum(isinstance(e, BlockStored) for e in sub.events) == 4
        assert sum(isinstance(e, BlockRemoved) for e in sub.events) == 5
        store.pool.check_invariants()
    finally:
        sub.pool.close()
        store.close()


assert np
