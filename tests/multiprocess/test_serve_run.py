"""``shmkv run`` as a user runs it: the real command in a subprocess, with small settings;
its JSON, its exit codes, a scheduler killed mid-run, Ctrl-C, and nothing left behind (no
segment in /dev/shm, no process alive). Plus one scheduler process fed bad frames."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import interrupt_once_serving, pid_running, run_leftovers

pytest.importorskip("torch")

pytestmark = [pytest.mark.multiprocess, pytest.mark.long]
ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--schedulers", "2", "--conversations", "6", "--blocks", "256",
         "--max-model-len", "512"]
RUN_TIMEOUT_S = 240


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT))




def _wait_gone(pids, timeout_s: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [p for p in pids if pid_running(p)]
        if not alive:
            return []
        time.sleep(0.1)
    return alive


# ``python -c`` in place of ``python -m shmkv.cli``: shmkv run where matplotlib cannot be
# imported (a None in sys.modules makes ``import matplotlib`` raise ImportError).
NO_MATPLOTLIB = ["-c", "import sys\nsys.modules['matplotlib'] = None\n"
                 "from shmkv.cli import main\nsys.exit(main(sys.argv[1:]))"]


def run_shmkv(tmp_path, *args: str, python_args=("-m", "shmkv.cli")
              ) -> tuple[subprocess.CompletedProcess, dict | None, int]:
    out = tmp_path / "run.json"
    proc = subprocess.Popen([sys.executable, *python_args, "run", *args,
                             "--json", str(out), "--plot", str(tmp_path / "run.png")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(), cwd=tmp_path)
    try:
        stdout, stderr = proc.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    figures = json.loads(out.read_text()) if out.exists() else None
    return done, figures, proc.pid


def _check_clean(figures: dict, pid: int) -> None:
    assert run_leftovers(pid) == []
    assert _wait_gone(figures["processes"].values()) == []


def test_run_shared_pool_json_report_and_plot(tmp_path):
    """Two schedulers on one shared pool serve the chat workload: every request finishes,
    every token equals the no-cache reference, conversations hit their history, and the
    run leaves nothing behind. The same workload then runs on private pools (SGLang's
    router, llm-d's scorers, round robin), by default, and one table puts the four side by
    side with the shared pool's gain against the best baseline router; --verbose
    prints each run's full report, which says how many blocks each KV-cache group gets."""
    done, f, pid = run_shmkv(tmp_path, *SMALL, "--verbose")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert f["pool"] == "shared" and f["schedulers"] == 2 and f["routing"] == "prefix-aware"
    assert f["requests"] == f["requests_total"] > 6
    assert f["prompt_tokens"] > f["prefill_tokens_saved"] > 0
    assert f["prefix_hit_rate"] == pytest.approx(f["prefill_tokens_saved"] / f["prompt_tokens"])
    assert f["tokens_checked"] == f["generated_tokens"] > 0 and f["token_mismatches"] == 0
    assert f["wall_s"] > 0 and f["pool_valid"] and f["problems"] == []
    # At the end every scheduler was drained and the prefix cache reset across them all.
    assert f["prefix_cache_reset"] is True
    assert f["pools_after"][0]["cached_blocks_after"] == 0
    assert [p["requests"] > 0 for p in f["per_scheduler"]] == [True, True]
    assert sum(p["requests"] for p in f["per_scheduler"]) == f["requests"]
    assert "prefix hit rate" in done.stdout and "mismatches 0" in done.stdout
    # The pool lock's share of the schedulers' wall time, in the JSON and the report.
    assert f["lock_hold_s"] == pytest.approx(sum(p["lock_hold_s"] for p in f["per_scheduler"]))
    assert f["lock_hold_s"] > 0
    assert f["lock_wait_share"] == pytest.approx(f["lock_wait_s"] / (2 * f["wall_s"]))
    assert (f"{f['lock_wait_share']:.1%} of the schedulers' {2 * f['wall_s']:.1f} s; held "
            f"{f['lock_hold_s'] * 1e3:.1f} ms)") in done.stdout
    assert (tmp_path / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f["timeline"] and f["timeline"][-1]["requests_done"] == f["requests"]
    assert [(c["pool"], c["routing"]) for c in f["compare"]] == [
        ("private", "sglang-cache-aware"), ("private", "llm-d-scorer"),
        ("private", "round-robin")]
    for c in f["compare"]:
        assert c["requests"] == f["requests"] and c["token_mismatches"] == 0
        assert c["prompt_tokens"] == f["prompt_tokens"] and c["blocks_per_pool"] == 128
        assert c["pool_valid"] and c["prefix_cache_reset"] is True
        assert [p["cached_blocks_after"] for p in c["pools_after"]] == [0, 0]
        _check_clean(c, pid)
    assert "same workload, 256 blocks in all (128 per KV-cache group)" in done.stdout
    assert [line for line in done.stdout.splitlines() if line.startswith("run ")] == [
        "run 1 of 4:", "run 2 of 4:", "run 3 of 4:", "run 4 of 4:"]
    assert f["kv_cache_groups"] == 2 and f["blocks_per_group"] == 128
    assert ("one shared pool of 256 blocks (16 tokens each; 2 KV-cache groups, so each "
            "prompt block takes 2: 128 per group in each pool)") in done.stdout
    assert ("2 private pools of 128 blocks (16 tokens each; 2 KV-cache groups, so each "
            "prompt block takes 2: 64 per group in each private pool)") in done.stdout
    base = min(f["compare"][:2], key=lambda c: (c["ttft_p99_s"], -c["prefix_hit_rate"]))
    assert (f"shared pool (prefix-aware) against the best baseline router, private pools "
            f"with {base['routing']} (the lowest TTFT p99 of the baselines sglang-cache-aware "
            f"and llm-d-scorer; round-robin is no baseline): hit rate "
            f"{f['prefix_hit_rate']:.1%} against {base['prefix_hit_rate']:.1%}"
            ) in " ".join(done.stdout.split())
    assert f["ttft_p99_s"] >= f["ttft_p50_s"] > 0 and f["queued_p99_s"] >= 0
    assert f["cost_model"] is None  # measured, with the model
    assert f["requests_per_scheduler"] == [p["requests"] for p in f["per_scheduler"]]
    assert (f"checked against the model's no-cache reference: "
            f"{4 * f['tokens_checked']:,}, 0 different") in done.stdout
    assert os.stat(tmp_path / "run.png").st_mode & 0o777 == 0o644  # as the JSON
    assert os.stat(tmp_path / "run.json").st_mode & 0o777 == 0o644
    _check_clean(f, pid)


def test_run_private_pools_prefix_aware_on_a_trace(tmp_path):
    """A JSONL trace (two conversations of two turns, two tenants) on private pools with
    prefix-aware routing: each second turn goes where its history is cached, so it hits it."""
    system = list(range(1, 49))  # 3 blocks
    lines = []
    for conv, salt in (("x", "tenant-a"), ("y", "tenant-b")):
        lines.append({"request_id": f"{conv}0", "conversation": conv, "cache_salt": salt,
                      "prompt_token_ids": system + [50, 51, 52], "max_tokens": 4})
    for conv in ("x", "y"):
        lines.append({"request_id": f"{conv}1", "conversation": conv,
                      "cache_salt": "tenant-a" if conv == "x" else "tenant-b",
                      "prompt_token_ids": list(range(60, 80)), "max_tokens": 4})
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    done, f, pid = run_shmkv(tmp_path, "--trace", str(trace), "--pool", "private",
                             "--routing", "prefix-aware", "--schedulers", "2",
                             "--blocks", "256", "--max-model-len", "512", "--no-compare")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("shmkv run: 2 schedulers, 2 private pools of 128 blocks")
    assert "run 1 of" not in done.stdout and "compare" not in f
    assert f["pool"] == "private" and f["requests"] == 4 and f["token_mismatches"] == 0
    # The first turns share no blocks (different salts); each second turn hits the three
    # system-prompt blocks of its history at least.
    assert f["prefill_tokens_saved"] >= 2 * 48
    _check_clean(f, pid)


def test_run_without_matplotlib_says_so_and_finishes(tmp_path):
    """Without matplotlib the run serves, reports, writes its JSON and exits 0; in place of
    the plot's path one line says no plot was written. By default four runs compare
    shared and private pools: one line each, then one table, no full report."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"request_id": f"r{i}", "prompt_token_ids":
                                         list(range(1, 40)), "max_tokens": 3}) + "\n"
                             for i in range(2)))
    done, f, pid = run_shmkv(tmp_path, "--trace", str(trace), "--schedulers", "2",
                             "--blocks", "128", "--max-model-len", "256",
                             python_args=NO_MATPLOTLIB)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert f["requests"] == 2 and f["token_mismatches"] == 0
    assert ("  plot: matplotlib is not installed, no plot written (pip install "
            "'shmkv[plot]')") in done.stdout.splitlines()
    assert not (tmp_path / "run.png").exists()
    lines = done.stdout.splitlines()
    assert [line.split(":")[0] for line in lines if line.startswith("  run ")] == [
        "  run 1 of 4", "  run 2 of 4", "  run 3 of 4", "  run 4 of 4"]
    assert ("  run 1 of 4: one shared pool of 128 blocks, prefix-aware: 2/2 requests, hit rate "
            f"{f['prefix_hit_rate']:.1%}, {f['wall_s']:.1f} s") in lines
    assert "same workload, 128 blocks in all (64 per KV-cache group), 2 schedulers:" in lines
    assert not any(line.startswith("shmkv run: 2 schedulers") for line in lines)
    assert lines[-1] == "  (--verbose: every run's full report; --no-compare: one configuration)"
    # what the command printed is what docs/ samples are rendered with, from its JSON
    from shmkv.serve.report import comparison_output

    assert done.stdout == comparison_output(f, [
        f"  figures: {tmp_path / 'run.json'}",
        "  plot: matplotlib is not installed, no plot written (pip install 'shmkv[plot]')"])
    _check_clean(f, pid)
    for c in f["compare"]:
        _check_clean(c, pid)


def test_kill_one_scheduler_the_others_finish(tmp_path):
    """--kill-one SIGKILLs a scheduler half way: its requests in flight go to the others,
    every request finishes with the right tokens, and the shared pool is valid afterwards
    with no block left in use (the dead process's references were reaped)."""
    done, f, pid = run_shmkv(tmp_path, *SMALL[:1], "3", *SMALL[2:], "--kill-one",
                             "--no-compare")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f["killed_scheduler"]["scheduler"] == 2
    assert f["requests"] == f["requests_total"] and f["token_mismatches"] == 0
    assert f["pool_valid"] and f["pools_after"][0]["blocks_in_use_after"] == 0
    assert f["prefix_cache_reset"] is True  # the survivors drained and reset the pool
    dead = f["per_scheduler"][2]
    assert not dead["alive_at_end"]
    assert all(p["alive_at_end"] for p in f["per_scheduler"][:2])
    assert any("scheduler-2" in p and "died" in p for p in f["notes"])
    assert f["problems"] == []
    assert "killed" in done.stdout
    _check_clean(f, pid)


def test_ctrl_c_stops_everything_and_cleans_up(tmp_path):
    """SIGINT to the whole process group (what Ctrl-C does) in the middle of a run: exit
    130, no traceback, every child gone and /dev/shm as before."""
    out = tmp_path / "run.json"
    returncode, stdout, stderr, pid = interrupt_once_serving(
        [sys.executable, "-m", "shmkv.cli", "run", "--schedulers", "2",
         "--blocks", "512", "--progress", "--json", str(out),
         "--plot", ""],
        cwd=tmp_path, env=_env(), wait_s=RUN_TIMEOUT_S)
    assert returncode == 130, stdout + stderr
    assert "Traceback" not in stderr
    f = json.loads(out.read_text())
    assert any(p.startswith("interrupted") for p in f["problems"])
    assert f["requests"] < f["requests_total"]
    _check_clean(f, pid)


def _children_of(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except FileNotFoundError:
        return []


@pytest.mark.parametrize("delay_s", [0.0, 0.5, 1.5, 3.0])
def test_ctrl_c_during_start_up_exits_130_cleanly(tmp_path, delay_s):
    """SIGINT to the process group (Ctrl-C) while the run starts (its fork server importing
    torch, the pools and channels being made, the children starting): exit 130 with no
    traceback from the front end or its fork server, no process of the run left, and
    nothing in /dev/shm with the run's names. The instants count from the intro line, which
    the front end prints right before the first run starts its processes. The workload is
    long enough (four runs of 200 conversations) that every instant falls inside the run on a
    fast machine too: a signal after the run's end would test nothing of start-up."""
    out = tmp_path / "run.json"
    long_run = [*SMALL[:2], "--conversations", "200", *SMALL[4:]]
    proc = subprocess.Popen([sys.executable, "-m", "shmkv.cli", "run", *long_run,
                             "--json", str(out), "--plot", ""],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(), cwd=tmp_path, start_new_session=True)
    children: set[int] = set()
    try:
        first = proc.stdout.readline()  # the intro: the runs start now
        assert first.strip(), proc.stderr.read()
        deadline = time.monotonic() + delay_s
        while time.monotonic() < deadline:  # the fork server and children seen so far
            children.update(_children_of(proc.pid))
            time.sleep(0.02)
        children.update(_children_of(proc.pid))
        os.killpg(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 130, first + stdout + stderr
    assert "Traceback" not in stderr, stderr
    if out.exists():  # the report of a run stopped part-way, never of one that finished
        assert any(p.startswith("interrupted") for p in json.loads(out.read_text())["problems"])
    assert run_leftovers(proc.pid) == []
    assert _wait_gone(children) == []


def test_bad_arguments_exit_2_without_traceback(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"request_id": "a", "prompt_token_ids": [1], "tokens": 3}\n')
    for args, needle in [(["--trace", str(bad)], "bad.jsonl:1"),
                         (["--schedulers", "0"], "--schedulers"),
                         (["--rank-nice", "20"], "--rank-nice 20: must be a whole number "
                          "from 0 to 19"),
                         (["--pool", "private", "--blocks", "64"],
                          "--blocks 64: 4 private pools of 16 blocks cannot hold"),
                         (["--trace", str(tmp_path / "missing.jsonl")], "missing.jsonl")]:
        out = subprocess.run([sys.executable, "-m", "shmkv.cli", "run", *args],
                             capture_output=True, text=True, env=_env(), cwd=tmp_path,
                             timeout=120)
        assert out.returncode == 2, (args, out.stdout, out.stderr)
        assert needle in out.stderr and "Traceback" not in out.stderr, out.stderr


# ---------------------------------------------------------------------------- one scheduler


class _LoneScheduler:
    """One scheduler process (``scheduler_main``, spawned) on a pool and block tables of
    its own, with its four channels, and no rank: the test reads and answers what the
    scheduler sends its rank, if it wants to. Everything is removed on exit."""

    def __init__(self, spawn_ctx, num_blocks: int = 128) -> None:
        from shmkv import BlockPool
        from shmkv.messages import Channel, create_doorbell
        from shmkv.serve import engine
        from shmkv.serve.model import TinyModelConfig
        from shmkv.serve.scheduler import scheduler_main
        from tests.conftest import unique_pool_name

        self.name = name = unique_pool_name("sch")
        self.model = TinyModelConfig()
        self.pool = BlockPool.create(name, num_blocks, enable_kv_cache_events=True)
        self.tables = engine.create_block_tables(name, self.model, 4, 256, 16)
        self.bell = create_doorbell(name)
        self.names = {k: f"{name}-{k}" for k in ("inbox", "outbox", "to_rank", "from_rank")}
        for k, ch in self.names.items():
            Channel.create(ch, 1 << 16, doorbell=self.bell if k in ("inbox", "from_rank")
                           else None).close()
        self.inbox, self.outbox = (Channel.open(self.names[k]) for k in ("inbox", "outbox"))
        self.to_rank = Channel.open(self.names["to_rank"])
        self.proc = spawn_ctx.Process(target=scheduler_main, args=(0, self.names))

    def __enter__(self):
        self.proc.start()
        return self

    def attach(self, **config) -> None:
        from shmkv.serve import engine
        from shmkv.serve.messages import AttachScheduler, SchedulerAttached, SchedulerConfig

        self.inbox.send(AttachScheduler(scheduler=0, config=SchedulerConfig(
            pool_name=self.name, model=engine.model_config_to_dict(self.model),
            max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256,
            block_tables_name=self.name, **config)))
        assert self.reply(SchedulerAttached).num_gpu_blocks == self.pool.num_gpu_blocks

    def reply(self, kind):
        """The scheduler's next answer, other than its periodic stats: a ``kind``."""
        from shmkv.serve.messages import SchedulerStats

        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            msg = self.outbox.recv(1.0)
            if msg is not None and not isinstance(msg, SchedulerStats):
                assert isinstance(msg, kind), msg
                return msg
        raise AssertionError(f"no {kind.__name__}")

    def __exit__(self, *exc) -> None:
        from shmkv import BlockPool
        from shmkv.messages import Channel, unlink_doorbell
        from shmkv.ranks.block_table import SharedBlockTables

        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)
        for ch in (self.inbox, self.outbox, self.to_rank):
            ch.close()
        for ch in self.names.values():
            Channel.unlink(ch)
        unlink_doorbell(self.bell)
        self.tables.close()
        SharedBlockTables.unlink(self.name)
        self.pool.close()
        BlockPool.unlink(self.name)


def test_scheduler_answers_bad_frames_and_keeps_serving(spawn_ctx):
    """A scheduler process fed an undecodable frame and a message it has no use for
    answers MessageRejected for each and goes on: it resets its pool's prefix cache when
    asked and stops with SchedulerStopped on Shutdown, exit code 0."""
    from shmkv.messages import ModelOutput, Shutdown
    from shmkv.serve.messages import (
        MessageRejected,
        PrefixCacheReset,
        ResetPrefixCache,
        SchedulerStopped,
    )

    with _LoneScheduler(spawn_ctx) as s:
        s.attach()
        s.inbox.send_bytes(b"\x93not a frame")
        assert "not a shmkv message frame" in s.reply(MessageRejected).reason
        s.inbox.send(ModelOutput(step=1, sampled_token_ids=[]))
        assert "unexpected message ModelOutput" in s.reply(MessageRejected).reason
        s.inbox.send(ResetPrefixCache())
        assert s.reply(PrefixCacheReset).success
        s.inbox.send(Shutdown(reason="test"))
        assert s.reply(SchedulerStopped).stats.num_steps == 0
        s.proc.join(60)
        assert s.proc.exitcode == 0


def test_scheduler_sent_sigterm_while_its_rank_is_silent_detaches_and_exits_143(spawn_ctx):
    """SIGTERM reaches a scheduler that waits for its rank's answer to a step, and the
    rank never answers (a SIGTERM to the whole run can stop the rank first). The
    scheduler gives up the wait at once, not after its rank timeout: it closes its pool
    handle (its slot and block references go back, nothing is left to reap) and exits
    143. Before, it waited out the timeout and the front end SIGKILLed it."""
    from shmkv.messages import ExecuteModel
    from shmkv.serve.messages import GenerateTokens

    with _LoneScheduler(spawn_ctx) as s:
        s.attach(rank_timeout_s=600.0)
        s.inbox.send(GenerateTokens(request_id="r", prompt_token_ids=list(range(40)),
                                    max_tokens=4))
        step = s.to_rank.recv(120)
        assert isinstance(step, ExecuteModel), step  # now it waits for the answer
        (row,) = [r for r in s.pool.processes() if not r["self"]]
        assert row["references"] > 0, row  # the step's blocks
        os.kill(s.proc.pid, signal.SIGTERM)
        s.proc.join(60)  # a tenth of the rank timeout
        assert s.proc.exitcode == 143
        assert [r for r in s.pool.processes() if not r["self"]] == []
        assert s.pool.reap_dead() == 0  # it detached itself
        assert s.pool.get_num_free_blocks() == s.pool.num_gpu_blocks - 1  # (the null block)
        s.pool.check_invariants()


def test_a_child_of_the_run_freezes_what_it_inherited(spawn_ctx):
    """child_setup moves every object a child inherited (torch and the serving modules, as
    the fork server preloads them) into the collector's permanent generation, so no full
    collection walks them inside a pool hold (one took 150 ms there, and `shmkv run` from an
    installed package waited 6-13% of its time on the lock)."""
    from tests.multiprocess import serve_workers

    results = spawn_ctx.Queue()
    proc = spawn_ctx.Process(target=serve_workers.gc_after_child_setup, args=(results,))
    proc.start()
    try:
        inherited, frozen, walked = results.get(timeout=120)
        proc.join(60)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(10)
    assert inherited > 50_000  # torch alone is more
    assert frozen >= inherited and walked < inherited // 100, (inherited, frozen, walked)


def test_rank_drops_bad_frames_and_keeps_serving(spawn_ctx):
    """A rank process fed an undecodable frame and a message that is not for a rank drops
    both (saying so on stderr) and still answers the next ExecuteModel; Shutdown: exit 0."""
    from shmkv.messages import (
        Channel,
        ExecuteModel,
        ModelOutput,
        Shutdown,
        create_doorbell,
        unlink_doorbell,
    )
    from shmkv.ranks.block_table import KVStore, SharedBlockTables
    from shmkv.serve import engine
    from shmkv.serve.messages import DrainScheduler
    from shmkv.serve.model import TinyModelConfig
    from tests.conftest import unique_pool_name

    name = unique_pool_name("rk")
    model = TinyModelConfig()
    tables = engine.create_block_tables(name, model, 4, 256, 16)
    store = engine.create_kv_store(name, model, 64, 16)
    bell = create_doorbell(name)
    to_rank, from_rank = f"{name}-to", f"{name}-from"
    Channel.create(to_rank, 1 << 16).close()
    Channel.create(from_rank, 1 << 16, doorbell=bell).close()
    tx, rx = Channel.open(to_rank), Channel.open(from_rank)
    proc = spawn_ctx.Process(target=engine.rank_main,
                             args=(name, name, to_rank, from_rank,
                                   engine.model_config_to_dict(model), None, 3))
    proc.start()
    try:
        tx.send_bytes(b"\x93garbage")
        tx.send(DrainScheduler())
        tables.commit(1)
        tx.send(ExecuteModel(step=1, requests=[]))
        assert rx.recv(120) == ModelOutput(step=1, sampled_token_ids=[])
        # RunConfig.rank_nice: the rank runs 3 steps nicer than its parent.
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        assert os.getpriority(os.PRIO_PROCESS, proc.pid) == min(19, mine + 3)
        tx.send(Shutdown())
        proc.join(60)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(10)
        tx.close()
        rx.close()
        for ch in (to_rank, from_rank):
            Channel.unlink(ch)
        unlink_doorbell(bell)
        tables.close()
        SharedBlockTables.unlink(name)
        store.close()
        KVStore.unlink(name)


def wait_for_progress(proc: subprocess.Popen) -> None:
    """Reads the run's stderr until its progress line ("requests") shows (it is serving)."""
    seen = b""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while b"requests" not in seen and time.monotonic() < deadline:
        seen += proc.stderr.read1(4096)
    assert b"requests" in seen, seen.decode()


def _marked_pids(mark: str) -> list[int]:
    """Processes whose environment carries ``SHMKV_TEST_MARK=mark`` (children inherit it)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if f"SHMKV_TEST_MARK={mark}".encode() in f.read().split(b"\0"):
                    out.append(int(entry))
        except OSError:
            continue
    return [p for p in out if pid_running(p)]


def test_front_end_killed_takes_every_child_and_cleanup_removes_the_rest(tmp_path):
    """SIGKILL the front end mid-run: its schedulers, ranks and multiprocessing's helpers all
    end (none is left orphaned, although the fork server is their parent), and
    ``shmkv cleanup`` then removes every segment the run left in /dev/shm."""
    import uuid

    mark = uuid.uuid4().hex
    proc = subprocess.Popen([sys.executable, "-m", "shmkv.cli", "run", *SMALL, "--progress",
                             "--plot", ""],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env=dict(_env(), SHMKV_TEST_MARK=mark), cwd=tmp_path)
    try:
        wait_for_progress(proc)
        children = [p for p in _marked_pids(mark) if p != proc.pid]
        assert len(children) >= 4  # 2 schedulers, 2 ranks (and the fork server, ...)
        proc.kill()
        proc.wait(30)
        assert _wait_gone(children, timeout_s=30) == []
        assert _marked_pids(mark) == []
        assert run_leftovers(proc.pid)  # the front end could not remove them
        out = subprocess.run([sys.executable, "-m", "shmkv.cli", "cleanup",
                              "--prefix", f"run{proc.pid}-"], capture_output=True,
                             text=True, env=_env(), timeout=120)
        assert out.returncode == 0, out.stderr
        assert run_leftovers(proc.pid) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        proc.stderr.close()
        for p in _marked_pids(mark):
            os.kill(p, signal.SIGKILL)
        if run_leftovers(proc.pid):
            subprocess.run([sys.executable, "-m", "shmkv.cli", "cleanup",
                            "--prefix", f"run{proc.pid}-"], capture_output=True,
                           env=_env(), timeout=120)


def test_rolling_restart_with_the_model_on_private_pools(tmp_path):
    """--rolling-restart with the model: each scheduler is killed in turn and a new one (with
    a new rank and block tables) takes its place on an emptied private pool; every request
    finishes with the reference's tokens, and every segment of every incarnation is gone
    after the run."""
    done, f, pid = run_shmkv(tmp_path, *SMALL, "--pool", "private", "--routing",
                             "sglang-cache-aware", "--rolling-restart", "--no-compare")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f["restart"] == "rolling" and [r["scheduler"] for r in f["restarts"]] == [0, 1]
    assert f["requests"] == f["requests_total"] and f["token_mismatches"] == 0
    assert f["tokens_checked"] == f["generated_tokens"] > 0
    assert f["pool_valid"] and f["problems"] == []
    assert "its private pool emptied" in done.stdout
    _check_clean(f, pid)
