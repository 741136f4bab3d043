"""The benchmarks still run end to end (tiny settings): JSON lines, a table, a PNG.
Speed itself is never asserted here; see benchmarks/."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.long]
ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, *(str(ROOT / a) if a.endswith(".py") else a
                                             for a in args)],
                          capture_output=True, text=True, env=env, timeout=300, cwd=cwd)


def test_bench_block_pool_smoke():
    """bench_block_pool --quick prints a JSON line per (op, n, impl) and the table."""
    out = _run("benchmarks/bench_block_pool.py", "--quick", "--no-vllm", "--work", "256",
               "--repeats", "1", "--warmup", "0", "--no-progress")
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert {r["op"] for r in rows} >= {"alloc_free", "get_cached_block.hit", "touch_free"}
    assert all(r["ns_per_block"] > 0 for r in rows)
    assert "vLLM/shmkv" in out.stdout


def test_bench_contention_smoke(tmp_path):
    """bench_contention with 1 and 2 processes prints JSON lines, a table and a PNG."""
    png = tmp_path / "contention.png"
    out = _run("benchmarks/bench_contention.py", "--procs", "1,2", "--seconds", "0.3",
               "--rounds", "1",
               "--blocks", "512", "--plot", str(png))
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [r["processes"] for r in rows] == [1, 2]
    assert all(r["requests"] > 0 and r["lock_holds"] > 0 for r in rows)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_contention_runs_spin_settings_side_by_side(tmp_path):
    """--spin-us 0,20: every process count with each spin of the lock's waiters, the rows
    grouped by spin, each against the first spin's requests/s at its process count;
    --plot "" draws nothing."""
    out = _run("benchmarks/bench_contention.py", "--procs", "1,2", "--seconds", "0.3",
               "--rounds", "1", "--spin-us", "0,20", "--blocks", "512", "--plot", "",
               cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "plot:" not in out.stdout and list(tmp_path.iterdir()) == []
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [(r["spin_us"], r["processes"]) for r in rows] == [(0, 1), (0, 2), (20, 1), (20, 2)]
    assert all(r["requests"] > 0 and r["lock_holds"] > 0 for r in rows)
    table = out.stdout[out.stdout.index("spin us"):].splitlines()
    assert "vs first spin" in table[0]
    assert table[2].split()[:2] == ["0", "1"] and table[2].split()[4] == "1.00x"
    first = rows[0]["requests_per_s"]
    assert table[4].split()[4] == f"{rows[2]['requests_per_s'] / first:.2f}x"


def test_bench_contention_without_matplotlib(tmp_path):
    """Without matplotlib the benchmark still finishes, exit 0, and says in one line that
    it wrote no plot."""
    png = tmp_path / "contention.png"
    out = _run("-c", "import runpy, sys\n"
               "sys.modules['matplotlib'] = None  # import matplotlib raises ImportError\n"
               "sys.argv[1:] = ['--procs', '1', '--seconds', '0.2', '--rounds', '1',\n"
               f"               '--blocks', '256', '--plot', {str(png)!r}]\n"
               "runpy.run_path('benchmarks/bench_contention.py', run_name='__main__')")
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    assert out.stdout.splitlines()[-1] == ("plot: matplotlib is not installed, no plot "
                                           "written (pip install 'shmkv[plot]')")
    assert not png.exists()


def test_bench_locks_smoke():
    """bench_locks prints a JSON line per (lock, processes) and cleans up after itself."""
    out = _run("benchmarks/bench_locks.py", "--iterations", "2000")
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert {(r["lock"], r["processes"]) for r in rows} >= {("posix_ipc", 1), ("ofd", 2)}
    assert not [f for f in os.listdir("/dev/shm") if "bench-locks" in f]


def test_bench_recovery_smoke():
    """bench_recovery prints a JSON line per measurement and the tables; every take-over
    it measured rolled a real dead hold back and got the victim's blocks back."""
    out = _run("benchmarks/bench_recovery.py", "--sizes", "1000,5000", "--repeats", "1")
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    rebuilds = [r for r in rows if r["bench"] == "recovery"]
    assert [r["num_blocks"] for r in rebuilds] == [1000, 5000]
    assert all(r["rebuild_ms_median"] > 0 for r in rebuilds)
    takeovers = [r for r in rows if r["bench"] == "takeover"]
    assert [r["num_blocks"] for r in takeovers] == [1000, 5000]
    assert all(r["journal_entries_undone"] > 0 for r in takeovers)
    assert [r["bench"] for r in rows].count("takeover-no-holder") == 1
    assert "detect+repair ms" in out.stdout and "rebuild ms" in out.stdout
    assert not [f for f in os.listdir("/dev/shm") if "bench-takeover" in f]


def test_bench_transport_smoke():
    """bench_transport prints a JSON line per (transport, step) and the ratio table."""
    out = _run("benchmarks/bench_transport.py", "--round-trips", "50", "--prompt-tokens", "64")
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert {(r["transport"], r["step"].split()[0]) for r in rows} == {
        ("channel", "decode"), ("channel", "prefill"), ("mqueue", "decode"), ("mqueue", "prefill")}
    assert all(r["us_per_round_trip"] > 0 for r in rows)
    assert "MQ/Channel" in out.stdout


def test_bench_serve_smoke(tmp_path):
    """bench_serve with two tiny rows prints a JSON line per row, the table and a PNG."""
    pytest.importorskip("torch")
    png = tmp_path / "serve.png"
    out = _run("benchmarks/bench_serve.py", "--schedulers", "2", "--conversations", "4",
               "--blocks", "256", "--rows", "shared:round-robin,private:prefix-aware",
               "--plot", str(png))
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [(r["pool"], r["routing"]) for r in rows] == [("shared", "round-robin"),
                                                        ("private", "prefix-aware")]
    assert all(r["token_mismatches"] == 0 and r["requests"] == r["requests_total"]
               for r in rows)
    assert "| shared, round-robin" in out.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_routers_smoke():
    """bench_routers on 40 hot-prompts requests, two rows: a JSON line per row with the
    latency figures, the command, and the table against the best baseline of the run."""
    out = _run("benchmarks/bench_routers.py", "--requests", "40", "--time-scale", "0",
               "--concurrency", "8", "--rows", "shared:least-loaded,private:llm-d-scorer")
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [(r["pool"], r["routing"]) for r in rows] == [("shared", "least-loaded"),
                                                        ("private", "llm-d-scorer")]
    assert all(r["requests"] == 40 and r["ttft_p99_s"] >= r["ttft_p50_s"] > 0 and
               r["cost_model"] == {"prefill_ms_per_token": 0.1, "decode_ms_per_step": 1.0}
               for r in rows)
    assert "python benchmarks/bench_routers.py --requests 40" in out.stdout
    assert "| private, llm-d-scorer (best baseline) |" in out.stdout
    assert "+0.0 pt" in out.stdout and "1.00x" in out.stdout  # the baseline against itself


def test_bench_block_table_smoke():
    """bench_block_table prints a JSON line per (scenario, impl) and the table; the
    implementations' slot mappings are checked equal inside the benchmark."""
    pytest.importorskip("torch")
    out = _run("benchmarks/bench_block_table.py", "--reqs", "16", "--steps", "2",
               "--repeats", "1")
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert {(r["scenario"], r["impl"]) for r in rows} >= {("prefill", "shmkv"),
                                                         ("decode", "shmkv")}
    assert all(r["step_us"] > 0 for r in rows)
    assert "vLLM/shmkv" in out.stdout


def test_bench_recovery_partial_keys_smoke():
    """With --partial-keys the rebuild also rechains alias rows (and the pool checks out)."""
    out = _run("benchmarks/bench_recovery.py", "--sizes", "2000", "--repeats", "1",
               "--partial-keys")
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    (rebuilt,) = [r for r in rows if r["bench"] == "recovery"]
    assert rebuilt["alias_keys"] > 0 and rebuilt["rebuild_ms_median"] > 0


def test_bench_python_floor_smoke():
    """bench_python_floor prints a JSON line per measurement and the table, and leaves no
    segment or semaphore behind."""
    out = _run("benchmarks/bench_python_floor.py", "--pairs", "200", "--repeats", "1",
               "--no-vllm")
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert {r["impl"] for r in rows} >= {"bare-holds", "pool-lock-holds", "shmkv-py"}
    assert all(r["ns_per_pair"] > 0 for r in rows)
    assert "ns/pair" in out.stdout
    assert not [f for f in os.listdir("/dev/shm") if "floor" in f]
