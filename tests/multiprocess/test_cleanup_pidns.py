"""``shmkv cleanup`` across pid namespaces (containers sharing the node's /dev/shm): a pid
recorded by a process of another pid namespace means nothing here, so cleanup keeps what such
a process may still be using. Each test starts real processes in a new pid namespace with
``unshare --pid --fork --mount-proc`` (root only; skipped, saying why, where it cannot)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shmkv.pool import layout as L
from tests.conftest import unique_pool_name

pytestmark = pytest.mark.multiprocess
ROOT = Path(__file__).resolve().parents[2]
UNSHARE = ["unshare", "--pid", "--fork", "--mount-proc"]


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT))


@pytest.fixture(scope="module")
def unshare():
    if os.geteuid() != 0:
        pytest.skip("a new pid namespace (unshare --pid) needs root")
    try:
        out = subprocess.run([*UNSHARE, "true"], capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        pytest.skip("no unshare(1) on this machine")
    if out.returncode != 0:
        pytest.skip(f"unshare --pid --fork --mount-proc fails here: {out.stderr.strip()}")
    return UNSHARE


@pytest.fixture
def name():
    n = unique_pool_name("ns")
    yield n
    for entry in os.listdir("/dev/shm"):
        if n in entry:
            try:
                os.unlink(f"/dev/shm/{entry}")
            except FileNotFoundError:
                pass


# A process that makes something, says so by making the file argv[2], then waits (at most
# a minute) for the file argv[3] before it lets go of it and exits.
_HOLDER = """
import os, sys, time
name, ready, go, what = sys.argv[1:5]
if what == "creating":  # a pool whose creator is at work on it
    from shmkv.pool.block_pool import BlockPool
    def slow(self):
        open(ready, "w").close()
        deadline = time.monotonic() + 60
        while not os.path.exists(go) and time.monotonic() < deadline:
            time.sleep(0.02)
        raise SystemExit(0)  # the test is over: give up creating it
    BlockPool._initialize = slow
    BlockPool.create(name, 64)
if what == "attached":  # a pool one live process holds
    from shmkv.pool.block_pool import BlockPool
    pool = BlockPool.create(name, 64)
if what == "channel":  # a channel of no pool
    from shmkv.messages import Channel
    channel = Channel.create(name)
open(ready, "w").close()
deadline = time.monotonic() + 60
while not os.path.exists(go) and time.monotonic() < deadline:
    time.sleep(0.02)
"""


def _hold(tmp_path, prefix: list[str], name: str, what: str):
    ready, go = tmp_path / f"{what}.ready", tmp_path / f"{what}.go"
    p = subprocess.Popen([*prefix, sys.executable, "-c", _HOLDER, name, str(ready), str(go),
                          what], env=_env(), cwd=ROOT)
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert p.poll() is None, f"the holder exited with {p.returncode}"
        assert time.monotonic() < deadline, "the holder did not get ready"
        time.sleep(0.02)
    return p, go


def _release(p, go) -> None:
    go.touch()
    assert p.wait(60) == 0


def _cleanup(prefix: list[str], name: str, *args: str) -> str:
    out = subprocess.run([*prefix, sys.executable, "-m", "shmkv.cli", "cleanup", "--prefix",
                          name, *args], capture_output=True, text=True, env=_env(), cwd=ROOT,
                         timeout=120)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stdout + out.stderr
    return out.stdout


def test_a_pool_being_created_in_another_pid_namespace_stays(tmp_path, unshare, name):
    # The creator runs here; cleanup runs in a container (its own pid namespace), where the
    # creator's pid names no process.
    p, go = _hold(tmp_path, [], name, "creating")
    try:
        out = _cleanup(unshare, name)
        entry = L.segment_name(name)[1:]
        assert os.path.exists(f"/dev/shm/{entry}"), out
        assert f"kept pool {name}: being created by pid {p.pid}" in out, out
    finally:
        _release(p, go)


def test_a_pool_held_in_another_pid_namespace_without_its_liveness_file_stays(
        tmp_path, unshare, name):
    entry = L.segment_name(name)[1:]
    p, go = _hold(tmp_path, unshare, name, "attached")
    try:
        os.unlink(f"/dev/shm/{entry}.alive")  # the liveness file goes missing
        out = _cleanup([], name)
        assert os.path.exists(f"/dev/shm/{entry}"), out
        assert f"kept pool {name}: 1 live process(es) attached" in out, out
    finally:
        _release(p, go)


def test_a_channel_made_in_another_pid_namespace_stays(tmp_path, unshare, name):
    p, go = _hold(tmp_path, unshare, name, "channel")
    try:
        channels = [e for e in os.listdir("/dev/shm") if e.startswith("shmkv_ch-" + name)]
        assert len(channels) == 1
        out = _cleanup([], name)
        assert os.path.exists(f"/dev/shm/{channels[0]}"), out
        assert "is of another pid namespace" in out, out
    finally:
        _release(p, go)
