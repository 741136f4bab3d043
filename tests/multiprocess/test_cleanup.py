"""``shmkv cleanup`` with real processes: nothing of a dead run or a dead pool is left in
/dev/shm, nothing live and no pool meant to stay is removed, and what is not ours is listed
and left alone. Every name is unique, and every cleanup is scoped to the test's names
(``--prefix``): the machine's other pools are never touched. Every join has a timeout; every
exit code is checked."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from shmkv import BlockPool
from shmkv.messages import Channel, channel_segment_name, create_doorbell, unlink_doorbell
from shmkv.pool import layout as L
from shmkv.pool import siblings
from tests.conftest import unique_pool_name
from tests.multiprocess import cleanup_workers as workers
from tests.multiprocess.conftest import join_processes

pytestmark = [pytest.mark.multiprocess, pytest.mark.long]
ROOT = Path(__file__).resolve().parents[2]
FOREIGN_UID = 4242


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT))


def shmkv(*args: str) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "shmkv.cli", *args], capture_output=True,
                         text=True, env=_env(), timeout=120)
    assert "Traceback" not in out.stderr, out.stderr
    return out


def _objects(name: str) -> list[str]:
    return sorted(e for e in os.listdir("/dev/shm") if name in e)


def _remove_all(name: str) -> None:
    """The test's own safety net: whatever is left of ``name`` goes, by hand."""
    for entry in _objects(name):
        try:
            os.unlink(f"/dev/shm/{entry}")
        except FileNotFoundError:
            pass


@pytest.fixture
def name():
    n = unique_pool_name("cl")
    yield n
    _remove_all(n)


def _start(ctx, target, *args, **kwargs):
    ready, stop = ctx.Event(), ctx.Event()
    p = ctx.Process(target=target, args=(*args, ready, stop), kwargs=kwargs)
    p.start()
    assert ready.wait(120), f"{target.__name__} did not get ready"
    return p, stop


def _kill(p) -> None:
    p.kill()
    assert join_processes([p], 30) == [-signal.SIGKILL]


def _siblings(name: str) -> list[str]:
    return [e for e in _objects(name) if not e.startswith(f"shmkv-{name}-v")
            and e != f"sem.shmkv-{name}-v{L.LAYOUT_VERSION}.lock"]


def test_a_dead_pools_siblings_go_with_it(spawn_ctx, name):
    """SIGKILL the process that made a pool and every kind of sibling: `ls` marks them
    orphans, `cleanup --dry-run` names each, `cleanup` leaves nothing."""
    p, _ = _start(spawn_ctx, workers.make_pool_and_siblings, name)
    made = _objects(name)
    kinds = {e.split("-")[0] for e in made}
    assert {"shmkv", "shmkv_ch", "shmkv_bt", "shmkv_stats", "sem.shmkv_bell",
            "sem.shmkv"} <= kinds, made
    live = shmkv("cleanup", "--dry-run", "--prefix", name)
    assert not [line for line in live.stdout.splitlines()
                if line.startswith("would remove") and name in line], live.stdout
    _kill(p)
    ls = shmkv("ls", "--all", "--prefix", name)
    rows = [line for line in ls.stdout.splitlines() if name in line]
    assert rows and all("ORPHAN" in line for line in rows), ls.stdout
    dry = shmkv("cleanup", "--dry-run", "--prefix", name)
    assert f"would remove pool {name}: no live process attached" in dry.stdout
    for entry in made:
        assert entry.removeprefix("sem.") in dry.stdout, (entry, dry.stdout)
    assert _objects(name) == made  # a dry run changes nothing
    out = shmkv("cleanup", "--prefix", name)
    assert out.returncode == 0
    assert f"removed pool {name}" in out.stdout
    assert "goes with its channel(s)" in out.stdout and "is removed too" in out.stdout
    assert _objects(name) == []


def _memory(name: str) -> int:
    """The /dev/shm memory (allocated bytes) of every object whose name holds ``name``."""
    return sum(os.lstat(f"/dev/shm/{e}").st_blocks * 512 for e in _objects(name))


def _human(n: int) -> str:
    return siblings.human_bytes(n)


def test_a_pool_made_by_shmkv_create_stays_until_removed_by_name(name):
    """`shmkv create` makes a pool meant to stay: `ls` says so and why, `cleanup` keeps it
    byte for byte although no process holds it, `cleanup --include-idle` or `unlink NAME`
    removes it, each saying how much of /dev/shm it frees."""
    import hashlib

    def image() -> dict[str, str]:
        return {e: hashlib.sha256(Path(f"/dev/shm/{e}").read_bytes()).hexdigest()
                for e in _objects(name)}

    made = shmkv("create", name, "--blocks", "64")
    assert made.returncode == 0 and "`shmkv cleanup` keeps it" in made.stdout, made.stdout
    ls = shmkv("ls", "--prefix", name)
    line = next(line for line in ls.stdout.splitlines() if line.startswith("pool"))
    assert " stays " in line and "stays (made by shmkv create); idle" in line, ls.stdout
    assert "1 pool(s) meant to stay" in ls.stdout
    before = image()
    assert len(before) == 3  # segment, lock, liveness file
    out = shmkv("cleanup", "--prefix", name)
    assert out.returncode == 0 and image() == before, out.stdout
    memory = _memory(name)
    assert (f"kept pool {name}: stays (made by shmkv create); idle: no live process attached"
            in out.stdout), out.stdout
    assert f"`shmkv unlink {name}` or `shmkv cleanup --include-idle` removes it " \
           f"({_human(memory)} of /dev/shm)" in out.stdout
    assert "0 object(s) removed (0 B of /dev/shm freed)" in out.stdout
    dry = shmkv("cleanup", "--include-idle", "--dry-run", "--prefix", name)
    assert f"would remove pool {name}: stays (made by shmkv create); idle:" in dry.stdout
    assert image() == before
    out = shmkv("cleanup", "--include-idle", "--prefix", name)
    assert f"removed pool {name}: stays (made by shmkv create); idle:" in out.stdout
    assert f"3 object(s) removed ({_human(memory)} of /dev/shm freed)" in out.stdout
    assert _objects(name) == []
    assert shmkv("create", name, "--blocks", "64").returncode == 0
    memory = _memory(name)
    out = shmkv("unlink", name)
    assert out.returncode == 0
    assert out.stdout.strip() == f"removed pool {name}: {_human(memory)} of /dev/shm freed"
    assert _objects(name) == []


def test_bad_scopes_are_refused_and_change_nothing(name):
    """`cleanup --prefix` and `ls --prefix` with an empty or odd prefix: exit 2, one line
    naming the argument and the rule, nothing removed."""
    BlockPool.create(name, 8).close()  # an orphan-to-be (its creator, this process, lives)
    before = _objects(name)
    for bad in ("", "a/b", "*"):
        for cmd in (("cleanup",), ("cleanup", "--include-idle"), ("ls",)):
            out = shmkv(*cmd, "--prefix", bad)
            assert out.returncode == 2, (cmd, bad, out.stdout)
            assert f"--prefix {bad!r}:" in out.stderr and "leave --prefix out" in out.stderr
    assert _objects(name) == before


def test_siblings_that_outlived_their_pool_are_removed(spawn_ctx, name):
    """The pool was unlinked by hand (or re-created under its name) after its processes
    died: its siblings are removed, the new pool of that name stays."""
    pytest.importorskip("torch")  # the KV store among the siblings
    p, _ = _start(spawn_ctx, workers.make_pool_and_siblings, name, with_kv=True)
    _kill(p)
    assert BlockPool.unlink(name)
    left = _siblings(name)
    assert any(e.startswith("shmkv_kv-") for e in left) and len(left) >= 7, left
    new = BlockPool.create(name, 8, label="new")  # another pool of that name, alive
    try:
        out = shmkv("cleanup", "--prefix", name)
        assert "a pool of that name now is another one" in out.stdout, out.stdout
        assert f"kept pool {name}: 1 live process(es) attached" in out.stdout
        assert _siblings(name) == []
        assert new.get_num_free_blocks() == 7
    finally:
        new.close()
        BlockPool.unlink(name)


def test_a_live_pools_siblings_stay(spawn_ctx, name):
    """The maker of the siblings is dead but another process still uses the pool: all of
    it stays, each with the reason. Once that process is gone, all of it goes."""
    maker, _ = _start(spawn_ctx, workers.make_pool_and_siblings, name)
    user, stop = _start(spawn_ctx, workers.attach_and_wait, name)
    try:
        _kill(maker)
        made = _objects(name)
        out = shmkv("cleanup", "--prefix", name)
        assert _objects(name) == made, out.stdout
        assert f"kept pool {name}: 1 live process(es) attached (pid {user.pid})" in out.stdout
        assert f"its pool {name} stays (1 live process(es) attached" in out.stdout
        assert "its channel(s)" in out.stdout
    finally:
        stop.set()
        assert join_processes([user], 60) == [0]
    out = shmkv("cleanup", "--prefix", name)
    assert _objects(name) == [], out.stdout


def test_foreign_and_corrupt_objects_are_listed_and_left_alone(spawn_ctx, name):
    """A channel planted by another user (whose recorded owner is dead, so it would go if it
    were ours), a foreign doorbell and pool, a torn header and a short segment: each is
    listed with the reason and left where it is."""
    dead = spawn_ctx.Process(target=workers.serve_forever)
    dead.start()
    dead_pid = dead.pid
    _kill(dead)
    planted = f"{name}-planted"
    Channel.create(planted, 4096).close()
    path = f"/dev/shm{channel_segment_name(planted)}"
    with open(path, "r+b") as f:  # its owner record: a dead creator, no pool
        rec = np.frombuffer(f.read(512), L.OWNER_DTYPE, 1, L.CHANNEL_OWNER_OFFSET).copy()
        rec["creator_pid"], rec["creator_start_ticks"] = dead_pid, 1
        f.seek(L.CHANNEL_OWNER_OFFSET)
        f.write(rec.tobytes())
    mine = f"{name}-mine"  # the same, but ours: removed
    Channel.create(mine, 4096).close()
    with open(f"/dev/shm{channel_segment_name(mine)}", "r+b") as f:
        f.seek(L.CHANNEL_OWNER_OFFSET)
        f.write(rec.tobytes())
    os.chown(path, FOREIGN_UID, FOREIGN_UID)
    os.chown(f"/dev/shm/sem.shmkv_bell-{planted}", FOREIGN_UID, FOREIGN_UID)
    bell = create_doorbell(f"{name}-lone")
    os.chown(f"/dev/shm/sem.{bell[1:]}", FOREIGN_UID, FOREIGN_UID)
    BlockPool.create(f"{name}-theirs", 8).close()
    os.chown(f"/dev/shm{L.segment_name(f'{name}-theirs')}", FOREIGN_UID, FOREIGN_UID)
    with open(f"/dev/shm/shmkv_bt-{name}-torn-v{L.BT_LAYOUT_VERSION}", "wb") as f:
        f.write(b"\xab" * 512)
    with open(f"/dev/shm/shmkv_kv-{name}-short-v{L.KV_LAYOUT_VERSION}", "wb") as f:
        f.write(b"\0" * 10)
    try:
        before = set(_objects(name))
        out = shmkv("cleanup", "--prefix", name)
        lines = out.stdout.splitlines()

        def reason(needle: str) -> str:
            return next(line for line in lines if needle in line)

        assert f"removed {f'/dev/shm{channel_segment_name(mine)}'}" in out.stdout
        assert f"its creator pid {dead_pid} is dead" in reason(channel_segment_name(mine))
        gone = {channel_segment_name(mine)[1:], f"sem.shmkv_bell-{mine}"}
        assert set(_objects(name)) == before - gone, out.stdout
        for needle in (channel_segment_name(planted), f"shmkv_bell-{planted}", bell[1:],
                       f" pool {name}-theirs: "):
            line = reason(needle)
            assert line.startswith("kept") and f"owned by uid {FOREIGN_UID}" in line, line
            assert "refused" in line
        assert "corrupt header" in reason(f"{name}-torn")
        assert "too small" in reason(f"{name}-short")
    finally:
        Channel.unlink(planted)
        unlink_doorbell(bell)
        BlockPool.unlink(f"{name}-theirs")


def _workers(pid: int) -> list[int]:
    """The schedulers and ranks of the run ``pid``: the children of its forkserver."""
    def children(p: int) -> list[int]:
        try:
            return [int(k) for k in open(f"/proc/{p}/task/{p}/children").read().split()]
        except FileNotFoundError:
            return []

    out = []
    for kid in children(pid):
        try:
            cmdline = open(f"/proc/{kid}/cmdline", "rb").read()
        except FileNotFoundError:
            continue
        if b"forkserver" in cmdline:
            out += children(kid)
    return out


@pytest.mark.parametrize("how", ["SIGTERM", "SIGTERM to the group",
                                 "SIGTERM to a child, then the group", "SIGKILL"])
def test_a_run_stopped_half_way_leaves_nothing_after_cleanup(tmp_path, how):
    """`shmkv run` (2 schedulers, 2 ranks) stopped half way: by SIGTERM to the front end, or
    to every process of the run at once (a CI time limit), it removes everything itself and
    exits 143; by SIGKILL `shmkv cleanup` does. Nothing of the run is left in /dev/shm."""
    pytest.importorskip("torch")
    conversations = "60" if how == "SIGTERM to a child, then the group" else "6"
    proc = subprocess.Popen([sys.executable, "-m", "shmkv.cli", "run", "--schedulers", "2",
                             "--conversations", conversations, "--blocks", "256", "--progress",
                             "--plot", ""], stdout=(tmp_path / "out.txt").open("wb"),
                            stderr=subprocess.PIPE, env=_env(), cwd=tmp_path,
                            start_new_session=True)
    mark = f"run{proc.pid}-"
    try:
        seen, deadline = b"", time.monotonic() + 240
        while b"requests" not in seen and time.monotonic() < deadline:
            chunk = proc.stderr.read1(4096)
            if not chunk:
                break
            seen += chunk
        assert b"requests" in seen, seen.decode(errors="replace")
        assert _objects(mark)
        if how == "SIGTERM to the group":
            os.killpg(proc.pid, signal.SIGTERM)
        elif how == "SIGTERM to a child, then the group":
            # The group's signal reaching one child well before the front end handles its
            # own: that child's death is part of the stop, not a problem.
            kids = _workers(proc.pid)
            assert kids, "no scheduler or rank process found"
            os.kill(kids[0], signal.SIGTERM)
            time.sleep(0.3)
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.send_signal(getattr(signal, how))
        if how == "SIGTERM":  # more signals during the stop: it still finishes it
            time.sleep(0.3)
            proc.send_signal(signal.SIGINT)
            proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
        if how.startswith("SIGTERM"):
            err = proc.stderr.read().decode(errors="replace")
            assert code == 143, (code, err, (tmp_path / "out.txt").read_text())
            assert _objects(mark) == [], err  # it removed everything itself
            if how != "SIGTERM to a child, then the group":  # (there, the front end kills
                # the dead child's partner, scheduler or rank, as after any death)
                assert "dead without close()" not in err, err  # every scheduler detached
            if how != "SIGTERM":  # its children stopped cleanly too
                out = (tmp_path / "out.txt").read_text()
                # each exits 143, or 0 when its scheduler's Shutdown came first; one the
                # signal reached before the front end had handled its own is named too
                assert re.search(r"(scheduler|rank)-\d\b.* stopped by SIGTERM too", out), out
                assert "problem: scheduler" not in out and "problem: rank" not in out, out
        else:
            assert code == -signal.SIGKILL
            deadline = time.monotonic() + 30  # its children notice and end
            while time.monotonic() < deadline and "would remove pool" not in shmkv(
                    "cleanup", "--dry-run", "--prefix", mark).stdout:
                time.sleep(0.5)
            assert _objects(mark)
        out = shmkv("cleanup", "--prefix", mark)
        assert out.returncode == 0
        assert _objects(mark) == [], out.stdout
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        proc.stderr.close()
        _remove_all(mark)


def test_sigterm_to_pytest_runs_the_finalizers(tmp_path):
    """A test run stopped by SIGTERM (a CI time limit) runs its fixtures' finalizers: the
    pool a fixture made is unlinked."""
    pool = unique_pool_name("pt")
    (tmp_path / "test_stopped.py").write_text(f'''
import os, time, pytest
from shmkv import BlockPool

@pytest.fixture
def made():
    pool = BlockPool.create({pool!r}, 8)
    yield pool
    pool.close()
    BlockPool.unlink({pool!r})
    open("finalized", "w").close()

def test_waits(made):
    open("ready", "w").close()
    time.sleep(120)
''')
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "tests.sigterm",
                             "-p", "no:cacheprovider", "test_stopped.py"], cwd=tmp_path,
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "ready").exists() and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read().decode()
            time.sleep(0.05)
        assert os.path.exists(f"/dev/shm{L.segment_name(pool)}")
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
        output = proc.stdout.read().decode()
        assert code == 2, output  # pytest: interrupted
        assert "SIGTERM" in output
        assert (tmp_path / "finalized").exists(), output
        assert _objects(pool) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        proc.stdout.close()
        BlockPool.unlink(pool)


def test_a_poisoned_pool_with_a_live_process_stays(spawn_ctx, name):
    """Issue 15, item 6 (verified here, fixed by the cleanup rewrite): a POISONED pool whose
    creator is dead but that a live process still uses (``shmkv recover`` could fix it) is
    kept with its reason, not counted as an orphan; once that process is gone it goes."""
    import struct

    maker, _ = _start(spawn_ctx, workers.make_pool_and_siblings, name)
    user, stop = _start(spawn_ctx, workers.attach_and_wait, name)
    try:
        _kill(maker)
        state_at = L.HEADER_DTYPE.fields["state"][1]
        with open(f"/dev/shm{L.segment_name(name)}", "r+b") as f:
            f.seek(state_at)
            f.write(struct.pack("<I", L.STATE_POISONED))
        made = _objects(name)
        out = shmkv("cleanup", "--prefix", name)
        assert _objects(name) == made, out.stdout
        assert f"kept pool {name}: 1 live process(es) attached (pid {user.pid})" in out.stdout
    finally:
        stop.set()
        assert join_processes([user], 60) == [0]
    out = shmkv("cleanup", "--prefix", name)
    assert _objects(name) == [], out.stdout


def _plant_data_region(name: str) -> list[str]:
    """Two ranks' offload data region files, named as vLLM's CPU worker names them for a
    shmkv pool (``shmkv.vllm``; the worker itself needs a GPU)."""
    paths = [f"/dev/shm/{L.OFFLOAD_DATA_REGION_PREFIX}{name}.mmap{suffix}"
             for suffix in ("", ".1")]
    for path in paths:
        with open(path, "wb") as f:
            f.truncate(4096)
    return paths


def test_unlink_removes_everything_named_after_the_pool(name):
    """`shmkv unlink` takes the pool's publisher position, stats and offload data region
    with it; a pool whose name only starts the same way keeps its own."""
    from shmkv.stats import PoolStats

    other = name + "x"
    for n in (name, other):
        pool = BlockPool.create(n, 8, label="maker")
        PoolStats.open(pool).close()
        pool.close()
    regions = _plant_data_region(name)
    others = _plant_data_region(other)
    try:
        out = shmkv("unlink", name)
        assert out.returncode == 0, out.stderr
        assert f"removed pool {name} (and its stats, offload data region)" in out.stdout
        assert not any(os.path.exists(p) for p in regions)
        assert _objects(name) == sorted(e for e in _objects(name) if other in e)
        assert all(os.path.exists(p) for p in others)
        again = shmkv("unlink", name)
        assert again.returncode == 2 and "no pool named" in again.stderr
    finally:
        BlockPool.unlink(other)
        _remove_all(other)


def test_unlink_removes_what_an_earlier_shmkv_named_after_the_pool(name):
    """After an upgrade, `shmkv unlink` also takes the earlier versions of the siblings
    named after the pool (a vLLM tier table v2 and its replica lock file, an SGLang page
    store v1), counted in the memory freed; a link, FIFO, directory or another user's file
    at such a name is left alone."""
    old = {L.sibling_segment_name("offload", name, 2): 8192,
           L.sibling_segment_name("offload", name, 2) + L.OFFLOAD_REPLICAS_SUFFIX: 4096,
           L.sibling_segment_name("sglang", name, 1): 4096}
    BlockPool.create(name, 8).close()
    for entry, size in old.items():
        fd = os.open(f"/dev/shm{entry}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        os.write(fd, b"\1" * size)  # pages of /dev/shm, as the old shmkv's files took
        os.close(fd)
    memory = _memory(name)
    out = shmkv("unlink", name)
    assert out.returncode == 0, out.stderr
    assert ("offload tier table v2, offload replica locks v2, SGLang page store v1"
            in out.stdout), out.stdout
    assert f"{_human(memory)} of /dev/shm freed" in out.stdout, (out.stdout, memory)
    assert _objects(name) == [], out.stdout
    # not regular files of this user: left alone
    table = f"/dev/shm{L.sibling_segment_name('offload', name, 2)}"
    store = f"/dev/shm{L.sibling_segment_name('sglang', name, 1)}"
    pub = f"/dev/shm{L.sibling_segment_name('pub', name, 2)}"
    stats = f"/dev/shm{L.sibling_segment_name('stats', name, 1)}"
    target = f"/dev/shm/{name}-target"
    with open(target, "wb") as f:
        f.write(b"\1")
    os.mkfifo(table, 0o600)
    os.mkdir(store, 0o700)
    os.symlink(target, pub)
    planted = [table, store, pub]
    if os.geteuid() == 0:
        with open(stats, "wb") as f:
            f.write(b"\1")
        os.chown(stats, FOREIGN_UID, FOREIGN_UID)
        planted.append(stats)
    try:
        BlockPool.create(name, 8).close()
        out = shmkv("unlink", name)
        assert out.returncode == 0, out.stderr
        assert f"removed pool {name}: " in out.stdout, out.stdout
        assert all(os.path.lexists(p) for p in planted + [target]), out.stdout
    finally:
        os.rmdir(store)
        _remove_all(name)


def _run(code: str) -> None:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=_env(), timeout=120)
    assert out.returncode == 0, out.stderr


def test_a_prefix_takes_a_pools_siblings_named_after_a_run(name):
    """`--prefix` matches an object by its own name or its pool's: `cleanup --prefix POOL`
    takes the pool's orphaned channel (named after the serving run) and its doorbell, and
    `ls --prefix RUN` lists them; a sibling in scope by its own name stays while its pool,
    out of the scope, is not removed with it."""
    pool, run = f"{name}-p", f"{name}-run"
    _run(f"from shmkv import BlockPool\nfrom shmkv.messages import Channel\n"
         f"p = BlockPool.create({pool!r}, 8)\nChannel.create({run + '-s0-in'!r}, pool={pool!r})\n"
         "p.close()")
    assert any(e.startswith(f"shmkv_ch-{run}") for e in _objects(name))
    ls = shmkv("ls", "--prefix", run)
    listed = [line.split()[:2] for line in ls.stdout.splitlines()]
    assert ls.returncode == 0 and ["channel", f"{run}-s0-in"] in listed, ls.stdout
    assert ["doorbell", f"shmkv_bell-{run}-s0-in"] in listed, ls.stdout
    ls = shmkv("ls", "--prefix", pool)
    assert ["channel", f"{run}-s0-in"] in [line.split()[:2] for line in ls.stdout.splitlines()]
    out = shmkv("cleanup", "--prefix", run)  # its pool is out of this scope: the channel stays
    assert out.returncode == 0 and "\n0 object(s) removed" in "\n" + out.stdout, out.stdout
    assert f"its pool {pool} is to go, but its name does not start with" in out.stdout
    assert any(e.startswith(f"shmkv_ch-{run}") for e in _objects(name))
    out = shmkv("cleanup", "--prefix", pool)
    assert out.returncode == 0, out.stderr
    assert f"removed pool {pool}" in out.stdout and f"ch-{run}-s0-in" in out.stdout
    assert _objects(name) == [], out.stdout


def test_include_idle_with_a_prefix_names_each_staying_pool_it_removes(name):
    for n in (name, f"{name}b"):
        assert shmkv("create", n, "--blocks", "16").returncode == 0
    out = shmkv("cleanup", "--prefix", name, "--include-idle", "--dry-run")
    assert (f"--include-idle with --prefix {name!r} would remove 2 pool(s) meant to stay "
            f"whose name starts with it: {name}, {name}b") in out.stdout, out.stdout
    out = shmkv("cleanup", "--prefix", name, "--include-idle")
    assert f"removed 2 pool(s) meant to stay whose name starts with it: {name}, {name}b" \
        in out.stdout, out.stdout
    assert _objects(name) == []
    help_text = shmkv("cleanup", "--help").stdout
    assert "shmkv unlink NAME" in " ".join(help_text.split())


def test_an_offload_data_region_goes_with_its_pool(name):
    """cleanup keeps a data region while its pool lives and removes it once the pool is
    gone; another user's region is listed and left alone."""
    pool = BlockPool.create(name, 8, label="live")
    regions = _plant_data_region(name)
    try:
        out = shmkv("cleanup", "--prefix", name)
        assert all(os.path.exists(p) for p in regions), out.stdout
        assert f"its pool {name} stays (1 live process(es) attached" in out.stdout
    finally:
        pool.close()
    assert siblings.unlink_pool_files(name)  # the pool alone (BlockPool.unlink takes both)
    dry = shmkv("cleanup", "--dry-run", "--prefix", name)
    assert f"offload data region of pool {name}" in dry.stdout and "its pool" in dry.stdout
    assert all(os.path.exists(p) for p in regions)
    if os.geteuid() == 0:
        os.chown(regions[1], FOREIGN_UID, FOREIGN_UID)
    out = shmkv("cleanup", "--prefix", name)
    assert not os.path.exists(regions[0]), out.stdout
    assert os.path.exists(regions[1]) == (os.geteuid() == 0), out.stdout


@pytest.mark.parametrize("ignores_sigterm", [False, True])
def test_the_partner_of_a_dead_process_is_stopped_by_sigterm_first(tmp_path, monkeypatch,
                                                                    ignores_sigterm):
    """When one of a scheduler / rank pair dies, `shmkv run` stops the other with SIGTERM,
    so it closes its pool handle (exit 143, nothing for a reap), and SIGKILLs it only if it
    is still there after PARTNER_STOP_S. (It was SIGKILLed at once, which, in a stop of the
    whole group by SIGTERM, left a scheduler 'dead without close()'.)"""
    import multiprocessing as mp

    from shmkv import BlockPool
    from shmkv.serve import runner
    from tests.conftest import unique_pool_name
    from tests.multiprocess import cleanup_workers

    monkeypatch.setattr(runner, "PARTNER_STOP_S", 1.0)
    name = unique_pool_name("partner")
    pool = BlockPool.create(name, 16)
    try:
        ctx = mp.get_context("spawn")
        ready = ctx.Event()
        partner = ctx.Process(target=cleanup_workers.attach_and_wait_for_sigterm,
                              args=(name, ignores_sigterm, ready))
        partner.start()
        assert ready.wait(60), "the partner never attached"
        runner.Runner._stop_partners([partner])
        assert not partner.is_alive()
        if ignores_sigterm:
            assert partner.exitcode == -signal.SIGKILL
            assert pool.reap_dead() == 1  # its references needed a reap
        else:
            assert partner.exitcode == 143
            assert pool.reap_dead() == 0  # it closed its handle itself
        assert pool.get_num_free_blocks() == 15
        pool.check_invariants()
    finally:
        pool.close()
        BlockPool.unlink(name)
