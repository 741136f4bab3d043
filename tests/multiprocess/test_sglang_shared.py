"""Several SGLang instances (real spawned processes) share one shmkv L3 store: a page one
stored is a hit for the others, byte for byte; no page is stored twice; a SIGKILLed
instance leaves no pin and no half page; ``shmkv cleanup`` then removes everything."""

from __future__ import annotations

import os
import signal
import time

import pytest

pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

import torch  # noqa: E402

from shmkv import BlockPool  # noqa: E402
from shmkv.pool import siblings  # noqa: E402
from tests.conftest import unique_pool_name  # noqa: E402
from tests.multiprocess import sglang_workers as W  # noqa: E402
from tests.multiprocess.conftest import join_processes  # noqa: E402
from tests.sglang_helpers import HostBuffer, make_backend, page_indices, remove_store  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]
STORE_BYTES = 1 << 20
KEYS = [f"page{i}" for i in range(6)]


@pytest.fixture
def store_name():
    name = unique_pool_name("sgl")
    yield name
    remove_store(name)
    assert not [e for e in os.listdir("/dev/shm") if name in e]


def _check_store(name: str) -> BlockPool:
    pool = BlockPool.attach(name)
    pool.reap_dead()
    pool.check_invariants()
    return pool


def _wait_file(path: str, proc, timeout_s: float = 60.0) -> str:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path) or not open(path).read():
        assert proc.is_alive(), f"worker exited with {proc.exitcode}"
        assert time.monotonic() < deadline, "worker never got ready"
        time.sleep(0.05)
    return open(path).read()


def test_page_stored_by_one_instance_is_a_hit_for_others_and_stored_once(spawn_ctx,
                                                                         store_name):
    """Three instances store the same pages at once: each page is stored exactly once, and
    a fourth instance loads the first storer's bytes."""
    out = spawn_ctx.Queue()
    start_at = time.time() + 6.0  # after every child imported SGLang
    procs = [spawn_ctx.Process(target=W.store_and_report,
                               args=(store_name, seed, KEYS, STORE_BYTES, start_at, out))
             for seed in (1, 2, 3)]
    for p in procs:
        p.start()
    reports = [out.get(timeout=120) for _ in procs]
    assert join_processes(procs) == [0, 0, 0]
    assert all(res == [True] * len(KEYS) and hit == len(KEYS) for _, res, _, hit in reports)
    assert sum(c["stored_pages"] for _, _, c, _ in reports) == len(KEYS)
    reader = spawn_ctx.Process(target=W.read_back, args=(store_name, KEYS, STORE_BYTES, out))
    reader.start()
    hits, pages, exists = out.get(timeout=120)
    assert join_processes([reader]) == [0]
    assert hits == [True] * len(KEYS) and exists == len(KEYS)
    # Every page equals what one of the storers had at that host page.
    sources = {seed: HostBuffer("page_first", seed=seed) for seed in (1, 2, 3)}
    for i, page in enumerate(pages):
        assert any(page == h.data_page(i * 4).view(torch.int16).numpy().tobytes()
                   for h in sources.values()), i
    pool = _check_store(store_name)
    try:
        assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1  # no pin left
    finally:
        pool.close()


def test_sigkill_mid_store_and_mid_get_leaves_no_pin_and_no_half_page(spawn_ctx, store_name,
                                                                      tmp_path):
    """An instance killed while storing leaves pages nobody sees; one killed while pinning
    leaves no pin once reaped; a survivor stores the half pages afresh."""
    survivor = make_backend(store_name, HostBuffer("page_first", seed=7), store_bytes=STORE_BYTES)
    try:
        assert survivor.batch_set_v1(KEYS[:2], page_indices([0, 1], 4)) == [True, True]
        ready = str(tmp_path / "store.ready")
        writer = spawn_ctx.Process(target=W.die_mid_store,
                                   args=(store_name, KEYS[2:], STORE_BYTES, ready))
        writer.start()
        assert _wait_file(ready, writer) == str(len(KEYS) - 2)
        # In flight: not visible, and not stored twice while its writer lives.
        assert survivor.batch_exists(KEYS[2:]) == 0
        assert survivor.batch_set_v1(KEYS[2:], page_indices([2, 3, 4, 5], 4)) == [True] * 4
        assert survivor.counters()["stored_pages"] == 2
        ready2 = str(tmp_path / "pin.ready")
        reader = spawn_ctx.Process(target=W.die_pinning,
                                   args=(store_name, KEYS[:2], STORE_BYTES, ready2))
        reader.start()
        assert _wait_file(ready2, reader) == "2"
        for p in (writer, reader):
            os.kill(p.pid, signal.SIGKILL)
        assert join_processes([writer, reader], 30) == [-9, -9]
        assert survivor.store.pool.reap_dead() == 2
        assert survivor.batch_exists(KEYS) == 2  # the half pages were never complete
        assert survivor.batch_set_v1(KEYS[2:], page_indices([2, 3, 4, 5], 4)) == [True] * 4
        assert survivor.counters()["stored_pages"] == 6
        assert survivor.batch_exists(KEYS) == len(KEYS)
        got = survivor.batch_get_v1(KEYS, page_indices(list(range(8, 14)), 4))
        assert got == [True] * len(KEYS)
        host = survivor.mem_pool_host
        for i in range(len(KEYS)):
            assert torch.equal(host.data_page((8 + i) * 4), host.data_page(i * 4)), i
        pool = _check_store(store_name)
        try:
            rows = pool.block_rows()
            assert int(rows["ref_cnt"][1:].sum()) == 0  # no pin, no writer hold left
            del rows
        finally:
            pool.close()
    finally:
        survivor.close()


@pytest.mark.slow
def test_cleanup_removes_the_store_once_every_instance_is_gone(spawn_ctx, store_name):
    """With every instance gone (the creator included), `shmkv cleanup` removes the pool
    and its page store; nothing of it stays in /dev/shm."""
    out = spawn_ctx.Queue()
    p = spawn_ctx.Process(target=W.store_and_report,
                          args=(store_name, 1, KEYS[:2], STORE_BYTES, 0.0, out))
    p.start()
    out.get(timeout=120)
    assert join_processes([p]) == [0]
    mine = [e for e in os.listdir("/dev/shm") if store_name in e]
    assert any(e.startswith("shmkv_sglang-") for e in mine), mine
    verdicts = [v for v in siblings.plan() if store_name in v.entry]
    assert verdicts and all(v.remove for v in verdicts), [(v.entry, v.reason) for v in verdicts]
    siblings.remove(verdicts)
    assert not [e for e in os.listdir("/dev/shm") if store_name in e]
