"""bench_vllm_tier_steps.py runs end to end with --quick: two replica processes of real
vLLM schedulers per setup, one JSON line each for vLLM's private tiers and shmkv's shared
tier, positive steps/s, and the table. Speed and the size of any gain are never asserted
here; see benchmarks/README.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")
pytest.importorskip("einops")  # vLLM's model inspection imports it (vllm_peer/requirements)

pytestmark = [pytest.mark.multiprocess, pytest.mark.long]
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_bench_vllm_tier_steps_smoke():
    """--quick prints one row per setup (N=2, one forward time), both stepping, and the
    table with the shared/private ratio."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "benchmarks/bench_vllm_tier_steps.py", "--quick"],
                         capture_output=True, text=True, env=env, timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-4000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [(r["setup"], r["impl"]) for r in rows] == [("private", "vllm"), ("shared", "shmkv")]
    private, shared = rows
    for row in rows:
        assert row["replicas"] == 2 and row["forward_ms"] == 10
        assert row["steps_per_s"] > 0 and row["steps_per_s_min"] > 0
        assert row["steps_per_s_min"] <= row["steps_per_s"]
        assert row["steps"] > 0 and row["finished"] > 0 and row["stored_chunks"] > 0
    assert private["chunks_per_tier"] * 2 == shared["chunks_per_tier"]
    assert shared["lock_holds_per_step"] > 0
    assert "shared/private" in out.stdout
    assert "left in /dev/shm" not in out.stderr
