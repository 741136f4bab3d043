"""fork() and liveness (issue 15, item 3): a forked child cannot keep its SIGKILLed parent
looking alive, and a pool handle refuses use in a forked child with a clear error."""

from __future__ import annotations

import os
import signal
import time

import pytest

from shmkv import BlockPool
from shmkv.pool.liveness import process_start_ticks
from tests.multiprocess import fork_workers
from tests.multiprocess.conftest import join_processes


def _wait_for(path: str, timeout_s: float = 30.0) -> str:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            pytest.fail(f"{path} never appeared")
        time.sleep(0.02)
    with open(path) as f:
        return f.read()


def test_a_forked_child_does_not_keep_a_killed_parent_alive(pool_name, spawn_ctx, tmp_path,
                                                            kernel):
    """The parent forks (the child inherits the descriptor of the liveness file) and is
    SIGKILLed while the child lives: its slot reads dead and is reaped with its block
    references. The child used to keep the parent's OFD lock, so nothing was reaped."""
    pool = BlockPool.create(pool_name, 16, kernel=kernel)
    grandchild = 0
    try:
        pid_file = str(tmp_path / "child.pid")
        proc = spawn_ctx.Process(target=fork_workers.fork_and_sleep, args=(pool_name, pid_file))
        proc.start()
        grandchild = int(_wait_for(pid_file))
        os.kill(proc.pid, signal.SIGKILL)
        # Not join(): the forked child holds the write end of the process's sentinel pipe.
        deadline = time.monotonic() + 30
        while proc.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proc.exitcode == -signal.SIGKILL
        os.kill(grandchild, 0)  # the forked child still lives
        assert pool.reap_dead() == 1
        assert pool.get_num_free_blocks() == 15
        pool.check_invariants()
    finally:
        if grandchild:
            try:
                os.kill(grandchild, signal.SIGKILL)
            except ProcessLookupError:
                pass
        pool.close()


def test_a_forked_child_cannot_use_its_parents_handle(pool_name, spawn_ctx, tmp_path, kernel):
    """In a forked child every call on the parent's handle raises ForkedPoolError naming
    both pids; close() there only unmaps; the parent goes on with its slot and blocks."""
    pool = BlockPool.create(pool_name, 16, kernel=kernel)
    try:
        out = str(tmp_path / "out")
        proc = spawn_ctx.Process(target=fork_workers.fork_and_use, args=(pool_name, out))
        proc.start()
        assert join_processes([proc], 60) == [0]
        result = _wait_for(out, 1)
        assert result.startswith("refused: pool "), result
        assert "is a fork of it" in result and "attach the pool again" in result
        assert result.endswith("| free refused"), result
        assert pool.get_num_free_blocks() == 15
        pool.check_invariants()
    finally:
        pool.close()


def _start_raw_forker(spawn_ctx, pool_name: str, tmp_path,
                      hold: bool = False) -> tuple[object, int]:
    """A spawned process that attaches, takes two blocks and forks with libc's fork() (no
    at-fork hooks: the child keeps the parent's OFD lock), then holds the pool lock if
    ``hold``; returns it and the child's pid."""
    pid_file = str(tmp_path / "child.pid")
    proc = spawn_ctx.Process(target=fork_workers.raw_fork_and_sleep,
                             args=(pool_name, pid_file, hold))
    proc.start()
    return proc, int(_wait_for(pid_file))


def _kill_and_wait(proc) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    # Not join(): the forked child holds the write end of the process's sentinel pipe.
    deadline = time.monotonic() + 30
    while proc.exitcode is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proc.exitcode == -signal.SIGKILL


def _kill_quietly(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_a_raw_forked_child_holding_the_lock_does_not_keep_a_killed_parent_alive(
        pool_name, spawn_ctx, tmp_path, kernel):
    """A child forked from C (no at-fork hook drops its descriptor) still holds the dead
    parent's OFD lock; the slot reads dead all the same, by its pid, and is reaped. Before
    liveness read the row's pid and start time, reap_dead() found nothing."""
    pool = BlockPool.create(pool_name, 16, kernel=kernel)
    grandchild = 0
    try:
        proc, grandchild = _start_raw_forker(spawn_ctx, pool_name, tmp_path)
        _kill_and_wait(proc)
        os.kill(grandchild, 0)  # the forked child lives, holding the lock
        assert pool.reap_dead() == 1
        assert pool.get_num_free_blocks() == 15
        pool.check_invariants()
    finally:
        if grandchild:
            _kill_quietly(grandchild)
        pool.close()


def test_a_dead_holder_whose_lock_a_raw_forked_child_keeps_is_taken_over(
        pool_name, spawn_ctx, tmp_path, kernel):
    """The parent dies holding the pool lock while its raw-forked child keeps its OFD lock:
    the next acquire takes over (the holder reads dead by its pid) instead of timing out
    with the holder called alive."""
    pool = BlockPool.create(pool_name, 16, kernel=kernel, lock_timeout_s=20)
    grandchild = 0
    try:
        proc, grandchild = _start_raw_forker(spawn_ctx, pool_name, tmp_path, hold=True)
        _kill_and_wait(proc)
        takeovers = int(pool.header_snapshot()["num_takeovers"])
        blocks = pool.get_new_blocks(1)  # LockTimeoutError if the holder read alive
        pool.free_blocks(blocks)
        assert int(pool.header_snapshot()["num_takeovers"]) == takeovers + 1
        pool.check_invariants()
        assert pool.get_num_free_blocks() == 15
    finally:
        if grandchild:
            _kill_quietly(grandchild)
        pool.close()


def test_a_reused_pid_does_not_keep_a_dead_slot_alive(pool_name, spawn_ctx, tmp_path, kernel):
    """The slot's lock is held (by the raw-forked child) and its row's pid names a live
    process, but one started at another tick than the row's start_ticks, as when the dead
    process's pid is reused: the slot reads dead. With the start time matching it reads
    alive: the test is on the start time, not on the pid alone. With the dead pid itself
    it reads dead, and is reaped."""
    pool = BlockPool.create(pool_name, 16, kernel=kernel)
    grandchild = 0
    try:
        proc, grandchild = _start_raw_forker(spawn_ctx, pool_name, tmp_path)
        slot = next(r["slot"] for r in pool.process_table.rows() if not r["self"])
        procs = pool._procs
        recorded_ticks = int(procs[slot]["start_ticks"])
        assert recorded_ticks == process_start_ticks(proc.pid) != 0
        _kill_and_wait(proc)
        other = os.getpid()  # a live process started long before the dead one
        assert process_start_ticks(other) != recorded_ticks
        with pool.lock():
            procs[slot]["pid"] = other  # the dead pid, as if reused by a live process
            assert not pool.process_table.is_alive(slot)
            procs[slot]["start_ticks"] = process_start_ticks(other)
            assert pool.process_table.is_alive(slot)  # the very process: alive
            procs[slot]["pid"] = proc.pid
            procs[slot]["start_ticks"] = recorded_ticks
        assert not pool.process_table.is_alive(slot)
        assert pool.reap_dead() == 1
        assert pool.get_num_free_blocks() == 15
        pool.check_invariants()
    finally:
        if grandchild:
            _kill_quietly(grandchild)
        pool.close()


def test_the_at_fork_hook_skips_a_closed_handle(pool_name, kernel):
    """A handle closed before the fork (still referenced, so still in the hook's set) is
    passed over: the hook used to raise PoolClosedError on it (printed as 'Exception
    ignored' in the child, and the pools after it in the set were then left unmarked,
    usable by the child). Seen in the chaos run."""
    pool = BlockPool.create(pool_name, 8, kernel=kernel)
    other = BlockPool.attach(pool_name, kernel=kernel)
    other.close()
    other._forked_child()  # what the hook calls in a forked child; nothing to do
    pool.check_invariants()
    pool.close()
