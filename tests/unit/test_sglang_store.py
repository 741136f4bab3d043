"""The SGLang page store (``shmkv.sglang.store``) on its own, without SGLang: its region is
mapped in at open, pages copied in and out, and what a subscriber of the pool's event log
learns of it."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from shmkv.sglang.store import PageStore
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


assert sys and np
