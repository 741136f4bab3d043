"""The process table and the reference ledger, seen from one attached process.

Every attached process holds a slot of the table (region ``proc_table``: pid, incarnation,
label, state, ``lock_phase``) and the same-numbered row of the ledger (region ``ledger``: the
references it holds, per block). A block's ``ref_cnt`` is the sum of its ledger column over
the active slots, so giving back a slot's row gives back exactly what its process held,
whether the process closed the pool or died (``reap_dead``) or was fenced off
(``BlockPool.reclaim_slot``).

Liveness of a slot is the liveness rule of ``shmkv/pool/liveness.py`` (``AliveLocks``: an OFD
lock per slot, and the row's pid + start time where this process can check them), never a
bare pid test. Every method that writes takes the caller's word that it holds the pool lock, and
journals every word it writes, so a hold cut short by a kill is rolled back whole.
"""

from __future__ import annotations

import logging
import secrets
import time

import numpy as np

from shmkv.pool import layout as L
from shmkv.pool.free_queue import FreeKVCacheBlockQueue
from shmkv.pool.journal import Journal, JournaledColumn, JournaledView
from shmkv.pool.liveness import AliveLocks, is_mark, own_pid_namespace, process_start_ticks

logger = logging.getLogger("shmkv.pool.block_pool")  # the pool's log, as before the split

# A process row's words journaled by attach and close: all but lock_phase, which the lock
# writes, unjournaled, for the row's owner (shmkv/pool/lock.py).
PROC_ROW_WORDS = L.P_LOCK_PHASE


class ProcessTable:
    """The process table and ledger of one pool, and this process's slot in them.

    Args:
        pool_name: the pool's name, for log messages.
        layout: the segment's layout.
        procs: region ``proc_table`` (structured view).
        ledger: region ``ledger``, one int32 row of ``num_blocks`` per slot.
        alive: this process's handle on the pool's liveness lock file.
        journal: the undo journal every write here goes through.
        hdr_w: the header's int64 words, journaled on write.
        ref_col: the blocks' ``ref_cnt`` column; ``ref_col_w`` the same, journaled.
        htok_col: the blocks' ``hash_num_tokens`` column (which freed blocks are cached).
        free_queue: the free queue, where released blocks go.
        enable_caching: whether cached blocks go to the queue's back (else all to the front).
    """

    def __init__(self, pool_name: str, layout: L.Layout, procs: np.ndarray, ledger: np.ndarray,
                 alive: AliveLocks, journal: Journal, hdr_w: JournaledView,
                 ref_col: np.ndarray, ref_col_w: JournaledColumn, htok_col: np.ndarray,
                 free_queue: FreeKVCacheBlockQueue, enable_caching: bool) -> None:
        self.pool_name = pool_name
        self._layout = layout
        self._procs = procs
        self._ledger = ledger
        self._alive = alive
        self._journal = journal
        self._hdr_w = hdr_w
        self._ref_col = ref_col
        self._ref_col_w = ref_col_w
        self._htok_col = htok_col
        self._free_queue = free_queue
        self._enable_caching = enable_caching
        self._num_blocks = layout.config.num_blocks
        self.own_slot = -1  # this process's slot, once claimed

    # ------------------------------------------------------------------ reads

    @property
    def num_slots(self) -> int:
        """Slots in the table (the pool's ``max_processes``)."""
        return len(self._procs)

    def active_slots(self) -> list[int]:
        """The slots held by an attached process (alive or not), in slot order."""
        return np.flatnonzero(self._procs["state"] == L.SLOT_ACTIVE).tolist()

    def is_alive(self, slot: int) -> bool:
        """Whether the process of ``slot`` is alive (the liveness rule: its OFD lock, and its
        pid + start time)."""
        return self._alive.is_alive(slot)

    def references_held(self, slot: int) -> int:
        """The block references ``slot``'s process holds (its ledger row's sum)."""
        return int(self._ledger[slot].sum())

    def rows(self) -> list[dict]:
        """One dict per active slot: slot, pid, label, alive, references held, attach time
        (ns since the epoch) and whether it is this process (``self``). A read of the
        shared table: hold the pool lock for a consistent one."""
        out = []
        for slot in self.active_slots():
            row = self._procs[slot]
            out.append({
                "slot": slot,
                "pid": int(row["pid"]),
                "label": bytes(row["label"]).decode(errors="replace"),
                "alive": self._alive.is_alive(slot),
                "references": int(self._ledger[slot].sum()),
                "attach_ns": int(row["attach_ns"]),
                "self": slot == self.own_slot,
            })
        return out

    def labels(self) -> dict[int, str]:
        """The label of every slot that has one, by slot: an attached process's, or a free
        slot's last process's (kept until the slot is reused, so a reader that polls, such
        as the publisher, can still name the events of a process that attached, logged and
        left between two polls). Cheap, and read without the lock (a label is written
        once, at attach), so a reader may call it at every poll."""
        return {slot: label.decode(errors="replace")
                for slot, label in enumerate(self._procs["label"].tolist()) if label}

    def live_pids(self) -> list[int]:
        """The pids of every slot not free (for messages)."""
        return [int(p) for p in self._procs["pid"][self._procs["state"] != L.SLOT_FREE]]

    def describe_holder(self, slot: int, pid: int) -> str:
        """Why the lock's holder (``slot``, ``pid``) holds it, for a timeout message."""
        if is_mark(slot):
            state = ("alive (a long hold, or it is stopped)" if self._alive.mark_alive(slot)
                     else "dead: it died holding the lock")
            return f"a process inside attach(), by its attach mark; that process is {state}"
        if not 0 <= slot < self.num_slots:
            return "not a process-table slot"
        if self._alive.is_alive(slot):
            return "that process is alive (a long hold, or it is stopped)"
        return "that process is dead: it died holding the lock"

    # ------------------------------------------------------------------ claiming a slot

    def claim_free_slot(self) -> int | None:
        """A FREE slot whose liveness byte this process could take, or None. A free row
        still marked ACQUIRING or RELEASING is skipped: its process died taking or giving
        back the lock (maybe holding the semaphore), and the mark is how a waiter finds out;
        the repair clears it. Slots that keep no label are taken first, so a released
        slot's label (``labels``) lives as long as the table has room. Takes no lock (the
        kernel arbitrates the byte)."""
        procs = self._procs
        usable = (procs["state"] == L.SLOT_FREE) & (procs["lock_phase"] == L.PHASE_IDLE)
        unlabelled = procs["label"] == b""
        order = np.concatenate([np.flatnonzero(usable & unlabelled),
                                np.flatnonzero(usable & ~unlabelled)])
        for slot in order.tolist():
            if self._alive.claim(slot):
                if self._procs[slot]["state"] == L.SLOT_FREE:
                    return slot
                self._alive.release(slot)  # filled in by a process that has since died
        return None

    def slot_is_free(self, slot: int) -> bool:
        """Whether ``slot`` is FREE with an empty ledger row (caller holds the lock)."""
        return (self._procs["state"][slot] == L.SLOT_FREE
                and not self._ledger[slot].any())

    def give_up_claim(self, slot: int) -> None:
        """Drops a claimed slot found not to be free after all (caller holds the lock): the
        row stays as the repair restored it (its process is dead; a reap gives it back)."""
        self._procs["lock_phase"][slot] = L.PHASE_IDLE  # our marks, not its
        self._alive.release(slot)

    def fill_row(self, slot: int, pid: int, label: bytes) -> int:
        """Makes ``slot`` this process's (caller holds the lock and the slot's liveness
        byte): pid, a fresh incarnation, start time, attach time, label, pid namespace,
        ACTIVE (last: a reader tests pid and start time only in an active row).

        Returns:
            the incarnation, the fence of this attach (``FencedError`` once it changes).
        """
        incarnation = secrets.randbits(63) | 1
        self.save_row(slot, PROC_ROW_WORDS)
        row = self._procs[slot]
        row["pid"] = pid
        row["incarnation"] = incarnation
        row["start_ticks"] = process_start_ticks(pid)
        row["attach_ns"] = time.time_ns()
        row["label"] = label
        row["pid_ns"] = own_pid_namespace()
        row["state"] = L.SLOT_ACTIVE
        self.own_slot = slot
        return incarnation

    def save_row(self, slot: int, words: int) -> None:
        """Journals the first ``words`` int64 words of a process row before they change."""
        base = self._layout.offsets["proc_table"] + slot * L.PROC_DTYPE.itemsize
        self._journal.save_many(np.arange(base, base + 8 * words, 8, dtype=np.int64), 8)

    # ------------------------------------------------------------------ giving slots back

    def release_slot(self, slot: int) -> int:
        """Gives back every reference of ``slot``'s ledger row, frees the slot; returns the
        number of references released. Caller holds the lock. Every write is journaled.

        Blocks whose count reaches 0 return to the free queue as ``free_blocks`` would put
        them, highest block id first: unhashed ones to the front, hashed ones to the back.
        A dead process's ``lock_phase`` is cleared with its row; this process's own (in
        ``close``) is left to the lock, which still writes it until the hold ends.
        """
        row = self._ledger[slot]
        held = np.flatnonzero(row)
        released = int(row[held].sum())
        # Per block: ref_cnt, the ledger entry, and up to prev, next and queue_key.
        self._journal.reserve(5 * len(held) + 2 * L.PROC_I64 + 8)
        if len(held):
            refs = self._ref_col[held] - row[held]
            self._ref_col_w[held] = refs
            row_offset = self._layout.offsets["ledger"] + slot * self._num_blocks * 4
            JournaledColumn(row, self._journal, row_offset)[held] = 0
            zero = held[refs == 0][::-1]
            if self._enable_caching:
                hashed = self._htok_col[zero] != L.NO_HASH_TOKENS
                first, last = zero[~hashed], zero[hashed]
            else:
                first, last = zero, zero[:0]
            if len(first):
                self._free_queue.prepend_n(first)
            if len(last):
                self._free_queue.append_n(last)
        own = slot == self.own_slot
        self.save_row(slot, PROC_ROW_WORDS if own else L.PROC_I64)
        proc = self._procs[slot]
        proc["state"] = L.SLOT_FREE  # first: a reader tests pid and start time only if active
        proc["pid"] = 0
        proc["incarnation"] = 0
        proc["start_ticks"] = 0
        proc["attach_ns"] = 0
        # The label stays until the slot is reused (``labels``).
        proc["pid_ns"] = 0
        if not own:
            proc["lock_phase"] = L.PHASE_IDLE
        return released

    def reap_dead(self) -> tuple[int, int]:
        """Releases the slots of processes that died without ``close()`` (caller holds the
        lock), counts them in the header's ``num_reaped``, and clears stale lock marks.

        Returns:
            (processes reaped, references released).
        """
        reaped = released_total = 0
        for slot in self.active_slots():
            if slot != self.own_slot and not self._alive.is_alive(slot):
                pid = int(self._procs[slot]["pid"])
                released = self.release_slot(slot)
                reaped += 1
                released_total += released
                logger.warning(
                    "pool %s: reaped slot %d (pid %d, dead without close()): %d block "
                    "references released", self.pool_name, slot, pid, released,
                )
        if reaped:
            self._hdr_w[L.H_NUM_REAPED] += reaped
        self._clear_dead_phases()
        return reaped, released_total

    def _clear_dead_phases(self) -> None:
        """Sets ``lock_phase`` back to IDLE in free rows whose process died taking or giving
        back the lock (one that died attaching, or closing): nobody else would, and a stale
        mark would make a later stuck lock look like its doing."""
        phases = self._procs["lock_phase"]
        stale = np.flatnonzero((phases != L.PHASE_IDLE) & (self._procs["state"] == L.SLOT_FREE))
        base = self._layout.offsets["proc_table"] + 8 * L.P_LOCK_PHASE
        for slot in stale.tolist():
            if slot != self.own_slot and not self._alive.is_alive(slot):
                self._journal.save(base + slot * L.PROC_DTYPE.itemsize, 8)
                phases[slot] = L.PHASE_IDLE
