"""benchmarks/bench_gpu.py's transfer part runs end to end on the CPU (tiny settings): a
JSON line per (layout, ids, direction, processes) with its memcpy limit, and the table.
One group of 2 processes (a group of 1 or 4 runs the same code). Speed is not asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.ecosystem_helpers import ROOT, command_env

pytest.importorskip("torch")
pytestmark = [pytest.mark.multiprocess, pytest.mark.long]


def test_bench_gpu_transfers_smoke(tmp_path):
    out = subprocess.run(
        [sys.executable, "benchmarks/bench_gpu.py", "--part", "transfers", "--quick",
         "--device", "cpu", "--procs", "2", "--repeats", "2", "--no-progress",
         "--layouts", "block_major,layer_major", "--json", str(tmp_path / "t.jsonl")],
        capture_output=True, text=True, env=command_env(), timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    cases = {(r["layout"], r["ids"], r["direction"], r["procs"]) for r in rows}
    assert cases == {(layout, ids, d, p) for layout in ("block_major", "layer_major")
                     for ids in ("consecutive", "random", "decode")
                     for d in ("load", "store") for p in (2,)}
    for r in rows:
        assert r["device"] == "cpu" and len(r["runs_ms"]) == len(r["limit_runs_ms"]) == 2
        assert r["bytes"] == r["procs"] * r["blocks_per_proc"] * r["block_bytes"] > 0
        assert r["gbps"] > 0 and r["limit_gbps"] > 0 and r["ratio"] > 0
    assert {r["blocks_per_proc"] for r in rows if r["ids"] == "decode"} == {16}
    saved = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert saved == rows
    assert "| layout | ids | direction | procs |" in out.stdout
    assert not [f for f in os.listdir("/dev/shm") if "bench-gpu" in f]
