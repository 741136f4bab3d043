"""No room in /dev/shm is a NoSpaceError at create, never a SIGBUS later.

Each run is a process in a private mount namespace whose /dev/shm is a real 16 MiB tmpfs
(``tests/multiprocess/no_space_workers.py``); it needs ``unshare`` and root, or user
namespaces, and is skipped without them. A segment sized with ``ftruncate`` alone is sparse:
there, the too-big pool's create was killed by SIGBUS, and so was a pool that fit once
another file filled the tmpfs (in ``get_new_blocks``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.long]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TMPFS_BYTES = 16 << 20
SIBLINGS = ["block_tables", "kv_store", "channel", "stats", "publisher", "doorbell"]


def _in_small_shm(*argv: str) -> subprocess.CompletedProcess:
    script = (f"mount -t tmpfs -o size={TMPFS_BYTES} tmpfs /dev/shm && "
              f'exec "$0" "$@"')
    env = dict(os.environ, PYTHONPATH=ROOT)
    # Without root, a user namespace (where this user is root) may mount it.
    namespaces = ["-m"] if os.geteuid() == 0 else ["-U", "-r", "-m"]
    return subprocess.run(["unshare", *namespaces, "--propagation", "private", "sh", "-c",
                           script, *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)


@pytest.fixture(scope="module")
def small_shm():
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) to make a private /dev/shm")
    probe = _in_small_shm("true")
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a private tmpfs on /dev/shm: {probe.stderr.strip()}")


def _assert_nothing_left(report: dict, label: str) -> None:
    assert "error" in report, f"{label}: {report}"
    assert re.search(r"no room in /dev/shm for [\d,]+ bytes \([\d,]+ bytes free of "
                     f"{TMPFS_BYTES:,}", report["error"]), f"{label}: {report['error']}"
    assert report["after"] == report["before"], label  # no segment, file or descriptor


def test_no_room_is_an_error_at_create_not_a_sigbus(small_shm, kernel):
    """A pool too big for /dev/shm fails to create, naming the size and the free space,
    leaving nothing; a pool that fits keeps serving once /dev/shm is full; every sibling
    made on a full /dev/shm fails the same way, and so does a pool whose segment fits but
    whose semaphore does not; three worker processes serving on one pool while /dev/shm
    fills all go on serving and exit 0."""
    run = _in_small_shm(sys.executable, "-m", "tests.multiprocess.no_space_workers", kernel)
    assert run.returncode == 0, f"exit {run.returncode} (-7/135: SIGBUS)\n{run.stderr}"
    out = json.loads(run.stdout)
    _assert_nothing_left(out["too_big"], "too big a pool")
    assert out["too_big"]["error"].startswith("pool /shmkv-big-v")
    assert out["too_big"]["before"]["shm"] == []
    assert out["filled"] > 0 and out["events"] > 0 and out["events_after"] > 0
    for sibling in SIBLINGS:
        _assert_nothing_left(out[sibling], sibling)
        assert "bytes (0 bytes free" in out[sibling]["error"], sibling
    _assert_nothing_left(out["semaphore"], "a pool whose semaphore has no room")
    assert out["semaphore"]["error"].startswith("the pool's semaphore /shmkv-tight-v")
    three = out["three_workers"]
    assert three["filled"] > 0
    assert three["exitcodes"] == [0, 0, 0], three  # -7: SIGBUS
    assert three["rounds_after_fill"] == [20, 20, 20], three
    assert out["end"] == []
