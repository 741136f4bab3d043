"""Workers of tests/multiprocess/test_fork.py: a process that forks while attached."""

from __future__ import annotations

import os
import time

from shmkv import BlockPool, ForkedPoolError


def fork_and_sleep(name: str, pid_file: str) -> None:
    """Attaches, takes two block references, forks a child that sleeps (holding whatever
    it inherited), writes the child's pid, and waits to be SIGKILLed."""
    pool = BlockPool.attach(name)
    pool.get_new_blocks(2)
    child = os.fork()
    if child == 0:
        try:
            time.sleep(60)
        finally:
            os._exit(0)
    with open(pid_file + ".tmp", "w") as f:
        f.write(str(child))
    os.rename(pid_file + ".tmp", pid_file)
    time.sleep(60)


def fork_and_use(name: str, out_file: str) -> None:
    """Attaches, forks; the child tries the parent's handle and reports what it got."""
    pool = BlockPool.attach(name)
    blocks = pool.get_new_blocks(1)
    child = os.fork()
    if child == 0:
        code = 1
        try:
            try:
                pool.get_new_blocks(1)
                result = "allocated"
            except ForkedPoolError as exc:
                result = "refused: " + str(exc)
            try:
                pool.free_blocks(blocks)
                result += " | free allowed"
            except ForkedPoolError:
                result += " | free refused"
            pool.close()  # only unmaps: the slot is the parent's
            with open(out_file, "w") as f:
                f.write(result)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    # The parent's handle, slot and references are untouched by the child.
    pool.free_blocks(blocks)
    pool.check_invariants()
    pool.close()


def raw_fork_and_sleep(name: str, pid_file: str, hold: bool = False) -> None:
    """As ``fork_and_sleep``, but forks with libc's fork() through ctypes, as C code would:
    Python's at-fork hooks do not run, so the child keeps the inherited descriptor of the
    liveness file, and with it the parent's OFD lock, for as long as it lives. With
    ``hold``, the parent takes the pool lock before it writes the pid file and keeps it
    until it is killed."""
    import ctypes

    pool = BlockPool.attach(name)
    pool.get_new_blocks(2)
    child = ctypes.CDLL(None, use_errno=True).fork()
    if child == 0:
        try:
            time.sleep(60)
        finally:
            os._exit(0)
    assert child > 0, "fork() failed"
    if hold:
        pool.lock().__enter__()
    with open(pid_file + ".tmp", "w") as f:
        f.write(str(child))
    os.rename(pid_file + ".tmp", pid_file)
    time.sleep(60)
