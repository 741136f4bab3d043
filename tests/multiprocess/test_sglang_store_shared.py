"""Several processes share one SGLang page store (``shmkv.sglang.store``; neither SGLang
nor torch imported: the promises are the store's, and SharedHostStorage's v1 calls are its
``save``/``load``): a page one stored is a hit for the others, byte for byte; no page is
stored twice; a SIGKILLed process leaves no pin and no half page, and a subscriber of the
event log never hears of one; the region is made by one process outside the pool lock;
``shmkv cleanup`` removes everything once every process is gone. (One test drives the real
SGLang class across processes: test_sglang_shared.py.)"""

from __future__ import annotations

import fcntl
import os
import signal
import time

import pytest

from shmkv import BlockPool
from shmkv.events import BlockStored, external_block_hash
from shmkv.pool import siblings
from shmkv.sglang.region import _maker_lock, region_path
from shmkv.sglang.store import open_pool
from tests.multiprocess import sglang_store_workers as W
from tests.multiprocess.conftest import join_processes

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120), pytest.mark.long]
NUM_PAGES = 16
STORE_BYTES = NUM_PAGES * W.PAGE_BYTES
NAMES = [f"page{i}" for i in range(6)]



def _check_store(name: str) -> BlockPool:
    """A fresh attachment, the dead reaped, every invariant checked."""
    pool = BlockPool.attach(name)
    pool.reap_dead()
    pool.check_invariants()
    return pool


def _wait_file(path: str, proc, timeout_s: float = 60.0) -> str:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path) or not open(path).read():
        assert proc.is_alive(), f"worker exited with {proc.exitcode}"
        assert time.monotonic() < deadline, "worker never got ready"
        time.sleep(0.02)
    return open(path).read()


def _advertised(pool: BlockPool) -> set[int]:
    """The pages a subscriber replaying the whole event log believes stored."""
    logged, lost = pool.read_events(pool.event_cursor(from_start=True))
    assert lost == 0
    out: set[int] = set()
    for e in logged:
        hashes = set(e.event.block_hashes)
        out = out | hashes if isinstance(e.event, BlockStored) else out - hashes
    return out


def test_page_stored_by_one_process_is_a_hit_for_others_and_stored_once(spawn_ctx,
                                                                        store_name):
    """Three processes store the same pages at once: each page is stored exactly once, and
    a fourth loads, byte for byte, what one of the storers had."""
    out = spawn_ctx.Queue()
    barrier = spawn_ctx.Barrier(3)  # every child has opened the store: they race
    procs = [spawn_ctx.Process(target=W.store_and_report,
                               args=(store_name, seed, NAMES, STORE_BYTES, barrier, out))
             for seed in (1, 2, 3)]
    for p in procs:
        p.start()
    reports = [out.get(timeout=60) for _ in procs]
    assert join_processes(procs) == [0, 0, 0]
    # A racer that found a page in flight elsewhere skips it: it may finish before that
    # page is complete, so only the reader, after every racer, must see all of them.
    assert [no_room for _, _, no_room, _ in reports] == [[], [], []], reports
    assert sum(stored for _, stored, _, _ in reports) == len(NAMES)
    reader = spawn_ctx.Process(target=W.read_back, args=(store_name, NAMES, STORE_BYTES, out))
    reader.start()
    hits, pages, prefix = out.get(timeout=60)
    assert join_processes([reader]) == [0]
    assert hits == [True] * len(NAMES) and prefix == len(NAMES)
    sources = {seed: W.host_pages(seed) for seed in (1, 2, 3)}
    for i, page in enumerate(pages):
        assert any(page == h[i].tobytes() for h in sources.values()), i
    pool = _check_store(store_name)
    try:
        assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1  # no pin left
        assert _advertised(pool) == {external_block_hash(W.key(n), True) for n in NAMES}
    finally:
        pool.close()


def test_sigkill_mid_store_and_mid_get_leaves_no_pin_and_no_half_page(spawn_ctx, store_name,
                                                                      tmp_path):
    """A process killed while storing leaves pages nobody sees, nor any subscriber hears
    of; one killed while pinning leaves no pin once reaped; a survivor stores the half
    pages afresh."""
    survivor = W.open_store(store_name, STORE_BYTES)
    host = W.host_pages(7)
    keys = [W.key(n) for n in NAMES]
    try:
        assert survivor.save(keys[:2], host, [0, 1]) == (2, [])
        ready = str(tmp_path / "store.ready")
        writer = spawn_ctx.Process(target=W.die_mid_store,
                                   args=(store_name, NAMES[2:], STORE_BYTES, ready))
        writer.start()
        assert _wait_file(ready, writer) == str(len(NAMES) - 2)
        # In flight: not visible, not advertised, and not stored twice while its writer lives.
        assert survivor.prefix(keys[2:]) == 0
        assert survivor.save(keys[2:], host, [2, 3, 4, 5]) == (0, [])
        assert _advertised(survivor.pool) == {external_block_hash(k, True) for k in keys[:2]}
        ready2 = str(tmp_path / "pin.ready")
        reader = spawn_ctx.Process(target=W.die_pinning,
                                   args=(store_name, NAMES[:2], STORE_BYTES, ready2))
        reader.start()
        assert _wait_file(ready2, reader) == "2"
        for p in (writer, reader):
            os.kill(p.pid, signal.SIGKILL)
        assert join_processes([writer, reader], 30) == [-9, -9]
        assert survivor.pool.reap_dead() == 2
        assert survivor.prefix(keys) == 2  # the half pages were never complete
        assert _advertised(survivor.pool) == {external_block_hash(k, True) for k in keys[:2]}
        assert survivor.save(keys[2:], host, [2, 3, 4, 5]) == (4, [])
        assert survivor.prefix(keys) == len(keys)
        assert survivor.load(keys, host, list(range(8, 14))) == [True] * len(keys)
        assert all((host[8 + i] == host[i]).all() for i in range(len(keys)))
        pool = _check_store(store_name)
        try:
            rows = pool.block_rows()
            assert int(rows["ref_cnt"][1:].sum()) == 0  # no pin, no writer hold left
            del rows
            assert _advertised(pool) == {external_block_hash(k, True) for k in keys}
        finally:
            pool.close()
    finally:
        survivor.close()


def test_the_store_stays_once_every_process_is_gone_until_removed_on_purpose(spawn_ctx,
                                                                            store_name):
    """With every process gone (the creator included), `shmkv cleanup` keeps the store: it
    is meant to stay for the next SGLang instance. `--include-idle` removes the pool and its
    page store; nothing of it stays in /dev/shm."""
    out = spawn_ctx.Queue()
    p = spawn_ctx.Process(target=W.store_and_report,
                          args=(store_name, 1, NAMES[:2], STORE_BYTES, None, out))
    p.start()
    assert out.get(timeout=60)[1] == 2
    assert join_processes([p]) == [0]
    mine = [e for e in os.listdir("/dev/shm") if store_name in e]
    assert any(e.startswith("shmkv_sglang-") for e in mine), mine
    verdicts = siblings.plan(prefix=store_name)
    assert {v.entry for v in verdicts} == set(mine)
    assert not any(v.remove for v in verdicts), [(v.entry, v.reason) for v in verdicts]
    pool = next(v for v in verdicts if v.kind == "pool")
    assert pool.lifetime == "stays" and pool.idle
    assert pool.reason.startswith("stays (made by sglang store); idle:")
    verdicts = siblings.plan(include_idle=True, prefix=store_name)
    assert all(v.remove for v in verdicts), [(v.entry, v.reason) for v in verdicts]
    siblings.remove(verdicts)
    assert not [e for e in os.listdir("/dev/shm") if store_name in e]


def test_a_store_whose_maker_died_before_it_was_complete_is_an_orphan(spawn_ctx, store_name):
    """The store's pool made, its page region not yet (the maker killed in between): the
    pool was never marked to stay, so once no process holds it `shmkv cleanup` removes it."""
    ready, stop = spawn_ctx.Event(), spawn_ctx.Event()
    p = spawn_ctx.Process(target=W.make_store_pool_and_wait, args=(store_name, ready, stop))
    p.start()
    try:
        assert ready.wait(60), "the maker never made the pool"
    finally:
        p.kill()
        assert join_processes([p]) == [-signal.SIGKILL]
    pool = next(v for v in siblings.plan(prefix=store_name) if v.kind == "pool")
    assert pool.remove and pool.lifetime == "orphan", pool
    assert pool.reason.endswith("never marked to stay")


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
