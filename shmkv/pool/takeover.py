"""Taking the pool lock over from a process that died holding it.

A POSIX semaphore is not released when its holder dies. A waiter wakes after every empty
wait slice (``lock.WAIT_SLICE_S``) and calls :meth:`TakeOver.on_stall`, which recognises two
situations:

1. **Dead holder.** ``holder`` names a slot whose liveness byte is free (the process is
   gone; ``shmkv/pool/liveness.py``), or, for a process inside ``attach()`` (whose row is not
   its own yet, or which has none: a full table), an attach mark byte that is free.
   Unambiguous: the holder writes ``holder`` after taking the semaphore and clears it before
   posting, so the unit died with it. Only the kernel's word counts (an OFD lock), never a
   pid, which means nothing to a waiter in another pid namespace; a ``holder`` word that
   names neither a slot nor a mark (another version's) is never taken for dead.
2. **Stuck with no holder.** ``holder == 0``, the semaphore at 0 and ``lock_seq`` unchanged
   for ``stuck_after_s``. Each process marks its row's ``lock_phase``: ACQUIRING before it
   waits, HOLDING as the very first store once it has the semaphore (before ``holder``),
   RELEASING before it clears ``holder`` (until after its post). So:

   - a *live* process marked HOLDING or RELEASING has the unit, or is about to post it: it
     is slow (preempted, stopped), not dead. Never take over then;
   - else a *dead* process marked HOLDING died with the unit (between the semaphore and
     ``holder``), and one marked RELEASING died before or just after its post: take over;
   - else a *dead* process marked ACQUIRING died waiting, or in the one store between
     taking the semaphore and marking HOLDING: with no process HOLDING or RELEASING, the
     unit can only be there. Take over.

   - a process marked ABANDONED (live or dead: an exception cut its acquire short just as
     the semaphore call returned, ``shmkv/pool/lock.py``) counts as a dead ACQUIRING one.

   - a live process in an attach hold marks no ``lock_phase`` of its own (it has no row
     yet); it locks its attach mark's hold byte instead, from its first statement under the
     lock to after its post. While another process has one locked, never take over.

   The one case this cannot tell apart: a live process stopped (SIGSTOP, or starved) for
   ``stuck_after_s`` in the single instruction between taking the semaphore and its HOLDING
   store (for an attach without a row: its few stores up to its ``holder`` word), while a
   dead process's mark is around.

Exactly one waiter takes over: the candidates race for an OFD lock on the arbiter byte of
the liveness file; the winner re-reads the lock's state under it, writes its own holder
record if nothing moved, and owns the semaphore unit the dead process took. The lock then
calls the pool's repair (``Repairer.on_dirty``, ``shmkv/pool/repair.py``) before anything
else.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import posix_ipc

from shmkv.pool import layout as L
from shmkv.pool.liveness import AliveLocks, is_mark
from shmkv.pool.lock import decode_holder, lock_name

DEFAULT_STUCK_AFTER_S = 2.0


class TakeOver:
    """One process's take-over logic for one pool.

    Args:
        shm_name: the pool's segment name.
        hdr64: flat int64 view of the header; procs: numpy view of the process table.
        alive: this process's liveness-file handle.
        my_holder_word: callable() -> this process's ``holder`` word.
        stuck_after_s: how long the lock must stand still with no holder recorded before
            a dead process's ``lock_phase`` mark is taken to mean it died with the semaphore
            (rule 2 above).
    """

    def __init__(self, shm_name: str, hdr64, procs: np.ndarray, alive: AliveLocks,
                 my_holder_word, stuck_after_s: float = DEFAULT_STUCK_AFTER_S) -> None:
        self._sem = posix_ipc.Semaphore(lock_name(shm_name))
        self._hdr = hdr64
        self._procs = procs
        self._alive = alive
        self._my_word = my_holder_word
        self.stuck_after_s = stuck_after_s
        self._threads = threading.Lock()  # threads of one process share the OFD arbiter
        self._stuck_seq: int | None = None
        self._stuck_since = 0.0
        self.victim: str = ""  # who the last take-over was from, for the repair's report

    def close(self) -> None:
        self._sem.close()

    def _holder_dead(self, word: int) -> bool:
        slot, _pid = decode_holder(word)
        if 0 <= slot < len(self._procs):
            return not self._alive.is_alive(slot)
        if is_mark(slot):  # a process inside attach(): its mark byte
            return not self._alive.mark_alive(slot)
        return False  # no byte to ask the kernel about: never taken for dead

    def _suspects(self) -> list[int]:
        """Slots of dead processes that may have died with the semaphore (rule 2 of the
        module docstring); [] when a live process may have it."""
        if self._alive.another_in_attach_hold():
            return []  # a live process without a row may have the unit
        phases = self._procs["lock_phase"]
        dead_with_unit, dead_waiting = [], []
        for slot in np.flatnonzero(phases != L.PHASE_IDLE).tolist():
            phase = int(phases[slot])
            alive = self._alive.is_alive(slot)
            if phase in (L.PHASE_HOLDING, L.PHASE_RELEASING):
                if alive:
                    return []  # it has the unit, or posts it: slow, not dead
                dead_with_unit.append(slot)
            elif (phase == L.PHASE_ACQUIRING and not alive) or phase == L.PHASE_ABANDONED:
                dead_waiting.append(slot)  # ABANDONED: a cut acquire, the unit may be there
        return dead_with_unit or dead_waiting

    def _stuck_without_holder(self) -> bool:
        seq = self._hdr[L.H_LOCK_SEQ]
        if self._sem.value != 0:
            self._stuck_seq = None
            return False
        now = time.monotonic()
        if self._stuck_seq != seq:
            self._stuck_seq, self._stuck_since = seq, now
            return False
        return now - self._stuck_since >= self.stuck_after_s

    def on_stall(self) -> bool:
        """Called by a waiter after an empty wait slice. Returns True when this process has
        taken the lock over (its holder record is written; it owns the semaphore unit)."""
        hdr = self._hdr
        word = hdr[L.H_HOLDER]
        if word:
            self._stuck_seq = None
            if not self._holder_dead(word):
                return False
            slot, pid = decode_holder(word)
            who = f"attach mark {slot}" if is_mark(slot) else f"slot {slot}"
            victim = f"holder {who} (pid {pid}) died holding the lock"
        else:
            if not self._stuck_without_holder():
                return False
            dead = self._suspects()
            if not dead:
                return False
            seq = hdr[L.H_LOCK_SEQ]
            victim = (
                f"the lock stood taken with no holder for {self.stuck_after_s} s; dead "
                f"process(es) in slot(s) {dead} were taking or giving it back"
            )
        if not self._threads.acquire(blocking=False):
            return False
        try:
            if not self._alive.try_arbiter():
                return False
            try:
                # Re-read under the arbiter: another waiter may have taken over (and even
                # released) since.
                if hdr[L.H_HOLDER] != word:
                    return False
                if not word and (hdr[L.H_LOCK_SEQ] != seq or self._sem.value != 0):
                    return False
                hdr[L.H_HOLDER] = self._my_word()
                self.victim = victim
                self._stuck_seq = None
                return True
            finally:
                self._alive.release_arbiter()
        finally:
            self._threads.release()
