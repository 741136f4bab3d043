"""The recorder when its file cannot be written (a full disk, a file size limit, a planted
link), and histories the checker must refuse: not whole (no ``Opened`` first, or emptied by a
recorder that stopped) or of two different pools."""

from __future__ import annotations

import os
import resource
import signal
import uuid

import pytest

pytest.importorskip("vllm.v1.core.block_pool")  # the checker replays on vLLM's own code

from shmkv import BlockPool  # noqa: E402
from shmkv.errors import UsageError  # noqa: E402
from shmkv.pool import recorder  # noqa: E402
from shmkv.pool.recorder import RECORD_ENV, Enter, Exit, Opened, read_history  # noqa: E402
from tests.conftest import unique_pool_name  # noqa: E402
from tests.linearizability.checker import FinalState, check  # noqa: E402
from tests.linearizability.recordings import rewrite_history  # noqa: E402

pytestmark = pytest.mark.long


def test_a_full_disk_never_fails_nor_changes_a_pool_call(kernel, tmp_path):
    """The history file stops growing after its first record (RLIMIT_FSIZE: EFBIG, a short
    write): every pool call still answers as an unrecorded pool's, nothing leaks, and the
    history is emptied (``record_error`` says why) so the checker cannot take its start for
    a process that stopped. (Before: the first call allocated a block, then raised OSError
    from its Exit record; the block was held by nobody who knew it, and the file ended in
    a cut frame.)"""
    name = unique_pool_name("linf")
    path = str(tmp_path / "h")
    pool = BlockPool.create(name, 9, kernel=kernel, record=path)
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(path) + 40, old_limit[1]))
        with pytest.warns(RuntimeWarning, match="recording this pool's history stopped"):
            got = [pool.get_new_blocks(1) for _ in range(3)]
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        assert [[b.block_id for b in g] for g in got] == [[1], [2], [3]]
        assert pool.get_num_free_blocks() == 5
        for g in got:
            pool.free_blocks(g)
        assert pool.get_num_free_blocks() == 8
        assert "File too large" in pool.record_error or "wrote" in pool.record_error
        pool.check_invariants()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
        pool.close()
        BlockPool.unlink(name)
    assert os.path.getsize(path) == 0
    assert not check([path])


def test_an_unwritable_record_file_refuses_the_handle_and_leaks_nothing(kernel):
    """Not even ``Opened`` can be written (/dev/full): create and attach raise naming the
    file, create leaves no segment, attach gives its process-table slot back."""
    name = unique_pool_name("linf")
    with pytest.raises(OSError, match="/dev/full"):
        BlockPool.create(name, 5, kernel=kernel, record="/dev/full")
    assert not [e for e in os.listdir("/dev/shm") if name in e]
    pool = BlockPool.create(name, 5, kernel=kernel, max_processes=2)
    try:
        before = pool.header_snapshot()["num_reaped"]
        for _ in range(3):
            with pytest.raises(OSError, match="/dev/full"):
                BlockPool.attach(name, kernel=kernel, record="/dev/full")
        other = BlockPool.attach(name, kernel=kernel)  # the one free slot was given back
        other.close()
        assert pool.header_snapshot()["num_reaped"] == before  # by close, not by a reap
        pool.check_invariants()
    finally:
        pool.close()
        BlockPool.unlink(name)


def test_a_record_dir_name_is_never_a_planted_file(kernel, tmp_path, monkeypatch):
    """In ``$SHMKV_RECORD_DIR`` each handle records to a new file: a link (or a file) planted
    under the name it picks is refused, and its target left as it was."""
    name = unique_pool_name("linf")
    monkeypatch.setenv(RECORD_ENV, str(tmp_path))
    token = uuid.uuid4()
    monkeypatch.setattr(recorder.uuid, "uuid4", lambda: token)
    target = tmp_path / "target"
    target.write_bytes(b"precious")
    os.symlink(target, tmp_path / f"{name}-{os.getpid()}-{token.hex[:8]}.history")
    with pytest.raises(OSError):
        BlockPool.create(name, 5, kernel=kernel)
    assert target.read_bytes() == b"precious"
    assert not [e for e in os.listdir("/dev/shm") if name in e]


def _record(tmp_path, name: str, kernel: str, pre_holds: int = 0) -> tuple[str, FinalState]:
    path = str(tmp_path / f"{name}.history")
    pool = BlockPool.create(name, 9, kernel=kernel, record=path)
    try:
        for _ in range(pre_holds):
            with pool.lock():
                pass
        blocks = pool.get_new_blocks(2)
        pool.free_blocks(blocks)
        final = FinalState.of(pool)
    finally:
        pool.close()
        BlockPool.unlink(name)
    return path, final


def test_the_checker_refuses_a_history_that_is_not_whole(kernel, tmp_path):
    """A history without its ``Opened`` record (an emptied file, or one split in two
    Opened-less halves that share a made-up process) is a difference, not a process that
    did nothing or one that held what another allocated. (Before: both were accepted.)"""
    name = unique_pool_name("linc")
    path, final = _record(tmp_path, name, kernel)
    assert check([path], final), "the whole history is accepted"
    records, _ = read_history(path)
    empty = str(tmp_path / "emptied.history")
    open(empty, "wb").close()
    assert not check([path, empty], final)
    # The calls split over two Opened-less files, both "processes" unknown: process 2
    # frees the blocks process 1 allocated.
    alloc_n = next(r.n for r in records if getattr(r, "op", "") == "get_new_blocks")
    first, second = str(tmp_path / "a.history"), str(tmp_path / "b.history")
    for part, keep in ((first, lambda r: getattr(r, "n", 0) <= alloc_n),
                       (second, lambda r: getattr(r, "n", 0) > alloc_n)):
        with open(part, "wb") as f:
            f.write(open(path, "rb").read())
        rewrite_history(part, lambda r, keep=keep: None if isinstance(r, Opened) or not keep(r)
                        else r)
    report = check([first, second], final)
    assert not report and "Opened" in report.differences[0], report


def test_the_checker_refuses_histories_of_two_pools(kernel, tmp_path):
    """Two pools' histories, each good alone, whose hold numbers happen not to collide are
    not one pool's history. (Before: replayed as one pool and accepted.)"""
    one, _ = _record(tmp_path, unique_pool_name("linc"), kernel)
    two, _ = _record(tmp_path, unique_pool_name("linc"), kernel, pre_holds=20)
    assert check([one]) and check([two])
    report = check([one, two])
    assert not report and "2 pools" in report.differences[0], report


def test_the_checker_refuses_a_valid_call_recorded_as_refused(kernel, tmp_path):
    """A lookup shmkv answered, recorded instead as refused for bad input (UsageError), is a
    difference: vLLM accepts that call. A call vLLM refuses too (freeing a block nobody
    holds) stays skipped. (Before: every UsageError was skipped unseen.)"""
    name = unique_pool_name("linc")
    path = str(tmp_path / "a.history")
    pool = BlockPool.create(name, 9, kernel=kernel, record=path)
    try:
        blocks = pool.get_new_blocks(2)
        assert pool.get_cached_block(b"\x01" * 32, [0]) is None
        with pytest.raises(UsageError):
            pool.free_blocks([pool.blocks[5]])  # held by nobody: refused
        pool.free_blocks(blocks)
        final = FinalState.of(pool)
    finally:
        pool.close()
        BlockPool.unlink(name)
    assert check([path], final), "the history as recorded is accepted"

    def refuse_lookup(rec):
        if isinstance(rec, Exit) and rec.result is None and rec.error_type is None and (
                lookup_n == rec.n):
            return Exit(n=rec.n, error_type="UsageError", error="made up")
        return rec

    lookup_n = next(r.n for r in read_history(path)[0]
                    if isinstance(r, Enter) and r.op == "get_cached_block")
    rewrite_history(path, refuse_lookup)
    report = check([path], final)
    assert not report and "vLLM accepts it" in report.differences[0], report
