"""SIGTERM as a clean stop for the children of ``shmkv run`` (schedulers and ranks).

``install`` (called by ``engine.child_setup``) makes SIGTERM only set a flag; each child's
loop looks at ``terminated()`` between two steps (never in the middle of a pool call or a
step), stops, closes what it opened (a scheduler detaches from the pool: its block
references and slot go back) and exits ``EXIT_TERMINATED`` (143). A second SIGTERM changes
nothing: the stop under way goes on.
"""

from __future__ import annotations

import signal
import threading

EXIT_TERMINATED = 128 + signal.SIGTERM  # 143
_terminated = threading.Event()


def terminated() -> bool:
    """Whether this process was sent SIGTERM (after ``install``)."""
    return _terminated.is_set()


def _on_sigterm(signum, frame) -> None:  # noqa: ARG001
    _terminated.set()


def install() -> None:
    signal.signal(signal.SIGTERM, _on_sigterm)


__all__ = ["EXIT_TERMINATED", "install", "terminated"]
