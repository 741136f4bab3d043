"""A tier pool's counters, read from its shared table by `shmkv stats` and `shmkv inspect` (run
as a user runs them, subprocesses) and exported as metrics: chunks stored, loaded and
cross-replica hits, per replica and for the node, for the vLLM offload tier and the SGLang page
store alike, after real replicas (spawned processes) stored and loaded."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

from shmkv import BlockPool
from shmkv.metrics import PoolMetrics
from shmkv.pool.siblings import unlink_pool_siblings
from tests.conftest import unique_pool_name
from tests.ecosystem_helpers import shmkv
from tests.multiprocess.conftest import join_processes

pytestmark = [pytest.mark.multiprocess, pytest.mark.long]


def _tier_section(text: str) -> list[str]:
    """The tier's lines of a command's output (the `tier` line and the rows under it)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("tier "))
    out = [lines[start].strip()]
    for line in lines[start + 1:]:
        if not line.strip().startswith(("node ", "row ")):
            break
        out.append(line.strip())
    return out


def _assert_cli_shows(name: str, expected: list[str], label: str) -> None:
    stats = shmkv("stats", name, "--count", "1", "--no-clear")
    inspect = shmkv("inspect", name)
    for what, out in (("stats", stats), ("inspect", inspect)):
        assert out.returncode == 0, (label, what, out.stderr)
        assert "Traceback" not in out.stderr
        shown = [re.sub(r"row +(\d+) +\S+( \d+)?", r"row \1", line)
                 for line in _tier_section(out.stdout)]
        assert shown == expected, (label, what, out.stdout)


def _metric_samples(pool: BlockPool) -> dict[tuple[str, str], float]:
    pytest.importorskip("prometheus_client")
    out = {}
    for family in PoolMetrics(pool).collect():
        for sample in family.samples:
            if sample.name.startswith("shmkv_tier_"):
                label = sample.labels.get("replica", sample.labels.get("state"))
                out[(sample.name, label)] = sample.value
    return out


# ------------------------------------------------------------------ vLLM offload tier

def _vllm_replica_a(name: str, num_chunks: int) -> None:
    """Replica A: stores prompt blocks 0..5, loads its own block 0, and leaves."""
    from vllm.v1.kv_offload.base import ReqContext

    from shmkv.vllm import SharedCPUOffloadingManager
    from tests.multiprocess.offload_workers import prompt_key

    manager = SharedCPUOffloadingManager(name, num_chunks, label="replica-a",
                                         replica_id="engine-a")
    ctx = ReqContext("a")
    manager.on_new_request(ctx)
    keys = [prompt_key(0, i) for i in range(6)]
    out = manager.prepare_store(keys, ctx)
    assert out is not None and out.keys_to_store == keys
    manager.complete_store(keys, ctx)
    manager.prepare_load(keys[:1], ctx)
    manager.complete_load(keys[:1], ctx)
    manager.close()


def test_vllm_tier_counters_show_in_stats_inspect_and_metrics(spawn_ctx):
    """Replica A (a process) stores 6 chunks and loads 1 of its own; replica B stores 2,
    loads 4 of A's and 1 of its own: `shmkv stats` and `shmkv inspect` show the node's and
    each row's stored, loaded and cross-replica hits, A's row gone, B's live."""
    pytest.importorskip("vllm.v1.kv_offload.base")
    from vllm.v1.kv_offload.base import ReqContext

    from shmkv.vllm import SharedCPUOffloadingManager
    from tests.multiprocess.offload_workers import prompt_key

    name = unique_pool_name("tierc")
    b = None
    try:
        a = spawn_ctx.Process(target=_vllm_replica_a, args=(name, 16))
        a.start()
        assert join_processes([a]) == [0]
        b = SharedCPUOffloadingManager(name, 16, label="replica-b", replica_id="engine-b")
        ctx = ReqContext("b")
        b.on_new_request(ctx)
        theirs = [prompt_key(0, i) for i in range(4)]
        mine = [prompt_key(1, i) for i in range(2)]
        out = b.prepare_store(mine, ctx)
        assert out is not None and out.keys_to_store == mine
        b.complete_store(mine, ctx)
        b.prepare_load(theirs + mine[:1], ctx)
        b.complete_load(theirs + mine[:1], ctx)
        _assert_cli_shows(name, [
            "tier     vLLM offload tier: 16 chunks, 8 with data"
            " (50.0% full; 0 being stored), 0 held",
            "node   8 chunks stored, 6 loaded, 4 cross-replica hits",
            "row 0 gone: 6 stored, 1 loaded, 0 cross-replica hits",
            "row 1 live: 2 stored, 5 loaded, 4 cross-replica hits",
        ], "vllm")
        samples = _metric_samples(b.pool)
        assert samples[("shmkv_tier_cross_replica_hit_chunks_total", "node")] == 4
        assert samples[("shmkv_tier_cross_replica_hit_chunks_total", "1")] == 4
        assert samples[("shmkv_tier_stored_chunks_total", "0")] == 6
        assert samples[("shmkv_tier_loaded_chunks_total", "1")] == 5
        assert samples[("shmkv_tier_chunks", "with_data")] == 8
        # vLLM's own /metrics keep the replica's cross-replica hits (get_stats)
        assert b.get_stats().reduce()["shmkv_cross_replica_hit_chunks"] == 4
    finally:
        if b is not None:
            b.close()
        SharedCPUOffloadingManager.unlink(name)


# ------------------------------------------------------------------ SGLang page store

def test_sglang_store_counters_show_in_stats_and_inspect(spawn_ctx):
    """An instance (a process) stores 3 pages and leaves; another stores 1 and loads 2 of
    the first's and 1 of its own: both commands show the node's and each slot's counts."""
    from tests.multiprocess import sglang_store_workers as W

    name = unique_pool_name("tiers")
    store_bytes = 8 * W.PAGE_BYTES
    store = None
    try:
        q = spawn_ctx.Queue()
        a = spawn_ctx.Process(target=W.store_and_report,
                              args=(name, 1, ["x0", "x1", "x2"], store_bytes, None, q))
        a.start()
        assert q.get(timeout=60)[1] == 3
        assert join_processes([a]) == [0]
        store = W.open_store(name, store_bytes)
        host = W.host_pages(2)
        assert store.save([W.key("y0")], host, [0])[0] == 1
        hits = store.load([W.key("x0"), W.key("x1"), W.key("y0")], host, [4, 5, 6])
        assert hits == [True, True, True]
        slot_a = 0  # the first process of the pool took slot 0; this one the next free
        slot_b = store.pool.slot
        rows = sorted([(slot_a, "gone: 3 stored, 0 loaded, 0 cross-replica hits"),
                       (slot_b, "live: 1 stored, 3 loaded, 2 cross-replica hits")])
        _assert_cli_shows(name, [
            "tier     SGLang page store: 8 pages, 4 with data"
            " (50.0% full; 0 being stored), 0 held",
            "node   4 pages stored, 3 loaded, 2 cross-replica hits",
            *[f"row {slot} {text}" for slot, text in rows],
        ], "sglang")
        assert np.array_equal(host[4], W.host_pages(1)[0])  # the bytes are A's
    finally:
        if store is not None:
            store.close()
        BlockPool.unlink(name)
        unlink_pool_siblings(name)


def test_ls_tells_the_vllm_tier_files_apart():
    """`shmkv ls` lists a vLLM tier's table and replica lock file each as what it is, and
    its data region (vLLM's file, usually the biggest object) as a row of its own, with its
    bytes and its pool, in the table and in --json alike (before: the table and the lock
    file were both `sibling` rows, and the data region was not listed at all)."""
    pytest.importorskip("vllm.v1.kv_offload.base")
    import json

    from shmkv.pool import layout as L
    from shmkv.vllm import SharedCPUOffloadingManager
    from shmkv.vllm.region import region_path

    name = unique_pool_name("tierls")
    manager = None
    try:
        manager = SharedCPUOffloadingManager(name, 16, label="replica", replica_id="engine")
        # The data region is the plain /dev/shm file vLLM's workers map; 1 MiB stands in
        # for one here (no GPU workers in this test).
        with open(region_path(name), "xb") as f:
            f.truncate(1 << 20)
        out = shmkv("ls", "--json", "--prefix", name)
        assert out.returncode == 0, out.stderr
        rows = {r["entry"]: r for r in json.loads(out.stdout)}
        table = rows[L.sibling_segment_name("offload", name, L.OFFLOAD_TIER_VERSION)[1:]]
        locks = rows[L.offload_replicas_path(name).removeprefix("/dev/shm/")]
        region = rows[region_path(name).removeprefix("/dev/shm/")]
        assert (table["kind"], table["name"], table["pool"]) == ("tier table", name, name)
        assert (locks["kind"], locks["name"], locks["pool"]) == ("tier locks", name, name)
        assert (region["kind"], region["name"], region["pool"]) == ("data region", name, name)
        assert region["bytes"] == 1 << 20
        assert table["note"].startswith("the vLLM offload tier's table")
        assert locks["note"].startswith("the vLLM offload tier's replica lock file")
        assert region["note"].startswith("the vLLM offload tier's data region of pool")
        text = shmkv("ls", "--prefix", name)
        assert text.returncode == 0, text.stderr
        line = next(line for line in text.stdout.splitlines() if line.startswith("data region"))
        assert f" {name} " in line and " 1,048,576 " in line, line
        for kind in ("tier table", "tier locks"):
            assert any(line.startswith(kind) for line in text.stdout.splitlines()), text.stdout
    finally:
        if manager is not None:
            manager.close()
        SharedCPUOffloadingManager.unlink(name)
    assert not [e for e in os.listdir("/dev/shm") if name in e]


# ------------------------------------------------------------------ a killed replica

def _vllm_replica_killed(name: str, num_chunks: int, ready) -> None:
    """A replica that stores 2 chunks, says so, and waits to be SIGKILLed."""
    import time

    from vllm.v1.kv_offload.base import ReqContext

    from shmkv.vllm import SharedCPUOffloadingManager
    from tests.multiprocess.offload_workers import prompt_key

    manager = SharedCPUOffloadingManager(name, num_chunks, label="replica-k",
                                         replica_id="engine-k")
    ctx = ReqContext("k")
    manager.on_new_request(ctx)
    keys = [prompt_key(2, i) for i in range(2)]
    manager.prepare_store(keys, ctx)
    manager.complete_store(keys, ctx)
    ready.set()
    time.sleep(600)


def test_a_killed_replicas_row_is_gone_at_once(spawn_ctx):
    """A replica SIGKILLed (no other replica joined since, so its row is still marked):
    `shmkv inspect` and `shmkv stats` show its row gone, read from the replica lock file's
    byte that its processes held, not live."""
    pytest.importorskip("vllm.v1.kv_offload.base")
    from shmkv.pool.tier_counters import OFFLOAD_REPLICA_FILE_WORD
    from shmkv.vllm.tier import W_REPLICA_FILE

    assert OFFLOAD_REPLICA_FILE_WORD == W_REPLICA_FILE
    name = unique_pool_name("tierk")
    ready = spawn_ctx.Event()
    k = spawn_ctx.Process(target=_vllm_replica_killed, args=(name, 8, ready))
    try:
        k.start()
        assert ready.wait(120)
        live = [line for line in _tier_section(shmkv("inspect", name).stdout)
                if line.startswith("row")]
        assert len(live) == 1 and " live: 2 stored" in live[0], live
        k.kill()
        k.join(30)
        expected = ["tier     vLLM offload tier: 8 chunks, 2 with data (25.0% full; 0 being "
                    "stored), 0 held", "node   2 chunks stored, 0 loaded, 0 cross-replica hits",
                    "row 0 gone: 2 stored, 0 loaded, 0 cross-replica hits"]
        _assert_cli_shows(name, expected, "killed")
    finally:
        if k.is_alive():
            k.kill()
            k.join(30)
        BlockPool.unlink(name)
        unlink_pool_siblings(name)
