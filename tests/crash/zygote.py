"""A spawned helper that forks one short-lived child per crash scenario.

Spawning a fresh interpreter per injection point costs about 0.4 s (numpy and shmkv
imports); the crash tests run hundreds of points. So the test spawns this *zygote* once: it
imports everything, attaches to nothing, and for each request forks a child that runs one
scenario function and exits. The children are real processes with their own slot, liveness
byte and pool mapping (``BlockPool.attach`` after the fork); the zygote reports how each one
ended. Every wait has a deadline; a child that overstays is killed and reported as such.
"""

from __future__ import annotations

import os
import signal
import time
import traceback

CHILD_DEADLINE_S = 60.0
EXIT_DONE = 0  # the scenario function returned
EXIT_ERROR = 3  # it raised


def _run_child(target, args) -> None:
    try:
        target(*args)
    except BaseException:  # report, never fall back into the zygote's loop
        traceback.print_exc()
        os._exit(EXIT_ERROR)
    os._exit(EXIT_DONE)  # without close(): the survivor reaps what is left


def _wait(pid: int) -> str:
    """'exit:<code>', 'signal:<num>' or 'timeout'."""
    deadline = time.monotonic() + CHILD_DEADLINE_S
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            if os.WIFSIGNALED(status):
                return f"signal:{os.WTERMSIG(status)}"
            return f"exit:{os.WEXITSTATUS(status)}"
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "timeout"
        time.sleep(0.001)


def serve(conn) -> None:
    """Zygote main loop: receives (target, args) tuples, answers each child's end."""
    import numpy  # noqa: F401  (imported once, here, before any fork)

    import shmkv  # noqa: F401
    import tests.crash.scenarios  # noqa: F401

    while True:
        if not conn.poll(600):
            return  # the test went away
        request = conn.recv()
        if request is None:
            return
        target, args = request
        pid = os.fork()
        if pid == 0:
            conn.close()
            _run_child(target, args)
        conn.send(_wait(pid))
