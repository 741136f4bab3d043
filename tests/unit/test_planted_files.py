"""Files another user (or a stale run) plants where shmkv opens things in /dev/shm: a FIFO
or a directory never blocks a call nor escapes as a raw OSError. Each call runs in a thread
joined with a timeout, so a call that would block fails the test instead of hanging it."""

from __future__ import annotations

import json
import os
import threading

import pytest

from shmkv import BlockPool
from shmkv.errors import SegmentError
from shmkv.metrics import PoolMetrics
from shmkv.pool import layout as L
from tests.ecosystem_helpers import shmkv

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
        elif kind == "symlink":
            os.symlink("/dev/zero", path)
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
    done, box = _in_thread(lambda: read_tag(path, 4096, bytes(16)))
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
    done, box = _in_thread(lambda: ReplicaLocks(pool_name, bytes(16)))
    assert done, "ReplicaLocks blocked"
    assert isinstance(box.get("error"), SegmentError), box
    assert path in str(box["error"])


def _tier_path(tier: str, pool: str) -> str:
    version = L.OFFLOAD_TIER_VERSION if tier == "offload" else L.SGLANG_STORE_VERSION
    return SHM + L.sibling_segment_name(tier, pool, version)


@pytest.mark.parametrize(("tier", "kind", "words"), [
    ("offload", "fifo", "a FIFO, not a regular file"),
    ("sglang", "directory", "a directory, not a regular file"),
    ("offload", "symlink", "a symbolic link"),
])
def test_a_special_file_at_a_tier_path_is_a_note_in_stats_inspect_and_metrics(
        pool_name, planted, tier, kind, words):
    """A FIFO, a directory or a link at the vLLM tier table's or the SGLang store's path
    (/dev/shm is world-writable: any user can make one) is not read: ``shmkv stats`` and
    ``shmkv inspect`` exit 0 with a note naming the path and what is there, and the metrics
    exporter's snapshot and scrape carry on without the tier (before: ``[Errno 29] Illegal
    seek`` or ``[Errno 21] Is a directory``, rc 2, and an OSError out of every scrape)."""
    prometheus_client = pytest.importorskip("prometheus_client")
    pool = BlockPool.create(pool_name, 8)
    try:
        path = planted(_tier_path(tier, pool_name), kind)
        note = f"tier: {path} is {words}"
        done, box = _in_thread(lambda: PoolMetrics(pool).snapshot())
        assert done, "PoolMetrics.snapshot blocked"
        assert "error" not in box, box
        assert box["result"].tier is None
        assert [n for n in box["result"].notes if n.startswith(note)], box
        done, box = _in_thread(lambda: prometheus_client.generate_latest(
            _Registry(PoolMetrics(pool))))
        assert done and "error" not in box, box
        assert b"shmkv_blocks" in box["result"]
        for cmd in (("stats", pool_name, "--count", "1", "--no-clear"), ("inspect", pool_name)):
            out = shmkv(*cmd, timeout=60)
            assert out.returncode == 0, (cmd, out.stdout, out.stderr)
            assert "Traceback" not in out.stderr
            assert note in out.stdout, (cmd, out.stdout)
            assert "its owner, or root, can remove it" in out.stdout
        assert os.path.lexists(path)  # left where it is: not shmkv's
    finally:
        pool.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="making another user's file needs root")
def test_another_users_file_at_a_tier_path_is_not_read(pool_name):
    """A regular file of another uid at the tier table's path is not read as the pool's
    tier (its counters would be whatever that user wrote): a note names its owner."""
    pool = BlockPool.create(pool_name, 8)
    path = _tier_path("offload", pool_name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        os.ftruncate(fd, 8192)
        os.fchown(fd, 65534, 65534)
        os.close(fd)
        snap = PoolMetrics(pool).snapshot()
        assert snap.tier is None
        assert snap.notes == [
            f"tier: {path} is owned by uid 65534, not by this user (uid 0): not read (not "
            "shmkv's: another user or program made it; its owner, or root, can remove it)"]
    finally:
        os.unlink(path)
        pool.close()


class _Registry:
    """A one-collector registry for ``generate_latest`` (a scrape, as the exporter does)."""

    def __init__(self, collector) -> None:
        self._collector = collector

    def collect(self):
        return self._collector.collect()


def test_ls_lists_planted_objects_as_what_they_are(pool_name, planted):
    """``shmkv ls`` (and ``--json``, the same rows) lists a directory or a symbolic link
    planted at a pool's path, and a FIFO at a publisher position's, as what each is, left
    alone and never opened (before: a raw ``ValueError: Invalid parameter(s)`` traceback
    from posix_ipc for the directory, ``shmkv ls: [Errno 40] Too many levels of symbolic
    links`` for the link)."""
    planted(SHM + L.segment_name(pool_name), "directory")
    planted(SHM + L.segment_name(f"{pool_name}s"), "symlink")
    fifo = planted(SHM + L.sibling_segment_name("pub", pool_name, L.PUBLISHER_STATE_VERSION))
    expected = {
        ("pool", pool_name): "a directory, not a regular file: left alone",
        ("pool", f"{pool_name}s"): "a symbolic link, not a regular file: left alone",
        ("publisher", pool_name): "a FIFO, not a regular file: left alone",
    }
    listed = shmkv("ls", "--json", "--prefix", pool_name, timeout=60)
    assert listed.returncode == 0, listed.stderr
    rows = {(r["kind"], r["name"]): r for r in json.loads(listed.stdout)}
    for key, note in expected.items():
        assert rows[key]["note"].startswith(note), rows[key]
    assert rows[("pool", f"{pool_name}s")]["bytes"] == len("/dev/zero")  # the link's own
    assert rows[("pool", pool_name)]["processes"] is None
    table = shmkv("ls", "--prefix", pool_name, timeout=60)
    assert table.returncode == 0 and "Traceback" not in table.stderr, table.stderr
    for (kind, name), note in expected.items():
        line = next(line for line in table.stdout.splitlines()
                    if line.startswith(kind) and f" {name} " in line)
        assert note in line, line
    assert os.path.exists(fifo)  # left where it is


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_special_file_at_the_stats_or_publisher_path_is_a_note(pool_name, planted, kind):
    """A FIFO or a directory at the pool's stats segment's path stops neither the metrics
    scrape nor ``shmkv stats`` / ``shmkv inspect`` (a note says it was not read), and one
    at its publisher position's path does not stop ``inspect`` (before: rc 2 with a
    SegmentError, or a raw ``ValueError: Invalid parameter(s)`` traceback from posix_ipc
    for a directory, and an error out of every scrape)."""
    pool = BlockPool.create(pool_name, 8)
    try:
        stats = planted(SHM + L.sibling_segment_name("stats", pool_name, L.STATS_VERSION), kind)
        pub = planted(SHM + L.sibling_segment_name("pub", pool_name,
                                                   L.PUBLISHER_STATE_VERSION), kind)
        done, box = _in_thread(lambda: PoolMetrics(pool).snapshot())
        assert done and "error" not in box, box
        assert [n for n in box["result"].notes if n.startswith("stats: not read: ")
                and n.endswith("refusing to use it" if kind == "fifo" else
                               "its owner, or root, can remove it)")], box
        for cmd in (("stats", pool_name, "--count", "1", "--no-clear"), ("inspect", pool_name)):
            out = shmkv(*cmd, timeout=60)
            assert out.returncode == 0, (cmd, out.stdout, out.stderr)
            assert "Traceback" not in out.stderr
            assert "stats: not read: stats segment" in out.stdout, out.stdout
        assert "publisher: not read: publisher state" in out.stdout, out.stdout
        assert os.path.lexists(stats) and os.path.lexists(pub)
    finally:
        pool.close()


def test_a_directory_at_a_pools_path_is_a_segment_error(pool_name, planted):
    """``shmkv inspect NAME`` with a directory at /dev/shm/shmkv-NAME-v10 says what is there
    (before: a raw ``ValueError: Invalid parameter(s)`` traceback from posix_ipc)."""
    path = planted(SHM + L.segment_name(pool_name), "directory")
    out = shmkv("inspect", pool_name, timeout=60)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "Traceback" not in out.stderr
    assert f"{path} is a directory, not a shared-memory segment" in out.stderr, out.stderr
