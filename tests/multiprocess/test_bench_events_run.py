"""benchmarks/bench_events.py runs end to end (tiny settings); speed is not asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.ecosystem_helpers import ROOT, command_env

pytest.importorskip("zmq")
pytestmark = pytest.mark.multiprocess


def test_bench_events_smoke():
    out = subprocess.run([sys.executable, "benchmarks/bench_events.py", "--events", "300",
                          "--iterations", "300"], capture_output=True, text=True,
                         env=command_env(), timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    publish = next(r for r in rows if r["bench"] == "publish")
    assert publish["received"] == publish["sent"] == publish["events"] >= 300
    replay = next(r for r in rows if r["bench"] == "replay")
    assert replay["events"] == publish["events"]
    assert {r["lock_timed"] for r in rows if r["bench"] == "alloc_free_1"} == {False, True}
    assert not [f for f in os.listdir("/dev/shm") if "bench-events" in f]
