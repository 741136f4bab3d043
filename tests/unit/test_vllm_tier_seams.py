"""The offload tier's seams where a real engine's start order and its several processes per
replica meet the data region and the replica lock file: a replica two of whose workers map
different regions is cut off, a removed replica lock file never makes a live replica read as
gone, and a lookup HIT kept across a region replacement is never loaded (nor leaks its hold).
Managers and workers' joins in one process (OFD locks tell descriptors apart as they tell
processes)."""

from __future__ import annotations

import os

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.base")

from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key  # noqa: E402

from shmkv.errors import SegmentError  # noqa: E402
from shmkv.vllm import SharedCPUOffloadingManager  # noqa: E402
from shmkv.vllm.lifecycle import join_as_worker  # noqa: E402
from shmkv.vllm.region import region_path  # noqa: E402
from shmkv.vllm.replicas import reap_gone, replica_locks_path  # noqa: E402
from tests.conftest import unique_pool_name  # noqa: E402

HIT, MISS = LookupResult.HIT, LookupResult.MISS
NUM_CHUNKS = 4
DATA_BYTES = NUM_CHUNKS * os.sysconf("SC_PAGE_SIZE")
CTX = ReqContext("seams")


def key(i: int):
    return make_offload_key(str(i).encode(), 0)


@pytest.fixture
def tier():
    """A tier name; every manager and worker hold made through it is closed at teardown,
    after the pool's invariants are checked, and the tier removed."""
    name = unique_pool_name("seam")
    opened: list = []

    def manager(replica: str) -> SharedCPUOffloadingManager:
        m = SharedCPUOffloadingManager(name, NUM_CHUNKS, replica_id=replica)
        opened.append(m)
        return m

    def worker(replica: str) -> int:
        locks, binding = join_as_worker(name, NUM_CHUNKS, 16, replica, DATA_BYTES)
        opened.append(locks)
        return binding.tag

    yield name, manager, worker
    for thing in reversed(opened):
        if isinstance(thing, SharedCPUOffloadingManager) and thing.pool is not None:
            thing.pool.check_invariants()
        thing.close()
    SharedCPUOffloadingManager.unlink(name)


def _store(manager, ints) -> list[int]:
    out = manager.prepare_store([key(i) for i in ints], CTX)
    manager.complete_store(out.keys_to_store, CTX)
    return out.store_spec.block_ids.tolist()


def test_a_replica_whose_two_workers_map_two_regions_gets_no_hit(tier):
    """TP=2: worker 0 of replica A maps the region; the region is removed; worker 1 makes a
    new one. Replica A (its engine core) reads every key MISS and may not load, since worker
    0's slot of any chunk would come from the old file; replica B, whose worker mapped only
    the new region, hits."""
    name, manager, worker = tier
    old = worker("A")
    os.unlink(region_path(name))
    new = worker("A")  # worker 1 of the same replica makes the new region
    assert new != old
    assert worker("B") == new
    b = manager("B")
    _store(b, [1])
    a = manager("A")
    assert b.lookup(key(1), CTX) == HIT
    assert a.lookup(key(1), CTX) == MISS
    with pytest.raises(SegmentError, match="data region was replaced"):
        a.prepare_load([key(1)], CTX)


def test_a_removed_replica_lock_file_never_makes_a_live_replica_gone(tier):
    """Replica A's engine core has stores in flight and is gone; its worker lives on (it
    may still be writing those chunks). The replica lock file is removed (a tmp cleaner).
    A new replica is refused, naming the file, instead of making a new file on which A's
    row reads gone; a process that opened the old file takes every row as live; A's chunks
    stay out of every replica's hands."""
    name, manager, worker = tier
    c = manager("C")
    worker("A")
    a = manager("A")
    out = a.prepare_store([key(1), key(2)], CTX)
    in_flight = [b + 1 for b in out.store_spec.block_ids.tolist()]  # block = chunk + 1
    a.close()  # the engine core is gone; its worker still holds the row
    os.unlink(replica_locks_path(name))
    with pytest.raises(SegmentError, match=r"replica lock file .* was removed or replaced"):
        SharedCPUOffloadingManager(name, NUM_CHUNKS, replica_id="B")
    with c.pool.lock():
        reap_gone(c._tier, c._locks)
    jobs = c._tier.jobs
    assert np.all(jobs[in_flight] != 0), "A's chunks left quarantine while its worker lives"
    got = c.prepare_store([key(10 + i) for i in range(NUM_CHUNKS)], CTX)
    taken = [] if got is None else [b + 1 for b in got.store_spec.block_ids.tolist()]
    assert not set(taken) & set(in_flight)


def test_a_hit_kept_across_a_region_replacement_is_never_loaded(tier):
    """Inside a step, replica A looks key 1 up (a HIT, pinned); the region is replaced (by
    replica C's worker) and C stores key 1 again. A, whose worker maps the old region, may
    not load it, and its lookup's hold does not leak: every chunk can be had again
    afterwards (the chunks held while the region was replaced lost their keys then, and go
    back to the free chunks when their holds do)."""
    name, manager, worker = tier
    worker("B")
    b = manager("B")
    _store(b, [1])
    worker("A")
    a = manager("A")
    with a.lock:
        assert a.lookup(key(1), CTX) == HIT
        os.unlink(region_path(name))
        worker("C")  # makes a new region: the tier forgets every chunk
        c = manager("C")
        _store(c, [1])
        with pytest.raises(SegmentError, match="data region was replaced"):
            a.prepare_load([key(1)], CTX)
    assert int(a.pool.block_rows()["ref_cnt"][1:].sum()) == 0
    worker("D")
    d = manager("D")  # no chunk was lost: a new replica can take every one of them
    out = d.prepare_store([key(100 + i) for i in range(NUM_CHUNKS)], CTX)
    assert out is not None and sorted(out.store_spec.block_ids.tolist()) == list(
        range(NUM_CHUNKS)), "a chunk held across the region replacement never came back"
    d.complete_store(out.keys_to_store, CTX)


def test_a_replica_no_worker_of_which_bound_the_region_is_cut_off(tier):
    """A replica whose engine core finds no region bound by its workers in this tier (they
    joined a removed tier of the same name: vLLM builds workers before the scheduler) gets
    no hit and stores nothing once the tier has a region: its workers would write elsewhere,
    and another replica would load zeros under its keys. Before any region is bound (no
    worker anywhere: scheduler-level use) it is trusted, and its keys go when the first
    worker makes the region."""
    name, manager, worker = tier
    early = manager("E")
    _store(early, [7])
    worker("B")  # makes the region: E's keys name no bytes, and are forgotten
    b = manager("B")
    assert b.lookup(key(7), CTX) == MISS
    _store(b, [1])
    a = manager("A")  # no worker of A joined this tier
    assert a.lookup(key(1), CTX) == MISS
    assert a.prepare_store([key(2)], CTX) is None
    with pytest.raises(SegmentError, match="data region was replaced|no worker"):
        a.prepare_load([key(1)], CTX)


def test_a_copy_of_the_region_renamed_over_it_is_never_the_bound_region(tier):
    """The region is copied, trailer and all, and the copy renamed over it (a backup
    restored, a file manager's move): the next worker does not take it for the bound region
    (another inode), makes a fresh one and the tier forgets its chunks; the replica whose
    worker maps the original gets no hit."""
    import shutil

    name, manager, worker = tier
    old = worker("A")
    a = manager("A")
    _store(a, [1])
    path = region_path(name)
    shutil.copyfile(path, path + ".copy")
    os.chmod(path + ".copy", 0o600)
    os.rename(path + ".copy", path)
    assert worker("B") != old
    b = manager("B")
    assert b.lookup(key(1), CTX) == MISS
    _store(b, [1])
    assert a.lookup(key(1), CTX) == MISS


def test_an_engine_core_whose_workers_joined_a_removed_tier_is_cut_off(tier):
    """Replica A's worker joins the tier; the tier is removed whole (``unlink --force``)
    before A's engine core starts; the core makes the tier anew, where no worker of A bound
    a region and none is bound at all. Built as vLLM builds it (its workers expected), the
    core gets no hit and stores nothing: its workers write a removed region, and another
    replica's core in the same position would otherwise load their bytes as its own."""
    name, manager, worker = tier
    worker("A")
    SharedCPUOffloadingManager.unlink(name)
    a = SharedCPUOffloadingManager(name, NUM_CHUNKS, replica_id="A", expect_workers=True)
    try:
        assert a.prepare_store([key(1)], CTX) is None
        b = SharedCPUOffloadingManager(name, NUM_CHUNKS, replica_id="B", expect_workers=True)
        try:
            assert b.lookup(key(1), CTX) == MISS
            assert b.prepare_store([key(2)], CTX) is None
        finally:
            b.close()
    finally:
        a.close()
