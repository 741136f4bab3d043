"""fork() and liveness (issue 15, item 3): a forked child cannot keep its SIGKILLed parent
looking alive, and a pool handle refuses use in a forked child with a clear error."""

from __future__ import annotations

import os
import signal
import time

import pytest

from shmkv import BlockPool
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
