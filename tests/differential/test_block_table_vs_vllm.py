"""Differential test: shmkv's SharedBlockTables row operations against vLLM 0.33.0's
MultiGroupBlockTable (its CPU numpy buffers), op for op."""

from __future__ import annotations

import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")
vbt = pytest.importorskip("vllm.v1.worker.block_table")

from shmkv.ranks.block_table import SharedBlockTables  # noqa: E402
from tests.conftest import unique_pool_name  # noqa: E402

pytestmark = pytest.mark.differential


@pytest.fixture
def tables():
    name = unique_pool_name("btd")
    t = SharedBlockTables.create(name, max_num_reqs=8, max_model_len=64, block_sizes=[4, 16])
    yield t
    t.close()
    SharedBlockTables.unlink(name)


def test_rows_follow_vllms_multi_group_block_table(tables):
    """The same row operations on vLLM 0.33.0's MultiGroupBlockTable give the same tables
    and row lengths (vLLM's numpy buffers, CPU)."""
    ref = vbt.MultiGroupBlockTable(8, 256, False, torch.device("cpu"), [4, 16], [16, 4])
    rng = random.Random(3)
    for _ in range(300):
        op = rng.choice(["add", "append", "clear", "move", "swap"])
        row, other = rng.randrange(8), rng.randrange(8)
        if op in ("add", "append"):
            lens = [int(n) for n in tables.num_blocks_per_row[:, row]] if op == "append" else [0, 0]
            ids = tuple([rng.randrange(1, 500) for _ in range(rng.randint(0, w - n))]
                        for w, n in zip((16, 4), lens, strict=True))
            getattr(tables, f"{op}_row")(ids, row)
            getattr(ref, f"{op}_row")(ids, row)
        elif op == "clear":
            tables.clear_row(row)
            ref.clear_row(row)
        elif op == "move":
            tables.move_row(row, other)
            ref.move_row(row, other)
        else:
            tables.swap_row(row, other)
            ref.swap_row(row, other)
        for g in range(2):
            width = tables.max_num_blocks_per_req[g]
            assert np.array_equal(tables.block_table(g).numpy(),
                                  ref[g].get_numpy_array()[:, :width]), (op, g)
            assert np.array_equal(tables.num_blocks_per_row[g].numpy(),
                                  ref[g].num_blocks_per_row), (op, g)


