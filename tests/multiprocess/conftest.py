"""Real OS processes: spawn context, a timeout on every join, every exit code checked."""

from __future__ import annotations

import multiprocessing as mp

import pytest

JOIN_TIMEOUT_S = 120


@pytest.fixture
def spawn_ctx():
    return mp.get_context("spawn")


def join_processes(procs, timeout_s: float = JOIN_TIMEOUT_S) -> list[int | None]:
    """Joins each process with a timeout, killing a straggler; returns the exit codes."""
    for p in procs:
        p.join(timeout_s)
    kill_processes(procs)
    return [p.exitcode for p in procs]


def kill_processes(procs) -> None:
    """Kills the processes still alive and joins them (a test's cleanup after a failure)."""
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(10)


def run_processes(ctx, target, arg_list, timeout_s: float = JOIN_TIMEOUT_S) -> list[int]:
    """Starts one process per args tuple, joins each with a timeout (killing stragglers),
    and returns the exit codes."""
    procs = [ctx.Process(target=target, args=args) for args in arg_list]
    for p in procs:
        p.start()
    return join_processes(procs, timeout_s)
