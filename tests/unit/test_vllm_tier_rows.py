"""The offload tier table's layout (``shmkv/vllm/tier.py``): every part of a table made by a
real manager lies in bytes of its own, inside the table."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.base")

from shmkv.vllm import SharedCPUOffloadingManager  # noqa: E402
from shmkv.vllm.tier import HEADER_BYTES, table_bytes  # noqa: E402
from tests.conftest import unique_pool_name  # noqa: E402


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
