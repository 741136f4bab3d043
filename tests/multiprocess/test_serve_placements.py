"""``shmkv run --device cpu`` with both KV placements, as a user runs it (the real command,
small settings): every token equals the no-cache reference, the shared device placement
computes fewer prefill tokens than private pools of the same blocks in all, a rank
SIGKILLed mid-run leaves the others to finish, bad device options are refused before
anything starts, and nothing is left in /dev/shm."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid

import pytest

from tests.multiprocess.test_serve_run import (
    RUN_TIMEOUT_S,
    SMALL,
    _check_clean,
    _env,
    _marked_pids,
    run_shmkv,
    wait_for_progress,
)

pytest.importorskip("torch")

pytestmark = [pytest.mark.multiprocess, pytest.mark.long]


@pytest.mark.parametrize("kv", ["device", "host"])
def test_run_on_cpu_serves_with_both_placements_and_no_mismatch(tmp_path, kv):
    """Two schedulers on one shared pool, the KV cache in the given placement: every
    request finishes, every token equals the reference, hits happen, the figures say where
    it ran, and the run leaves nothing behind."""
    done, f, pid = run_shmkv(tmp_path, *SMALL, "--device", "cpu", "--kv", kv, "--no-compare")
    assert done.returncode == 0, done.stdout + done.stderr
    assert (f["device"], f["kv"], f["dtype"], f["exact_tokens"]) == ("cpu", kv, "float32", True)
    assert f["requests"] == f["requests_total"] and f["token_mismatches"] == 0
    assert f["tokens_checked"] == f["generated_tokens"] > 0
    assert f["prefill_tokens_saved"] > 0 and f["divergences"] == []
    assert f["prefill_tokens_computed"] == f["prompt_tokens"] - f["prefill_tokens_saved"]
    assert f["peak_device_memory_bytes"] is None  # a CPU run
    assert f["pool_valid"] and f["problems"] == []
    assert f"KV cache {kv} placement" in done.stdout
    _check_clean(f, pid)


def test_shared_device_placement_computes_fewer_prefill_tokens_than_private_pools(tmp_path):
    """The same workload and the same blocks in all, routed round robin: one pool tensor
    shared by every rank (a prefix one computed is attended by the others) against one
    private pool each."""
    args = ["--schedulers", "2", "--conversations", "6", "--blocks", "256", "--kv", "device",
            "--routing", "round-robin", "--no-compare"]
    shared = run_shmkv(tmp_path, *args)
    private = run_shmkv(tmp_path, *args, "--pool", "private")
    for done, f, pid in (shared, private):
        assert done.returncode == 0, done.stdout + done.stderr
        assert f["token_mismatches"] == 0 and f["requests"] == f["requests_total"]
        _check_clean(f, pid)
    assert shared[1]["pool"] == "shared" and private[1]["pool"] == "private"
    assert shared[1]["prompt_tokens"] == private[1]["prompt_tokens"]
    assert shared[1]["prefill_tokens_computed"] < private[1]["prefill_tokens_computed"]


def test_bad_device_options_exit_2_before_anything_starts(capsys):
    """Each bad option or combination (the command's own entry point, in this process):
    exit 2, the argument named, no traceback, nothing made in /dev/shm."""
    import torch

    from shmkv.cli import main

    cases = [(["run", "--device", "gpu"], "--device must be cpu, cuda, cuda:N or auto"),
             (["run", "--kv", "disk"], "--kv must be one of device, host"),
             (["run", "--dtype", "float16"], "--dtype must be one of float32, bfloat16"),
             (["run", "--model", "none", "--kv", "host"], "--model none")]
    if not torch.cuda.is_available():
        cases.append((["run", "--device", "cuda"], "--device cuda: torch sees no CUDA device"))
    for args, needle in cases:
        assert main(args) == 2, args
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err, (args, err)
    with pytest.raises(SystemExit) as exc:  # argparse's own refusal
        main(["run", "--model", "huge"])
    assert exc.value.code == 2 and "--model" in capsys.readouterr().err
    for args in (["replay", "--device", "cpu", "--kv", "host"], ["replay", "--dtype", "bfloat16"]):
        with pytest.raises(SystemExit) as exc:  # a replay has no model options at all
            main(args)
        assert exc.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err
    assert [e for e in os.listdir("/dev/shm") if f"run{os.getpid()}-" in e] == []


def _nice(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(") ", 1)[1].split()[16])
    except (OSError, IndexError, ValueError):
        return None


@pytest.mark.parametrize("kv", ["device", pytest.param("host", marks=pytest.mark.slow)])
def test_a_rank_killed_mid_run_the_others_finish(tmp_path, kv):
    """SIGKILL one rank process while serving: its scheduler is stopped, its requests go to
    the others, every request finishes with the reference's tokens, the pool is valid with
    nothing in use, the death is reported (exit 1) and nothing is left behind."""
    mark = uuid.uuid4().hex
    out = tmp_path / "run.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "shmkv.cli", "run", "--schedulers", "3", "--conversations",
         "30", "--blocks", "256", "--kv", kv, "--progress", "--plot", "", "--json", str(out),
         "--no-compare"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(_env(), SHMKV_TEST_MARK=mark),
        cwd=tmp_path)
    try:
        wait_for_progress(proc)
        ranks = [p for p in _marked_pids(mark) if p != proc.pid and _nice(p) == 10]
        assert len(ranks) == 3, ranks
        os.kill(ranks[0], signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    f = json.loads(out.read_text())
    assert proc.returncode == 1, stdout + stderr.decode()
    assert "Traceback" not in stderr.decode()
    assert f["requests"] == f["requests_total"] and f["token_mismatches"] == 0
    assert f["pool_valid"] and f["pools_after"][0]["blocks_in_use_after"] == 0
    assert any("rank-" in p and "died" in p for p in f["problems"]), f["problems"]
    assert sum(not s["alive_at_end"] for s in f["per_scheduler"]) == 1
    _check_clean(f, proc.pid)


def _cut_down_small():
    import dataclasses

    from shmkv.serve.small_model import SMALL_MODEL_CONFIG

    return dataclasses.replace(SMALL_MODEL_CONFIG, vocab_size=512, num_layers=2,
                               hidden_size=64, intermediate_size=96, num_heads=4,
                               num_kv_heads=2, head_size=16, sliding_window=(None, None))


@pytest.mark.parametrize("kv,dtype", [("device", "float32"), ("host", "bfloat16")])
def test_small_models_shape_cut_down_serves_through_the_ranks(kv, dtype):
    """--model small's shape (one full-attention group), cut down, through scheduler and
    rank processes on the CPU: float32 matches the reference token for token; bfloat16
    serves every request and reports (does not fail on) any flip."""
    from shmkv.serve.device import RunDevice
    from shmkv.serve.runner import RunConfig, Runner
    from shmkv.serve.workload import ChatWorkloadConfig, chat_workload

    model = _cut_down_small()
    workload = chat_workload(ChatWorkloadConfig(num_conversations=4,
                                                vocab_size=model.vocab_size))
    cfg = RunConfig(num_schedulers=2, num_blocks=256, model=model,
                    run_device=RunDevice("cpu", kv, dtype))
    runner = Runner(cfg, workload, log=lambda _: None)
    f = runner.run().figures
    assert f["problems"] == [] and f["pool_valid"]
    assert f["requests"] == f["requests_total"] and f["tokens_checked"] > 0
    assert (f["kv"], f["dtype"], f["exact_tokens"]) == (kv, dtype, dtype == "float32")
    if dtype == "float32":
        assert f["token_mismatches"] == 0
    assert len(f["divergences"]) == min(f["requests_mismatched"], 5)
    assert [e for e in os.listdir("/dev/shm") if runner.name in e] == []
