"""The inspection script, run as a user would run it, on a live pool."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers import make_request

ROOT = Path(__file__).resolve().parents[2]


def _inspect(name: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "shmkv_inspect.py"), name],
        capture_output=True, text=True, env=env, timeout=60,
    )


def test_inspect_reports_counts_and_healthy_invariants(make_pool):
    """shmkv_inspect prints the header, the block counts and 'invariants: OK'."""
    pool = make_pool(20)
    blocks = pool.get_new_blocks(5)
    pool.cache_full_blocks(make_request(64), blocks, 0, 4, 16, 0)
    out = _inspect(pool.pool_name)
    assert out.returncode == 0, out.stderr
    assert ("blocks: 19 usable (of 20: block 0 is the null block, never handed out), 14 free, "
            "5 in use, 4 cached keys") in out.stdout
    assert "invariants: OK" in out.stdout


def test_inspect_reports_corruption_with_exit_code_1(make_pool):
    """A corrupted pool makes shmkv_inspect list the broken invariant and exit 1."""
    pool = make_pool(20)
    pool._blocks["ref_cnt"][3] = 7  # a queued block with a reference
    out = _inspect(pool.pool_name)
    assert out.returncode == 1
    assert "INV-REF" in out.stdout


def test_inspect_missing_pool_exits_2_without_traceback(pool_name):
    """A missing pool gives a one-line error and exit code 2."""
    out = _inspect(pool_name)
    assert out.returncode == 2
    assert f"no pool named {pool_name}" in out.stderr and "Traceback" not in out.stderr
