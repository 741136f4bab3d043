"""Several real processes on one pool: concurrent churn keeps every invariant, a prefix
cached by one process is a hit for another, processes that vanish leak nothing, and the
stress test demonstrably detects races when the lock is off."""

from __future__ import annotations

import os
import random
import time

import pytest

from shmkv import BlockPool
from shmkv.pool import layout as L
from shmkv.pool.block_pool import _ckernel
from tests.conftest import unique_pool_name
from tests.helpers import FakeRequest
from tests.multiprocess import workers
from tests.multiprocess.conftest import kill_processes, run_processes

pytestmark = pytest.mark.multiprocess

KERNELS = ["python"] + (["c"] if _ckernel is not None else [])


@pytest.fixture
def pool_factory():
    made = []

    def factory(num_blocks: int, **kw) -> BlockPool:
        pool = BlockPool.create(unique_pool_name("mp"), num_blocks, **kw)
        made.append(pool)
        return pool

    yield factory
    for pool in made:
        name = pool.pool_name
        pool.close()
        BlockPool.unlink(name)


def _fresh_check(ctx, name: str, expect_all_free: bool) -> None:
    codes = run_processes(ctx, workers.check_from_fresh_process, [(name, expect_all_free)])
    assert codes == [0], "check_invariants from a fresh process failed (see stderr)"


@pytest.mark.parametrize("num_procs", [2, 4, 8])
@pytest.mark.parametrize("kernel", KERNELS)
def test_concurrent_churn_keeps_invariants(spawn_ctx, pool_factory, num_procs, kernel):
    """2 to 8 processes allocate / cache / lookup-touch / free on one pool; afterwards a
    fresh process finds every invariant intact and every block but the null one free."""
    seed = random.randrange(1 << 30)
    print(f"seed={seed} processes={num_procs} kernel={kernel}")
    pool = pool_factory(192, max_processes=num_procs + 2)
    args = [(pool.pool_name, seed + i, 1.5, kernel, True) for i in range(num_procs)]
    codes = run_processes(spawn_ctx, workers.hammer, args)
    assert codes == [0] * num_procs, f"seed={seed}: worker exit codes {codes}"
    _fresh_check(spawn_ctx, pool.pool_name, expect_all_free=True)
    assert [p["slot"] for p in pool.processes()] == [pool.slot]


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="without the pool lock, concurrent processes corrupt the pool; "
                   "this proves the stress test can see it")
def test_churn_without_the_lock_is_detected(spawn_ctx, pool_factory):
    """The same churn with the lock disabled in every worker is caught: a worker fails its
    own checks or the final invariant check fails."""
    seed = random.randrange(1 << 30)
    print(f"seed={seed}")
    pool = pool_factory(96, max_processes=8)
    args = [(pool.pool_name, seed + i, 3.0, "python", False) for i in range(4)]
    codes = run_processes(spawn_ctx, workers.hammer, args, timeout_s=30)
    assert codes == [0] * 4, f"worker exit codes {codes}"
    _fresh_check(spawn_ctx, pool.pool_name, expect_all_free=True)


def test_prefix_cached_by_a_is_a_hit_for_b_and_outlives_a(spawn_ctx, pool_factory):
    """B hits the blocks A cached; after A frees them and closes, B's references keep them
    alive with their hashes."""
    pool = pool_factory(32)
    tokens = list(range(64))
    cached, release, done = spawn_ctx.Event(), spawn_ctx.Event(), spawn_ctx.Event()
    a = spawn_ctx.Process(target=workers.cache_then_wait,
                          args=(pool.pool_name, tokens, cached, release, done))
    a.start()
    try:
        assert cached.wait(60), "A did not cache"
        b = BlockPool.attach(pool.pool_name, label="B")
        req = FakeRequest(tokens)
        hits = [b.get_cached_block(h, [0]) for h in req.block_hashes]
        assert all(h is not None for h in hits)
        hits = [h[0] for h in hits]
        b.touch(hits)
        release.set()
        assert done.wait(60), "A did not finish"
        a.join(60)
        assert a.exitcode == 0
        assert [h.ref_cnt for h in hits] == [1] * 4
        assert [h.block_hash[:32] for h in hits] == req.block_hashes
        assert [p["label"] for p in pool.processes()] == ["creator", "B"]
        b.free_blocks(reversed(hits))
        b.close()
    finally:
        if a.is_alive():
            a.kill()
            a.join(10)
    _fresh_check(spawn_ctx, pool.pool_name, expect_all_free=True)


@pytest.mark.parametrize("how", ["return", "exception", "os_exit", "sigkill"])
def test_process_leaving_without_close_leaks_nothing_after_reap(spawn_ctx, pool_factory, how):
    """Whether a process returns, raises, calls os._exit or is SIGKILLed (outside the lock)
    without close(), reap_dead() in a survivor gives back its blocks and its slot."""
    pool = pool_factory(16)
    ready = spawn_ctx.Event()
    child = spawn_ctx.Process(target=workers.leave_without_close,
                              args=(pool.pool_name, how, ready))
    child.start()
    child.join(60)
    assert ready.is_set()
    expected = {"return": 0, "exception": 1, "os_exit": 3, "sigkill": -9}[how]
    assert child.exitcode == expected
    assert pool.get_num_free_blocks() == 9  # the six blocks are still referenced
    assert pool.reap_dead() == 1
    assert pool.get_num_free_blocks() == 15
    assert [p["slot"] for p in pool.processes()] == [pool.slot]
    _fresh_check(spawn_ctx, pool.pool_name, expect_all_free=True)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_gpu_blocks": 99}, "LayoutMismatchError", "num_blocks: expected 99, found 16"),
        ({"hash_block_size": 32, "num_gpu_blocks": 8},
         "LayoutMismatchError", "num_blocks: expected 8, found 16; hash_block_size"),
    ],
)
def test_attaching_with_other_expectations_is_refused(spawn_ctx, pool_factory, kwargs, error,
                                                      match):
    """A second process expecting another config gets an error naming every field."""
    pool = pool_factory(16)
    codes = run_processes(spawn_ctx, workers.attach_expecting,
                          [(pool.pool_name, kwargs, error, match)])
    assert codes == [0]


def test_attaching_to_another_layout_version_is_refused(spawn_ctx, pool_factory):
    """A segment whose header says another layout version is refused with both versions."""
    from shmkv.pool import layout as L

    pool = pool_factory(16)
    pool.layout.view(pool._segment.buf, "header")["layout_version"] = L.LAYOUT_VERSION + 1
    try:
        codes = run_processes(
            spawn_ctx, workers.attach_expecting,
            [(pool.pool_name, {}, "LayoutMismatchError",
              f"layout_version is {L.LAYOUT_VERSION + 1}, expected {L.LAYOUT_VERSION}")],
        )
        assert codes == [0]
    finally:
        pool.layout.view(pool._segment.buf, "header")["layout_version"] = L.LAYOUT_VERSION


def test_nothing_left_in_dev_shm(pool_factory):
    """create + close + unlink leaves no segment, semaphore or lock file behind."""
    pool = pool_factory(8)
    name, shm = pool.pool_name, pool._segment.shm_name
    pool.close()
    BlockPool.unlink(name)
    leftovers = [f for f in os.listdir("/dev/shm") if shm.lstrip("/") in f]
    assert leftovers == []


def test_creator_dying_does_not_take_the_pool_with_it(spawn_ctx):
    """SIGKILL of the creating process leaves a pool the others keep using; its blocks
    come back at the next reap."""
    name = unique_pool_name("creator")
    ready, stop = spawn_ctx.Event(), spawn_ctx.Event()
    creator = spawn_ctx.Process(target=workers.create_and_wait, args=(name, ready, stop))
    creator.start()
    try:
        assert ready.wait(60)
        survivor = BlockPool.attach(name, label="survivor")
        creator.kill()
        creator.join(30)
        assert creator.exitcode == -9
        blocks = survivor.get_new_blocks(27)  # all the free ones
        assert len(blocks) == 27
        assert survivor.reap_dead() == 1
        assert len(survivor.get_new_blocks(4)) == 4  # the creator's four came back
        survivor.check_invariants()
        survivor.close()
    finally:
        if creator.is_alive():
            creator.kill()
            creator.join(10)
        BlockPool.unlink(name)


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_waiter_takes_the_lock_over_from_a_holder_killed_inside_it(spawn_ctx, kernel):
    """A process SIGKILLed while it holds the pool lock leaves the semaphore taken; the next
    waiter finds the holder dead after one wait slice, takes the lock over, reaps it (its
    four blocks come back) and goes on. Nothing is leaked."""
    name = unique_pool_name("deadholder")
    pool = BlockPool.create(name, 16, kernel=kernel, lock_timeout_s=5)
    held = spawn_ctx.Event()
    holder = spawn_ctx.Process(target=workers.hold_lock_forever, args=(name, held))
    holder.start()
    try:
        assert held.wait(60)
        assert pool.holder() == (1, holder.pid)
        holder.kill()
        holder.join(30)
        assert holder.exitcode == -9
        assert len(pool.get_new_blocks(15)) == 15  # all but the null block: none leaked
        report = pool.last_repair
        assert report.took_over and report.processes_reaped == 1
        assert report.references_released == 4
        assert f"slot 1 (pid {holder.pid}) died holding the lock" in report.cause
        assert pool._hdr64[L.H_NUM_TAKEOVERS] == 1
        pool.check_invariants()
        pool.close()
    finally:
        if holder.is_alive():
            holder.kill()
            holder.join(10)
        BlockPool.unlink(name)


@pytest.mark.parametrize("kernel", KERNELS)
def test_one_waiter_of_many_takes_over_from_a_dead_holder(spawn_ctx, kernel):
    """Three processes wait on a holder that is then SIGKILLed: exactly one takes the lock
    over (the arbiter byte picks one winner, who re-reads the holder under it), the others
    are served after it, the take-over is counted once and the semaphore ends at 1 (a
    second take-over would post a unit nobody took, letting two processes hold the lock)."""
    import posix_ipc

    from shmkv.pool.lock import lock_name

    name = unique_pool_name("onewinner")
    pool = BlockPool.create(name, 32, kernel=kernel, lock_timeout_s=10)
    ready = [spawn_ctx.Event() for _ in range(3)]
    go, held, result = spawn_ctx.Event(), spawn_ctx.Event(), spawn_ctx.Queue()
    waiters = [spawn_ctx.Process(target=workers.wait_for_a_dead_holder,
                                 args=(name, kernel, r, go, result)) for r in ready]
    holder = spawn_ctx.Process(target=workers.hold_lock_forever, args=(name, held))
    procs = [*waiters, holder]
    try:
        for w in waiters:
            w.start()
        assert all(r.wait(60) for r in ready)
        holder.start()
        assert held.wait(60)
        go.set()
        deadline = time.monotonic() + 30  # every waiter is inside its lock wait
        while int((pool._procs["lock_phase"] == L.PHASE_ACQUIRING).sum()) < 3:
            assert time.monotonic() < deadline, pool._procs["lock_phase"]
            time.sleep(0.01)
        holder.kill()
        holder.join(30)
        assert holder.exitcode == -9
        answers = [result.get(timeout=60) for _ in waiters]
        for w in waiters:
            w.join(30)
        assert [w.exitcode for w in waiters] == [0, 0, 0]
        assert sorted(took for _, took in answers) == [False, False, True]
        assert pool._hdr64[L.H_NUM_TAKEOVERS] == 1
        sem = posix_ipc.Semaphore(lock_name(pool._segment.shm_name))
        try:
            assert sem.value == 1
        finally:
            sem.close()
        assert pool.get_num_free_blocks() == 31  # the holder's 4 and the waiters' 3 are back
        pool.check_invariants()
        pool.close()
    finally:
        kill_processes(procs)
        BlockPool.unlink(name)


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_waiter_that_loses_the_race_to_take_over_backs_off(spawn_ctx, kernel):
    """The worst interleaving of two waiters, forced: waiter B has read the dead holder's
    word and judged it dead when waiter A takes the lock over; B, now at the arbiter, must
    re-read the holder word under it and back off, or two processes hold the lock."""
    name = unique_pool_name("takerace")
    a = BlockPool.create(name, 16, kernel=kernel, lock_timeout_s=5)
    b = BlockPool.attach(name, kernel=kernel)
    held = spawn_ctx.Event()
    holder = spawn_ctx.Process(target=workers.hold_lock_forever, args=(name, held))
    holder.start()
    try:
        assert held.wait(60)
        holder.kill()
        holder.join(30)
        assert holder.exitcode == -9
        dead_word = int(a._hdr64[L.H_HOLDER])
        b_judges = b._takeover._holder_dead

        def a_wins_while_b_judges(word):
            assert a._takeover.on_stall()  # A takes over between B's read and its arbiter
            return b_judges(word)

        b._takeover._holder_dead = a_wins_while_b_judges
        assert b._takeover.on_stall() is False
        assert int(a._hdr64[L.H_HOLDER]) == a._takeover._my_word()
        # Put the dead holder back and let the real path take over once, for the clean-up.
        a._hdr64[L.H_HOLDER] = dead_word
        b._takeover._holder_dead = b_judges
        assert len(a.get_new_blocks(1)) == 1 and a.last_repair.took_over
        assert b.get_num_free_blocks() == 14
        b.check_invariants()
    finally:
        if holder.is_alive():
            holder.kill()
            holder.join(10)
        b.close()
        a.close()
        BlockPool.unlink(name)


@pytest.mark.parametrize("kernel", KERNELS)
def test_waiting_on_a_live_holder_times_out_naming_it_alive(spawn_ctx, kernel):
    """A live holder is never taken over: the waiter's bounded wait ends in
    LockTimeoutError naming the holder's slot and pid, alive."""
    from shmkv import LockTimeoutError

    name = unique_pool_name("liveholder")
    pool = BlockPool.create(name, 16, kernel=kernel, lock_timeout_s=0.3)
    held = spawn_ctx.Event()
    holder = spawn_ctx.Process(target=workers.hold_lock_forever, args=(name, held))
    holder.start()
    try:
        assert held.wait(60)
        with pytest.raises(LockTimeoutError,
                           match=rf"held by slot 1 \(pid {holder.pid}\).*alive"):
            pool.get_new_blocks(1)
        assert pool.get_num_free_blocks() == 11
    finally:
        holder.kill()
        holder.join(30)
        assert holder.exitcode == -9
        pool.close()
        BlockPool.unlink(name)


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_reclaimed_process_is_fenced_and_writes_nothing(spawn_ctx, kernel):
    """A stopped (not dead) process whose slot is reclaimed gets its references released
    at once; resumed, its next call raises FencedError and neither that call nor its close()
    writes a byte into the pool."""
    import signal

    from tests.helpers import segment_image

    name = unique_pool_name("fenced")
    pool = BlockPool.create(name, 16, kernel=kernel)
    ready, go, result = spawn_ctx.Event(), spawn_ctx.Event(), spawn_ctx.Queue()
    child = spawn_ctx.Process(target=workers.attach_hold_then_call,
                              args=(name, kernel, ready, go, result))
    child.start()
    try:
        assert ready.wait(60)
        os.kill(child.pid, signal.SIGSTOP)
        assert [p["pid"] for p in pool.processes() if not p["self"]] == [child.pid]
        assert pool.reclaim_slot(1) == 3
        assert pool.get_num_free_blocks() == 15
        pool.check_invariants()
        image = segment_image(pool)
        os.kill(child.pid, signal.SIGCONT)
        go.set()
        assert "FencedError" in result.get(timeout=60)
        child.join(60)
        assert child.exitcode == 0
        assert segment_image(pool) == image  # the fenced process wrote nothing
        with pytest.raises(ValueError, match="not an active slot"):
            pool.reclaim_slot(1)
        with pytest.raises(ValueError, match="own slot"):
            pool.reclaim_slot(pool.slot)
        pool.check_invariants()
    finally:
        if child.is_alive():
            child.kill()
            child.join(10)
        pool.close()
        BlockPool.unlink(name)


def test_an_attacher_killed_holding_the_semaphore_unrecorded_does_not_wedge_the_next(
        spawn_ctx):
    """A process killed right after taking the semaphore in its attach, before recording
    itself as holder, leaves the lock taken with no holder and its free row marked
    ACQUIRING. The next process to attach must not reuse that row (the mark is the only
    trace of who has the semaphore): it takes another, finds the lock stuck, takes it over
    and attaches."""
    name = unique_pool_name("wedge")
    pool = BlockPool.create(name, 16, max_processes=4)
    try:
        codes = run_processes(spawn_ctx, workers.attach_with_fault, [(name, "attach:2", 0.2)])
        assert codes == [-9]
        assert pool.holder() is None and pool._procs["lock_phase"][1] == L.PHASE_ACQUIRING
        codes = run_processes(spawn_ctx, workers.attach_with_fault, [(name, "", 0.2)],
                              timeout_s=60)
        assert codes == [0]
        assert pool._hdr64[L.H_NUM_TAKEOVERS] == 1
        assert pool._procs["lock_phase"][1] == L.PHASE_IDLE  # the repair cleared the mark
        pool.check_invariants()
    finally:
        pool.close()
        BlockPool.unlink(name)


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_signal_during_a_lock_wait_is_not_an_error(spawn_ctx, kernel):
    """A handled signal during the wait for a held lock neither raises posix_ipc's
    SignalError nor ends the wait early; a handler that raises (Ctrl-C) gets through, and
    the waiter's slot is left idle and usable."""
    import signal

    from shmkv import LockTimeoutError

    name = unique_pool_name("sigwait")
    pool = BlockPool.create(name, 16, kernel=kernel, lock_timeout_s=0.5)
    held = spawn_ctx.Event()
    holder = spawn_ctx.Process(target=workers.hold_lock_forever, args=(name, held))
    holder.start()
    seen = []
    old = signal.signal(signal.SIGALRM, lambda *a: seen.append("alarm"))
    try:
        assert held.wait(60)
        signal.setitimer(signal.ITIMER_REAL, 0.05, 0.05)
        with pytest.raises(LockTimeoutError):
            pool.get_new_blocks(1)
        signal.setitimer(signal.ITIMER_REAL, 0)
        assert seen

        def interrupt(*a):
            raise KeyboardInterrupt

        signal.signal(signal.SIGALRM, interrupt)
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        with pytest.raises(KeyboardInterrupt):
            pool.get_new_blocks(1)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        holder.kill()
        holder.join(30)
        assert holder.exitcode == -9
    try:
        assert len(pool.get_new_blocks(1)) == 1  # the dead holder's lock is taken over
        pool.check_invariants()
    finally:
        pool.close()
        BlockPool.unlink(name)
