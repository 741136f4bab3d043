"""The history recorder: off unless asked (a plain BlockPool then), one hold number per
hold from the segment's ``lock_seq`` on both kernels, bad input refused, and a process
killed inside a call leaves a call with no end whose hold the checker finds rolled back."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from shmkv import BlockPool
from shmkv.errors import UsageError
from shmkv.pool.layout import segment_name
from shmkv.pool.recorder import RECORD_ENV, Enter, Exit, Released, read_history
from tests.conftest import unique_pool_name
from tests.linearizability import workers
from tests.multiprocess.conftest import join_processes


def test_off_unless_asked(kernel, tmp_path, monkeypatch):
    monkeypatch.delenv(RECORD_ENV, raising=False)
    name = unique_pool_name("linr")
    pool = BlockPool.create(name, 5, kernel=kernel)
    try:
        assert type(pool) is BlockPool  # the unrecorded path is vLLM's API, nothing more
        monkeypatch.setenv(RECORD_ENV, str(tmp_path))
        other = BlockPool.attach(name, kernel=kernel)
        assert type(other).__name__ == "RecordingBlockPool"
        other.close()
        (path,) = tmp_path.iterdir()
        assert path.name.startswith(f"{name}-{os.getpid()}-") and read_history(str(path))[0]
    finally:
        pool.close()
        BlockPool.unlink(name)


def test_each_hold_has_its_own_number(kernel, tmp_path):
    name = unique_pool_name("linr")
    path = str(tmp_path / "h")
    pool = BlockPool.create(name, 9, kernel=kernel, record=path)
    try:
        a = pool.get_new_blocks(2)
        pool.free_blocks(a)
        with pool.lock():  # one hold: both calls carry its number
            seq = int(pool.header_snapshot()["lock_seq"])
            b = pool.get_new_blocks(1)
            pool.touch(b)
        pool.free_blocks(b + b)
        pool.check_invariants()
    finally:
        pool.close()
        BlockPool.unlink(name)
    records, cut = read_history(path)
    enters = [r for r in records if isinstance(r, Enter)]
    assert [r.op for r in enters] == ["get_new_blocks", "free_blocks", "get_new_blocks",
                                      "touch", "free_blocks"]
    first = enters[0].seq
    assert [r.seq for r in enters] == [first, first + 1, seq, seq, seq + 1] and seq == first + 2
    exits = [r for r in records if isinstance(r, Exit)]
    assert [r.n for r in exits] == [r.n for r in enters] and exits[0].result == [1, 2]
    assert isinstance(records[-2], Released) and records[-2].own and not cut


@pytest.mark.parametrize("record", [7, ""])
def test_a_bad_record_path_is_refused(kernel, record):
    name = unique_pool_name("linr")
    with pytest.raises(UsageError, match="record must be a file path"):
        BlockPool.create(name, 5, kernel=kernel, record=record)
    assert not os.path.exists(f"/dev/shm{segment_name(name)}")  # nothing was left


@pytest.mark.parametrize("store", [1, 4, 9])
def test_a_call_killed_in_its_hold_is_rolled_back(kernel, tmp_path, store):
    pytest.importorskip("vllm.v1.core.block_pool")  # the checker replays on vLLM's pool
    from tests.linearizability.checker import FinalState, check

    name = unique_pool_name("linr")
    pool = BlockPool.create(name, 9, kernel=kernel, record=str(tmp_path / "a.history"),
                            stuck_after_s=0.5)
    try:
        proc = mp.get_context("spawn").Process(
            target=workers.die_in_allocation,
            args=(name, kernel, str(tmp_path / "b.history"), store))
        proc.start()
        assert join_processes([proc], timeout_s=60) == [-9]
        pool.reap_dead()
        final = FinalState.of(pool)
        pool.check_invariants()
    finally:
        pool.close()
        BlockPool.unlink(name)
    records, _ = read_history(str(tmp_path / "b.history"))
    last = [r for r in records if isinstance(r, (Enter, Exit))][-1]
    assert isinstance(last, Enter) and last.op == "get_new_blocks"  # no end: it died in it
    (reap,) = [r for r in read_history(str(tmp_path / "a.history"))[0]
               if isinstance(r, Released) and not r.own]
    assert reap.blocks == [(3, 1), (2, 1)]  # what it held before the killed call
    report = check(str(tmp_path), final)
    assert report and report.holds_rolled_back == 1, report
