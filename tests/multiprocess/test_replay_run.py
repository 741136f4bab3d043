"""``shmkv replay`` and ``shmkv run --trace`` on traces the tests write, in both formats, as
a user runs them (the real command in a subprocess): hand-checked Mooncake hits in one pool
and in private pools, the capacity sweep's JSON and plot, the infinite-cache bound,
malformed lines refused before anything starts, the replay against the run with the
model, ``--time-scale``, Ctrl-C, and ``benchmarks/bench_replay.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import interrupt_once_serving, pid_running, run_leftovers

pytestmark = [pytest.mark.multiprocess, pytest.mark.long]
ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 240


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT))




def _shmkv(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, int]:
    proc = subprocess.Popen([sys.executable, "-m", "shmkv.cli", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(), cwd=tmp_path)
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), proc.pid


def _mooncake(path: Path, requests) -> Path:
    """``requests``: (hash_ids, output_length[, timestamp_ms]); 16 tokens an id."""
    with open(path, "w") as f:
        for k, r in enumerate(requests):
            ids, out = r[0], r[1]
            ts = r[2] if len(r) > 2 else k
            f.write(json.dumps({"timestamp": ts, "input_length": 16 * len(ids),
                                "output_length": out, "hash_ids": ids}) + "\n")
    return path


def test_mooncake_hand_checked_hits_shared_and_private_sweep(tmp_path):
    """Three requests of five ids sharing their k = 3 leading ids, one at a time
    (--concurrency 1), 3 schedulers: the prefix rule says the 2nd and 3rd hit 3 blocks
    (48 tokens) each when they meet the 1st's blocks: in one pool (any routing) and in
    private pools with the routers that route by prefix (SGLang's, llm-d's); never in
    private pools round-robin (each request lands on a pool of its own). The same at both
    capacities, and the bound. The requests come 300 ms apart (--time-scale 1), so llm-d's
    scorers read the figures of an idle node."""
    trace = _mooncake(tmp_path / "three.jsonl", [([1, 2, 3, 10, 11], 16, 0),
                                                 ([1, 2, 3, 20, 21], 16, 300),
                                                 ([1, 2, 3, 30, 31], 16, 600)])
    done, pid = _shmkv(tmp_path, "replay", "--trace", str(trace), "--trace-block-tokens",
                       "16", "--schedulers", "3", "--concurrency", "1", "--time-scale", "1",
                       "--blocks", "192,384", "--max-model-len", "128", "--json", "sweep.json",
                       "--plot", "sweep.png")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Mooncake trace, 3 requests" in done.stdout and "16/16 = 1" in done.stdout
    got = json.loads((tmp_path / "sweep.json").read_text())
    assert got["infinite_cache_bound"] == {"prompt_tokens": 240,
                                           "prefill_tokens_saved": 96,
                                           "prefix_hit_rate": 0.4}
    assert got["trace"]["format"] == "mooncake" and got["trace"]["capped"] == 0
    saved = {(r["pool"], r["routing"], r["num_blocks"]): r["prefill_tokens_saved"]
             for r in got["runs"]}
    assert saved == {(pool, routing, cap): 0 if routing == "round-robin" else 96
                     for cap in (192, 384)
                     for pool, routing in [("shared", "prefix-aware"),
                                           ("private", "sglang-cache-aware"),
                                           ("private", "llm-d-scorer"),
                                           ("private", "round-robin")]}
    for r in got["runs"]:
        assert r["model_free"] and r["requests"] == 3 and r["prompt_tokens"] == 240
        assert r["ttft_steps_mean"] >= 1
    assert (tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    assert "infinite cache (bound)" in done.stdout
    # one line per run, "run k of n", then one table (no full report without --verbose);
    # the capacity is in blocks in all, with each KV-cache group's share beside it
    lines = done.stdout.splitlines()
    assert [line.split(":")[0] for line in lines if line.startswith("  run ")] == [
        f"  run {k} of 8" for k in range(1, 9)]
    assert "  run 4 of 8: 3 private pools of 64 blocks, round-robin: 3/3 requests, hit " \
        "rate 0.0%" in done.stdout
    assert not any(line.startswith("shmkv replay: 3 schedulers") for line in lines)
    assert sum(line.startswith("capacity sweep:") for line in lines) == 1
    assert "2 KV-cache groups: every cached prompt block takes one pool block in each" \
        in done.stdout
    assert "blocks (per group)" in done.stdout and "  192 (96)" in done.stdout
    assert run_leftovers(pid) == []


def test_shmkv_trace_with_conversations_replay_meets_the_bound(tmp_path):
    """A shmkv-format trace (conversations resend their history): one request at a time,
    one pool with room for everything: the replay hits exactly the infinite-cache bound."""
    lines = []
    for c in range(4):
        for t in range(3):
            prompt = ([5] * 40 if t == 0 else []) + [(c * 7 + t * 3 + k) % 90 + 1
                                                     for k in range(10)]
            lines.append({"request_id": f"c{c}-t{t}", "conversation": f"c{c}",
                          "prompt_token_ids": prompt, "max_tokens": 5})
    trace = tmp_path / "conv.jsonl"
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    done, pid = _shmkv(tmp_path, "replay", "--trace", str(trace), "--schedulers", "2",
                       "--concurrency", "1", "--blocks", "512,1024", "--json", "s.json",
                       "--plot", "", "--verbose")
    assert done.returncode == 0, done.stdout + done.stderr
    # --verbose: every run's full report (a replay's explains its lock wait), one table
    lines = done.stdout.splitlines()
    assert sum(line.startswith("shmkv replay: 2 schedulers") for line in lines) == 8
    assert sum(line.startswith("capacity sweep:") for line in lines) == 1
    assert sum("lock wait          a replay has no model step" in line
               for line in lines) == 2  # the shared pool's runs
    assert sum("lock wait          each private pool has a lock of its own" in line
               for line in lines) == 6
    got = json.loads((tmp_path / "s.json").read_text())
    bound = got["infinite_cache_bound"]["prefill_tokens_saved"]
    assert bound > 0
    shared = [r for r in got["runs"] if r["pool"] == "shared"]
    assert len(shared) == 2 and all(r["prefill_tokens_saved"] == bound for r in shared)
    assert all(r["prefill_tokens_saved"] <= bound for r in got["runs"])
    assert run_leftovers(pid) == []


BAD_LINES = [
    ('{"timestamp": 0, "input_length": 32, "output_length": 1}', "field hash_ids is missing"),
    ('{"timestamp": 0, "input_length": -1, "output_length": 1, "hash_ids": [1]}',
     "field input_length must be >= 1"),
    ('{"timestamp": 0, "input_length": 48, "output_length": 1, "hash_ids": [1, 2]}',
     "field hash_ids has 2 ids, input_length 48 needs 3"),
    ('{"timestamp": 0, "input_length": 32, "output_length": 1, "hash_ids": [1, "two"]}',
     "field hash_ids[1]"),
]


@pytest.mark.parametrize("command", ["replay", "run"])
def test_malformed_lines_refused_before_anything_starts(tmp_path, command):
    good = '{"timestamp": 0, "input_length": 32, "output_length": 1, "hash_ids": [1, 2]}'
    for line, field in BAD_LINES if command == "replay" else BAD_LINES[-1:]:
        trace = tmp_path / "bad.jsonl"
        trace.write_text(good + "\n" + line + "\n")
        done, pid = _shmkv(tmp_path, command, "--trace", str(trace), "--trace-block-tokens",
                           "16", "--schedulers", "2", "--blocks", "256")
        assert done.returncode == 2, (line, done.stdout, done.stderr)
        assert "bad.jsonl:2: " in done.stderr and field in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
        assert "requests" not in done.stdout  # no run, no report
        assert run_leftovers(pid) == []


def test_replay_and_run_with_the_model_agree_on_hits(tmp_path):
    """The same Mooncake trace and routing, one request at a time: the replay and the run
    with the model give the same hits in every configuration of --compare whose router
    decides from the requests alone (a Mooncake request's prompt is the trace's, not the
    model's output, and in this order who cached what first is fixed). llm-d's scorer also
    weighs each scheduler's pool usage as last reported (every 50 ms, as llm-d scrapes it),
    so which report it saw depends on timing: its rows are only checked to exist in both."""
    reqs = []
    for k in range(16):
        shared = [1, 2, 3] if k % 2 else [7, 8]
        reqs.append((shared + [100 + k * 3, 101 + k * 3, 102 + k * 3][: 1 + k % 3], 32))
    trace = _mooncake(tmp_path / "agree.jsonl", reqs)
    common = ["--trace", str(trace), "--trace-block-tokens", "16", "--schedulers", "2",
              "--concurrency", "1", "--blocks", "128", "--max-model-len", "128",
              "--compare", "--plot", ""]
    replay, pid1 = _shmkv(tmp_path, "replay", *common, "--json", "replay.json")
    model, pid2 = _shmkv(tmp_path, "run", *common, "--json", "model.json")
    assert replay.returncode == 0, replay.stdout + replay.stderr
    assert model.returncode == 0, model.stdout + model.stderr
    r = json.loads((tmp_path / "replay.json").read_text())
    m = json.loads((tmp_path / "model.json").read_text())
    assert r["model_free"] and not m["model_free"] and m["tokens_checked"] > 0
    assert m["token_mismatches"] == 0
    def rows(report: dict) -> list[tuple]:
        return [(f["pool"], f["routing"], f["prefill_tokens_saved"], f["evictions"])
                if f["routing"] != "llm-d-scorer" else (f["pool"], f["routing"])
                for f in [report, *report["compare"]]]

    hits = rows(r)
    assert hits == rows(m)
    assert len(hits) == 4 and ("private", "llm-d-scorer") in hits
    assert hits[0][2] > 0
    assert run_leftovers(pid1) == [] and run_leftovers(pid2) == []


def test_time_scale_honours_timestamps(tmp_path):
    trace = _mooncake(tmp_path / "t.jsonl", [([1], 1, 0), ([2], 1, 0), ([3], 1, 3000)])
    done, _ = _shmkv(tmp_path, "replay", "--trace", str(trace), "--trace-block-tokens", "16",
                     "--schedulers", "1", "--blocks", "256", "--time-scale", "0.4",
                     "--json", "t.json", "--plot", "", "--no-compare")
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads((tmp_path / "t.json").read_text())["wall_s"] >= 1.2
    done, _ = _shmkv(tmp_path, "replay", "--trace", str(trace), "--trace-block-tokens", "16",
                     "--schedulers", "1", "--blocks", "256", "--json", "t.json", "--plot", "",
                     "--no-compare")
    assert json.loads((tmp_path / "t.json").read_text())["wall_s"] < 1.2


def test_ctrl_c_of_a_replay_leaves_nothing(tmp_path):
    """SIGINT to the process group in the middle of a replay: exit 130, the JSON says
    interrupted, no process left, nothing of the run in /dev/shm."""
    trace = _mooncake(tmp_path / "long.jsonl",
                      [([k % 50, 1000 + k, 2000 + k, 3000 + k], 64) for k in range(60000)])
    returncode, stdout, stderr, pid = interrupt_once_serving(
        [sys.executable, "-m", "shmkv.cli", "replay", "--trace",
         str(trace), "--trace-block-tokens", "16", "--schedulers", "2",
         "--blocks", "512", "--progress", "--json", "c.json",
         "--plot", ""],
        cwd=tmp_path, env=_env(), wait_s=TIMEOUT_S, settle_s=0.5)
    assert returncode == 130, stdout + stderr
    assert "Traceback" not in stderr
    f = json.loads((tmp_path / "c.json").read_text())
    assert any(p.startswith("interrupted") for p in f["problems"])
    assert f["requests"] < f["requests_total"]
    assert run_leftovers(pid) == []
    deadline = time.monotonic() + 10
    while any(pid_running(p) for p in f["processes"].values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(pid_running(p) for p in f["processes"].values())


def test_bench_replay_smoke(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_replay.py"),
                          "--requests", "300", "--schedulers", "1,2", "--blocks", "1024"],
                         capture_output=True, text=True, env=_env(), cwd=tmp_path,
                         timeout=TIMEOUT_S)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    assert [x["schedulers"] for x in lines] == [1, 2]
    assert all(x["requests"] == 300 and x["requests_per_s"] > 0 for x in lines)
    assert "requests/s" in out.stdout


@pytest.mark.parametrize("timestamp, scale", [(1e308, "1"), (2_000, "1e308"),
                                               (2_000, "inf"), (2_000, "nan")])
def test_time_scale_past_any_wait_is_refused_at_once(tmp_path, timestamp, scale):
    """A trace whose last arrival, times --time-scale, is beyond the longest wait a run
    makes (or a --time-scale that is not a finite number) is one line on stderr and exit
    2, before any process starts, never a wait without end."""
    trace = _mooncake(tmp_path / "far.jsonl", [([1], 1, 0), ([2], 1, timestamp)])
    proc = subprocess.Popen([sys.executable, "-m", "shmkv.cli", "replay", "--trace",
                             str(trace), "--trace-block-tokens", "16", "--schedulers", "1",
                             "--blocks", "256", "--time-scale", scale, "--plot", ""],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(), cwd=tmp_path)
    try:
        stdout, stderr = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 2, (stdout, stderr)
    assert "--time-scale" in stderr and "Traceback" not in stderr, stderr
    assert len(stderr.strip().splitlines()) == 1, stderr
    assert "requests" not in stdout  # no run, no report
    assert run_leftovers(proc.pid) == []


@pytest.mark.parametrize("routing", ["sglang-cache-aware", "llm-d-scorer"])
def test_baseline_routers_send_a_shared_prefix_where_they_sent_it(tmp_path, routing):
    """The three hand-checked Mooncake requests on private pools, one at a time: SGLang's
    router (3 of 5 blocks matched, 0.6 > 0.3) and llm-d's scorers (prefix 3 x 0.6 against an
    idle queue and pool elsewhere) both send the 2nd and 3rd where they sent the 1st, from
    what they routed alone: 48 tokens hit each. The requests come 300 ms apart, so the
    figures llm-d's scorers read (reported every 50 ms) are those of an idle node."""
    trace = _mooncake(tmp_path / "three.jsonl", [([1, 2, 3, 10, 11], 16, 0),
                                                 ([1, 2, 3, 20, 21], 16, 300),
                                                 ([1, 2, 3, 30, 31], 16, 600)])
    done, pid = _shmkv(tmp_path, "replay", "--trace", str(trace), "--trace-block-tokens",
                       "16", "--schedulers", "3", "--concurrency", "1", "--blocks", "192",
                       "--time-scale", "1",
                       "--max-model-len", "128", "--pool", "private", "--routing", routing,
                       "--no-compare", "--json", "run.json", "--plot", "")
    assert done.returncode == 0, done.stdout + done.stderr
    got = json.loads((tmp_path / "run.json").read_text())
    assert got["routing"] == routing and got["prefill_tokens_saved"] == 96
    assert sorted(p["requests"] for p in got["per_scheduler"]) == [0, 0, 3]
    assert run_leftovers(pid) == []


@pytest.mark.parametrize("pool, routing, saved", [("private", "prefix-aware", 4 * 48),
                                                  ("shared", "least-loaded", 5 * 48)])
def test_a_restarted_replica_loses_its_private_cache_not_the_shared_one(tmp_path, pool,
                                                                        routing, saved):
    """Six requests on one 3-block prefix, 300 ms apart, 2 schedulers: every later request
    hits the prefix (48 tokens), except, on private pools, the first after the restart of
    the scheduler that held it (--restart-one kills scheduler 1, where the oracle sent the
    prefix, after 3 requests; it comes back with an empty pool). On the shared pool the
    cache outlives the scheduler."""
    trace = _mooncake(tmp_path / "six.jsonl", [([1, 2, 3, 10 + k], 16, 300 * k)
                                               for k in range(6)])
    done, pid = _shmkv(tmp_path, "replay", "--trace", str(trace), "--trace-block-tokens",
                       "16", "--schedulers", "2", "--concurrency", "1", "--time-scale", "1",
                       "--blocks", "256", "--max-model-len", "128", "--pool", pool,
                       "--routing", routing, "--restart-one", "--no-compare", "--json",
                       "run.json", "--plot", "")
    assert done.returncode == 0, done.stdout + done.stderr
    got = json.loads((tmp_path / "run.json").read_text())
    assert got["prefill_tokens_saved"] == saved and got["requests"] == 6
    (restart,) = got["restarts"]
    assert restart["scheduler"] == 1 and restart["after_requests"] == 3
    # (on a loaded machine the new scheduler may attach after the last request)
    assert restart.get("serving_again_s", float("inf")) > restart["killed_s"]
    assert "scheduler-1 killed at" in done.stdout and got["pool_valid"]
    assert run_leftovers(pid) == []
