"""A create or attach that fails for want of a descriptor (EMFILE) leaves nothing open.

A spawned process lowers its RLIMIT_NOFILE step by step, from "no descriptor free" up to
where the call succeeds, and counts /proc/self/fd and its /dev/shm mappings around each try
(``tests/multiprocess/fd_limit_workers.py``). Before, an attach that got the liveness file
but not the semaphore kept the ``.alive`` descriptor for good, and the pool's mapping (with
its descriptor) until a garbage collection.
"""

from __future__ import annotations

import pytest

from shmkv import BlockPool
from tests.conftest import unique_pool_name
from tests.multiprocess.conftest import join_processes
from tests.multiprocess.fd_limit_workers import attach_under_limits

pytestmark = [pytest.mark.multiprocess, pytest.mark.long]


@pytest.mark.parametrize("create", [False, True], ids=["attach", "create"])
def test_failed_attach_or_create_leaves_no_descriptor(spawn_ctx, kernel, create):
    """Every try that fails with EMFILE leaves the same descriptors and mappings as before
    it; a higher limit then succeeds."""
    name = unique_pool_name("fd")
    with BlockPool.create(name, 16, kernel=kernel) as pool:
        queue = spawn_ctx.Queue()
        proc = spawn_ctx.Process(target=attach_under_limits, args=(name, kernel, create, queue))
        proc.start()
        rows = queue.get(timeout=60)
        assert join_processes([proc], 60) == [0]
        assert rows[-1][-1] == "ok", rows
        failed = [row for row in rows if row[-1] != "ok"]
        assert failed, "the lowest limit let the call through: nothing was tested"
        for extra, fds_before, fds_after, maps_before, maps_after, outcome in failed:
            assert "files open" in outcome or "open files" in outcome, outcome
            assert (fds_after, maps_after) == (fds_before, maps_before), (
                f"{extra} descriptor(s) free: {outcome}; descriptors {fds_before} -> "
                f"{fds_after}, /dev/shm mappings {maps_before} -> {maps_after}")
        pool.check_invariants()
