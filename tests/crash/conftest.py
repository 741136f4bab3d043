"""Fixtures of the crash tests: the zygote that forks one short-lived child per scenario."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal

import pytest

from tests.crash import zygote

KILLED = f"signal:{int(signal.SIGKILL)}"  # how the zygote reports a child SIGKILL ended


@pytest.fixture(scope="module")
def forker():
    """The zygote (``tests/crash/zygote.py``): spawned once per module; ``forker(target,
    *args)`` forks a child that runs ``target(*args)`` and returns how it ended."""
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # no idle BLAS threads to fork
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=zygote.serve, args=(child,), daemon=True)
    proc.start()
    child.close()

    def run(target, *args) -> str:
        parent.send((target, args))
        assert parent.poll(zygote.CHILD_DEADLINE_S + 30), "the zygote stopped answering"
        return parent.recv()

    yield run
    parent.send(None)
    proc.join(30)
    if proc.is_alive():
        proc.kill()
        proc.join(10)
    assert proc.exitcode == 0
