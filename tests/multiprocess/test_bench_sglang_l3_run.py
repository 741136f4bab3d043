"""Smoke test: ``bench_sglang_l3.py --quick`` runs, prints both phases, and the shared L3
serves pages the private-L2 phase recomputed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.long

pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_sglang_l3_quick_runs():
    """Both phases print a JSON line; L3 hits > 0 and fewer pages are recomputed."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "benchmarks/bench_sglang_l3.py", "--quick"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["phase"] for r in rows] == ["l2", "l3"]
    l2, l3 = rows
    assert l2["pages"] == l3["pages"] and l3["l3_hits"] > 0
    assert l3["recomputed"] == l2["recomputed"] - l3["l3_hits"]
    assert 0 < l3["stored_pages"] <= l3["recomputed"]  # a page two recompute is stored once
    # the same-process memcpy baseline and both ratios are measured, with the load beside
    assert l3["memcpy_gbps"] > 0 and l3["get_vs_memcpy"] > 0 and l3["set_vs_memcpy"] > 0
    assert l3["loadavg_1m"] >= 0
    assert not [e for e in os.listdir("/dev/shm") if "bench-sgl-" in e]
