"""The pool lock across pid namespaces (containers sharing /dev/shm, ``--ipc=host``): a
live holder is never taken over, whatever a pid means where the waiter runs.

A process in another pid namespace is attached to the pool as its own pids go; the waiter
cannot see them. So every take-over decision rests on an OFD lock on the pool's ``.alive``
file, which the kernel holds for the process wherever it runs: the holder's slot byte, or,
for a process that holds the lock before it has a slot (one attaching to a full table, which
reaps under the lock), its attach mark byte.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import posix_ipc
import pytest

from shmkv import BlockPool, LockTimeoutError
from shmkv.pool import layout as L
from shmkv.pool.lock import decode_holder, lock_name
from tests.conftest import unique_pool_name

pytestmark = [pytest.mark.multiprocess, pytest.mark.long]

_ATTACHER = """
import sys
from shmkv import BlockPool, PoolFullError
try:
    BlockPool.attach(sys.argv[1], kernel=sys.argv[2]).close()
except PoolFullError:
    sys.exit(3)
"""


def _attach_and_wait(name: str, kernel: str, ready, leave) -> None:
    pool = BlockPool.attach(name, kernel=kernel)
    ready.set()
    leave.wait(60)
    pool.close()


def _unused_pid() -> int:
    """A pid that no process of this namespace has (nor had a moment ago)."""
    pid = 300
    while os.path.exists(f"/proc/{pid}") or os.path.exists(f"/proc/{pid + 1}"):
        pid += 7
    return pid + 1


def _in_new_pid_namespace(argv: list[str], pid: int, env: dict) -> subprocess.Popen:
    """Runs argv as process ``pid`` of a new pid namespace (root: unshare, ns_last_pid),
    in a session of its own (the group a SIGCONT goes to)."""
    script = (f"echo {pid - 1} > /proc/sys/kernel/ns_last_pid && "
              + " ".join(f"'{a}'" for a in argv) + "; exit $?")
    return subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", script],
                            env=env, start_new_session=True)


def _namespaces_available() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"],
                           capture_output=True, timeout=30)
    return probe.returncode == 0


needs_pid_namespaces = pytest.mark.skipif(
    not _namespaces_available(), reason="needs root and unshare --pid (new pid namespaces)")


@needs_pid_namespaces
def test_a_slotless_holder_in_another_pid_namespace_is_not_taken_over(kernel, spawn_ctx):
    """The table is full (the creator and a worker); a process in a new pid namespace
    attaches, so it takes the lock without a slot to reap, and is stopped (SIGSTOP, fault
    point) holding it, its pid one that does not exist here. The creator's call waits the
    whole lock_timeout_s and raises LockTimeoutError naming it alive; continued, it finds
    no slot (PoolFullError), and the semaphore is back at 1.
    Before: the waiter took it for dead after one slice ("holder slot -1 (pid ...) died
    holding the lock"), and the semaphore ended at 2."""
    name = unique_pool_name("ns")
    pool = BlockPool.create(name, 16, kernel=kernel, max_processes=2, lock_timeout_s=1.0)
    ready, leave = spawn_ctx.Event(), spawn_ctx.Event()
    worker = spawn_ctx.Process(target=_attach_and_wait, args=(name, kernel, ready, leave))
    worker.start()
    attacher = None
    try:
        assert ready.wait(60)
        pid = _unused_pid()
        env = dict(os.environ, SHMKV_FAULT="attach:3:stop")
        attacher = _in_new_pid_namespace([sys.executable, "-c", _ATTACHER, name, kernel],
                                         pid, env)
        hdr = pool._hdr64
        deadline = time.monotonic() + 30
        while not hdr[L.H_HOLDER] and time.monotonic() < deadline:
            time.sleep(0.005)
        holder = decode_holder(int(hdr[L.H_HOLDER]))
        assert holder is not None and holder[1] == pid, holder  # stopped, holding the lock
        assert not os.path.exists(f"/proc/{pid}")  # its pid means nothing here
        start = time.monotonic()
        with pytest.raises(LockTimeoutError, match="alive"):
            pool.get_new_blocks(1)
        assert time.monotonic() - start >= 0.9
        assert pool.last_repair is None  # nobody took over
        os.killpg(attacher.pid, signal.SIGCONT)
        assert attacher.wait(60) == 3  # PoolFullError: the table is still full
        assert posix_ipc.Semaphore(lock_name(pool._segment.shm_name)).value == 1
        assert len(pool.get_new_blocks(2)) == 2
        leave.set()
        worker.join(60)
        assert worker.exitcode == 0
        fresh = BlockPool.attach(name, kernel=kernel)
        try:
            fresh.check_invariants()
        finally:
            fresh.close()
    finally:
        leave.set()
        if attacher is not None and attacher.poll() is None:
            os.killpg(attacher.pid, signal.SIGKILL)
            attacher.wait(10)
        worker.join(10)
        if worker.is_alive():
            worker.kill()
            worker.join(10)
        pool.close()
        BlockPool.unlink(name)


def _attach_wait_then_allocate(name: str, kernel: str, ready, go) -> None:
    pool = BlockPool.attach(name, kernel=kernel)
    ready.set()
    go.wait(60)
    pool.get_new_blocks(1)  # waits for the lock until it is killed
    pool.close()


def _state(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0]
    except FileNotFoundError:
        return b"gone"


def test_an_attacher_stopped_giving_the_lock_back_is_not_taken_for_a_stuck_lock(kernel,
                                                                                spawn_ctx):
    """An attacher of a full table (no row, so no lock_phase marks) is stopped after it
    cleared its holder word and before its post: the lock stands taken with no holder. A
    waiter of the pool then dies waiting (a dead ACQUIRING mark). The creator, with
    stuck_after_s 0.1 s, must not take the lock for stuck (rule 2): the attacher's hold byte
    says a live process may have the unit. It times out; continued, the attacher posts, and
    the semaphore is back at 1 (a take-over would have left 2).
    Without the hold byte check the creator took over after 0.1 s."""
    name = unique_pool_name("hb")
    pool = BlockPool.create(name, 16, kernel=kernel, max_processes=2, lock_timeout_s=1.0,
                            stuck_after_s=0.1)
    sem = posix_ipc.Semaphore(lock_name(pool._segment.shm_name))
    ready, go = spawn_ctx.Event(), spawn_ctx.Event()
    waiter = spawn_ctx.Process(target=_attach_wait_then_allocate, args=(name, kernel, ready, go))
    waiter.start()
    attacher = None
    try:
        assert ready.wait(60)
        for n in range(1, 20):  # the store before which it has cleared `holder`, not posted
            seq = int(pool._hdr64[L.H_LOCK_SEQ])
            attacher = subprocess.Popen([sys.executable, "-c", _ATTACHER, name, kernel],
                                        env=dict(os.environ, SHMKV_FAULT=f"attach:{n}:stop"))
            deadline = time.monotonic() + 30
            while _state(attacher.pid) not in (b"T", b"Z", b"gone") and attacher.poll() is None:
                assert time.monotonic() < deadline
                time.sleep(0.005)
            if attacher.poll() is not None:
                pytest.fail(f"no store of the attach hold leaves the window (exit "
                            f"{attacher.returncode} at store {n})")
            # Its hold counted (lock_seq), its holder word cleared, the semaphore not posted.
            if (pool._hdr64[L.H_LOCK_SEQ] == seq + 1 and not pool._hdr64[L.H_HOLDER]
                    and sem.value == 0):
                break
            os.kill(attacher.pid, signal.SIGCONT)
            assert attacher.wait(60) == 3
        go.set()
        time.sleep(0.3)  # the waiter marks itself ACQUIRING and waits
        os.kill(waiter.pid, signal.SIGKILL)
        waiter.join(60)
        assert waiter.exitcode == -signal.SIGKILL
        with pytest.raises(LockTimeoutError, match="no holder is recorded"):
            pool.get_new_blocks(1)
        assert pool.last_repair is None  # nobody took over
        os.kill(attacher.pid, signal.SIGCONT)
        assert attacher.wait(60) == 3
        assert sem.value == 1
        assert len(pool.get_new_blocks(2)) == 2
        fresh = BlockPool.attach(name, kernel=kernel)  # the dead waiter is reaped for it
        try:
            fresh.check_invariants()
        finally:
            fresh.close()
    finally:
        if attacher is not None and attacher.poll() is None:
            attacher.kill()
            attacher.wait(10)
        if waiter.is_alive():
            waiter.kill()
        waiter.join(10)
        sem.close()
        pool.close()
        BlockPool.unlink(name)
