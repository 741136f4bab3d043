"""The offload tier table's layout and its replica rows (``shmkv/vllm/tier.py``): every part
of a table made by a real manager lies in bytes of its own, inside the table; and a replica's
row is named in ``shmkv inspect`` and ``shmkv stats`` (the real command) by its DP rank, its
vLLM engine id (cut with a marker when longer than its field) and its engine core's pid."""

from __future__ import annotations

import os

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.base")

from shmkv.vllm import SharedCPUOffloadingManager  # noqa: E402
from shmkv.vllm.tier import HEADER_BYTES, table_bytes  # noqa: E402
from tests.conftest import unique_pool_name  # noqa: E402
from tests.ecosystem_helpers import shmkv  # noqa: E402


@pytest.fixture
def manager():
    name = unique_pool_name("vrow")
    manager = SharedCPUOffloadingManager(name, 16)
    yield manager
    if manager.pool is not None:
        manager.pool.check_invariants()
    manager.close()
    SharedCPUOffloadingManager.unlink(name)


def _span(view, base: int) -> tuple[int, int]:
    """The byte range ``[start, end)`` of ``view`` (a numpy array or memoryview of the
    table) from the table's first byte at address ``base``."""
    arr = np.asarray(view)
    start = arr.__array_interface__["data"][0] - base
    return start, start + arr.nbytes


def test_every_part_of_the_table_has_bytes_of_its_own(manager):
    """The header, the counter block, the replica labels and each body array of a 16-chunk
    table are disjoint and inside the table (in tier v4 the counter block's last row,
    replica row 63's, lay on the chunks' first ranks)."""
    tier = manager._tier
    base = np.frombuffer(tier._seg.buf, np.uint8).__array_interface__["data"][0]
    parts = {"header": (0, HEADER_BYTES), "counters": _span(tier.counter_words, base),
             "labels": _span(tier.labels, base)}
    for name in ("ranks", "jobs", "heap_rank", "heap_block", "free_stack", "producer"):
        parts[name] = _span(getattr(tier, name), base)
    spans = sorted(parts.values())
    for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
        assert end <= start, parts
    assert spans[0][0] == 0 and spans[-1][1] <= table_bytes(16) <= len(tier._seg.buf), parts


def _tier_rows(*command: str) -> list[str]:
    out = shmkv(*command)
    assert out.returncode == 0 and "Traceback" not in out.stderr, (command, out.stderr)
    return [line.strip() for line in out.stdout.splitlines() if line.strip().startswith("row ")]


def test_inspect_and_stats_name_rows_by_dp_rank_engine_id_and_core_pid(manager):
    """Replicas join one tier: one that says its DP rank and engine id, one whose engine id
    (131 UTF-8 bytes) is longer than the label's 112, an engine core that says nothing, and
    a GPU worker (no engine core yet) that says nothing. Both commands name the first row
    ``dp 2 engine-b_dp2 pid <its core's pid>``; the second row's id keeps its first whole
    characters and ends with the marker (U+2026); the third row is named by its core's pid
    alone, and the worker's by its key, as every row was before the labels."""
    from shmkv.vllm.lifecycle import join_as_worker

    name = manager.pool_name
    e_acute, mark = "\u00e9", "\u2026"  # 2 UTF-8 bytes; the marker, 3
    long_id = "engine-" + e_acute * 60 + "_dp1"  # 7 + 120 + 4 bytes
    labelled = SharedCPUOffloadingManager(name, 16, replica_id="b@start-0", dp_rank=2,
                                          engine_id="engine-b_dp2")
    cut = SharedCPUOffloadingManager(name, 16, replica_id="c@start-0", dp_rank=1,
                                     engine_id=long_id)
    worker, _ = join_as_worker(name, 16, 16, "w@start-0", 16 * 4096)
    try:
        pid = os.getpid()
        (row,) = worker.rows
        key = f"{int(manager._tier.replica_keys[row]) & (2**64 - 1):016x}"
        expected = {
            f"row {manager._row} pid {pid} live: 0 stored, 0 loaded, 0 cross-replica hits",
            f"row {labelled._row} dp 2 engine-b_dp2 pid {pid} live: 0 stored, 0 loaded, "
            "0 cross-replica hits",
            # 7 + 2 * 51 = 109 bytes of whole characters, then the 3-byte marker
            f"row {cut._row} dp 1 engine-{e_acute * 51}{mark} pid {pid} live: 0 stored, "
            "0 loaded, 0 cross-replica hits",
            f"row {row} {key} live: 0 stored, 0 loaded, 0 cross-replica hits",
        }
        for command in (("inspect", name), ("stats", name, "--count", "1", "--no-clear")):
            rows = {" ".join(line.split()) for line in _tier_rows(*command)}
            assert rows == expected, (command, rows)
        manager.pool.check_invariants()
    finally:
        worker.close()
        labelled.close()
        cut.close()


def test_a_gone_replicas_row_keeps_its_name_until_another_takes_it(manager):
    """A labelled replica that left is shown gone under its DP rank and engine id; the
    replica that takes its row next (no other row free), saying only its engine id, is
    shown under that alone: nothing of the one that left (its DP rank) stays."""
    name = manager.pool_name
    gone = SharedCPUOffloadingManager(name, 16, replica_id="g@start-0", dp_rank=5,
                                      engine_id="engine-g_dp5")
    row, pid = gone._row, os.getpid()
    gone.close()
    rows = {" ".join(line.split()) for line in _tier_rows("inspect", name)}
    assert f"row {row} dp 5 engine-g_dp5 pid {pid} gone: 0 stored, 0 loaded, " \
           "0 cross-replica hits" in rows, rows
    tier = manager._tier
    with manager.pool.lock():  # every other row in use by a live replica's key
        others = [r for r in range(len(tier.replica_keys)) if r not in (row, manager._row)]
        saved = tier.replica_keys[others].copy()
        tier.replica_keys[others] = 1
    try:
        taker = SharedCPUOffloadingManager(name, 16, replica_id="t@start-0",
                                           engine_id="engine-t")
    finally:
        with manager.pool.lock():
            tier.replica_keys[others] = saved
    try:
        assert taker._row == row
        rows = {" ".join(line.split()) for line in _tier_rows("inspect", name)}
        assert f"row {row} engine-t pid {pid} live: 0 stored, 0 loaded, 0 cross-replica " \
               "hits" in rows, rows
    finally:
        taker.close()
