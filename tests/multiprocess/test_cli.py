"""The ``shmkv`` command as a user runs it: demo, inspect, unlink, and its exit codes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from shmkv import BlockPool

pytestmark = pytest.mark.multiprocess
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
    assert "blocks: 32 total, 28 free, 3 in use" in out.stdout
    assert "refs       3  creator" in out.stdout
    assert "invariants: OK" in out.stdout


def test_unlink_and_error_exit_codes(pool_name):
    """unlink: 0 when removed, 1 when there was nothing; errors exit 2 without traceback."""
    BlockPool.create(pool_name, 8).close()
    assert shmkv("unlink", pool_name).returncode == 0
    assert shmkv("unlink", pool_name).returncode == 1
    missing = shmkv("inspect", pool_name)
    assert missing.returncode == 2
    assert "no shared-memory segment" in missing.stderr and "Traceback" not in missing.stderr
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
        dry = shmkv("cleanup", "--dry-run")
        assert dry.returncode == 0
        assert f"would remove pool {dead_name}" in dry.stdout
        assert live.pool_name not in dry.stdout
        out = shmkv("cleanup")
        assert out.returncode == 0 and f"removed pool {dead_name}" in out.stdout
        assert not [f for f in os.listdir("/dev/shm") if dead_name in f]
        assert live.get_num_free_blocks() == 7  # untouched
    finally:
        if creator.is_alive():
            creator.kill()
            creator.join(10)
        BlockPool.unlink(dead_name)
