"""The tier's data region belongs to its pool: a removed region or a removed pool never
answers HIT for bytes the region does not hold, and a region file another user planted, or a
link, is refused naming the file. Real vLLM 0.33.0 Schedulers, real worker processes
mapping the region with vLLM's SharedOffloadRegion."""

from __future__ import annotations

import os
import signal

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")
pytest.importorskip("einops")  # vLLM's model inspection imports it (vllm_peer/requirements)

from vllm.v1.kv_offload.base import ReqContext, make_offload_key  # noqa: E402

from shmkv.errors import SegmentError  # noqa: E402
from shmkv.vllm import SharedCPUOffloadingManager  # noqa: E402
from shmkv.vllm.region import TRAILER_BYTES, region_path  # noqa: E402
from tests.conftest import unique_pool_name  # noqa: E402
from tests.multiprocess.conftest import join_processes  # noqa: E402
from tests.multiprocess.vllm_scheduler_driver import (  # noqa: E402
    BLOCK_SIZE,
    make_scheduler,
    replica_worker,
    run_request,
    worker_spec,
    write_model_dir,
)

pytestmark = [pytest.mark.multiprocess, pytest.mark.long]

TIER_BYTES = 1 << 20
PROMPT = [1 + (i * 7) % 900 for i in range(6 * BLOCK_SIZE + 5)]  # six chunks


class Worker:
    """A replica's GPU worker process (``replica_worker``)."""

    def __init__(self, ctx, pool: str, model_dir: str, engine_id: str) -> None:
        self.to_parent, self.from_parent = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=replica_worker, args=(
            pool, model_dir, engine_id, TIER_BYTES, self.to_parent, self.from_parent))
        self.proc.start()
        ready = self.to_parent.get(timeout=150)
        assert ready[0] == "ready", ready

    def ask(self, command):
        self.from_parent.put(command)
        return self.to_parent.get(timeout=60)

    def stop(self) -> None:
        if self.proc.is_alive():
            self.from_parent.put("exit")
        assert join_processes([self.proc]) in ([0], [-signal.SIGKILL])


@pytest.fixture
def tier(tmp_path):
    pool = unique_pool_name("rgn")
    yield pool, write_model_dir(str(tmp_path / "model"))
    SharedCPUOffloadingManager.unlink(pool)


def _store_and_write(scheduler, worker: Worker) -> list[int]:
    """Replica A serves the prompt (its stores complete) and its worker writes b'A' into
    the chunks the stores used."""
    stored = run_request(scheduler, "a-0", PROMPT)["stored"]
    assert len(stored) == 6
    assert worker.ask(("write", stored, [ord("A")] * 6)) == "written"
    return stored


@pytest.mark.timeout(240)
def test_a_removed_region_is_never_a_hit(spawn_ctx, tier):
    """A's region is removed (vLLM's usual /dev/shm workaround) while A runs: the next
    replica's worker makes a fresh region and the tier forgets A's chunks, so B's lookup
    misses (it never loads zeros as A's KV); A, whose worker still maps the old bytes, gets
    no hit and stores nothing from then on."""
    pool, model_dir = tier
    worker_a = Worker(spawn_ctx, pool, model_dir, "A")
    scheduler_a = make_scheduler(pool, model_dir, TIER_BYTES, engine_id="A")
    worker_b = scheduler_b = None
    try:
        stored = _store_and_write(scheduler_a, worker_a)
        os.unlink(region_path(pool))
        worker_b = Worker(spawn_ctx, pool, model_dir, "B")
        assert worker_b.ask(("read", stored)) == [bytes(16)] * 6  # a fresh region
        scheduler_b = make_scheduler(pool, model_dir, TIER_BYTES, engine_id="B")
        b = run_request(scheduler_b, "b-0", PROMPT)
        assert b["loaded"] == [] and len(b["stored"]) == 6
        a = run_request(scheduler_a, "a-1", PROMPT)
        assert a == {"loaded": [], "stored": []}
        assert worker_a.ask(("read", stored)) == [b"A" * 16] * 6  # its old bytes, unshared
        fresh = scheduler_b.connector.connector_scheduler.manager  # no chunk was lost
        num_chunks = fresh.num_chunks
        ctx = ReqContext("all")
        keys = [make_offload_key(i.to_bytes(8, "big"), 0) for i in range(num_chunks)]
        out = fresh.prepare_store(keys, ctx)
        assert out is not None and len(out.keys_to_store) == num_chunks
        fresh.complete_store(keys, ctx, success=False)
    finally:
        for scheduler in (scheduler_a, scheduler_b):
            if scheduler is not None:
                scheduler.connector.shutdown()
        for worker in (worker_a, worker_b):
            if worker is not None:
                worker.stop()


@pytest.mark.timeout(240)
def test_a_region_left_by_a_removed_pool_is_replaced(spawn_ctx, tier):
    """The pool and its tier table are removed but the populated region stays: the next
    replica's worker does not adopt it (its bytes describe no chunk of the new pool) but
    replaces it with a fresh, zeroed region."""
    pool, model_dir = tier
    worker_a = Worker(spawn_ctx, pool, model_dir, "A")
    scheduler_a = make_scheduler(pool, model_dir, TIER_BYTES, engine_id="A")
    try:
        stored = _store_and_write(scheduler_a, worker_a)
    finally:
        scheduler_a.connector.shutdown()
        worker_a.stop()
    path = region_path(pool)
    old_inode = os.stat(path).st_ino
    from shmkv.pool import siblings
    from shmkv.pool.segment import Segment
    from shmkv.vllm import tier_table_name

    siblings.unlink_pool_files(pool)  # the pool and its table, not the region
    assert Segment.unlink(tier_table_name(pool)) and os.path.exists(path)
    worker_b = Worker(spawn_ctx, pool, model_dir, "B")
    try:
        assert worker_b.ask(("read", stored)) == [bytes(16)] * 6
        assert os.stat(path).st_ino != old_inode
    finally:
        worker_b.stop()


def _plant(path: str, size: int, *, uid: int = 65534, mode: int = 0o666) -> None:
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode)
    os.ftruncate(fd, size)
    os.fchmod(fd, mode)
    os.close(fd)
    os.chown(path, uid, uid)


@pytest.mark.skipif(os.geteuid() != 0, reason="planting another user's file needs root")
def test_a_region_file_another_user_planted_is_refused(tier):
    """A file of the region's name and size, owned by another user with mode 0666, made
    before the tier: the worker refuses it naming the file, and maps nothing."""
    pool, model_dir = tier
    spec = worker_spec(pool, model_dir, TIER_BYTES, engine_id="A")
    path = region_path(pool)
    _plant(path, spec.num_chunks * spec.kv_bytes_per_chunk + TRAILER_BYTES)
    try:
        with pytest.raises(SegmentError, match=f"data region {path}: .*refusing to use it"):
            spec.open_data_region(0)
        assert os.stat(path).st_uid == 65534  # left as it was
    finally:
        os.unlink(path)


def test_a_region_path_that_is_a_link_is_refused(tier, tmp_path):
    """A symbolic link at the region's path is never followed."""
    pool, model_dir = tier
    spec = worker_spec(pool, model_dir, TIER_BYTES, engine_id="A")
    target = tmp_path / "elsewhere"
    target.write_bytes(b"")
    path = region_path(pool)
    os.symlink(target, path)
    try:
        with pytest.raises(SegmentError, match=f"data region {path} is a symbolic link"):
            spec.open_data_region(0)
        assert target.read_bytes() == b""
    finally:
        os.unlink(path)


def test_no_room_for_the_region_is_an_error_not_a_sigbus(tier):
    """A region larger than /dev/shm's free space is refused at start, naming both sizes,
    and leaves no file behind."""
    pool, model_dir = tier
    st = os.statvfs("/dev/shm")
    too_big = (st.f_bavail * st.f_frsize) * 2
    spec = worker_spec(pool, model_dir, too_big, engine_id="A")
    with pytest.raises(SegmentError, match=r"needs at least [\d,]+ bytes in /dev/shm .* and "
                                           r"[\d,]+ are free"):
        spec.open_data_region(0)
    assert not [e for e in os.listdir("/dev/shm") if pool in e and "offload_data" in e]
