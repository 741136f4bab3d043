"""The commands agree with each other, as a user runs them (subprocesses): one message and
exit code for a missing pool, one count of a pool's blocks, inspect never names itself as
the lock holder, a floor under the polling intervals, ``shmkv --version``, the cache listed
block by block (``inspect --keys``), ISO times in ``events``, and every argument of run and
replay refused before anything starts, naming the argument, the value and the rule."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

from shmkv import BlockPool, Request
from shmkv.events import short_hash
from tests.ecosystem_helpers import command_env, shmkv
from tests.helpers import run_leftovers

pytestmark = [pytest.mark.multiprocess, pytest.mark.long]
ROOT = Path(__file__).resolve().parents[2]


def test_every_command_says_the_same_of_a_missing_pool(pool_name):
    """inspect, stats, events, recover, metrics, publish and unlink: the same line (after
    the command's name) and exit 2, no traceback."""
    outs = {
        "inspect": shmkv("inspect", pool_name),
        "stats": shmkv("stats", pool_name, "--count", "1"),
        "events": shmkv("events", pool_name),
        "recover": shmkv("recover", pool_name),
        "metrics": shmkv("metrics", pool_name, "--port", "0"),
        "publish": shmkv("publish", pool_name, "--endpoint", "tcp://127.0.0.1:0"),
        "unlink": shmkv("unlink", pool_name),
    }
    expected = (f"no pool named {pool_name} (no /dev/shm/shmkv-{pool_name}-v"
                f"{_layout_version()}; `shmkv ls` lists the pools)")
    for command, out in outs.items():
        assert out.returncode == 2, (command, out.stderr)
        assert out.stderr == f"shmkv {command}: {expected}\n", (command, out.stderr)


def _layout_version() -> int:
    from shmkv.pool.layout import LAYOUT_VERSION

    return LAYOUT_VERSION


def test_one_count_of_a_pools_blocks(pool_name):
    """inspect, stats and the metrics give the same number of blocks for one pool: the
    usable ones, the null block apart (and say so)."""
    from shmkv.metrics import PoolMetrics

    pool = BlockPool.create(pool_name, 64)
    try:
        pool.get_new_blocks(3)
        said = "63 usable (of 64: block 0 is the null block, never handed out), 60 free, 3 in use"
        inspect = shmkv("inspect", pool_name)
        stats = shmkv("stats", pool_name, "--count", "1")
        assert f"blocks: {said}" in inspect.stdout, inspect.stdout
        assert f"blocks   {said}" in stats.stdout, stats.stdout
        assert PoolMetrics(pool).snapshot().num_blocks == 63
        assert "holder               free" in inspect.stdout  # not the inspect itself
        pool.check_invariants()
    finally:
        pool.close()
        BlockPool.unlink(pool_name)


@pytest.mark.parametrize("command, interval, floor", [
    ("stats", "0", "0.1"), ("stats", "-1", "0.1"), ("stats", "nan", "0.1"),
    ("events", "0", "0.01"),
])
def test_polling_interval_has_a_floor(pool_name, command, interval, floor):
    """An interval under the floor (each poll takes the pool lock) is refused at once,
    naming the option, the value and the floor, before the pool is even looked for."""
    out = shmkv(command, pool_name, "--interval", interval)
    assert out.returncode == 2
    assert out.stderr.startswith(f"shmkv {command}: --interval {float(interval)!r}: must be "
                                 f"at least {floor} s"), out.stderr


def test_version():
    """`shmkv --version`: the package's version (pyproject's) and the layout version."""
    import tomllib

    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    out = shmkv("--version")
    assert out.returncode == 0
    assert out.stdout == f"shmkv {version} (layout v{_layout_version()})\n"


def test_inspect_keys_lists_the_cached_blocks(pool_name):
    """--keys: group, hash, tokens, reference count, LRU place, who cached each block (from
    the event log) and who holds it; --json the same as data."""
    pool = BlockPool.create(pool_name, 32, enable_kv_cache_events=True, label="creator")
    other = BlockPool.attach(pool_name, label="scheduler-1")
    try:
        req = Request("a", list(range(48)), block_hasher=pool.make_block_hasher())
        blocks = pool.get_new_blocks(3)
        pool.cache_full_blocks(req, blocks, 0, 3, 16, 0)
        hits = other.get_cached_prefix(
            Request("b", list(range(48)), block_hasher=other.make_block_hasher()).block_hashes)
        other.touch(hits[:1])  # scheduler-1 holds the first block
        pool.free_blocks(reversed(blocks))  # blocks 2, 3 to the free queue's tail
        out = shmkv("inspect", pool_name, "--keys", "--json")
        assert out.returncode == 0, out.stderr
        listing = json.loads(out.stdout)
        assert (listing["num_cached"], listing["num_free"]) == (3, 30)
        rows = {r["block_id"]: r for r in listing["blocks"]}
        assert [r["block_id"] for r in listing["blocks"]] == [3, 2, 1]  # eviction order
        b1, b2, b3 = (blocks[0].block_id, blocks[1].block_id, blocks[2].block_id)
        assert (b1, b2, b3) == (1, 2, 3)
        assert rows[3]["lru_position"] == 28 and rows[2]["lru_position"] == 29
        assert rows[1]["lru_position"] is None and rows[1]["ref_cnt"] == 1
        assert rows[1]["holders"] == [{"slot": other.slot, "pid": os.getpid(),
                                       "references": 1}]
        for b, want_tokens in ((1, 16), (2, 32), (3, 48)):
            assert rows[b]["group"] == 0 and rows[b]["num_tokens"] == want_tokens
            assert rows[b]["hash"] == bytes(req.block_hashes[b - 1]).hex()
            assert rows[b]["cached_by"]["slot"] == pool.slot
            assert rows[b]["cached_by"]["pid"] == os.getpid()
            assert rows[b]["cached_by"]["label"] == "creator"
        text = shmkv("inspect", pool_name, "--keys", "--limit", "2")
        lines = text.stdout.splitlines()
        assert lines[0].startswith(f"pool {pool_name}: 3 cached block(s), 30 block(s)")
        assert re.match(r"\s+3\s+0\s+" + short_hash(bytes.fromhex(rows[3]["hash"]))
                        + r"\s+48\s+0\s+28\s+slot "
                        rf"{pool.slot} pid {os.getpid()} creator$", lines[2]), lines[2]
        assert lines[-1] == "  ... 1 more (--limit N)"
        other.free_blocks(hits[:1])
        other.check_invariants()
    finally:
        other.close()
        pool.close()
        BlockPool.unlink(pool_name)


@pytest.mark.parametrize("int_hashes", ["1", "0"])
def test_events_and_inspect_keys_print_a_hash_the_same_way(pool_name, int_hashes,
                                                           monkeypatch):
    """`shmkv events` and `shmkv inspect --keys` print the same 16 hex digits for a block's
    hash (its low 64 bits: events' integer form), whether the events carry integer hashes
    (vLLM's default) or 32-byte ones."""
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", int_hashes)  # as it logs
    env = command_env()
    pool = BlockPool.create(pool_name, 32, enable_kv_cache_events=True)
    try:
        req = Request("a", list(range(32)), block_hasher=pool.make_block_hasher())
        blocks = pool.get_new_blocks(2)
        pool.cache_full_blocks(req, blocks, 0, 2, 16, 0)
        want = [short_hash(bytes(h)) for h in req.block_hashes[:2]]
        assert want == [bytes(h)[-8:].hex() for h in req.block_hashes[:2]]
        events = subprocess.run([sys.executable, "-m", "shmkv.cli", "events", pool_name],
                                capture_output=True, text=True, env=env, timeout=120)
        keys = subprocess.run([sys.executable, "-m", "shmkv.cli", "inspect", pool_name,
                               "--keys"], capture_output=True, text=True, env=env,
                              timeout=120)
        assert events.returncode == 0 and keys.returncode == 0, events.stderr + keys.stderr
        assert f"[{want[0]}, {want[1]}]" in events.stdout, events.stdout
        listed = {int(line.split()[0]): line.split()[2]
                  for line in keys.stdout.splitlines()[2:]}
        assert [listed[b.block_id] for b in blocks] == want, keys.stdout
        pool.free_blocks(reversed(blocks))
        pool.check_invariants()
    finally:
        pool.close()
        BlockPool.unlink(pool_name)


def test_events_prints_iso_times(pool_name):
    """events: each line's time is ISO 8601 UTC to the microsecond (the logged time);
    --epoch gives seconds; --json carries both."""
    pool = BlockPool.create(pool_name, 32, enable_kv_cache_events=True)
    try:
        req = Request("a", list(range(32)), block_hasher=pool.make_block_hasher())
        blocks = pool.get_new_blocks(2)
        pool.cache_full_blocks(req, blocks, 0, 2, 16, 0)
        (logged,), _ = pool.read_events(pool.event_cursor())
        iso = shmkv("events", pool_name).stdout.split()[1]
        assert datetime.fromisoformat(iso).timestamp() == pytest.approx(logged.ts, abs=1e-6)
        assert iso.endswith("+00:00")
        assert shmkv("events", pool_name, "--epoch").stdout.split()[1] == f"{logged.ts:.6f}"
        record = json.loads(shmkv("events", pool_name, "--json").stdout)
        assert record["ts"] == logged.ts and record["time"] == iso
        pool.free_blocks(reversed(blocks))
        pool.check_invariants()
    finally:
        pool.close()
        BlockPool.unlink(pool_name)


# ---------------------------------------------------------------------------- run, replay

BAD_ARGUMENTS = [
    (["--blocks", "abc"], "--blocks 'abc': 'abc' is not a whole number; give a number of "
     "blocks >= 16, or several separated by commas (2048,8192,32768)"),
    (["--blocks", "2048,x"], "--blocks '2048,x': 'x' is not a whole number"),
    (["--blocks", "8"], "--blocks '8': 8 is under 16"),
    (["--blocks", "2048,,4096"], "--blocks '2048,,4096': an empty item between commas"),
    (["--schedulers", "0"], "--schedulers 0: must be a whole number >= 1"),
    (["--max-num-seqs", "0"], "--max-num-seqs 0: must be a whole number >= 1"),
    (["--time-scale", "-1"], "--time-scale -1.0: must be a finite number >= 0"),
    (["--timeout", "0"], "--timeout 0.0: must be a finite number of seconds > 0"),
    (["--trace-format", "mooncake"], "--trace-format 'mooncake': needs --trace PATH"),
    (["--kill-one", "--schedulers", "1"], "--kill-one with --schedulers 1: needs at least 2"),
    (["--max-model-len", "16"], "--max-model-len 16: too small for this workload, whose "
     "longest request (c57-t5: its prompt as sent, with its conversation's history, plus "
     "the tokens it generates) is 374 tokens; use --max-model-len 374 or more"),
    (["--blocks", "64"], "--blocks 64: 4 private pools of 16 blocks cannot hold one request "
     "of --max-model-len 512 (65 blocks: 32 per KV-cache group x 2 groups + the null "
     "block); raise --blocks to 260 or lower --max-model-len"),
    (["--blocks", "64", "--no-compare"], "--blocks 64: one pool of 64 blocks cannot hold"),
]


@pytest.mark.parametrize("command", ["replay", "run"])
def test_every_bad_argument_is_named_before_anything_starts(tmp_path, command):
    """Each bad argument: one line on stderr naming it, its value and the rule; exit 2;
    nothing started, nothing left (run checks --rank-nice too)."""
    cases = BAD_ARGUMENTS + ([(["--rank-nice", "20"], "--rank-nice 20: must be a whole "
                               "number from 0 to 19")] if command == "run" else [])
    if command == "run":
        pytest.importorskip("torch")
    for args, message in cases:
        proc = subprocess.Popen([sys.executable, "-m", "shmkv.cli", command, *args],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        try:
            stdout, stderr = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert proc.returncode == 2, (args, stdout, stderr)
        assert stderr.startswith(f"shmkv {command}: {message}"), (args, stderr)
        assert len(stderr.splitlines()) == 1 and stdout == "", stderr
        assert not list(tmp_path.iterdir())  # no plot, no JSON
        assert run_leftovers(proc.pid) == []


def test_replay_offers_only_what_applies():
    """replay's help: its own plot name, no model options; run's has them."""
    from shmkv.cli import build_parser

    def joined(text: str) -> str:  # argparse wraps lines, at hyphens too
        return " ".join(re.sub(r"-\n\s+", "-", text).split())

    replay = joined(shmkv("replay", "--help").stdout)
    run = joined(shmkv("run", "--help").stdout)
    assert build_parser().parse_args(["replay"]).plot == "shmkv-replay.png"
    assert build_parser().parse_args(["run"]).plot == "shmkv-run.png"
    for option in ("--rank-nice", "--no-check", "--model"):
        assert option not in replay and option in run, option
    assert "shmkv-replay.png" in replay and "shmkv-run.png" not in replay
    assert "--no-compare" in replay and "--verbose" in replay
    for option in ("--rank-nice", "--no-check"):
        out = shmkv("replay", option, *(["20"] if option == "--rank-nice" else []))
        assert out.returncode == 2 and "unrecognized arguments" in out.stderr
