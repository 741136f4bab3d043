"""What every child process of ``shmkv run`` does first (schedulers and ranks alike).

Its own module so that the scheduler and the rank's entry point (``shmkv/serve/engine.py``)
can share it without importing each other.
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time

from shmkv.pool.liveness import pid_alive

__all__ = ["child_setup"]


def child_setup(front_end_pid: int | None) -> None:
    """What every child of the run does first: leave Ctrl-C to the front end (the terminal
    sends it to the whole process group), take back the signals the front end blocks while
    it runs (a child inherits its mask), and die with the front end.

    Dying with it takes two mechanisms: ``PR_SET_PDEATHSIG`` fires when the *parent* dies,
    but a child made by the fork server has the fork server as parent, and the fork server
    lives as long as any of its children holds the pipe that keeps it alive: a cycle that
    would outlive a SIGKILLed front end. So a thread also waits on the front end's pidfd
    and ends the process when it exits.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if not front_end_pid:
        return
    try:
        fd = os.pidfd_open(front_end_pid)
    except ProcessLookupError:
        os._exit(1)  # gone already
    except (OSError, AttributeError):
        fd = None  # no pidfd (kernel < 5.3): poll

    def watch() -> None:
        if fd is not None:
            select.select([fd], [], [])
        else:
            while pid_alive(front_end_pid):
                time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="front-end-watch", daemon=True).start()
