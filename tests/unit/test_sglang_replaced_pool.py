"""The SGLang page store when its pool is replaced (unlinked and made again under the same
name) between a process's attaching to the pool and its opening the pool's region.

Such a process holds the old pool's page metadata; the region now on disk belongs to the new
pool. Mapping it would answer the old pool's hits with the new pool's bytes, and a region made
for the old pool must never be taken by the new pool's processes.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest

from shmkv import BlockPool, SegmentError
from shmkv.sglang import identity as ident
from shmkv.sglang.region import open_region, region_path
from shmkv.sglang.store import PageStore, open_pool

PAGE_BYTES = 4096
NUM_PAGES = 4
IDENTITY = {"model": "org/model", "page_bytes": PAGE_BYTES}



def _store(name: str) -> PageStore:
    return PageStore(name, NUM_PAGES * PAGE_BYTES, PAGE_BYTES, dict(IDENTITY), 8)


def _key(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


def _page(fill: int) -> np.ndarray:
    return np.full((1, PAGE_BYTES), fill, np.uint8)


def _open_region(pool: BlockPool, name: str):
    return open_region(pool, name, PAGE_BYTES, ident.encode(IDENTITY),
                       lambda found: ident.compare(found, IDENTITY, name))


def test_a_process_of_a_replaced_pool_never_maps_the_new_pools_region(store_name):
    """Attached to the old pool (which holds page "a"), the process finds the new pool's
    region: it is refused with a clear error, and the new pool's region and pages are left
    as they were. (Before: it was mapped, and the old pool's hit on "a" read the bytes the
    new pool's writer stored for "b".)"""
    old = _store(store_name)
    assert old.save([_key("a")], _page(0xAA), [0]) == (1, [])
    late = open_pool(store_name, NUM_PAGES, 8, "late")  # attached, region not yet opened
    try:
        old.close()
        BlockPool.unlink(store_name)
        new = _store(store_name)
        try:
            assert new.save([_key("b")], _page(0xBB), [0]) == (1, [])
            ino = os.stat(region_path(store_name)).st_ino
            with pytest.raises(SegmentError, match="replaced"):
                _open_region(late, store_name)
            assert os.stat(region_path(store_name)).st_ino == ino
            out = np.zeros((1, PAGE_BYTES), np.uint8)
            assert new.load([_key("b")], out, [0]) == [True]
            assert (out == 0xBB).all()
            new.pool.check_invariants()
        finally:
            new.close()
        late.check_invariants()
    finally:
        late.close()


def test_a_process_of_a_replaced_pool_never_makes_a_region_for_the_new_pool(store_name):
    """The old pool and its region are gone and the new pool has no region yet: the process
    attached to the old pool makes none (a region it made would name the new pool as its
    owner, and both pools' writers would then share its slots). (Before: it made one, the
    new pool's processes mapped it, and a page stored through the old pool overwrote the
    page the new pool served for another key.)"""
    old = _store(store_name)
    late = open_pool(store_name, NUM_PAGES, 8, "late")
    try:
        old.close()
        BlockPool.unlink(store_name)
        with BlockPool.create(store_name, NUM_PAGES + 1, enable_caching=True, hash_block_size=1,
                              enable_kv_cache_events=False, medium="L3") as fresh:
            with pytest.raises(SegmentError, match="replaced"):
                _open_region(late, store_name)
            assert not os.path.exists(region_path(store_name))
            fresh.check_invariants()
        late.check_invariants()
    finally:
        late.close()


def test_a_process_whose_region_was_replaced_under_a_live_pool_serves_nothing(store_name):
    """The region file is removed while the pool lives (an operator's ``rm``); the next
    process makes a new one and drops the pool's keys. The process still mapping the old
    region neither completes a page there (another process would read the new region's
    slot), not even one begun before, nor serves from it: its calls raise naming the
    region, and the page another
    process stores is read back right. (Before: the old process stored "c" into the old
    region, and the new one's hit on "c" read zeros.)"""
    old = _store(store_name)
    try:
        assert old.save([_key("a")], _page(0xAA), [0]) == (1, [])
        todo, blocks, _ = old.begin_store([_key("d")])  # a store in flight meanwhile
        assert todo == [0]
        os.unlink(region_path(store_name))
        new = _store(store_name)
        try:
            with pytest.raises(SegmentError, match="replaced"):
                old.finish_store([_key("d")], blocks)
            assert new.prefix([_key("d")]) == 0
            out = np.zeros((1, PAGE_BYTES), np.uint8)
            assert new.load([_key("a")], out, [0]) == [False]  # its bytes went with the file
            with pytest.raises(SegmentError, match="replaced"):
                old.save([_key("c")], _page(0xCC), [0])
            with pytest.raises(SegmentError, match="replaced"):
                old.load([_key("a")], out, [0])
            with pytest.raises(SegmentError, match="replaced"):
                old.prefix([_key("a")])
            assert new.load([_key("c")], out, [0]) == [False]
            assert new.save([_key("c")], _page(0xCD), [0]) == (1, [])
            assert new.load([_key("c")], out, [0]) == [True] and (out == 0xCD).all()
            new.pool.check_invariants()
        finally:
            new.close()
    finally:
        old.close()


def test_a_process_whose_pool_was_replaced_too_goes_on_with_its_own_pages(store_name):
    """Pool and region unlinked and made again: the process still on the old pair shares
    them with no newcomer, so it goes on storing and serving its own pages, and the new
    pool never sees them."""
    old = _store(store_name)
    try:
        assert old.save([_key("a")], _page(0xAA), [0]) == (1, [])
        BlockPool.unlink(store_name)
        new = _store(store_name)
        try:
            assert old.save([_key("c")], _page(0xCC), [0]) == (1, [])
            out = np.zeros((1, PAGE_BYTES), np.uint8)
            assert old.load([_key("a"), _key("c")], np.zeros((2, PAGE_BYTES), np.uint8),
                            [0, 1]) == [True, True]
            assert old.load([_key("c")], out, [0]) == [True] and (out == 0xCC).all()
            assert new.prefix([_key("a"), _key("c")]) == 0
            new.pool.check_invariants()
        finally:
            new.close()
        old.pool.check_invariants()
    finally:
        old.close()


def _attached(name: str, ready, done) -> None:
    """A process attached to the store's pool (an instance of an earlier shmkv, as far as
    a newcomer can tell) until ``done`` is set."""
    pool = open_pool(name, NUM_PAGES, 8, "earlier")
    ready.set()
    done.wait(60)
    pool.close()


def test_a_store_of_an_earlier_version_is_left_to_its_release(store_name):
    """An earlier shmkv's page region (an earlier store version, on the earlier release's
    own pool) beside this one's name, with a process attached: an instance of this version
    makes its own region and leaves the earlier one untouched, byte for byte (two releases
    never share a store, nor remove each other's)."""
    import multiprocessing as mp

    from shmkv.pool import layout as L
    from tests.multiprocess.conftest import join_processes

    earlier = "/dev/shm" + L.sibling_segment_name("sglang", store_name,
                                                  L.SGLANG_STORE_VERSION - 1)
    ctx = mp.get_context("spawn")
    ready, done = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_attached, args=(store_name, ready, done))
    proc.start()
    try:
        assert ready.wait(60)
        with open(earlier, "wb") as f:
            f.write(b"earlier" * 512)
        store = _store(store_name)
        try:
            assert os.path.exists(region_path(store_name))
            with open(earlier, "rb") as f:
                assert f.read() == b"earlier" * 512
        finally:
            store.close()
    finally:
        done.set()
        assert join_processes([proc], 60) == [0]
        os.unlink(earlier)
