"""Every `shmkv` subcommand run as a user runs it (a subprocess), with its error paths:
help text, exit codes 0/1/2, one-line errors without a traceback unless --debug."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest

from shmkv import BlockPool
from shmkv.cli import build_parser
from shmkv.pool import siblings
from tests.ecosystem_helpers import ROOT, command_env, serve_requests, shmkv, start_shmkv

pytestmark = [pytest.mark.multiprocess, pytest.mark.long]

COMMANDS = {"demo", "create", "inspect", "stats", "events", "publish", "metrics", "recover",
            "unlink", "ls", "cleanup", "bench"}


def no_traceback(*outs) -> None:
    for out in outs:
        assert "Traceback" not in out.stderr, out.stderr


def subcommands() -> set[str]:
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    return set(action.choices)


def test_help_for_every_command():
    """`shmkv --help` names every command and the exit codes; each has its own help."""
    assert COMMANDS <= subcommands()
    top = shmkv("--help")
    assert top.returncode == 0
    assert "Exit codes" in top.stdout
    for command in sorted(subcommands()):
        out = shmkv(command, "--help")
        assert out.returncode == 0, (command, out.stderr)
        assert f"usage: shmkv {command}" in out.stdout
        assert len(out.stdout.splitlines()) > 3


def test_bad_usage_exits_2():
    """No command, an unknown one, and an unknown option to each command: exit 2 with the
    usage line, no traceback."""
    outs = [shmkv(), shmkv("frobnicate")]
    outs += [shmkv(command, "--bogus-option") for command in sorted(subcommands())]
    for out in outs:
        assert out.returncode == 2 and out.stderr.startswith("usage: shmkv"), out.stderr
    no_traceback(*outs)


def test_debug_shows_the_traceback(pool_name):
    plain = shmkv("inspect", pool_name)
    debug = shmkv("--debug", "inspect", pool_name)
    assert plain.returncode == 2 and "Traceback" not in plain.stderr
    assert debug.returncode != 0 and "Traceback" in debug.stderr
    assert "SegmentNotFoundError" in debug.stderr


def test_create_inspect_unlink(pool_name):
    out = shmkv("create", pool_name, "--blocks", "64", "--events", "--max-processes", "4")
    assert out.returncode == 0, out.stderr
    assert f"created pool {pool_name}: 64 blocks of 16 tokens (63 usable: block 0 is the " \
        "null block)" in out.stdout
    pool = BlockPool.attach(pool_name)
    try:
        assert pool.num_gpu_blocks == 64 and pool.enable_kv_cache_events
        assert pool.layout.config.max_processes == 4
    finally:
        pool.close()
    again = shmkv("create", pool_name, "--blocks", "64")
    assert again.returncode == 2 and "already exists" in again.stderr
    missing_blocks = shmkv("create", pool_name)
    assert missing_blocks.returncode == 2 and "--blocks" in missing_blocks.stderr
    inspect = shmkv("inspect", pool_name)
    assert inspect.returncode == 0 and "blocks: 63 usable (of 64: block 0 is the null " \
        "block, never handed out), 63 free" in inspect.stdout
    assert "publisher:" not in inspect.stdout and "stats:" not in inspect.stdout
    assert re.search(r"retention +2 \(stays until unlinked\)\n +stays_by +shmkv create\n",
                     inspect.stdout), inspect.stdout
    assert re.search(r"tier_of +none\n", inspect.stdout), inspect.stdout
    from shmkv.publisher import KVEventPublisher, unlink_state
    from shmkv.stats import PoolStats

    pool = BlockPool.attach(pool_name)
    try:
        stats = PoolStats.open(pool)
        stats.add_prefix_cache(64, 16)
        stats.close()
        KVEventPublisher(pool, "tcp://127.0.0.1:0").close()
    finally:
        pool.close()
    inspect = shmkv("inspect", pool_name)
    assert "publisher: not running" in inspect.stdout and "next seq 0" in inspect.stdout
    assert "stats: 1 slot(s) recorded, 64 prefix tokens queried, 16 hit" in inspect.stdout
    unlink_state(pool_name)
    assert shmkv("unlink", pool_name).returncode == 0
    too_small = shmkv("create", pool_name, "--blocks", "0")
    assert too_small.returncode == 2 and too_small.stderr.startswith("shmkv create:")
    bad_name = shmkv("create", "a/b", "--blocks", "8")
    assert bad_name.returncode == 2 and "contains '/'" in bad_name.stderr
    assert shmkv("unlink", pool_name).returncode == 2
    no_traceback(again, missing_blocks, too_small, bad_name)


def test_stats(pool_name):
    from shmkv.stats import PoolStats, unlink_stats

    pool = BlockPool.create(pool_name, 64, enable_kv_cache_events=True)
    try:
        stats = PoolStats.open(pool, time_lock=True)
        serve_requests(pool, pool.make_block_hasher(), 0, 5, list(range(32)))
        stats.add_prefix_cache(280, 128, requests=5)
        out = shmkv("stats", pool_name, "--count", "2", "--interval", "0.1")
        assert out.returncode == 0, out.stderr
        assert out.stdout.count(f"pool {pool_name}") == 2
        assert "280 tokens queried, 128 hit (45.7%)" in out.stdout
        assert f"slot   0 pid {os.getpid():>7}: 280 queried" in out.stdout
        assert "/s)" in out.stdout  # the second refresh has rates
        assert "\033[H" not in out.stdout  # not a terminal: no clearing
        stats.close()
    finally:
        pool.close()
        unlink_stats(pool_name)
    missing = shmkv("stats", f"{pool_name}-x", "--count", "1")
    bad = shmkv("stats", pool_name, "--count", "one")
    assert missing.returncode == 2 and f"no pool named {pool_name}-x" in missing.stderr
    assert bad.returncode == 2 and "invalid int value" in bad.stderr
    no_traceback(missing, bad)


def test_events_print_follow_and_json(pool_name):
    pool = BlockPool.create(pool_name, 64, enable_kv_cache_events=True)
    try:
        serve_requests(pool, pool.make_block_hasher(), 0, 4)
        log, _ = pool.read_events(pool.event_cursor())
        out = shmkv("events", pool_name)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert len(lines) == len(log) == 4
        assert [int(line.split()[0]) for line in lines] == [e.seq for e in log]
        assert all("BlockStored" in line and "slot   0" in line for line in lines)
        two = shmkv("events", pool_name, "-n", "2")
        assert two.stdout.splitlines() == lines[:2]
        as_json = shmkv("events", pool_name, "--json")
        records = [json.loads(line) for line in as_json.stdout.splitlines()]
        assert [r["seq"] for r in records] == [e.seq for e in log]
        assert [r["event"]["block_hashes"] for r in records] == \
            [e.event.block_hashes for e in log]
        assert records[0]["event"]["type"] == "BlockStored"
        assert shmkv("events", pool_name, "--from", "end").stdout == ""
        # --follow: new events appear; SIGTERM ends it with 143
        follow = start_shmkv("events", pool_name, "--from", "end", "--follow")
        try:
            assert follow.stderr.readline() == f"following pool {pool_name} from seq 4\n"
            serve_requests(pool, pool.make_block_hasher(), 10, 2)
            got = [follow.stdout.readline() for _ in range(2)]
            assert [int(line.split()[0]) for line in got] == [4, 5]
            follow.send_signal(signal.SIGTERM)
            follow.wait(30)
            assert follow.returncode == 143
        finally:
            if follow.poll() is None:
                follow.kill()
                follow.wait(30)
            follow.stdout.close()
            follow.stderr.close()
        # a reader that leaves early (more output than a pipe holds): exit 0, no error
        serve_requests(pool, pool.make_block_hasher(), 100, 300)
        piped = subprocess.run(
            f"{sys.executable} -m shmkv.cli events {pool_name} --json | head -1; "
            "exit ${PIPESTATUS[0]}", shell=True, executable="/bin/bash",
            capture_output=True, text=True, env=command_env(), cwd=ROOT, timeout=60)
        assert piped.returncode == 0 and piped.stderr == ""
        assert json.loads(piped.stdout)["seq"] == 0
    finally:
        pool.close()
    other = f"{pool_name}-nolog"
    BlockPool.create(other, 8).close()
    try:
        nolog = shmkv("events", other)
    finally:
        BlockPool.unlink(other)
    missing = shmkv("events", f"{pool_name}-x")
    assert nolog.returncode == 2 and "no event log" in nolog.stderr
    assert missing.returncode == 2 and f"no pool named {pool_name}-x" in missing.stderr
    no_traceback(nolog, missing)


def test_ls_lists_pools_with_processes_and_their_siblings(pool_name):
    from shmkv.publisher import KVEventPublisher, unlink_state
    from shmkv.stats import PoolStats, unlink_stats

    gone = f"{pool_name}-gone"
    assert shmkv("create", gone, "--blocks", "16").returncode == 0  # its creator exited
    pool = BlockPool.create(pool_name, 32, enable_kv_cache_events=True)
    other = BlockPool.attach(pool_name)
    try:
        PoolStats.open(pool).close()
        KVEventPublisher(pool, "tcp://127.0.0.1:0").close()
        out = shmkv("ls", "--json", "--prefix", pool_name)
        assert out.returncode == 0, out.stderr
        rows = {(r["kind"], r["name"]): r for r in json.loads(out.stdout)}
        mine = rows[("pool", pool_name)]
        assert (mine["processes"], mine["alive"], mine["creator_alive"]) == (2, 2, True)
        assert mine["bytes"] == pool.layout.total_bytes and mine["owner"]
        assert rows[("pool", gone)]["creator_alive"] is False
        assert rows[("pool", gone)]["processes"] == 0
        assert (mine["lifetime"], mine["orphan"]) == ("scoped", False)
        assert (rows[("pool", gone)]["lifetime"], rows[("pool", gone)]["idle"]) == ("stays", True)
        assert rows[("pool", gone)]["cleanup"].startswith("stays (made by shmkv create); idle")
        assert rows[("publisher", pool_name)]["pool"] == pool_name
        assert "next seq 0, stopped" in rows[("publisher", pool_name)]["note"]
        assert rows[("stats", pool_name)]["pool"] == pool_name
        assert not any(kind in ("lock", "liveness") for kind, _ in rows)  # --all only
        everything = json.loads(shmkv("ls", "--all", "--json", "--prefix", pool_name).stdout)
        kinds = {r["kind"] for r in everything if pool_name in r["name"]}
        assert {"pool", "lock", "liveness", "publisher", "stats"} <= kinds
        table = shmkv("ls", "--prefix", pool_name)
        line = next(line for line in table.stdout.splitlines()
                    if line.startswith("pool") and f" {pool_name} " in line)
        assert "2/2" in line and "alive" in line and " scoped " in line
        line = next(line for line in table.stdout.splitlines()
                    if line.startswith("pool") and f" {gone} " in line)
        assert " stays " in line and "stays (made by shmkv create)" in line, line
        assert re.search(r"it takes [\d.]+ KiB of /dev/shm", line), line
    finally:
        other.close()
        pool.close()
        unlink_state(pool_name)
        unlink_stats(pool_name)
        BlockPool.unlink(gone)
    bad = shmkv("ls", "extra")
    assert bad.returncode == 2
    no_traceback(bad)


def test_unlink_removes_the_siblings_and_cleanup_the_orphaned_ones(pool_name):
    from shmkv.publisher import KVEventPublisher, state_segment_name
    from shmkv.stats import PoolStats, stats_segment_name, unlink_stats

    pool = BlockPool.create(pool_name, 16, enable_kv_cache_events=True)
    PoolStats.open(pool).close()
    KVEventPublisher(pool, "tcp://127.0.0.1:0").close()
    pool.close()
    out = shmkv("unlink", pool_name)
    assert out.returncode == 0 and "publisher position, stats" in out.stdout
    assert not os.path.exists(f"/dev/shm{state_segment_name(pool_name)}")
    assert not os.path.exists(f"/dev/shm{stats_segment_name(pool_name)}")
    # a stats segment whose pool is gone: cleanup --dry-run names it
    pool = BlockPool.create(pool_name, 16)
    PoolStats.open(pool).close()
    pool.close()
    siblings.unlink_pool_files(pool_name)  # the pool alone (BlockPool.unlink takes both)
    try:
        dry = shmkv("cleanup", "--dry-run", "--prefix", pool_name)
        assert dry.returncode == 0
        assert f"would remove /dev/shm{stats_segment_name(pool_name)}" in dry.stdout
    finally:
        unlink_stats(pool_name)
    bad = shmkv("unlink")
    assert bad.returncode == 2
    no_traceback(bad)


def test_recover_and_demo_errors(pool_name):
    missing = shmkv("recover", pool_name)
    assert missing.returncode == 2 and f"no pool named {pool_name}" in missing.stderr
    BlockPool.create(pool_name, 8).close()
    ok = shmkv("recover", pool_name)
    assert ok.returncode == 0 and "invariants: OK" in ok.stdout
    reclaim = shmkv("recover", pool_name, "--reclaim", "999999")
    assert reclaim.returncode == 2 and "no process with pid 999999" in reclaim.stderr
    bad_pid = shmkv("recover", pool_name, "--reclaim", "x")
    assert bad_pid.returncode == 2
    demo = shmkv("demo", "--processes", "0")
    assert demo.returncode == 2 and "--processes" in demo.stderr
    no_traceback(missing, reclaim, bad_pid, demo)


def test_bench(tmp_path):
    listed = shmkv("bench", "--list")
    assert listed.returncode == 0 and "block_pool" in listed.stdout
    builtin = shmkv("bench", "--iterations", "200", "--blocks", "64")
    assert builtin.returncode == 0, builtin.stderr
    assert builtin.stdout.count("ns per block") == 4
    script = shmkv("bench", "block_pool", "--help")  # the script's own help, its exit code
    assert script.returncode == 0 and "usage:" in script.stdout
    unknown = shmkv("bench", "nosuch")
    assert unknown.returncode == 2 and "no benchmark 'nosuch'" in unknown.stderr
    too_few = shmkv("bench", "--iterations", "0")
    assert too_few.returncode == 2
    # an installed shmkv has no benchmarks/ beside it: a clear error, the built-in still runs
    shutil.copytree(ROOT / "shmkv", tmp_path / "shmkv",
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    installed = subprocess.run([sys.executable, "-m", "shmkv", "bench", "block_pool"],
                               capture_output=True, text=True, env=env, cwd=tmp_path,
                               timeout=120)
    assert installed.returncode == 2 and "source tree" in installed.stderr
    no_traceback(unknown, too_few, installed)
