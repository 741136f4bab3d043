"""What every ``shmkv`` command shares: exit codes, the stop on SIGTERM / Ctrl-C."""

from __future__ import annotations

import time

EXIT_OK, EXIT_PROBLEM, EXIT_ERROR = 0, 1, 2
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT); SIGTERM gives 143 (128 + SIGTERM)


class StopOnSignals:
    """SIGTERM/SIGINT end a long-running command cleanly: the handler only sets a flag,
    which the command's loop checks between steps, so no step (a pool call, a send and the
    save of its position) is cut in the middle; the command then detaches and exits
    ``exit_code`` (143 after SIGTERM, 130 after SIGINT). From the first signal on, both are
    ignored, so a second one cannot cut the stop (nor the interpreter's exit, where Python
    puts the default actions back) half way."""

    def __init__(self) -> None:
        import signal

        self.stopped = False
        self.signum: int | None = None

        def handler(signum, frame):  # noqa: ARG001
            self.stopped = True
            if self.signum is None:
                self.signum = signum
            self.ignore()

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    @staticmethod
    def ignore() -> None:
        """SIGTERM and SIGINT are ignored from now on (the command is on its way out)."""
        import signal

        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    @property
    def exit_code(self) -> int:
        """128 + the signal that stopped the command; 0 if none did (it ran its course)."""
        return 0 if self.signum is None else 128 + self.signum

    def sleep(self, seconds: float) -> None:
        """Sleeps up to ``seconds``, less if a signal comes."""
        end = time.monotonic() + seconds
        while not self.stopped and (left := end - time.monotonic()) > 0:
            time.sleep(min(left, 0.05))


def missing_pool_message(name: str) -> str:
    """The one message every command gives for a pool that does not exist."""
    from shmkv.pool import layout as L

    return (f"no pool named {name} (no /dev/shm{L.segment_name(name)}; `shmkv ls` lists "
            "the pools)")


def attach_pool(name: str, **kwargs):
    """``BlockPool.attach(name, **kwargs)`` for a command: a pool that does not exist is
    :func:`missing_pool_message` (exit 2, as every error), the same for every command.

    Raises:
        SegmentNotFoundError: no such pool, with that message.
    """
    from shmkv.errors import SegmentNotFoundError
    from shmkv.pool import layout as L
    from shmkv.pool.block_pool import BlockPool

    L.validate_pool_name(name)
    try:
        return BlockPool.attach(name, **kwargs)
    except SegmentNotFoundError as exc:
        raise SegmentNotFoundError(missing_pool_message(name)) from exc
