"""The router benchmark's quick run (``benchmarks/bench_vllm_router.py --quick``: two vLLM
OpenAI servers of vLLM's CPU build behind SGLang's ``smg`` routing round-robin, a private
tier per server against one shared tier, server 0 restarted mid-run), checked on
what does not depend on timing: every configuration completes every request, the greedy
text is the same in every configuration, and the restarted server computes fewer prompt
tokens on the shared tier (where the other server's stores wait for it) than on its private
one (which starts empty, as vLLM's own CPU cache would). 3.5 to 5 minutes on a 2-core
machine other jobs shared: most of it starts servers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.vllm_engine.engines import ROOT, engine_env

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]
BENCH = ROOT / "benchmarks" / "bench_vllm_router.py"


def test_quick_router_bench(vllm_cpu, tmp_path):
    from benchmarks.bench_vllm_router import find_smg

    if find_smg(vllm_cpu) is None:
        pytest.skip("SGLang's router (smg) is not installed (bash scripts/install_vllm_cpu.sh "
                    "installs sglang-router beside vLLM)")
    out = tmp_path / "runs.jsonl"
    done = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--python", vllm_cpu, "--plot", "",
         "--json", str(out)], capture_output=True, text=True, timeout=840,
        env=engine_env(), cwd=str(ROOT))
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    runs = [r for r in lines if "summary" not in r]
    assert {(r["tier"], r["router"]) for r in runs} == {("private", "round_robin"),
                                                         ("shared", "round_robin")}, runs
    for r in runs:
        assert r["completed"] == r["requests"] > 0, r
        assert r["text_differs"] == 0, r
    by_tier = {r["tier"]: r for r in runs}
    shared, private = by_tier["shared"], by_tier["private"]
    assert shared["restarted_prompt_tokens"] > 0 and private["restarted_prompt_tokens"] > 0
    assert shared["restarted_computed"] < private["restarted_computed"], (shared, private)
