"""Chaos: several processes run a serving-like workload on one pool while a driver SIGKILLs
random ones and starts replacements, many times.

The survivors must keep making progress throughout (a process killed holding the lock is
taken over, its hold rolled back from the undo journal; a process killed anywhere is reaped),
and at the end the pool must be valid with every block accounted for.

Pieces (module level, so that spawn can import them; ``scripts/shmkv_chaos.py`` runs the
driver from the command line):

- :func:`worker`: one serving process. Each step either admits a request (prefix lookup,
  ``touch`` of the hits, ``get_new_blocks`` for the rest, ``cache_full_blocks``, now and then
  a partial key on the last full block (``cache_partial_block``: an alias row), all under
  one hold of the lock) drawn from a few shared prompts, so processes hit each other's
  cache, or finishes one (``free_blocks`` in reverse order, or now and then
  ``unpin_blocks``, then ``poll_reuse`` each step). Out of blocks, it preempts its
  own requests and reaps the dead. Every few steps it checks that its ledger row is exactly
  what its running requests hold and that each held block kept its hash. Now and then it
  closes and attaches again. Any exception makes it exit 1. With ``ChaosConfig.threads``
  a second thread of the process plays the publisher (it reads the global event log in
  batches of 16 and, now and then, the cached keys of a snapshot, each under the lock, as
  ``KVEventPublisher`` does), so victims die holding the lock in either thread. With
  ``fork_p`` it now and then forks: through ``os.fork`` (the child must get
  ``ForkedPoolError`` from its parent's handle) or through libc's ``fork()`` (no at-fork
  hook: the child keeps the parent's liveness lock while it sleeps, and the parent, if
  killed meanwhile, must still read dead). A ``prefix-index chain`` ``InvariantViolation``
  (from the driver's injected corruption) is counted and lived with: the pool repairs itself
  under the same hold, and what the worker got earlier in that hold is kept as a request.
- :func:`run_chaos`: the driver. It creates the pool, starts the workers, and repeatedly
  picks a victim (half the time whoever holds the lock right now, half of those once its
  hold has journaled a write; else any attached worker), freezes it with SIGSTOP to see
  where it stands (holding the lock, taking or giving it back, outside it), SIGKILLs it,
  checks it died of SIGKILL, starts a replacement and waits until every survivor has
  completed a step since the kill; then ``check_invariants``. At the end it stops the
  workers (exit code 0 each), reaps, checks the invariants and counts the blocks.
  Victims caught inside ``attach()`` or ``close()`` are killed too (those are the holds
  that leave a FREE process row behind; ``test_chaos.py::
  test_a_newcomer_does_not_take_the_row_of_a_process_dead_in_the_lock`` has the cases);
  with ``kill_in_attach_close=False`` they are let go (SIGCONT) and counted as spared.
  With ``corrupt_p`` it now and then makes a cached block's prefix-index chain loop (under
  the lock); before its next ``check_invariants`` it walks that bucket itself, so a loop
  no worker ran into is caught (and repaired) there, never left to poison the pool.

Progress is reported through a lock-free shared array (``RawArray``: a worker can be killed
at any instant, and a ``multiprocessing`` lock held by a dead process would hang everyone
else): per worker its pid, whether it attached, its steps, the time of its last step and the
longest gap between two of its consecutive steps (its longest stall: waits for the lock,
take-overs and repairs included; the time ``attach()`` itself takes, tens of milliseconds
of mapping and views, left out). All times are ``time.monotonic()``, system-wide on Linux.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import random
import signal
import sys
import threading
import time
import traceback
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field

import numpy as np

from shmkv import BlockPool, ForkedPoolError, InvariantViolation, OutOfBlocksError, ShmKVError
from shmkv.pool import layout as L
from tests.helpers import FakeRequest

BS = 16
PROMPTS = [list(range(p * 10_000, p * 10_000 + 128)) for p in range(6)]

# Heartbeat fields, one row of NF doubles per worker index.
F_PID, F_ATTACHED, F_STEPS, F_LAST, F_MAX_GAP, F_OOMS, F_REATTACHES, F_MAX_REPAIR, \
    F_ERROR, F_BUSY, F_PUB_READS, F_FORKS, F_FORK_BAD, F_CORRUPT = range(14)
NF = 14
FORK_CHILD_MAX_S = 10.0  # a forked child still there after this long is a hang
C_STOP = 0  # control cell: the workers stop when it is non-zero


# ---------------------------------------------------------------------------------- worker

def _attach(name: str, kernel: str, label: str, w: dict, hb, base: int) -> BlockPool:
    hb[base + F_BUSY] = 1  # attaching: see ChaosConfig.kill_in_attach_close
    pool = BlockPool.attach(name, kernel=kernel, label=label,
                            lock_timeout_s=w["lock_timeout_s"],
                            stuck_after_s=w["stuck_after_s"],
                            _lock_enabled=w["lock_enabled"])
    hb[base + F_BUSY] = 0
    return pool


def _check_holdings(pool: BlockPool, running: list) -> None:
    """This process's ledger row is exactly what its running requests hold; every held
    block is referenced and kept its hash (or lost it to an evict_blocks of its own)."""
    with pool.lock():
        counts = Counter(b.block_id for _, blocks in running for b in blocks)
        expected = np.zeros(pool.num_gpu_blocks, dtype=np.int64)
        for block_id, n in counts.items():
            expected[block_id] = n
        row = np.asarray(pool._ledger[pool.slot], dtype=np.int64)
        if not np.array_equal(row, expected):
            bad = np.flatnonzero(row != expected)[:8].tolist()
            raise AssertionError(
                f"pid {os.getpid()}: ledger row differs from the running requests at blocks "
                f"{bad}: ledger {row[bad].tolist()}, expected {expected[bad].tolist()}"
            )
        for req, blocks in running:
            for i, b in enumerate(blocks):
                if b.ref_cnt < 1:
                    raise AssertionError(f"held block {b.block_id} has ref_cnt {b.ref_cnt}")
                h = b.block_hash
                if i < len(req.block_hashes) and h is not None and h[:32] != req.block_hashes[i]:
                    raise AssertionError(f"held block {b.block_id} changed its hash")


def _chain_error(exc: InvariantViolation) -> bool:
    """Whether ``exc`` is a kernel's answer to a corrupt prefix-index chain (what the
    driver injects); any other violation is a failure."""
    return "chain" in str(exc)


class _PublisherThread:
    """The second thread of a worker: reads the event log as a publisher does (batches of
    16 events, each read under the lock) and every 32 reads the cached keys of a snapshot
    (``cached_key_snapshot``: bounded holds). Stopped before the handle closes."""

    def __init__(self, pool: BlockPool, hb, base: int) -> None:
        self._pool, self._hb, self._base = pool, hb, base
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._park_r, self._park_w = os.pipe()  # park(): blocked reading it
        self._park_asked = False
        self._thread = threading.Thread(target=self._run, name="chaos-publisher", daemon=True)
        self._thread.start()

    def park(self) -> None:
        """Returns once this thread is blocked in read(2) on its park pipe, as the kernel
        says (``/proc/self/task/<tid>/syscall``), between two reads of the log: it is then
        not waiting for the GIL, so it cannot ask the main thread to drop it. A thread that
        waited for the GIL at a raw fork (libc's fork(): CPython does not re-initialise the
        GIL) has asked for it, and the child, whose eval loop checks that request once the
        fork call returns, hands the GIL over and waits forever for a thread it does not
        have: the "forked child hung" of a loaded machine, where the main thread is often
        descheduled while it holds the GIL."""
        self._park_asked = True
        parked = f"0 {self._park_r:#x} "  # read(2) on the park pipe
        deadline = time.monotonic() + 60
        while True:
            try:
                with open(f"/proc/self/task/{self._thread.native_id}/syscall") as f:
                    if f.read().startswith(parked):
                        return
            except FileNotFoundError:  # the thread ended (its error is reported by stop)
                return
            if time.monotonic() > deadline:
                raise AssertionError("the publisher thread did not park in 60 s")
            time.sleep(0.0005)

    def unpark(self) -> None:
        self._park_asked = False
        os.write(self._park_w, b"p")

    def _run(self) -> None:
        pool = self._pool
        try:
            cursor = pool.event_cursor(from_start=False)
            reads = 0
            while not self._stop.is_set():
                if self._park_asked:
                    os.read(self._park_r, 1)  # parked until unpark()
                pool.read_events(cursor, 16)
                reads += 1
                if reads % 32 == 0:
                    pool.cached_key_snapshot(chunk_blocks=16)
                self._hb[self._base + F_PUB_READS] += 1
                self._stop.wait(0.002)
        except BaseException as exc:  # noqa: BLE001  (the main thread reports it)
            self.error = exc
            traceback.print_exc()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)
        if self._thread.is_alive():
            raise AssertionError("the publisher thread did not stop in 60 s")
        os.close(self._park_r)
        os.close(self._park_w)
        if self.error is not None:
            raise AssertionError(f"the publisher thread failed: {self.error!r}")


def _fork(pool: BlockPool, rng: random.Random, children: dict,
          publisher: _PublisherThread | None) -> None:
    """Forks a child: half the time with os.fork (the child must be refused the parent's
    handle; exit 3 if it is not), else with libc's fork() (no at-fork hook runs, so the
    child keeps the parent's liveness lock until it exits). The libc child naps in libc's
    usleep through PyDLL, so it never lets go of the GIL: CPython does not re-initialise the
    GIL after a raw fork, and the publisher thread may have held the GIL's own mutex at that
    instant (a time.sleep there hung one child for 10 s in CI). For the same reason the
    publisher thread is parked across a raw fork (``_PublisherThread.park``)."""
    if rng.random() < 0.5:
        pid = os.fork()
        if pid == 0:
            code = 3
            try:
                try:
                    pool.get_new_blocks(1)
                except ForkedPoolError:
                    code = 0
                time.sleep(rng.uniform(0, 0.3))
            finally:
                os._exit(code)
    else:
        import ctypes

        libc = ctypes.PyDLL(None)
        nap_us = int(rng.uniform(0.02, 0.5) * 1e6)
        # Looked up before the fork: a lookup in the child (dlsym) could wait for a loader
        # lock another thread held at the fork. The child dies with its parent (a victim's
        # child would be orphaned otherwise).
        usleep, prctl, fork = libc.usleep, libc.prctl, libc.fork
        if publisher is not None:
            publisher.park()
        pid = fork()
        if pid == 0:
            prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
            usleep(nap_us)
            os._exit(0)
        if publisher is not None:
            publisher.unpark()
        if pid < 0:
            raise OSError("fork() failed")
    children[pid] = time.monotonic()


def _reap_children(children: dict, hb, base: int, wait_s: float = 0.0) -> None:
    """Collects the forked children that exited (all of them within ``wait_s``); counts
    those that did not exit 0; a child older than FORK_CHILD_MAX_S is a hang: killed,
    counted."""
    deadline = time.monotonic() + wait_s
    while children:
        for pid, born in list(children.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                del children[pid]
                hb[base + F_FORKS] += 1
                if os.waitstatus_to_exitcode(status) != 0:
                    hb[base + F_FORK_BAD] += 1
                    print(f"pid {os.getpid()}: forked child {pid} ended with "
                          f"{os.waitstatus_to_exitcode(status)}", file=sys.stderr)
            elif time.monotonic() - born > FORK_CHILD_MAX_S:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                del children[pid]
                hb[base + F_FORK_BAD] += 1
                print(f"pid {os.getpid()}: forked child {pid} hung", file=sys.stderr)
        if not children or time.monotonic() > deadline:
            return
        time.sleep(0.01)


def worker(name: str, kernel: str, index: int, seed: int, hb, ctl, w: dict) -> None:
    """One serving process (see the module docstring). ``hb``/``ctl``: the shared heartbeat
    and control arrays; ``w``: the workload settings made by :func:`run_chaos`."""
    os.setpgid(0, 0)  # its own group: the driver ends whatever this process forked
    rng = random.Random(seed)
    base = index * NF
    hb[base + F_PID] = os.getpid()
    if w["quiet"]:  # no warning per reap and repair: hundreds in a run
        logging.getLogger("shmkv").setLevel(logging.ERROR)
    try:
        pool = _attach(name, kernel, f"chaos-{index}", w, hb, base)
        publisher = _PublisherThread(pool, hb, base) if w["threads"] else None
        children: dict[int, float] = {}  # forked children: pid -> when
        hb[base + F_ATTACHED] = 1
        last = time.monotonic()  # gaps are timed between steps, attach() left out
        running: list[tuple[FakeRequest, list]] = []
        seen_repair = None
        steps = 0
        while not ctl[C_STOP]:
            steps += 1
            if rng.random() < w["admit_p"] and len(running) < w["max_running"] or not running:
                prompt = rng.choice(PROMPTS)[: rng.choice((16, 32, 64, 96, 128))]
                tokens = prompt + [rng.randrange(50_000) for _ in range(rng.randint(1, 40))]
                req = FakeRequest(tokens)
                need_total = -(-len(tokens) // BS)
                got: list = []  # what this hold gave the request so far
                try:
                    with pool.lock():
                        hits = pool.get_cached_prefix(req.block_hashes)
                        pool.touch(hits)
                        got = hits
                        try:
                            blocks = hits + pool.get_new_blocks(need_total - len(hits))
                        except OutOfBlocksError:
                            pool.free_blocks(reversed(hits))
                            got = []
                            raise
                        got = blocks
                        pool.cache_full_blocks(req, blocks, len(hits), len(tokens) // BS, BS, 0)
                        full = len(tokens) // BS
                        if full >= 2 and rng.random() < w["partial_p"]:
                            # A partial key (an alias row) on the last full block, keyed
                            # as if blocks were 32 tokens, in group 1, which no lookup here
                            # reads (group 0's hits stay what _check_holdings expects).
                            pool.cache_partial_block(req, blocks[full - 1], (full - 1) * BS, 1,
                                                     2 * BS)
                    running.append((req, blocks))
                except InvariantViolation as exc:
                    if not _chain_error(exc):
                        raise
                    hb[base + F_CORRUPT] += 1  # repaired under that hold; keep what it gave
                    if got:
                        running.append((req, got))
                except OutOfBlocksError:
                    hb[base + F_OOMS] += 1
                    for _ in range((len(running) + 1) // 2):  # preempt the oldest half
                        _, blocks = running.pop(0)
                        pool.free_blocks(reversed(blocks))
                    pool.reap_dead()
            else:
                _, blocks = running.pop(rng.randrange(len(running)))
                if rng.random() < w["unpin_p"]:
                    # To the queue's tail, watched; another process's reuse found by a poll.
                    pool.unpin_blocks(reversed(blocks), lambda block: None)
                else:
                    pool.free_blocks(reversed(blocks))
            if pool._reuse_watchers:
                pool.poll_reuse()
            if rng.random() < w["evict_p"] and running:
                _, blocks = rng.choice(running)
                try:
                    pool.evict_blocks([blocks[0].block_id])
                except InvariantViolation as exc:
                    if not _chain_error(exc):
                        raise
                    hb[base + F_CORRUPT] += 1
            if w["fork_p"] and rng.random() < w["fork_p"]:
                _fork(pool, rng, children, publisher)
            if children:
                _reap_children(children, hb, base)
            if steps % 16 == 0:
                _check_holdings(pool, running)
            if rng.random() < w["reattach_p"]:
                if publisher is not None:
                    publisher.stop()
                hb[base + F_BUSY] = 1  # closing
                pool.close()  # gives back every reference it holds
                running = []
                seen_repair = None
                pool = _attach(name, kernel, f"chaos-{index}", w, hb, base)
                if w["threads"]:
                    publisher = _PublisherThread(pool, hb, base)
                hb[base + F_REATTACHES] += 1
                last = time.monotonic()
            if publisher is not None and publisher.error is not None:
                publisher.stop()  # raises it
            repair = pool.last_repair
            if repair is not None and repair is not seen_repair:
                seen_repair = repair
                hb[base + F_MAX_REPAIR] = max(hb[base + F_MAX_REPAIR], repair.seconds)
            if w["step_sleep_s"]:
                time.sleep(rng.uniform(0, w["step_sleep_s"]))  # the model's forward pass
            now = time.monotonic()
            if now - last > hb[base + F_MAX_GAP]:
                hb[base + F_MAX_GAP] = now - last
            last = hb[base + F_LAST] = now
            hb[base + F_STEPS] += 1
        if publisher is not None:
            publisher.stop()
        _reap_children(children, hb, base, wait_s=FORK_CHILD_MAX_S + 1)
        _check_holdings(pool, running)
        for _, blocks in running:
            pool.free_blocks(reversed(blocks))
        hb[base + F_BUSY] = 1
        pool.close()
    except BaseException:  # noqa: BLE001  (report anything, then fail)
        hb[base + F_ERROR] = 1
        traceback.print_exc()
        sys.stderr.flush()
        sys.exit(1)


def hold_then_sleep(name: str, kernel: str, prefix_tokens: list[int], conn) -> None:
    """For the kill-outside-the-lock test: hits the cached ``prefix_tokens`` (touching
    blocks the parent holds), allocates the rest of its request, caches its full blocks,
    sends what it holds, and sleeps until it is killed."""
    try:
        pool = BlockPool.attach(name, kernel=kernel, label="sleeper")
        req = FakeRequest(prefix_tokens + list(range(70_000, 70_069)))
        with pool.lock():
            hits = pool.get_cached_prefix(req.block_hashes)
            pool.touch(hits)
            new = pool.get_new_blocks(-(-len(req.all_token_ids) // BS) - len(hits))
            pool.cache_full_blocks(req, hits + new, len(hits), len(req.all_token_ids) // BS,
                                   BS, 0)
        conn.send({"slot": pool.slot, "hits": [b.block_id for b in hits],
                   "new": [b.block_id for b in new],
                   "cached": [b.block_id for b in new if b.block_hash is not None],
                   "references": int(pool._ledger[pool.slot].sum())})
        time.sleep(300)
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        sys.exit(1)


def peer(name: str, kernel: str, how: str, num_blocks: int, conn) -> None:
    """A survivor in another process: ``how`` is "reap_dead" (it calls it) or "allocate"
    (it asks for ``num_blocks``, more than the free queue holds: the shortfall reaps)."""
    try:
        pool = BlockPool.attach(name, kernel=kernel, label="peer")
        if how == "reap_dead":
            reaped = pool.reap_dead()
            conn.send({"reaped": reaped, "repaired": pool.last_repair is not None,
                       "free": pool.get_num_free_blocks()})
        else:
            free_before = pool.get_num_free_blocks()
            blocks = pool.get_new_blocks(num_blocks)
            conn.send({"free_before": free_before, "got": [b.block_id for b in blocks],
                       "repaired": pool.last_repair is not None})
            pool.free_blocks(reversed(blocks))
        pool.close()
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        sys.exit(1)


def die_in(name: str, kernel: str, op: str, n: int) -> None:
    """Attaches (``op`` "close": then closes) with ``shmkv.pool.fault`` armed to SIGKILL this
    process before the n-th store of the attach (or close)."""
    from shmkv.pool import fault

    if op == "attach":
        fault.arm("attach", n)
    pool = BlockPool.attach(name, kernel=kernel, label="victim", stuck_after_s=0.1)
    if op == "close":
        fault.arm("close", n)
        pool.close()


def newcomer(name: str, kernel: str, lock_timeout_s: float) -> None:
    """Attaches, allocates a block, closes (raises, so exits non-zero, if it cannot)."""
    pool = BlockPool.attach(name, kernel=kernel, label="newcomer",
                            lock_timeout_s=lock_timeout_s, stuck_after_s=0.1)
    pool.get_new_blocks(1)
    pool.close()


# ---------------------------------------------------------------------------------- driver

@dataclass
class ChaosConfig:
    workers: int = 4
    kills: int = 30  # stop after this many kills...
    seconds: float | None = None  # ...or after this long, whichever comes first
    kernel: str | None = None
    num_blocks: int = 64
    max_processes: int | None = None  # default: workers + 2 (a full table reaps on attach)
    lock_timeout_s: float = 10.0
    stuck_after_s: float = 0.2
    kill_interval_s: tuple[float, float] = (0.05, 0.3)
    holder_bias: float = 0.5  # share of kills aimed at whoever holds the lock...
    mid_write_bias: float = 0.5  # ...and of those, at a holder whose journal is not empty
    step_sleep_s: float = 0.002
    admit_p: float = 0.55
    max_running: int = 6
    evict_p: float = 0.02
    partial_p: float = 0.3  # admissions that also key a partial tail (an alias row)
    unpin_p: float = 0.25  # finished requests released with unpin_blocks (HiSparse's way)
    reattach_p: float = 0.003
    check_every: int = 1  # check_invariants in the driver after every n-th kill
    # Kill workers inside attach() and close() too: a process killed there holding the lock
    # (or its semaphore) leaves a FREE process row that a newcomer must not claim (see
    # test_chaos.py::test_a_newcomer_does_not_take_the_row_of_a_process_dead_in_the_lock).
    # False: a victim found attaching or closing is let go (SIGCONT), counted as spared.
    kill_in_attach_close: bool = True
    threads: bool = False  # a publisher thread beside each worker's main thread
    fork_p: float = 0.0  # steps that fork a child (os.fork or libc fork(), half each)
    corrupt_p: float = 0.0  # kill rounds in which the driver makes an index chain loop
    lock_enabled: bool = True  # False only to prove the checks catch corruption
    quiet: bool = True  # silence shmkv's warnings (each reap and repair logs one)
    seed: int | None = None
    start_timeout_s: float = 120.0  # a spawned worker's imports and attach, on a busy box
    stop_timeout_s: float | None = None  # for the workers to stop (lock_timeout_s + 30)


@dataclass
class ChaosReport:
    kernel: str
    workers: int
    seed: int
    kills: int = 0
    kills_survived: int = 0  # every survivor completed a step afterwards, in time
    kills_holding_lock: int = 0  # the holder record named the victim
    kills_mid_write: int = 0  # ...and its undo journal was not empty: rolled back
    kills_in_lock_transition: int = 0  # its lock_phase was ACQUIRING (or waiting)/RELEASING
    kills_outside_lock: int = 0
    kills_unregistered: int = 0  # no active process row (attaching, or closing), lock free
    spared: int = 0  # victims found attaching or closing and let go (kill_in_attach_close)
    kills_in_attach_close: int = 0  # victims killed inside attach() or close()
    takeovers: int = 0  # header num_takeovers
    repairs: int = 0  # header epoch: holds that began with a take-over or a dirty journal
    reaped: int = 0  # header num_reaped
    longest_stall_s: float = 0.0  # largest gap between two consecutive steps of a worker
    longest_recovery_s: float = 0.0  # kill -> every survivor took the lock and stepped
    max_repair_s: float = 0.0
    leaked_blocks: int = -1
    invariant_violations: int = -1
    worker_failures: list = field(default_factory=list)  # (index, pid, exit code)
    steps: int = 0
    out_of_blocks: int = 0
    reattaches: int = 0
    publisher_reads: int = 0  # event-log reads of the workers' publisher threads
    forks: int = 0  # forked children that exited (those of killed workers not counted)
    fork_failures: int = 0  # ...that used the parent's handle, or hung
    orphans_ended: int = 0  # a killed worker's children left at the end (_end_groups)
    corruptions_injected: int = 0
    corruptions_met_by_workers: int = 0  # InvariantViolation (chain) answered in a worker
    corruptions_met_by_driver: int = 0  # ...left for the driver's own walk to find
    corruptions_morphed: int = 0  # ...turned by pops into what no walk checks (see above)
    wall_s: float = 0.0
    errors: list = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=False)

    def table(self) -> str:
        rows = [
            ("kernel / workers / seed", f"{self.kernel} / {self.workers} / {self.seed}"),
            ("kills (survived)", f"{self.kills} ({self.kills_survived})"),
            ("  holding the lock (mid-write)",
             f"{self.kills_holding_lock} ({self.kills_mid_write})"),
            ("  taking / giving it back", self.kills_in_lock_transition),
            ("  outside it", self.kills_outside_lock),
            ("  with no active row (attaching or closing)", self.kills_unregistered),
            ("  inside attach() or close()", self.kills_in_attach_close),
            ("victims spared (attaching or closing)", self.spared),
            ("take-overs", self.takeovers),
            ("repairs", self.repairs),
            ("processes reaped", self.reaped),
            ("longest stall", f"{self.longest_stall_s * 1e3:.1f} ms"),
            ("longest recovery after a kill", f"{self.longest_recovery_s * 1e3:.1f} ms"),
            ("longest repair", f"{self.max_repair_s * 1e3:.2f} ms"),
            ("leaked blocks", self.leaked_blocks),
            ("invariant violations", self.invariant_violations),
            ("worker failures", len(self.worker_failures)),
            ("steps (out of blocks, re-attaches)",
             f"{self.steps} ({self.out_of_blocks}, {self.reattaches})"),
            ("publisher-thread reads", self.publisher_reads),
            ("forked children (failures)", f"{self.forks} ({self.fork_failures})"),
            ("children of killed workers ended at the end", self.orphans_ended),
            ("chain loops injected (met by workers, by the driver, morphed)",
             f"{self.corruptions_injected} ({self.corruptions_met_by_workers}, "
             f"{self.corruptions_met_by_driver}, {self.corruptions_morphed})"),
            ("wall time", f"{self.wall_s:.1f} s"),
        ]
        width = max(len(k) for k, _ in rows)
        lines = [f"{k:<{width}}  {v}" for k, v in rows]
        lines += [f"error: {e}" for e in self.errors]
        return "\n".join(lines)


def _group_members(pgids: set[int]) -> list[int]:
    """The live (not zombie) processes whose process group is one of ``pgids``."""
    live = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != b"Z" and int(fields[2]) in pgids:
            live.append(int(entry))
    return live


def _proc_state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return "?"


def _freeze(pid: int, timeout_s: float = 5.0) -> bool:
    """SIGSTOPs ``pid`` and waits until it is stopped; False if it did not stop in time."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while _proc_state(pid) not in ("T", "t", "Z", "X", "?"):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.0002)
    return True


def _wait_exit(p, timeout_s: float) -> None:
    """Waits for a worker to exit by polling its exit code: ``join`` would also wait for
    its forked children, which hold the write end of the worker's sentinel pipe."""
    deadline = time.monotonic() + timeout_s
    while p.exitcode is None and time.monotonic() < deadline:
        time.sleep(0.002)


class _Driver:
    def __init__(self, cfg: ChaosConfig) -> None:
        self.cfg = cfg
        self.seed = cfg.seed if cfg.seed is not None else random.randrange(1 << 30)
        self.rng = random.Random(self.seed)
        self.ctx = mp.get_context("spawn")
        n = cfg.workers
        self.hb = self.ctx.RawArray("d", n * NF)
        self.ctl = self.ctx.RawArray("d", 1)
        self.procs: list = [None] * n
        self.groups: set[int] = set()  # every worker's process group (its pid)
        self.generation = 0
        self.name = f"chaos-{os.getpid()}-{uuid.uuid4().hex[:10]}"
        self.kernel = cfg.kernel
        self.w = {
            "lock_timeout_s": cfg.lock_timeout_s, "stuck_after_s": cfg.stuck_after_s,
            "lock_enabled": cfg.lock_enabled, "admit_p": cfg.admit_p,
            "max_running": cfg.max_running, "evict_p": cfg.evict_p,
            "partial_p": cfg.partial_p, "unpin_p": cfg.unpin_p,
            "reattach_p": cfg.reattach_p, "step_sleep_s": cfg.step_sleep_s,
            "quiet": cfg.quiet, "threads": cfg.threads, "fork_p": cfg.fork_p,
        }
        self.corrupt_bucket: tuple[int, int] | None = None  # (bucket, group) left looping
        self.totals = Counter()
        self.max_gap = 0.0
        self.max_repair = 0.0

    def row(self, i: int, f: int) -> float:
        return self.hb[i * NF + f]

    def start(self, i: int) -> None:
        for f in range(NF):
            self.hb[i * NF + f] = 0.0
        self.generation += 1
        p = self.ctx.Process(
            target=worker, name=f"chaos-{i}",
            args=(self.name, self.kernel, i, self.seed * 1000 + self.generation, self.hb,
                  self.ctl, self.w),
        )
        p.start()
        self.procs[i] = p
        self.groups.add(p.pid)

    def fold(self, i: int) -> None:
        """Adds a finished worker's figures to the totals."""
        for key, f in (("steps", F_STEPS), ("ooms", F_OOMS), ("reattaches", F_REATTACHES),
                       ("pub_reads", F_PUB_READS), ("forks", F_FORKS),
                       ("fork_bad", F_FORK_BAD), ("corrupt", F_CORRUPT)):
            self.totals[key] += int(self.row(i, f))
        self.max_gap = max(self.max_gap, self.row(i, F_MAX_GAP))
        self.max_repair = max(self.max_repair, self.row(i, F_MAX_REPAIR))

    def attached(self) -> list[int]:
        return [i for i, p in enumerate(self.procs)
                if p is not None and p.exitcode is None and self.row(i, F_ATTACHED)]

    def died_unasked(self, report: ChaosReport) -> bool:
        for i, p in enumerate(self.procs):
            if p is not None and p.exitcode is not None:
                report.worker_failures.append((i, p.pid, p.exitcode))
                report.errors.append(f"worker {i} (pid {p.pid}) ended by itself: {p.exitcode}")
                self.fold(i)
                self.procs[i] = None
        return bool(report.worker_failures)

    def pick_victim(self) -> int | None:
        """Half the time (holder_bias) whoever holds the lock now, if it is a worker (half
        of those times, only once its hold has journaled a write); otherwise a random
        attached worker."""
        pids = {p.pid: i for i, p in enumerate(self.procs) if p is not None}
        if self.rng.random() < self.cfg.holder_bias:
            dirty = self.rng.random() < self.cfg.mid_write_bias
            hdr = self.pool._hdr64
            deadline = time.monotonic() + 0.05
            while time.monotonic() < deadline:
                holder = self.pool.holder()
                if holder is not None and holder[1] in pids and (
                        not dirty or hdr[L.H_JOURNAL_LEN]):
                    return pids[holder[1]]
                time.sleep(0.0001)
        candidates = self.attached()
        return self.rng.choice(candidates) if candidates else None

    def classify(self, pid: int, report: ChaosReport) -> None:
        """Where the (stopped) victim stands with respect to the lock. A holder is counted
        as such even during its attach (its row not active yet): its hold is rolled back,
        and it is then never reaped, as it never was attached."""
        holder = self.pool.holder()
        procs = self.pool._procs
        rows = np.flatnonzero((procs["pid"] == pid) & (procs["state"] == L.SLOT_ACTIVE))
        if holder is not None and holder[1] == pid:
            report.kills_holding_lock += 1
            report.kills_mid_write += bool(self.pool._hdr64[L.H_JOURNAL_LEN])
        elif not len(rows):
            report.kills_unregistered += 1
        elif procs["lock_phase"][rows[0]] != L.PHASE_IDLE:
            report.kills_in_lock_transition += 1
        else:
            report.kills_outside_lock += 1

    def wait_progress(self, since: dict[int, float], deadline_s: float,
                      report: ChaosReport) -> float | None:
        """Waits until each worker in ``since`` (index -> a step count) has more steps;
        returns how long it took, or None (a stall past the deadline, or a failure)."""
        t0 = time.monotonic()
        while True:
            pending = [i for i, s in since.items()
                       if self.procs[i] is not None and self.row(i, F_STEPS) <= s]
            if not pending:
                return time.monotonic() - t0
            if self.died_unasked(report):
                return None
            if time.monotonic() - t0 > deadline_s:
                report.errors.append(
                    f"workers {pending} made no step for {deadline_s:.1f} s (steps "
                    f"{[int(self.row(i, F_STEPS)) for i in pending]}); {self.describe()}"
                )
                return None
            time.sleep(0.001)

    def run(self) -> ChaosReport:
        cfg = self.cfg
        report = ChaosReport(kernel="", workers=cfg.workers, seed=self.seed)
        t_start = time.monotonic()
        self.pool = BlockPool.create(
            self.name, cfg.num_blocks, kernel=cfg.kernel, label="chaos-driver",
            # A raw-forked child keeps its dead parent's liveness byte (so the slot, once
            # reaped, cannot be claimed) until it exits: room for those with forks on.
            # (A soak of 500 kills with 2 * workers + 2 slots ran out of them once.)
            max_processes=cfg.max_processes or (4 * cfg.workers + 2 if cfg.fork_p
                                                else cfg.workers + 2),
            lock_timeout_s=cfg.lock_timeout_s, stuck_after_s=cfg.stuck_after_s,
            partial_keys=True,
            **({"enable_kv_cache_events": True, "event_log_bytes": 1 << 18}
               if cfg.threads else {}),
        )
        pool = self.pool
        self.kernel = report.kernel = pool.kernel
        epoch0 = int(pool._hdr64[L.H_EPOCH])
        recovery_s = cfg.lock_timeout_s + 2.0  # the survivors' bound after a kill
        try:
            for i in range(cfg.workers):
                self.start(i)
            ok = self.wait_attached(cfg.start_timeout_s, report)
            t0 = time.monotonic()
            while ok and report.kills < cfg.kills and (
                cfg.seconds is None or time.monotonic() - t0 < cfg.seconds
            ):
                time.sleep(self.rng.uniform(*cfg.kill_interval_s))
                if self.died_unasked(report):
                    break
                if cfg.corrupt_p and self.rng.random() < cfg.corrupt_p:
                    self.inject_loop(report)
                victim = self.pick_victim()
                if victim is None:
                    continue
                ok = self.kill(victim, report, recovery_s)
            if ok and not report.errors:  # every worker, replacements too, steps after that
                self.wait_attached(cfg.start_timeout_s, report)
                since = {i: self.row(i, F_STEPS) + 1 for i in self.attached()}
                self.wait_progress(since, recovery_s, report)
            self.stop(report)
            self.finish(report, epoch0)
        finally:
            for i, p in enumerate(self.procs):
                if p is not None and p.exitcode is None:
                    p.kill()
                    p.join(10)
                    report.errors.append(f"worker {i} (pid {p.pid}) had to be killed")
            report.orphans_ended = self._end_groups()
            pool.close()
            BlockPool.unlink(self.name)
        report.wall_s = time.monotonic() - t_start
        return report

    def _end_groups(self) -> int:
        """SIGKILLs what is left in the workers' process groups once they are gone, and
        returns how many groups still had a process. A child a worker forked with libc's
        fork() dies with it only once it has set PR_SET_PDEATHSIG, so a victim SIGKILLed
        right after such a fork may leave it (holding the victim's liveness lock, as a live
        forked child would); an os.fork() child naps with no death signal."""
        ended = 0
        for pgid in sorted(self.groups):
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                continue
            ended += 1
        deadline = time.monotonic() + 5.0
        while _group_members(self.groups) and time.monotonic() < deadline:
            time.sleep(0.01)
        left = _group_members(self.groups)
        self.groups.clear()
        if left:
            raise AssertionError(f"processes of the workers' groups outlived SIGKILL: {left}")
        return ended

    def wait_attached(self, timeout_s: float, report: ChaosReport) -> bool:
        deadline = time.monotonic() + timeout_s
        while len(self.attached()) < self.cfg.workers:
            if self.died_unasked(report):
                return False
            if time.monotonic() > deadline:
                report.errors.append(f"workers not attached after {timeout_s} s")
                return False
            time.sleep(0.005)
        return True

    def kill(self, i: int, report: ChaosReport, recovery_s: float) -> bool:
        p = self.procs[i]
        if not _freeze(p.pid):
            report.errors.append(f"worker {i} (pid {p.pid}) did not stop")
        if self.row(i, F_BUSY):
            if not self.cfg.kill_in_attach_close:
                os.kill(p.pid, signal.SIGCONT)
                report.spared += 1
                return True
            report.kills_in_attach_close += 1
        self.classify(p.pid, report)
        t_kill = time.monotonic()
        os.kill(p.pid, signal.SIGKILL)
        _wait_exit(p, 30)
        # Each survivor must complete two steps from now: the second one took the lock
        # after the kill (every step does).
        survivors = {j: self.row(j, F_STEPS) + 1 for j in self.attached() if j != i}
        report.kills += 1
        if p.exitcode != -signal.SIGKILL:
            report.worker_failures.append((i, p.pid, p.exitcode))
            report.errors.append(f"kill {report.kills}: worker {i} ended with {p.exitcode}")
            return False
        self.fold(i)
        self.procs[i] = None
        self.start(i)
        took = self.wait_progress(survivors, recovery_s, report)
        if took is None:
            return False
        report.kills_survived += 1
        report.longest_recovery_s = max(report.longest_recovery_s,
                                        time.monotonic() - t_kill)
        if self.cfg.check_every and report.kills % self.cfg.check_every == 0:
            if not self.check(report):
                return False
        return True

    def inject_loop(self, report: ChaosReport) -> None:
        """Makes a random cached block's prefix-index chain loop back to the bucket's head
        (a self-loop when it is the head), under the lock, as a stray write would."""
        pool = self.pool
        with pool.lock():
            rows = pool._blocks[:pool.num_gpu_blocks]
            cached = np.flatnonzero(rows["hash_num_tokens"] != L.NO_HASH_TOKENS)
            cached = cached[cached != 0]
            if not len(cached):
                return
            block = int(self.rng.choice(cached.tolist()))
            key = pool._index.block_key(block)
            bucket = pool._index.bucket_of(bytes(key[0]), int(key[1]))
            buckets = pool.layout.view(pool._segment.buf, "index_buckets")
            pool._blocks["index_next"][block] = int(buckets[bucket])
            self.corrupt_bucket = (bucket, int(key[1]))
        report.corruptions_injected += 1

    def walk_injected(self, report: ChaosReport) -> None:
        """Walks the bucket of the last injected loop with a key no block holds: a loop
        still there raises InvariantViolation (and is repaired); a sound chain misses."""
        if self.corrupt_bucket is None:
            return
        bucket, group = self.corrupt_bucket
        self.corrupt_bucket = None
        index = self.pool._index
        probe = None
        for i in range(1 << 16):
            candidate = i.to_bytes(2, "big") + b"\xa5" * 30
            if index.bucket_of(candidate, group) == bucket:
                probe = candidate
                break
        if probe is None:
            report.errors.append(f"no probe key found for bucket {bucket}")
            return
        try:
            self.pool.get_cached_block(probe, [group])
        except InvariantViolation as exc:
            if not _chain_error(exc):
                raise
            report.corruptions_met_by_driver += 1
            return
        # No walk met a loop, yet the chain may be unsound: a pop in a looping chain can
        # turn the loop into a keyless row left in the chain, which walks do not check
        # (only check_invariants does). Counted, and repaired as a walk's finding would be.
        from shmkv.pool.recovery import collect_violations

        with self.pool.lock():
            if collect_violations(self.pool):
                report.corruptions_morphed += 1
                self.pool._repairer.repair_corruption()

    def check(self, report: ChaosReport) -> bool:
        try:
            self.walk_injected(report)
            self.pool.check_invariants()
        except InvariantViolation as exc:
            report.invariant_violations = max(report.invariant_violations, 0) + len(
                exc.violations)
            report.errors.append(f"after kill {report.kills}: {exc}")
            return False
        except ShmKVError as exc:  # LockTimeoutError: a stall as long as the lock timeout
            report.errors.append(f"after kill {report.kills}: {exc!r}; {self.describe()}")
            return False
        return True

    def describe(self) -> str:
        """The lock's state and the workers', for a stall's error message."""
        pool = self.pool
        procs = pool._procs
        rows = [(slot, int(procs["pid"][slot]), int(procs["state"][slot]),
                 int(procs["lock_phase"][slot]), pool._alive.is_alive(slot))
                for slot in range(pool.max_processes)
                if procs["pid"][slot] or procs["lock_phase"][slot]]
        now = time.monotonic()
        workers = [(i, p.pid, _proc_state(p.pid), int(self.row(i, F_BUSY)),
                    round(now - self.row(i, F_LAST), 3) if self.row(i, F_LAST) else None)
                   for i, p in enumerate(self.procs) if p is not None]
        return (f"holder {pool.holder()}, journal_len {int(pool._hdr64[L.H_JOURNAL_LEN])}, "
                f"lock_seq {int(pool._hdr64[L.H_LOCK_SEQ])}; process rows (slot, pid, state, "
                f"lock_phase, alive) {rows}; workers (index, pid, state, busy, seconds since its "
                f"last step) {workers}")

    def stop(self, report: ChaosReport) -> None:
        self.ctl[C_STOP] = 1
        deadline = time.monotonic() + (self.cfg.stop_timeout_s
                                       or self.cfg.lock_timeout_s + 30)
        for i, p in enumerate(self.procs):
            if p is None:
                continue
            _wait_exit(p, max(0.1, deadline - time.monotonic()))
            if p.exitcode is None:
                report.errors.append(f"worker {i} (pid {p.pid}) did not stop; killed")
                p.kill()
                p.join(10)
            if p.exitcode != 0:
                report.worker_failures.append((i, p.pid, p.exitcode))
            self.fold(i)
            self.procs[i] = None

    def finish(self, report: ChaosReport, epoch0: int) -> None:
        pool = self.pool
        if report.invariant_violations < 0:
            report.invariant_violations = 0
            try:
                pool.reap_dead()
                self.check(report)
            except Exception as exc:  # noqa: BLE001  (reported, and fails the run)
                report.errors.append(f"final reap and check: {exc!r}")
        report.leaked_blocks = pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()
        others = [p for p in pool.processes() if not p["self"]] \
            if not report.invariant_violations else []
        if others:
            report.errors.append(f"processes left in the table: {others}")
        hdr = pool._hdr64
        report.takeovers = int(hdr[L.H_NUM_TAKEOVERS])
        report.reaped = int(hdr[L.H_NUM_REAPED])
        report.repairs = int(hdr[L.H_EPOCH]) - epoch0
        report.steps = self.totals["steps"]
        report.out_of_blocks = self.totals["ooms"]
        report.reattaches = self.totals["reattaches"]
        report.publisher_reads = self.totals["pub_reads"]
        report.forks = self.totals["forks"]
        report.fork_failures = self.totals["fork_bad"]
        report.corruptions_met_by_workers = self.totals["corrupt"]
        if report.fork_failures:
            report.errors.append(f"{report.fork_failures} forked children used the parent's "
                                 "handle or hung")
        report.longest_stall_s = self.max_gap
        report.max_repair_s = self.max_repair


def run_chaos(cfg: ChaosConfig | None = None, **kwargs) -> ChaosReport:
    """Runs one chaos session (see the module docstring) and returns its report."""
    cfg = cfg or ChaosConfig(**kwargs)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # spawned workers inherit it
    logger = logging.getLogger("shmkv")
    level = logger.level
    if cfg.quiet:
        logger.setLevel(logging.ERROR)
    try:
        return _Driver(cfg).run()
    finally:
        logger.setLevel(level)
