"""bench_kv_cache_manager still runs end to end (tiny settings); speed is never asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess
ROOT = Path(__file__).resolve().parents[2]


def test_bench_kv_cache_manager_smoke():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "benchmarks/bench_kv_cache_manager.py", "--requests", "40",
         "--max-running", "8", "--decode-tokens", "4", "--num-blocks", "512", "--no-vllm",
         "--repeats", "2"],
        capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 1 and rows[0]["requests"] == 40
    assert rows[0]["hit_rate"] > 0.4 and rows[0]["decode_calls"] == 160
    # 512-token prompts fill their last block: the first decode token needs a block, the
    # next three do not.
    assert rows[0]["decode_no_new_block_calls"] == 120 and rows[0]["repeats"] == 2
    assert "ns per decode allocate_slots, no new block" in out.stdout
