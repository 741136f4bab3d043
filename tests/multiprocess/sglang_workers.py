"""Spawned SGLang instances for test_sglang_shared.py (module-level, so spawn can pickle
them). Each builds its backend through SGLang's factory, as an instance does at start."""

from __future__ import annotations

import os
import sys
import time

import torch


def _backend(pool: str, seed: int, store_bytes: int):
    from tests.sglang_helpers import HostBuffer, make_backend
    host = HostBuffer("page_first", seed=seed)
    return make_backend(pool, host, store_bytes=store_bytes), host


def store_and_report(pool: str, seed: int, keys: list[str], store_bytes: int, start_at: float,
                     out) -> None:
    """Stores ``keys`` from host pages 0..n-1 (all processes at ``start_at``), then reports
    its counters and whether each page read back equals what the FIRST storer wrote."""
    from tests.sglang_helpers import page_indices
    backend, host = _backend(pool, seed, store_bytes)
    try:
        time.sleep(max(0.0, start_at - time.time()))
        res = backend.batch_set_v1(keys, page_indices(list(range(len(keys))), 4))
        out.put((seed, res, backend.counters(), backend.batch_exists(keys)))
    finally:
        backend.close()


def read_back(pool: str, keys: list[str], store_bytes: int, out) -> None:
    """Loads ``keys`` into host pages 8.. and reports the hit list and the bytes."""
    from tests.sglang_helpers import page_indices
    backend, host = _backend(pool, 99, store_bytes)
    try:
        n = len(keys)
        hits = backend.batch_get_v1(keys, page_indices(list(range(8, 8 + n)), 4))
        # plain bytes: a torch tensor through a queue would be a shared-memory handle
        pages = [host.data_page(p * 4).view(torch.int16).numpy().tobytes() for p in range(8, 8 + n)]
        out.put((hits, pages, backend.batch_exists(keys)))
    finally:
        backend.close()


def die_mid_store(pool: str, keys: list[str], store_bytes: int, ready_path: str) -> None:
    """Begins storing ``keys`` (slots reserved, half the bytes written), says so, and waits
    to be SIGKILLed before finishing."""
    backend, host = _backend(pool, 5, store_bytes)
    store = backend.store
    todo, blocks, _ = store.begin_store(backend._hashes("t", keys))
    for b in blocks[: len(blocks) // 2]:
        backend._slots[b.block_id - 1].copy_(backend._view[0])
    with open(ready_path, "w") as f:
        f.write(f"{len(blocks)}")
    time.sleep(600)
    sys.exit(3)


def die_pinning(pool: str, keys: list[str], store_bytes: int, ready_path: str) -> None:
    """Pins stored pages (as a get does before copying) and waits to be SIGKILLed."""
    backend, host = _backend(pool, 6, store_bytes)
    pinned = backend.store.pin(backend._hashes("t", keys))
    with open(ready_path, "w") as f:
        f.write(str(sum(b is not None for b in pinned)))
    time.sleep(600)
    os._exit(3)
