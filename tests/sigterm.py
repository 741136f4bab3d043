"""A SIGTERM to pytest (a CI time limit, ``timeout(1)``, ``kill``) stops the run the way
Ctrl-C does: the test in progress gets a KeyboardInterrupt and pytest then runs every
fixture's finalizer, so the pools, segments and processes the fixtures made are removed
rather than left in /dev/shm. pytest then exits with code 2 (interrupted).

Signals that come while the run is stopping (a second SIGTERM, a SIGINT) are ignored, so
the finalizers are not cut half way; a third one gives up and ends the process with the
signal's default action (a hung finalizer). ``tests/conftest.py`` installs it for the suite;
``pytest -p tests.sigterm`` for any other test file.
"""

from __future__ import annotations

import os
import signal
import threading

_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_state = {"stopping": 0, "old": {}}


def _on_signal(signum, frame) -> None:  # noqa: ARG001
    if os.getpid() != _state.get("pid"):  # a forked child: the signal's usual effect
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    _state["stopping"] += 1
    if _state["stopping"] == 1:
        raise KeyboardInterrupt(f"{signal.Signals(signum).name}: stopping the test run")
    if _state["stopping"] >= 3:  # asked three times: give up on the finalizers
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def install() -> None:
    """SIGTERM raises KeyboardInterrupt once; later SIGTERM/SIGINT wait for the stop."""
    if threading.current_thread() is not threading.main_thread():
        return
    _state["pid"] = os.getpid()
    old = signal.signal(signal.SIGTERM, _on_signal)
    _state["old"].setdefault(signal.SIGTERM, old)

    def on_sigint(signum, frame):
        if _state["stopping"] or os.getpid() != _state.get("pid"):
            _on_signal(signum, frame)
        else:
            raise KeyboardInterrupt  # Ctrl-C as usual
    _state["old"].setdefault(signal.SIGINT, signal.signal(signal.SIGINT, on_sigint))


def uninstall() -> None:
    for signum, old in _state["old"].items():
        if old is not None:
            signal.signal(signum, old)
    _state["old"].clear()


def pytest_configure(config) -> None:  # noqa: ARG001
    install()


def pytest_unconfigure(config) -> None:  # noqa: ARG001
    uninstall()
