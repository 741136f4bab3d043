"""bench_cluster_index runs end to end (tiny settings) against a real Redis; speed itself
is never asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("zmq")
pytestmark = [pytest.mark.multiprocess, pytest.mark.long]
ROOT = Path(__file__).resolve().parents[2]


def test_bench_cluster_index_smoke(redis_server):
    out = subprocess.run(
        [sys.executable, "benchmarks/bench_cluster_index.py", "--quick", "--redis",
         redis_server.url], capture_output=True, text=True, timeout=300, cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    routing = {r["policy"]: r for r in rows if r["bench"] == "routing"}
    assert set(routing) == {"round_robin", "index", "single_pool"}
    assert all(r["prompt_tokens"] > 0 for r in routing.values())
    [tput] = [r for r in rows if r["bench"] == "indexer_throughput"]
    assert tput["replayed"] == tput["events"] > 0
    assert "vs round robin" in out.stdout
