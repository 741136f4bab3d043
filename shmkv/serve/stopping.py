"""SIGTERM as a clean stop for the children of ``shmkv run`` (schedulers and ranks).

``install`` (called by ``engine.child_setup``) makes SIGTERM only set a flag; each child's
loop looks at ``terminated()`` between two steps (never in the middle of a pool call or a
step), stops, closes what it opened (a scheduler detaches from the pool: its block
references and slot go back) and exits ``EXIT_TERMINATED`` (143). A second SIGTERM changes
nothing: the stop under way goes on.

A wait on another process that may never answer (a scheduler waiting for its rank's step,
when the same SIGTERM stopped the rank first) looks at ``terminated()`` too and raises
``Terminated``: the process still closes everything and exits 143, instead of waiting out
its timeout and being SIGKILLed by the front end with its pool handle open.
"""

from __future__ import annotations

import signal
import threading

EXIT_TERMINATED = 128 + signal.SIGTERM  # 143
TERM_POLL_S = 0.25  # a wait on another process looks this often whether SIGTERM came
_terminated = threading.Event()


class Terminated(Exception):
    """A wait given up because this process was sent SIGTERM."""


def terminated() -> bool:
    """Whether this process was sent SIGTERM (after ``install``)."""
    return _terminated.is_set()


def _on_sigterm(signum, frame) -> None:  # noqa: ARG001
    _terminated.set()


def install() -> None:
    signal.signal(signal.SIGTERM, _on_sigterm)


__all__ = ["EXIT_TERMINATED", "TERM_POLL_S", "Terminated", "install", "terminated"]
