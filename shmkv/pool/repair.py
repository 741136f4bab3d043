"""The repair of a pool after a dead hold, and ``shmkv recover``'s repair.

Two entry points, both run under the pool lock:

- ``Repairer.on_dirty(took_over)``, the lock's callback at the start of a hold that took the
  lock over from a dead process or found the undo journal non-empty: rolls the dead hold
  back from the journal (or, if it overflowed, rebuilds the derived structures), reaps the
  dead, bumps the epoch, and reports in ``last_repair``;
- ``Repairer.repair()``, what ``BlockPool.repair`` (``shmkv recover``) does once attached:
  reaps the dead, checks every invariant, rebuilds if any is broken.

The checks and the rebuild themselves are ``shmkv/pool/recovery.py``'s; this module decides
when they run and reports.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from shmkv.pool import layout as L
from shmkv.pool.journal import JournaledView, undo
from shmkv.pool.process_table import ProcessTable
from shmkv.pool.recovery import SegmentViews, collect_violations, rebuild
from shmkv.pool.takeover import TakeOver

logger = logging.getLogger("shmkv.pool.block_pool")  # the pool's log, as before the split


@dataclass
class RepairReport:
    """What the repair at the start of a hold found and did (``BlockPool.last_repair``)."""

    cause: str  # whom the lock was taken over from, or why the journal was not empty
    took_over: bool
    journal_entries_undone: int
    rebuilt: bool  # the journal had overflowed: derived structures rebuilt instead
    processes_reaped: int
    references_released: int
    seconds: float
    epoch: int


class Repairer:
    """Repairs one pool, for the process attached to it.

    Args:
        pool_name: the pool's name, for log messages.
        views: the segment's views (what the rollback and the rebuild work on).
        hdr_w: the header's int64 words, journaled on write (the counters it bumps).
        header: the header as a structured view (its ``state``, POISONED on failure).
        process_table: whose dead it reaps.
        takeover: who the lock was taken over from (``victim``).
        on_dropped_keys: called with the (hash, group) keys a rebuild dropped, so that event
            subscribers can forget them too.
    """

    def __init__(self, pool_name: str, views: SegmentViews, hdr_w: JournaledView, header,
                 process_table: ProcessTable, takeover: TakeOver,
                 on_dropped_keys: Callable[[list[tuple[bytes, int]]], None]) -> None:
        self.pool_name = pool_name
        self._views = views
        self._hdr_w = hdr_w
        self._header = header
        self._process_table = process_table
        self._takeover = takeover
        self._on_dropped_keys = on_dropped_keys
        self.last_repair: RepairReport | None = None

    def on_dirty(self, took_over: bool) -> None:
        """Repairs the pool at the start of a hold that took the lock over from a dead
        process, or found the undo journal non-empty: rolls the dead hold back from the
        journal (or, if it overflowed, rebuilds the derived structures), reaps the dead,
        bumps the epoch. Called by the lock, which holds it; ``last_repair`` reports.

        Args:
            took_over: the lock was taken over from a dead process (else the journal was
                found non-empty).

        Raises:
            whatever the rollback or the rebuild raised; the pool is marked POISONED then.
        """
        t0 = time.perf_counter()
        views = self._views
        hdr = views.hdr64
        cause = self._takeover.victim if took_over else (
            "the previous hold left its undo journal unfinished"
        )
        try:
            pending = hdr[L.H_JOURNAL_LEN]
            undone, rebuilt = 0, False
            if pending > 0:
                undone = undo(views.buf, views.layout, hdr)
            elif pending < 0:
                report = rebuild(views)  # empties the journal when it is done
                if report.dropped_keys:
                    self._on_dropped_keys(report.dropped_keys)
                rebuilt = True
            if took_over:
                self._hdr_w[L.H_NUM_TAKEOVERS] += 1
            reaped, released = self._process_table.reap_dead()
            self._hdr_w[L.H_EPOCH] += 1
        except BaseException:
            self._header["state"] = L.STATE_POISONED
            logger.error("pool %s: repair failed; the pool is marked POISONED", self.pool_name)
            raise
        self.last_repair = RepairReport(
            cause=cause, took_over=took_over, journal_entries_undone=undone, rebuilt=rebuilt,
            processes_reaped=reaped, references_released=released,
            seconds=time.perf_counter() - t0, epoch=int(hdr[L.H_EPOCH]),
        )
        logger.warning("pool %s: repaired after a dead hold: %s", self.pool_name,
                       self.last_repair)

    def repair_corruption(self) -> None:
        """A kernel found corrupt shared state (and raised InvariantViolation) in a call of
        this process: reaps the dead, rebuilds the derived structures (free queue, index,
        ref counts) from the authoritative ones (the rebuild bumps the epoch), and reports in
        ``last_repair``, as after a dead hold. The caller holds the pool lock. A rebuild
        that fails marks the pool POISONED (``shmkv recover`` is then the way back)."""
        t0 = time.perf_counter()
        views = self._views
        try:
            reaped, released = self._process_table.reap_dead()
            report = rebuild(views)
            if report.dropped_keys:
                self._on_dropped_keys(report.dropped_keys)
        except BaseException:
            self._header["state"] = L.STATE_POISONED
            logger.error("pool %s: repair of corrupt shared state failed; the pool is marked "
                         "POISONED", self.pool_name)
            raise
        self.last_repair = RepairReport(
            cause="a kernel found corrupt shared state (InvariantViolation)", took_over=False,
            journal_entries_undone=0, rebuilt=True, processes_reaped=reaped,
            references_released=released, seconds=time.perf_counter() - t0,
            epoch=int(views.hdr64[L.H_EPOCH]),
        )
        logger.warning("pool %s: repaired after corrupt shared state: %s", self.pool_name,
                       self.last_repair)

    def repair(self) -> dict:
        """Reaps the dead, checks every invariant and, if any is broken, rebuilds the
        derived structures from the authoritative ones and checks again. A POISONED pool
        that passes is READY again. The caller holds the pool lock.

        Returns:
            a report: processes reaped, references released, violations found and left,
            the rebuild's report (or None), the epoch.
        """
        views = self._views
        reaped, released = self._process_table.reap_dead()
        found = collect_violations(views)
        rebuilt = None
        if found:
            rebuilt = rebuild(views)  # a repairer killed in it leaves it to the next
            if rebuilt.dropped_keys:
                self._on_dropped_keys(rebuilt.dropped_keys)
            if self._header["state"][0] == L.STATE_POISONED:
                self._header["state"] = L.STATE_READY
        left = collect_violations(views) if found else []
        return {
            "processes_reaped": reaped,
            "references_released": released,
            "violations_found": found,
            "rebuilt": rebuilt,
            "violations_left": left,
            "epoch": int(views.hdr64[L.H_EPOCH]),
        }
