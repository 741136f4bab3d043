"""bench_gpu_serve's quick mode (the CPU and the tiny model): three rows, their JSON lines
and the table, every token the reference's, and the shared device placement computing
fewer prefill tokens than private pools."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.long]
ROOT = Path(__file__).resolve().parents[2]


def test_bench_gpu_serve_quick_on_the_cpu(tmp_path):
    """--quick runs device/shared, device/private and host/shared; --json holds the rows."""
    pytest.importorskip("torch")
    out_json = tmp_path / "serve.jsonl"
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/bench_gpu_serve.py"),
                          "--quick", "--json", str(out_json)], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert rows == [json.loads(line) for line in out_json.read_text().splitlines()]
    assert [(r["kv"], r["pool"]) for r in rows] == [("device", "shared"),
                                                   ("device", "private"), ("host", "shared")]
    for r in rows:
        assert r["device"] == "cpu" and r["model"] == "tiny" and r["problems"] == []
        assert r["requests"] == r["requests_total"] and r["token_mismatches"] == 0
        assert r["requests_per_s"] > 0 and 0 < r["ttft_p50_s"] <= r["ttft_p99_s"]
        assert r["peak_device_memory_bytes"] is None
    shared, private, _ = rows
    assert shared["prefill_tokens_computed"] < private["prefill_tokens_computed"]
    assert "| device, private" in out.stdout and "prefill computed" in out.stdout
