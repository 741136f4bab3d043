"""Chaos tests: processes serving on one pool are SIGKILLed at random instants and replaced,
many times; the survivors keep going, and at the end the pool is valid and every block is
accounted for (``tests/crash/chaos.py`` has the workers and the driver). Run with ``-s`` to
see each run's report (a table and a JSON line).

Also: a process killed while it does not hold the lock is reaped by a survivor, exactly.

The soak variant is marked ``slow`` and runs only when selected: ``-m slow``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal

import pytest

from shmkv import BlockPool
from shmkv.pool import layout as L
from tests.conftest import KERNELS, unique_pool_name
from tests.crash import chaos
from tests.crash.conftest import KILLED
from tests.helpers import FakeRequest

pytestmark = [pytest.mark.crash, pytest.mark.multiprocess, pytest.mark.long]

LOCK_TIMEOUT_S = 10.0
STALL_BOUND_S = LOCK_TIMEOUT_S + 2.0  # the lock timeout plus a margin for the repair
JOIN_TIMEOUT_S = 60


def run_and_report(**kwargs) -> chaos.ChaosReport:
    report = chaos.run_chaos(chaos.ChaosConfig(lock_timeout_s=LOCK_TIMEOUT_S, **kwargs))
    print()
    print(report.table())
    print(report.to_json())
    return report


def assert_survived(report: chaos.ChaosReport, kills: int) -> None:
    detail = f"seed {report.seed}: {report.errors}"
    assert report.errors == [], detail
    assert report.worker_failures == [], detail
    assert report.kills == kills, detail
    assert report.kills_survived == kills, detail
    assert report.leaked_blocks == 0, detail
    assert report.invariant_violations == 0, detail
    assert report.longest_stall_s < STALL_BOUND_S, detail
    # Every kill inside a hold is taken over exactly once; one taking or giving back the
    # lock may be (it may have held the semaphore with no holder recorded yet).
    assert report.kills_holding_lock <= report.takeovers, detail
    assert report.takeovers <= report.kills_holding_lock + report.kills_in_lock_transition, (
        detail)
    assert report.takeovers >= 1, f"no kill landed inside the lock: {detail}"
    # Every victim is reaped, but one killed inside attach() (before its commit) or close()
    # (after it), whose row is then FREE: it was never, or no longer, attached.
    assert report.kills_unregistered <= report.kills_in_attach_close, detail
    assert report.kills - report.kills_in_attach_close <= report.reaped <= report.kills, (
        detail)
    assert report.steps > 0


@pytest.mark.parametrize("kernel", KERNELS)
def test_chaos_kills_survived_nothing_leaked(kernel):
    """4 workers, 30 SIGKILLs at random instants (half of them aimed at the lock holder),
    each followed by a replacement: every survivor takes the lock and steps again after
    every kill, no stall approaches the lock timeout, the invariants hold after every kill,
    and at the end no block leaks."""
    report = run_and_report(kernel=kernel, workers=4, kills=30)
    assert_survived(report, 30)


@pytest.mark.parametrize("kernel", KERNELS)
def test_chaos_with_publisher_threads_forks_and_corrupt_chains(kernel):
    """The short version of the issue-15 soak (scripts/shmkv_chaos.py runs the long one):
    30 kills of workers that each run a publisher thread beside the main thread and now and
    then fork (os.fork and libc fork(), whose child keeps the parent's liveness lock), while
    the driver makes index chains loop. Everything the plain run asserts, plus: every forked
    child was refused its parent's handle and none hung, loops were injected and each was
    met by a bounded walk (none left to check_invariants). Stalls are bounded as in the
    plain run (the lock timeout plus a margin); the 1 s figure of the issue is a
    measurement on a quiet machine (``scripts/shmkv_chaos.py --max-stall``), not asserted
    here: a shared, slow machine took 1.006 s once."""
    report = run_and_report(kernel=kernel, workers=4, kills=30, threads=True, fork_p=0.01,
                            corrupt_p=0.3)
    assert_survived(report, 30)
    detail = f"seed {report.seed}: {report.errors}"
    assert report.publisher_reads > 0, detail
    assert report.forks > 0 and report.fork_failures == 0, detail
    assert report.corruptions_injected > 0, detail
    assert report.corruptions_met_by_workers + report.corruptions_met_by_driver > 0, detail


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("kernel", KERNELS)
def test_chaos_soak(kernel):
    """The same, 600 kills. Out of the default run (``-m "not long and not slow"`` in
    pyproject.toml); run it with ``python -m pytest -q -m slow``."""
    report = run_and_report(kernel=kernel, workers=4, kills=600)
    assert_survived(report, 600)


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="with the lock off, the processes corrupt the pool; this proves "
                   "the chaos checks see it")
@pytest.mark.parametrize("kernel", KERNELS)
def test_chaos_without_the_lock_is_detected(kernel):
    report = chaos.run_chaos(chaos.ChaosConfig(
        kernel=kernel, workers=4, kills=20, lock_timeout_s=2.0, lock_enabled=False,
        stop_timeout_s=5.0,  # a worker may loop for ever in a corrupted chain
    ))
    print()
    print(report.table())
    assert_survived(report, 20)


# ------------------------------------------------------------ killed outside the lock

SURVIVOR_TOKENS = list(range(40))  # 3 blocks, 2 of them full (cached)
PREFIX_TOKENS = SURVIVOR_TOKENS[:32]


def receive(conn, proc) -> dict:
    """The message ``proc`` sends on ``conn``; fails at once if it ends without sending."""
    for _ in range(JOIN_TIMEOUT_S * 10):
        if conn.poll(0.1):
            return conn.recv()
        if proc.exitcode is not None:
            pytest.fail(f"{proc.name} ended with {proc.exitcode} without reporting (stderr)")
    pytest.fail(f"{proc.name} did not report within {JOIN_TIMEOUT_S} s")


def victim_request() -> FakeRequest:
    # hold_then_sleep's request: the survivor's two full blocks, then 69 tokens of its own:
    # 7 blocks, 6 full; 2 hits, 5 new, 4 of them cached.
    return FakeRequest(PREFIX_TOKENS + list(range(70_000, 70_069)))


@pytest.mark.parametrize("how", ["reap_dead", "allocate"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_a_process_killed_outside_the_lock_is_reaped_and_its_blocks_return(kernel, how):
    """A process sharing two of the survivor's cached blocks and holding five of its own
    (four cached) is SIGKILLed while it sleeps, not holding the lock. A peer process reaps
    it, by ``reap_dead()`` or by an allocation the free queue cannot cover; no take-over,
    no repair; exactly its references come back."""
    ctx = mp.get_context("spawn")
    name = unique_pool_name("outside")
    pool = BlockPool.create(name, 32, kernel=kernel, label="survivor",
                            lock_timeout_s=LOCK_TIMEOUT_S)
    procs = []
    try:
        mine = FakeRequest(SURVIVOR_TOKENS)
        held = pool.get_new_blocks(3)
        pool.cache_full_blocks(mine, held, 0, 2, 16, 0)
        free0 = pool.get_num_free_blocks()
        assert free0 == 28

        parent, child = ctx.Pipe()
        sleeper = ctx.Process(target=chaos.hold_then_sleep, name="sleeper",
                              args=(name, kernel, PREFIX_TOKENS, child))
        procs.append(sleeper)
        sleeper.start()
        info = receive(parent, sleeper)
        assert info["hits"] == [b.block_id for b in held[:2]]
        assert len(info["new"]) == 5 and len(info["cached"]) == 4
        assert info["references"] == 7
        assert pool.get_num_free_blocks() == free0 - 5
        assert [b.ref_cnt for b in held] == [2, 2, 1]

        # Freeze it, make sure it is outside the lock, and kill it there.
        assert chaos._freeze(sleeper.pid)
        assert pool.holder() is None
        row = pool._procs[info["slot"]]
        assert (int(row["pid"]), int(row["state"]), int(row["lock_phase"])) == (
            sleeper.pid, L.SLOT_ACTIVE, L.PHASE_IDLE)
        os.kill(sleeper.pid, signal.SIGKILL)
        sleeper.join(JOIN_TIMEOUT_S)
        assert sleeper.exitcode == -signal.SIGKILL
        dead = [p for p in pool.processes() if p["pid"] == sleeper.pid]
        assert [(p["alive"], p["references"]) for p in dead] == [(False, 7)]
        assert pool.get_num_free_blocks() == free0 - 5  # nothing comes back by itself

        parent, child = ctx.Pipe()
        reaper = ctx.Process(target=chaos.peer, name="peer", args=(name, kernel, how, free0, child))
        procs.append(reaper)
        reaper.start()
        result = receive(parent, reaper)
        reaper.join(JOIN_TIMEOUT_S)
        assert reaper.exitcode == 0
        assert not result["repaired"]  # nothing to repair: the kill was outside the lock
        if how == "reap_dead":
            assert result == {"reaped": 1, "repaired": False, "free": free0}
            # The five blocks are free again; the four cached ones keep their hashes.
            queue = pool.get_free_block_ids()
            partial = set(info["new"]) - set(info["cached"])
            assert {queue[0]} == partial  # unhashed: at the head, reused first
            assert set(queue[-4:]) == set(info["cached"])  # hashed: at the tail
            hits = pool.get_cached_prefix(victim_request().block_hashes)
            assert [b.block_id for b in hits] == info["hits"] + info["cached"]
        else:
            # free0 blocks asked for, free0 - 5 free: the shortfall reaped the sleeper.
            assert result["free_before"] == free0 - 5
            assert len(result["got"]) == free0
            assert set(info["new"]) <= set(result["got"])
            hits = pool.get_cached_prefix(victim_request().block_hashes)
            assert [b.block_id for b in hits] == info["hits"]  # its own were evicted
        assert pool.get_num_free_blocks() == free0
        assert [b.ref_cnt for b in held] == [1, 1, 1]
        assert int(pool._hdr64[L.H_NUM_REAPED]) == 1
        assert int(pool._hdr64[L.H_NUM_TAKEOVERS]) == 0
        assert [p["pid"] for p in pool.processes()] == [os.getpid()]
        pool.check_invariants()
        pool.free_blocks(reversed(held))
        assert pool.get_num_free_blocks() == 31
    finally:
        for p in procs:
            if p.exitcode is None:
                p.kill()
                p.join(10)
        pool.close()
        BlockPool.unlink(name)


# ------------------------------------------------- a dead holder's slot, claimed again



def _semaphore_taken(pool: BlockPool) -> bool:
    import posix_ipc

    from shmkv.pool.lock import lock_name

    sem = posix_ipc.Semaphore(lock_name(pool._segment.shm_name))
    try:
        return sem.value == 0
    finally:
        sem.close()


def _finish(pool: BlockPool) -> None:
    from shmkv import LockTimeoutError

    name = pool.pool_name
    try:
        pool.close()
    except LockTimeoutError:
        pass  # the wedged lock of the bug below; close() has released what it could
    BlockPool.unlink(name)


def _dead_in_window(kernel: str, op: str, window: str, forker) -> BlockPool:
    """A pool whose victim (slot 1) died inside ``op`` with the semaphore taken and its row
    FREE: holding the lock with its holder record written ("holder recorded"), or between
    taking the semaphore and writing it, or clearing it and posting ("no holder recorded").
    Found by killing it before its 1st, 2nd, ... store."""
    for n in range(1, 100):
        pool = BlockPool.create(unique_pool_name("reclaim"), 16, kernel=kernel,
                                label="survivor", lock_timeout_s=0.5, stuck_after_s=0.1)
        ended = forker(chaos.die_in, pool.pool_name, kernel, op, n)
        if ended == "exit:0":
            _finish(pool)
            break
        assert ended == KILLED, f"store {n}: the victim ended with {ended}"
        if (int(pool._procs["state"][1]) == L.SLOT_FREE and _semaphore_taken(pool)
                and (pool.holder() is not None) == (window == "holder recorded")):
            return pool
        _finish(pool)
    pytest.fail(f"{op}: no store leaves the window {window!r}")


@pytest.mark.parametrize("window", ["holder recorded", "no holder recorded"])
@pytest.mark.parametrize("op", ["attach", "close"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_a_newcomer_does_not_take_the_row_of_a_process_dead_in_the_lock(kernel, op, window,
                                                                        forker):
    """A process dies inside attach() or close() with the lock's semaphore taken and its
    process row FREE. A newcomer attaches: it must not claim that row (its liveness byte is
    free, but its lock_phase mark is the only trace of who has the semaphore), so it takes
    another, takes the lock over (the holder, or the process taking or giving the lock
    back, is dead), repairs and attaches; and the survivor can use the pool afterwards.
    (Before the fix, the newcomer took the row: the dead one then looked alive, the lock
    was stuck for lock_timeout_s, and for good when no holder was recorded.)"""
    pool = _dead_in_window(kernel, op, window, forker)
    try:
        ended = forker(chaos.newcomer, pool.pool_name, kernel, 0.5)
        assert ended == "exit:0", f"the newcomer could not attach ({ended}; see stderr)"
        pool.reap_dead()
        pool.check_invariants()
        assert pool.get_num_free_blocks() == 15
    finally:
        _finish(pool)
