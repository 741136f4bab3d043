"""Files another user (or a stale run) plants where shmkv opens things in /dev/shm: a FIFO
or a directory never blocks a call nor escapes as a raw OSError. Each call runs in a thread
joined with a timeout, so a call that would block fails the test instead of hanging it."""

from __future__ import annotations

import os
import threading

import pytest

from shmkv import BlockPool
from shmkv.errors import SegmentError
from shmkv.pool import layout as L

SHM = "/dev/shm"
JOIN_S = 20.0


def _in_thread(fn):
    """Runs ``fn`` in a daemon thread; (finished, its result or exception)."""
    box: dict = {}

    def run():
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 (handed to the test)
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(JOIN_S)
    return not thread.is_alive(), box


@pytest.fixture
def planted():
    paths: list[str] = []

    def plant(path: str, kind: str = "fifo") -> str:
        if kind == "fifo":
            os.mkfifo(path, 0o600)
        else:
            os.mkdir(path, 0o700)
        paths.append(path)
        return path

    yield plant
    for path in paths:
        if os.path.isdir(path) and not os.path.islink(path):
            os.rmdir(path)
        elif os.path.lexists(path):
            os.unlink(path)


def test_a_fifo_at_a_host_tier_path_does_not_block_create_or_unlink(pool_name, planted):
    """A FIFO at /dev/shm/shmkv-<pool>.host-v<N> (where a HiSparse host tier of the pool
    would be) does not block ``BlockPool.create`` of the pool, nor ``BlockPool.unlink``, and
    is left where it is (it is not shmkv's)."""
    fifo = planted(SHM + L.segment_name(f"{pool_name}.host"))
    done, box = _in_thread(lambda: BlockPool.create(pool_name, 8))
    assert done, "BlockPool.create blocked on a FIFO"
    assert "error" not in box, box
    pool = box["result"]
    pool.check_invariants()
    pool.close()
    done, box = _in_thread(lambda: BlockPool.unlink(pool_name))
    assert done and box.get("result") is True, box
    assert os.path.exists(fifo)


def test_a_fifo_at_the_data_region_path_is_refused_without_blocking(pool_name, planted):
    """``read_tag`` of the vLLM tier's data region, with a FIFO planted at its path, is a
    SegmentError naming it, at once (before: an O_RDONLY open that waits for a writer, inside
    the node-wide pool lock)."""
    pytest.importorskip("vllm.v1.kv_offload.base")
    from shmkv.vllm.region import read_tag, region_path

    path = planted(region_path(pool_name))
    done, box = _in_thread(lambda: read_tag(path, 4096))
    assert done, "read_tag blocked on a FIFO"
    assert isinstance(box.get("error"), SegmentError), box
    assert "not a regular file" in str(box["error"]) and path in str(box["error"])


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_special_file_at_the_replica_lock_path_is_a_segment_error(pool_name, planted, kind):
    """A FIFO or a directory at the tier's replica lock file path is refused as a
    SegmentError naming the path (before: a raw IsADirectoryError, or an open that blocks)."""
    pytest.importorskip("vllm.v1.kv_offload.base")
    from shmkv.vllm.replicas import ReplicaLocks, replica_locks_path

    path = planted(replica_locks_path(pool_name), kind)
    done, box = _in_thread(lambda: ReplicaLocks(pool_name))
    assert done, "ReplicaLocks blocked"
    assert isinstance(box.get("error"), SegmentError), box
    assert path in str(box["error"])
