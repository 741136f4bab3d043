"""Spawned clients of the SGLang page store (``shmkv.sglang.store``) for
test_sglang_store_shared.py: module-level, so spawn can pickle them, and importing neither
SGLang nor torch, so a process starts in well under a second. Each opens the store as an
instance does at registration and moves pages with the store's own ``save``/``load``: the
code SharedHostStorage's v1 calls run, less SGLang's argument glue."""

from __future__ import annotations

import hashlib
import os
import sys
import time

import numpy as np

from shmkv.sglang.store import PageStore

PAGE_BYTES = 16 << 10
IDENTITY = {"model": "org/model", "page_bytes": PAGE_BYTES}
HOST_PAGES = 16


def key(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


def host_pages(seed: int) -> np.ndarray:
    """An instance's host pool: HOST_PAGES pages of PAGE_BYTES, filled from ``seed``."""
    return np.random.default_rng(seed).integers(0, 256, (HOST_PAGES, PAGE_BYTES), np.uint8)


def open_store(pool: str, store_bytes: int) -> PageStore:
    return PageStore(pool, store_bytes, PAGE_BYTES, dict(IDENTITY), 16, label="sglang-test")


def store_and_report(pool: str, seed: int, names: list[str], store_bytes: int,
                     barrier, out) -> None:
    """Stores ``names`` from host pages 0..n-1 (every worker at once, past ``barrier`` if
    given), then reports (seed, pages stored, indices that found no room, prefix length)."""
    store = open_store(pool, store_bytes)
    try:
        host = host_pages(seed)
        keys = [key(n) for n in names]
        if barrier is not None:
            barrier.wait(60)
        stored, no_room = store.save(keys, host, list(range(len(keys))))
        out.put((seed, stored, no_room, store.prefix(keys)))
    finally:
        store.close()


def read_back(pool: str, names: list[str], store_bytes: int, out) -> None:
    """Loads ``names`` into host pages 8.. and reports (hits, the pages' bytes, prefix)."""
    store = open_store(pool, store_bytes)
    try:
        host = host_pages(99)
        keys = [key(n) for n in names]
        dst = list(range(8, 8 + len(keys)))
        hits = store.load(keys, host, dst)
        out.put((hits, [host[p].tobytes() for p in dst], store.prefix(keys)))
    finally:
        store.close()


def die_mid_store(pool: str, names: list[str], store_bytes: int, ready_path: str) -> None:
    """Begins storing ``names`` (slots reserved, half of them written), says so, and waits
    to be SIGKILLed before finishing."""
    store = open_store(pool, store_bytes)
    host = host_pages(5)
    slots = store.slots(host)
    todo, blocks, _ = store.begin_store([key(n) for n in names])
    for b in blocks[: len(blocks) // 2]:
        slots[b.block_id - 1] = host[0]
    with open(ready_path, "w") as f:
        f.write(f"{len(blocks)}")
    time.sleep(600)
    sys.exit(3)


def die_pinning(pool: str, names: list[str], store_bytes: int, ready_path: str) -> None:
    """Pins complete pages (as a load does before copying) and waits to be SIGKILLed."""
    store = open_store(pool, store_bytes)
    pinned = store.pin([key(n) for n in names])
    with open(ready_path, "w") as f:
        f.write(str(sum(b is not None for b in pinned)))
    time.sleep(600)
    os._exit(3)


def open_and_store(pool: str, names: list[str], store_bytes: int, out) -> None:
    """Opens the store (waiting while another process makes its region) and stores
    ``names`` from host pages 0..; reports (pages stored, region inode)."""
    store = open_store(pool, store_bytes)
    try:
        stored, _ = store.save([key(n) for n in names], host_pages(11), list(range(len(names))))
        out.put((stored, os.stat("/dev/shm" + store.region.name).st_ino))
    finally:
        store.close()


def make_store_pool_and_wait(pool: str, ready, stop) -> None:
    """Make the store's pool and nothing else (as a maker killed before its page region),
    then wait to be killed."""
    from shmkv.sglang.store import open_pool

    bp = open_pool(pool, 8, 8, "maker")
    ready.set()
    stop.wait(120)
    bp.close()
