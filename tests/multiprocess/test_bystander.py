"""The test suite on a node that serves: the tests that create, list and clean up shmkv
objects leave the node's other pools byte for byte as they were.

Three pools of names no test uses stand by, as an operator's would: one made by
``shmkv create`` (meant to stay, idle), one whose creator exited without removing it (an
orphan: an unscoped ``shmkv cleanup`` would remove it), and one a live process holds. The
cleanup tests then run in a pytest of their own; afterwards every file of the three is
still there, the same inode with the same bytes."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from shmkv import BlockPool
from shmkv.pool import siblings
from tests.multiprocess import cleanup_workers as workers
from tests.multiprocess.conftest import join_processes

pytestmark = [pytest.mark.multiprocess, pytest.mark.long]
ROOT = Path(__file__).resolve().parents[2]

# The tests that create, list or clean up objects by what /dev/shm holds (`shmkv cleanup`,
# `shmkv ls`, `shmkv unlink`, siblings.plan/remove); `shmkv run`'s are left out for their
# length (they clean up with the same scoped command).
CLEANUP_TESTS = [
    "tests/unit/test_siblings.py",
    "tests/multiprocess/test_cleanup.py",
    "tests/multiprocess/test_cli.py::test_cleanup_removes_only_pools_nobody_lives_in",
    "tests/multiprocess/test_cli_commands.py::test_ls_lists_pools_with_processes_and_their_siblings",
    "tests/multiprocess/test_cli_commands.py::"
    "test_unlink_removes_the_siblings_and_cleanup_the_orphaned_ones",
    "tests/multiprocess/test_sglang_store_shared.py::"
    "test_the_store_stays_once_every_process_is_gone_until_removed_on_purpose",
    "tests/multiprocess/test_sglang_store_shared.py::"
    "test_a_store_whose_maker_died_before_it_was_complete_is_an_orphan",
]


def _files(names: list[str]) -> dict[str, tuple[int, str]]:
    """(inode, sha256 of the bytes) of every /dev/shm entry of the pools ``names``."""
    out = {}
    for entry in sorted(os.listdir("/dev/shm")):
        if any(name in entry for name in names):
            path = f"/dev/shm/{entry}"
            out[entry] = (os.lstat(path).st_ino,
                          hashlib.sha256(Path(path).read_bytes()).hexdigest())
    return out


def _create_and_leave(name: str) -> None:
    """A creator that exits without removing its pool (an orphan once it is gone)."""
    BlockPool.create(name, 16, label="bystander").close()


@pytest.mark.timeout(900)
def test_the_cleanup_tests_leave_other_pools_byte_identical(spawn_ctx):
    mark = uuid.uuid4().hex[:10]
    stays, orphan, live = (f"bystander{mark}-{what}" for what in ("stays", "orphan", "live"))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    holder = None
    stop = spawn_ctx.Event()
    try:
        made = subprocess.run([sys.executable, "-m", "shmkv.cli", "create", stays, "--blocks",
                               "32"], capture_output=True, text=True, env=env, timeout=120)
        assert made.returncode == 0, made.stderr
        maker = spawn_ctx.Process(target=_create_and_leave, args=(orphan,))
        maker.start()
        assert join_processes([maker], 60) == [0]
        pool = BlockPool.create(live, 16, label="bystander")
        pool.close()  # made by this process (alive), held by the one below
        ready = spawn_ctx.Event()
        holder = spawn_ctx.Process(target=workers.attach_and_wait, args=(live, ready, stop))
        holder.start()
        assert ready.wait(60), "the holder did not attach"
        # What an unscoped cleanup would do to them: the orphan would go.
        verdicts = {v.name: v for v in siblings.plan() if v.kind == "pool"
                    and v.name in (stays, orphan, live)}
        assert verdicts[orphan].remove and verdicts[orphan].lifetime == "orphan"
        assert not verdicts[stays].remove and verdicts[stays].idle
        assert not verdicts[live].remove
        before = _files([stays, orphan, live])
        assert len(before) == 9, before  # segment, lock and liveness file of each
        # -m "": every marker (most of these tests are `long`, left out by default)
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                              "-m", "", "-k", "not run_stopped_half_way", *CLEANUP_TESTS],
                             capture_output=True, text=True, env=env, cwd=ROOT, timeout=840)
        assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
        assert " passed" in run.stdout and " failed" not in run.stdout, run.stdout[-2000:]
        assert _files([stays, orphan, live]) == before
    finally:
        stop.set()
        if holder is not None:
            assert join_processes([holder], 60) == [0]
        for name in (stays, orphan, live):
            BlockPool.unlink(name)
        assert not _files([stays, orphan, live])
