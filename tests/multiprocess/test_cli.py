"""The ``shmkv`` command as a user runs it: demo, inspect, unlink, and its exit codes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shmkv import BlockPool

pytestmark = [pytest.mark.multiprocess, pytest.mark.long]
ROOT = Path(__file__).resolve().parents[2]


def shmkv(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "shmkv.cli", *args], capture_output=True,
                          text=True, env=env, timeout=timeout)


def test_demo_shows_cross_process_hits_and_cleans_up():
    """shmkv demo: several processes, hits computed by another process, invariants OK, and
    nothing left in /dev/shm."""
    before = {f for f in os.listdir("/dev/shm") if "shmkv-demo" in f}
    out = shmkv("demo", "--processes", "3", "--requests", "4")
    assert out.returncode == 0, out.stderr
    assert "cached by another scheduler process" in out.stdout
    summary = [line for line in out.stdout.splitlines() if "requests," in line][0]
    assert summary.startswith("12 requests")
    foreign = int(summary.split(", ")[-1].split()[0])
    assert foreign > 0, summary
    assert "invariants: OK" in out.stdout
    after = {f for f in os.listdir("/dev/shm") if "shmkv-demo" in f}
    assert after == before


def test_inspect_lists_processes_and_invariants(make_pool):
    """shmkv inspect shows the attached processes with their references."""
    pool = make_pool(32)
    pool.get_new_blocks(3)
    out = shmkv("inspect", pool.pool_name)
    assert out.returncode == 0, out.stderr
    assert ("31 usable (of 32: block 0 is the null block, never handed out), 28 free, "
            "3 in use") in out.stdout
    assert "refs       3  creator" in out.stdout
    assert "invariants: OK" in out.stdout


def test_unlink_and_error_exit_codes(pool_name):
    """unlink: 0 when removed, 2 (as every command for a missing pool) when there was
    nothing; errors exit 2 without traceback."""
    BlockPool.create(pool_name, 8).close()
    assert shmkv("unlink", pool_name).returncode == 0
    assert shmkv("unlink", pool_name).returncode == 2
    missing = shmkv("inspect", pool_name)
    assert missing.returncode == 2
    assert f"no pool named {pool_name}" in missing.stderr and "Traceback" not in missing.stderr
    bad = shmkv("inspect", "a/b")
    assert bad.returncode == 2 and "contains '/'" in bad.stderr


def test_cleanup_removes_only_pools_nobody_lives_in(spawn_ctx, make_pool):
    """A pool whose processes all died is removed; a pool with a live process stays."""
    from tests.conftest import unique_pool_name
    from tests.multiprocess import workers

    live = make_pool(8)
    dead_name = unique_pool_name("orphan")
    ready, stop = spawn_ctx.Event(), spawn_ctx.Event()
    creator = spawn_ctx.Process(target=workers.create_and_wait, args=(dead_name, ready, stop))
    creator.start()
    try:
        assert ready.wait(60)
        creator.kill()
        creator.join(30)
        dry = shmkv("cleanup", "--dry-run", "--prefix", dead_name)
        assert dry.returncode == 0
        assert f"would remove pool {dead_name}" in dry.stdout
        live_dry = shmkv("cleanup", "--dry-run", "--prefix", live.pool_name)
        assert f"would remove pool {live.pool_name}" not in live_dry.stdout
        assert f"kept pool {live.pool_name}: 1 live process(es) attached" in live_dry.stdout
        out = shmkv("cleanup", "--prefix", dead_name)
        assert out.returncode == 0 and f"removed pool {dead_name}" in out.stdout
        assert not [f for f in os.listdir("/dev/shm") if dead_name in f]
        assert live.get_num_free_blocks() == 7  # untouched
    finally:
        if creator.is_alive():
            creator.kill()
            creator.join(10)
        BlockPool.unlink(dead_name)


@pytest.mark.crash
def test_recover_takes_over_from_a_holder_killed_mid_allocation(spawn_ctx, make_pool,
                                                                monkeypatch):
    """shmkv recover: a process killed by SHMKV_FAULT half way through an allocation,
    inside the lock; recover takes the lock over, rolls the hold back, reaps the process,
    and reports it. The pool is then exactly as before the allocation."""
    from tests.multiprocess import workers

    pool = make_pool(32)
    pool.get_new_blocks(3)
    queue = pool.get_free_block_ids()
    monkeypatch.setenv("SHMKV_FAULT", "allocate:25")
    child = spawn_ctx.Process(target=workers.attach_and_allocate, args=(pool.pool_name, 4))
    child.start()
    child.join(60)
    assert child.exitcode == -9
    assert pool.holder() is not None and pool.holder()[1] == child.pid
    out = shmkv("recover", pool.pool_name, "--stuck-after", "0.2")
    assert out.returncode == 0, out.stderr
    assert "died holding the lock" in out.stdout and f"pid {child.pid}" in out.stdout
    assert "its hold rolled back:" in out.stdout
    assert "reaped with it: 1 process(es)" in out.stdout
    assert "invariants: OK" in out.stdout
    assert pool.get_free_block_ids() == queue
    pool.check_invariants()


def test_recover_rebuilds_a_corrupted_pool_and_clears_the_poison(make_pool):
    """A broken invariant (a ref count off by one) poisons the pool; recover rebuilds the
    derived structures from the authoritative ones, says what it found, and the pool is
    READY and valid again."""
    from shmkv import InvariantViolation
    from shmkv.pool import layout as L

    pool = make_pool(32)
    blocks = pool.get_new_blocks(3)
    pool._blocks["ref_cnt"][blocks[0].block_id] += 1
    with pytest.raises(InvariantViolation):
        pool.check_invariants()
    assert pool._header["state"][0] == L.STATE_POISONED
    out = shmkv("recover", pool.pool_name)
    assert out.returncode == 0, out.stderr
    assert "invariants: " in out.stdout and "broken" in out.stdout
    assert "INV-LEDGER" in out.stdout
    assert "1 ref counts fixed" in out.stdout and "after the rebuild: OK" in out.stdout
    assert pool._header["state"][0] == L.STATE_READY
    pool.check_invariants()
    assert shmkv("recover", "no-such-pool").returncode == 2


def _wait_stopped(pid: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat", "rb") as f:
            if f.read().rsplit(b")", 1)[1].split()[0] == b"T":
                return
        time.sleep(0.01)
    raise AssertionError(f"pid {pid} did not stop")


@pytest.mark.crash
def test_recover_reclaim_refuses_a_stopped_lock_holder_at_once_and_recovers_once_killed(
        spawn_ctx, make_pool, monkeypatch):
    """shmkv recover --reclaim PID, PID stopped (SIGSTOP, by a fault point) half way through
    an allocation, holding the lock: it cannot be fenced (it would finish its writes when it
    runs again), so recover refuses at once, naming it and saying to kill it, instead of
    waiting its whole --timeout for the lock. Killed (kill -9), recover takes the lock over,
    rolls its hold back and reaps it; another stopped process that does not hold the lock
    is reclaimed (fenced) by the same command.
    Before: recover waited the 5 s --timeout, then "pool lock not acquired within 5.0 s: held
    by slot 2 ...; that process is alive", exit 2, with no word of what to do."""
    import signal

    from tests.multiprocess import workers

    pool = make_pool(32)
    pool.get_new_blocks(3)
    ready, go, result = spawn_ctx.Event(), spawn_ctx.Event(), spawn_ctx.Queue()
    bystander = spawn_ctx.Process(target=workers.attach_hold_then_call,
                                  args=(pool.pool_name, pool.kernel, ready, go, result))
    holder = spawn_ctx.Process(target=workers.attach_and_allocate, args=(pool.pool_name, 4))
    bystander.start()
    try:
        assert ready.wait(60)
        os.kill(bystander.pid, signal.SIGSTOP)  # stopped, not holding the lock
        monkeypatch.setenv("SHMKV_FAULT", "allocate:25:stop")
        holder.start()
        _wait_stopped(holder.pid)  # stopped half way through its allocation, in the lock
        assert pool.holder() is not None and pool.holder()[1] == holder.pid
        start = time.monotonic()
        out = shmkv("recover", pool.pool_name, "--reclaim", str(holder.pid), "--timeout", "5")
        assert time.monotonic() - start < 4, f"recover waited for the lock: {out.stderr}"
        assert out.returncode == 2, out.stdout + out.stderr
        assert f"pid {holder.pid} holds the pool lock" in out.stderr, out.stderr
        assert f"kill -9 {holder.pid}" in out.stderr and "Traceback" not in out.stderr
        os.kill(holder.pid, signal.SIGKILL)
        holder.join(60)
        assert holder.exitcode == -signal.SIGKILL
        out = shmkv("recover", pool.pool_name, "--reclaim", str(bystander.pid),
                    "--stuck-after", "0.2")
        assert out.returncode == 0, out.stdout + out.stderr
        assert "died holding the lock" in out.stdout and "its hold rolled back:" in out.stdout
        assert f"(pid {bystander.pid}): 3 reference(s) released" in out.stdout
        assert pool.get_num_free_blocks() == 28  # only the creator's 3 blocks are held
        os.kill(bystander.pid, signal.SIGCONT)
        go.set()  # its next call is fenced
        assert "FencedError" in result.get(timeout=60)
        bystander.join(60)
        assert bystander.exitcode == 0
        fresh = BlockPool.attach(pool.pool_name)
        try:
            fresh.check_invariants()
        finally:
            fresh.close()
    finally:
        for proc in (holder, bystander):
            if proc.pid is not None and proc.is_alive():
                proc.kill()
                proc.join(10)
