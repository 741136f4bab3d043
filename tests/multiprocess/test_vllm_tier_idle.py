"""Idle vLLM offload tiers (``shmkv/pool/lifecycle.py``, rule 6): a tier no process holds is
idle since a process last joined or left it; ``shmkv cleanup --idle-for`` removes those idle
that long and nothing held, whatever its age; a replica's start names the other idle
tiers and what they keep of /dev/shm. Real processes make, hold and leave the tiers; a tier
is made "old" by setting its record back (the times of ``lifecycle.presence_paths``),
never by sleeping. Every name is the test's own, every cleanup is scoped to it
(``--prefix``), and every assertion about the start-up line is about the test's own names:
the machine's other pools are never touched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.kv_offload.base")

from shmkv import BlockPool  # noqa: E402
from shmkv.pool import lifecycle as LC  # noqa: E402
from shmkv.pool.siblings import human_bytes  # noqa: E402
from shmkv.vllm.lifecycle import idle_tiers_notice  # noqa: E402
from tests.conftest import unique_pool_name  # noqa: E402
from tests.multiprocess import idle_tier_workers as workers  # noqa: E402
from tests.multiprocess.conftest import join_processes  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.long]
ROOT = Path(__file__).resolve().parents[2]
HOUR = 3600.0


def shmkv(*args: str) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "shmkv.cli", *args], capture_output=True,
                         text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)
    assert "Traceback" not in out.stderr, out.stderr
    return out


def _objects(name: str) -> list[str]:
    """The test's own objects in /dev/shm: those whose name holds ``name``."""
    return sorted(e for e in os.listdir("/dev/shm") if name in e)


def _memory(name: str) -> int:
    return sum(os.lstat(f"/dev/shm/{e}").st_blocks * 512 for e in _objects(name))


def _age(pool: str, seconds: float) -> None:
    """Sets the tier's record of its last join or leave back by ``seconds``."""
    then = time.time() - seconds
    for path in LC.presence_paths(pool):
        os.utime(path, (then, then))


def _run(ctx, target, *args) -> None:
    p = ctx.Process(target=target, args=args)
    p.start()
    assert join_processes([p]) == [0]


def _check(pool: str) -> None:
    """The pool's invariants, from a fresh process of its own (this one) that attaches."""
    with BlockPool.attach(pool, label="check") as fresh:
        fresh.reap_dead()
        fresh.check_invariants()


TIERS = ("old", "young", "held", "killed", "bad", "new")  # the tests' tiers: <base>-<tier>


@pytest.fixture
def base():
    """The start of every pool name of the test; at teardown each of its tiers is removed
    by name, and nothing with it is left."""
    name = unique_pool_name("idle")
    yield name
    for tier in TIERS:
        if _objects(f"{name}-{tier}"):
            shmkv("unlink", "--force", f"{name}-{tier}")
    assert _objects(name) == []


@pytest.mark.timeout(240)
def test_idle_for_removes_a_tier_idle_that_long_and_keeps_a_younger_one(spawn_ctx, base):
    """Two tiers whose replicas stopped: one idle for 3 h, one for seconds. Plain cleanup
    keeps both; `--idle-for 1h --dry-run` names the old one with its size and idle time and
    changes nothing; `--idle-for 1h` removes the old tier whole and keeps the younger."""
    old, young = f"{base}-old", f"{base}-young"
    _run(spawn_ctx, workers.make_tier_and_leave, old)
    _run(spawn_ctx, workers.make_tier_and_leave, young)
    _age(old, 3 * HOUR)
    before = _objects(base)
    assert len(_objects(old)) == 6, _objects(old)  # pool, lock, .alive, table, locks, region
    rows = {r["name"]: r for r in json.loads(shmkv("ls", "--json", "--prefix", base).stdout)
            if r["kind"] == "pool"}
    assert abs(rows[old]["idle_since"] - (time.time() - 3 * HOUR)) < 60
    assert abs(rows[young]["idle_since"] - time.time()) < 60
    out = shmkv("cleanup", "--prefix", base)
    assert out.returncode == 0 and _objects(base) == before, out.stdout
    assert f"kept pool {old}: stays (made by vllm tier); idle:" in out.stdout
    size = human_bytes(_memory(old))
    dry = shmkv("cleanup", "--idle-for", "1h", "--dry-run", "--prefix", base)
    assert dry.returncode == 0, dry.stderr
    assert (f"would remove pool {old}: stays (made by vllm tier); idle: no live process "
            "attached (0 dead)") in dry.stdout
    assert (f"; idle for 3.0 h, at least --idle-for 60 min ({size} of /dev/shm)"
            in dry.stdout), dry.stdout
    assert f"kept pool {young}: stays (made by vllm tier); idle:" in dry.stdout
    assert ", less than --idle-for 60 min; `shmkv unlink" in dry.stdout
    assert _objects(base) == before
    out = shmkv("cleanup", "--idle-for", "1h", "--prefix", base)
    assert out.returncode == 0, out.stderr
    assert f"removed pool {old}:" in out.stdout and f"removed pool {young}" not in out.stdout
    assert f"6 object(s) removed ({size} of /dev/shm freed)" in out.stdout, out.stdout
    assert _objects(old) == []
    assert _objects(base) == [e for e in before if young in e]
    _check(young)


@pytest.mark.timeout(240)
def test_a_held_tier_stays_whatever_its_age_and_its_last_leave_is_recorded(spawn_ctx,
                                                                           base):
    """A tier whose GPU worker holds it (its replica lock file, attached to no pool), with
    its record set back 30 days, stays under `--idle-for 1s`, naming the hold. Once that
    worker leaves, the tier is idle since its leave: `--idle-for 1h` keeps it."""
    tier = f"{base}-held"
    _run(spawn_ctx, workers.make_tier_and_leave, tier)
    ready, stop = spawn_ctx.Event(), spawn_ctx.Event()
    holder = spawn_ctx.Process(target=workers.hold_tier, args=(tier, ready, stop))
    holder.start()
    try:
        assert ready.wait(120)
        _age(tier, 30 * 24 * HOUR)
        before = _objects(base)
        out = shmkv("cleanup", "--idle-for", "1s", "--prefix", base)
        assert out.returncode == 0, out.stderr
        assert (f"kept pool {tier}: stays (made by vllm tier); replica processes (engine "
                "cores, GPU workers) hold") in out.stdout, out.stdout
        assert "0 object(s) removed" in out.stdout and _objects(base) == before
    finally:
        stop.set()
        assert join_processes([holder]) == [0]
    out = shmkv("cleanup", "--idle-for", "1h", "--prefix", base)
    assert f"kept pool {tier}:" in out.stdout and "less than --idle-for 60 min" in out.stdout
    assert _objects(base) == before
    _check(tier)


@pytest.mark.timeout(240)
def test_a_tier_whose_last_replica_was_killed_reads_idle_for_up_to(spawn_ctx, base):
    """A replica that is gone without leaving (its engine core's row stays in the pool)
    records no leave: cleanup says the tier is idle for "up to" its age, and `--idle-for`
    still judges by it (no process holds the tier)."""
    tier = f"{base}-killed"
    _run(spawn_ctx, workers.make_tier_and_die, tier)
    _age(tier, 2 * HOUR)
    dry = shmkv("cleanup", "--idle-for", "1h", "--dry-run", "--prefix", base)
    assert (f"would remove pool {tier}: stays (made by vllm tier); idle: no live process "
            "attached (1 dead)") in dry.stdout, dry.stdout
    assert ("idle for up to 2.0 h (a process died without leaving: when is not recorded), "
            "at least --idle-for 60 min") in dry.stdout
    _check(tier)


@pytest.mark.timeout(240)
def test_bad_idle_for_values_are_refused_and_change_nothing(spawn_ctx, base):
    """`cleanup --idle-for` with a value that is not a time (or with --include-idle): exit
    2, one line naming the flag and the accepted forms, and nothing removed, although an
    idle tier 3 h old is there to be removed."""
    tier = f"{base}-bad"
    _run(spawn_ctx, workers.make_tier_and_leave, tier)
    _age(tier, 3 * HOUR)
    before = _objects(base)
    for bad in ("", "abc", "-5", "-1h", "5x", "1h30m", "nan", "inf", "1e3", "2 hours", "h"):
        for extra in ((), ("--dry-run",)):
            # `--idle-for=-1h`: argparse takes a lone "-1h" for an option (its own error,
            # exit 2 naming --idle-for, below)
            out = shmkv("cleanup", *extra, f"--idle-for={bad}", "--prefix", base)
            assert out.returncode == 2, (bad, out.stdout, out.stderr)
            assert out.stdout == ""
            assert f"--idle-for {bad!r}:" in out.stderr, out.stderr
            assert "plain seconds (3600), or a number with one unit, s, m, h or d" in out.stderr
    out = shmkv("cleanup", "--idle-for", "-1h", "--prefix", base)
    assert out.returncode == 2 and "argument --idle-for: expected one argument" in out.stderr
    out = shmkv("cleanup", "--idle-for", "1h", "--include-idle", "--prefix", base)
    assert out.returncode == 2 and "with --include-idle: give one" in out.stderr
    assert _objects(base) == before
    _check(tier)


@pytest.mark.timeout(240)
def test_a_replica_start_names_the_other_idle_tiers_and_what_they_keep(spawn_ctx, base):
    """A replica starting on one tier logs one warning naming another idle tier of this
    user, its /dev/shm memory and idle time and how to remove it, and removes nothing; with
    no other idle tier of the test's names, it names none of them."""
    old, new = f"{base}-old", f"{base}-new"
    _run(spawn_ctx, workers.make_tier_and_leave, old)
    _age(old, 2 * HOUR)
    old_objects, size = _objects(old), human_bytes(_memory(old))
    queue = spawn_ctx.Queue()
    p = spawn_ctx.Process(target=workers.start_replica_and_report, args=(new, queue))
    p.start()
    lines = queue.get(timeout=120)
    assert join_processes([p]) == [0]
    mine = [line for line in lines if base in line]
    assert len(mine) == 1, lines
    assert mine[0].startswith("WARNING shmkv.vllm.lifecycle shmkv: ")
    assert "other shmkv tier(s) kept idle in /dev/shm, no process holding them" in mine[0]
    assert f"{old} (vllm tier, {size}, idle for 2.0 h)" in mine[0]
    assert new not in mine[0]
    assert "`shmkv unlink NAME` removes one; `shmkv cleanup --idle-for DURATION`" in mine[0]
    assert _objects(old) == old_objects  # named, never touched
    # The same look, scoped to the test's names, from this process
    assert f"{old} (vllm tier, {size}, idle for 2.0 h)" in idle_tiers_notice(new, base)
    assert idle_tiers_notice(old, base).count(f"{new} (vllm tier, ") == 1

    assert shmkv("unlink", old).returncode == 0
    p = spawn_ctx.Process(target=workers.start_replica_and_report, args=(new, queue))
    p.start()
    lines = queue.get(timeout=120)
    assert join_processes([p]) == [0]
    assert not [line for line in lines if base in line], lines
    assert idle_tiers_notice(new, base) is None
    _check(new)
