"""Fault injection for crash tests: SIGKILL this process before its n-th shared-memory write
of an operation.

``SHMKV_FAULT=<op>:<n>`` in a process's environment (or :func:`arm` in its code) makes the
first call of ``op`` that follows kill the process with SIGKILL right before the ``n``-th
store (1-based) that call makes to the segment, counting every store from the lock's
acquire to its release: the lock's own words (``lock_phase``, the holder record,
``lock_seq``, ``journal_len``), each undo-journal entry and each word of the mutation. A
crash test enumerates ``n = 1, 2, ...`` until the call completes (:data:`completed`).

Operations (the public ``BlockPool`` method that starts the count): ``allocate``
(``get_new_blocks``), ``free`` (``free_blocks``), ``touch``, ``cache``
(``cache_full_blocks``), ``evict`` (``evict_blocks``), ``reset`` (``reset_prefix_cache``),
``reap`` (``reap_dead``), ``attach``, ``close``, ``partial`` (``cache_partial_block``),
``move`` (``move_block_hashes``).

One counter serves both kernels: with the C extension built, the count lives in C (its
stores tick it directly) and the Python stores tick the same counter.

``SHMKV_FAULT=<op>:<n>:stop`` (or ``arm(op, n, stop=True)``) stops the process with SIGSTOP
at that point instead, and lets it go on from there once it gets SIGCONT: a process stopped
at a chosen instant of a hold, for the tests of what waiters, take-over and ``shmkv recover``
do with a holder that is alive but does not move.
"""

from __future__ import annotations

import os
import signal
import sys

try:
    from shmkv.pool import _ckernel
except ImportError:  # pragma: no cover - the C kernel is optional
    _ckernel = None
else:  # CLock.mutate starts and ends the count of a planned call here, from C
    _ckernel.set_fault(sys.modules[__name__])

ENV_VAR = "SHMKV_FAULT"
OPERATIONS = (
    "allocate", "free", "touch", "cache", "evict", "reset", "reap", "attach", "close",
    "partial", "move", "unpin",
)

# The plan: (op, n) waiting for its call, or None. `armed` is True while a call counts.
planned: tuple[str, int] | None = None
stop_not_kill = False  # the planned point stops the process (SIGSTOP), not kills it
armed = False
completed = False  # a planned call ran to its end without reaching its n-th store
_left = -1  # stores still allowed (pure-Python counter, when there is no C kernel)


def arm(op: str, n: int, stop: bool = False) -> None:
    """Kills this process before the ``n``-th store of the next call of ``op`` (with
    ``stop``, stops it there with SIGSTOP; it goes on when continued)."""
    global planned, completed, stop_not_kill
    if op not in OPERATIONS:
        raise ValueError(f"{ENV_VAR}: unknown operation {op!r}; one of {OPERATIONS}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{ENV_VAR}: the store number must be an int >= 1, got {n!r}")
    planned = (op, n)
    stop_not_kill = bool(stop)
    completed = False


def arm_from_env() -> None:
    """Reads ``SHMKV_FAULT=<op>:<n>[:stop]`` (no-op when unset)."""
    spec = os.environ.get(ENV_VAR)
    if not spec:
        return
    op, sep, rest = spec.partition(":")
    n, _, mode = rest.partition(":")
    if not sep or not n.strip().isdigit() or mode.strip() not in ("", "stop"):
        raise ValueError(f"{ENV_VAR} must look like 'allocate:7' or 'allocate:7:stop', got "
                         f"{spec!r}")
    arm(op.strip(), int(n), stop=mode.strip() == "stop")


def begin(op: str) -> bool:
    """Starts counting if ``op`` is the planned operation. Returns whether it did (the
    caller then calls :func:`end` when the operation returns)."""
    global armed, planned, _left
    if planned is None or planned[0] != op or armed:
        return False
    n = planned[1]
    planned = None
    armed = True
    if _ckernel is not None:
        _ckernel.fault_arm(n, stop_not_kill)
    else:
        _left = n - 1
    return True


def end() -> None:
    """The counted call returned without reaching its store: disarm."""
    global armed, completed, _left
    armed = False
    completed = True
    _left = -1
    if _ckernel is not None:
        _ckernel.fault_arm(0)


def tick() -> None:
    """One store is about to happen: die here if it is the planned one."""
    global _left
    if _ckernel is not None:
        _ckernel.fault_tick()
        return
    if _left == 0:
        _left = -1  # fires once (a stopped process goes on past it)
        fire()
    if _left > 0:
        _left -= 1


def fire() -> None:
    if stop_not_kill:
        os.kill(os.getpid(), signal.SIGSTOP)  # returns once continued
        return
    os.kill(os.getpid(), signal.SIGKILL)
    signal.pause()  # pragma: no cover - SIGKILL is not delivered late, but never go on


arm_from_env()
