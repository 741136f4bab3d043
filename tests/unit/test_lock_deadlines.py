"""Lock waits keep their deadlines on CLOCK_MONOTONIC: a step of the wall clock neither
stretches nor shortens a wait for the pool lock, in either kernel.

The wall clock cannot be stepped on a shared machine, so the waiter runs under an
LD_PRELOAD shim (compiled here) that moves its own CLOCK_REALTIME and ``gettimeofday``
forward by ``SHIFT_S``: a deadline computed from the wall clock then lies ``SHIFT_S``
beyond the kernel's wall clock, exactly as after a step back of ``SHIFT_S`` during the
wait, and a wait on it lasts ``SHIFT_S`` longer than meant.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from shmkv import BlockPool
from tests.conftest import unique_pool_name

SHIFT_S = 3

_SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <sys/time.h>
#include <time.h>

static long shift_s(void) {
    const char *s = getenv("SHMKV_TEST_WALL_SHIFT_S");
    return s ? atol(s) : 0;
}

int clock_gettime(clockid_t id, struct timespec *ts) {
    static int (*real)(clockid_t, struct timespec *);
    if (!real) real = (int (*)(clockid_t, struct timespec *))dlsym(RTLD_NEXT, "clock_gettime");
    int rc = real(id, ts);
    if (rc == 0 && (id == CLOCK_REALTIME || id == CLOCK_REALTIME_COARSE)) ts->tv_sec += shift_s();
    return rc;
}

int gettimeofday(struct timeval *tv, void *tz) {
    struct timespec ts;
    (void)tz;
    clock_gettime(CLOCK_REALTIME, &ts);
    tv->tv_sec = ts.tv_sec;
    tv->tv_usec = ts.tv_nsec / 1000;
    return 0;
}
"""

_WAITER = """
import json, sys, time
from shmkv import BlockPool
name, kernel, parent_wall = sys.argv[1], sys.argv[2], float(sys.argv[3])
shift_seen = time.time() - parent_wall
start = time.monotonic()
pool = BlockPool.attach(name, kernel=kernel, lock_timeout_s=2.0)
waited = time.monotonic() - start
took_over = pool.last_repair is not None
pool.close()
print(json.dumps({"shift_seen": shift_seen, "waited_s": waited, "took_over": took_over}))
"""


@pytest.fixture(scope="module")
def wall_shift_shim(tmp_path_factory) -> str:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler for the clock shim")
    out = tmp_path_factory.mktemp("shim")
    src, lib = out / "wall_shift.c", out / "wall_shift.so"
    src.write_text(_SHIM)
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(lib), str(src), "-ldl"],
                   check=True, timeout=60)
    return str(lib)


def _die_holding_the_lock(name: str, kernel: str) -> None:
    pool = BlockPool.attach(name, kernel=kernel)
    with pool.lock():
        os.kill(os.getpid(), signal.SIGKILL)


def test_a_wall_clock_step_does_not_stretch_a_lock_wait(kernel, wall_shift_shim):
    """A holder dies holding the lock; a waiter whose wall clock reads SHIFT_S (3) seconds
    ahead takes the lock over after one wait slice (well under a second), as without the
    shift. With wall-clock deadlines its first 20 ms slice lasted 3 s."""
    name = unique_pool_name()
    pool = BlockPool.create(name, 11, kernel=kernel)
    try:
        holder = mp.get_context("spawn").Process(target=_die_holding_the_lock,
                                                 args=(name, kernel))
        holder.start()
        holder.join(30)
        assert holder.exitcode == -signal.SIGKILL
        env = dict(os.environ, LD_PRELOAD=wall_shift_shim,
                   SHMKV_TEST_WALL_SHIFT_S=str(SHIFT_S))
        done = subprocess.run([sys.executable, "-c", _WAITER, name, kernel, str(time.time())],
                              env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        seen = json.loads(done.stdout.splitlines()[-1])
        assert seen["shift_seen"] > SHIFT_S - 0.5, "the shim did not move the wall clock"
        assert seen["took_over"]
        assert seen["waited_s"] < 1.0, seen
        fresh = BlockPool.attach(name, kernel=kernel)
        try:
            fresh.check_invariants()
        finally:
            fresh.close()
    finally:
        pool.close()
        BlockPool.unlink(name)


@pytest.mark.parametrize("clockwait", [True, False], ids=["sem_clockwait", "poll"])
def test_monotonic_wait_times_out_and_takes(clockwait):
    """The pure-Python kernel's timed wait, with sem_clockwait and with the polling fallback
    (a libc without it): an empty wait returns False after its time, not before; a posted
    unit is taken."""
    import posix_ipc

    from shmkv.pool.lock import MonotonicWait

    name = "/" + unique_pool_name() + ".lock"
    sem = posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=0o600, initial_value=0)
    timed = MonotonicWait(name, sem)
    try:
        if not clockwait:
            timed.close()  # no handle: the poll
        assert (timed._handle is not None) == clockwait
        start = time.monotonic()
        assert not timed.wait(0.05)
        assert 0.05 <= time.monotonic() - start < 0.5
        sem.release()
        assert timed.wait(0.05)
        assert sem.value == 0
    finally:
        timed.close()
        sem.close()
        posix_ipc.unlink_semaphore(name)
