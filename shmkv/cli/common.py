"""What every ``shmkv`` command shares: exit codes, the stop on SIGTERM / Ctrl-C."""

from __future__ import annotations

import time

EXIT_OK, EXIT_PROBLEM, EXIT_ERROR = 0, 1, 2
EXIT_INTERRUPTED = 130  # `shmkv run` stopped by a signal, and Ctrl-C of any command


class StopOnSignals:
    """SIGTERM/SIGINT end a long-running command cleanly (exit 0): the handler only sets
    a flag, which the command's loop checks between steps, so no step (a pool call, a
    send and the save of its position) is cut in the middle."""

    def __init__(self) -> None:
        import signal

        self.stopped = False

        def handler(signum, frame):  # noqa: ARG001
            self.stopped = True

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    def sleep(self, seconds: float) -> None:
        """Sleeps up to ``seconds``, less if a signal comes."""
        end = time.monotonic() + seconds
        while not self.stopped and (left := end - time.monotonic()) > 0:
            time.sleep(min(left, 0.05))
