"""bench_vllm_offload.py runs end to end with tiny settings: two JSON lines (private vLLM
tiers, one shared shmkv tier) whose figures are consistent, and the table. Speed and the
size of the gain are never asserted here; see benchmarks/README.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.kv_offload.cpu.manager")

pytestmark = [pytest.mark.multiprocess, pytest.mark.long]
ROOT = Path(__file__).resolve().parents[2]


def test_bench_vllm_offload_smoke():
    """--quick prints one row per setup, same workload, figures that add up, and ratios."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "benchmarks/bench_vllm_offload.py", "--quick"],
                         capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [(r["setup"], r["impl"]) for r in rows] == [("private", "vllm"), ("shared", "shmkv")]
    private, shared = rows
    assert private["blocks"] == shared["blocks"] > 0  # one workload for both
    assert private["chunks_per_tier"] * private["replicas"] == shared["chunks_per_tier"]
    for row in rows:
        assert row["tier_hit_blocks"] <= row["tier_lookups"]
        assert row["prefill_tokens_saved"] == 16 * row["tier_hit_blocks"]
        assert row["tier_hit_rate"] == pytest.approx(row["tier_hit_blocks"] / row["tier_lookups"])
        assert all(row[f"{c}_ns"] > 0 for c in ("lookup", "prepare_store", "complete_store"))
    assert "prefill tokens saved" in out.stdout and "vLLM/shmkv" in out.stdout
