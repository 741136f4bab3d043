"""Several processes share one SGLang page store (``shmkv.sglang.store``, no SGLang
imported: the promises are the store's): the region is made by one process outside the
pool lock, the others wait for it."""

from __future__ import annotations

import fcntl
import os
import time

import pytest

from shmkv.sglang.region import _maker_lock, region_path
from shmkv.sglang.store import open_pool
from tests.conftest import unique_pool_name
from tests.multiprocess import sglang_store_workers as W
from tests.multiprocess.conftest import join_processes
from tests.sglang_host import remove_store

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]
NUM_PAGES = 16
STORE_BYTES = NUM_PAGES * W.PAGE_BYTES


@pytest.fixture
def store_name():
    name = unique_pool_name("sgls")
    yield name
    remove_store(name)
    assert not [e for e in os.listdir("/dev/shm") if name in e]


def test_a_process_waits_for_the_maker_out_of_the_lock_and_takes_over_from_a_dead_one(
        spawn_ctx, store_name):
    """While another process makes the region (its file there, no magic yet, the maker's
    OFD lock held), an opener waits without holding the pool lock; once the maker is gone
    (its lock dropped), the opener makes the region afresh, 0600, and stores into it."""
    pool = open_pool(store_name, NUM_PAGES, 16, "test")
    path = region_path(store_name)
    maker = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        _maker_lock(maker, fcntl.F_WRLCK)  # a maker at work, reserving pages
        planted = os.fstat(maker).st_ino
        out = spawn_ctx.Queue()
        opener = spawn_ctx.Process(target=W.open_and_store,
                                   args=(store_name, ["a", "b"], STORE_BYTES, out))
        opener.start()
        deadline = time.monotonic() + 60
        while len(pool.processes()) < 2:  # the opener attached to the pool
            assert opener.is_alive() and time.monotonic() < deadline, opener.exitcode
            time.sleep(0.02)
        for _ in range(20):  # the pool lock is free for others while it waits
            with pool.lock():
                assert os.lstat(path).st_ino == planted  # the live maker's file is left
            time.sleep(0.02)
        assert opener.is_alive() and out.empty()
    finally:
        os.close(maker)  # the maker dies: the kernel drops its lock
    stored, inode = out.get(timeout=60)
    assert join_processes([opener]) == [0]
    st = os.lstat(path)
    assert stored == 2 and inode == st.st_ino != planted
    assert (st.st_mode & 0o7777, st.st_uid) == (0o600, os.geteuid())
    store = W.open_store(store_name, STORE_BYTES)
    try:
        assert store.prefix([W.key("a"), W.key("b")]) == 2
        store.pool.reap_dead()
        store.pool.check_invariants()
    finally:
        store.close()
        pool.close()
