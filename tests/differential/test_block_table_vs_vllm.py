"""Differential test: shmkv's SharedBlockTables row operations against the row tables of
the installed vLLM release, op for op, on their CPU numpy buffers.

vLLM 0.33.0 keeps a request's rows in the V1 runner's ``MultiGroupBlockTable`` (add, append,
clear, move, swap). vLLM 0.34.0 removed that runner: its CPU runner's ``CPUBlockTables``
writes rows with ``append_block_ids(row, ids, overwrite)`` and never moves them, so there
the add and append operations are compared."""

from __future__ import annotations

import importlib
import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm.v1.core.block_pool")  # vLLM's KV layer (the required part)

from shmkv.ranks.block_table import SharedBlockTables  # noqa: E402
from tests.conftest import unique_pool_name  # noqa: E402

pytestmark = pytest.mark.differential

GROUP_BLOCK_SIZES = [4, 16]
GROUP_WIDTHS = (16, 4)  # max_model_len 64 over block sizes 4 and 16


def _module_or_none(name: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError:
        return None


V1_RUNNER_TABLE = _module_or_none("vllm.v1.worker.block_table")  # through vLLM 0.33
CPU_RUNNER_TABLE = _module_or_none("vllm.v1.worker.cpu.block_table")  # from vLLM 0.34


def test_this_release_has_a_row_table_to_compare_with():
    """Every supported release keeps its rows in one of the two tables below; a release with
    neither must fail here rather than leave rows unchecked."""
    assert V1_RUNNER_TABLE is not None or CPU_RUNNER_TABLE is not None


@pytest.fixture
def tables():
    name = unique_pool_name("btd")
    t = SharedBlockTables.create(name, max_num_reqs=8, max_model_len=64,
                                 block_sizes=GROUP_BLOCK_SIZES)
    yield t
    t.close()
    SharedBlockTables.unlink(name)


def _random_ids(rng: random.Random, lens: list[int]) -> tuple[list[int], ...]:
    return tuple([rng.randrange(1, 500) for _ in range(rng.randint(0, w - n))]
                 for w, n in zip(GROUP_WIDTHS, lens, strict=True))


@pytest.mark.skipif(V1_RUNNER_TABLE is None,
                    reason="this vLLM release has no V1-runner MultiGroupBlockTable (removed "
                           "in 0.34.0); its CPU runner's table is compared below")
def test_rows_follow_vllms_multi_group_block_table(tables):
    """The same row operations on vLLM 0.33.0's MultiGroupBlockTable give the same tables
    and row lengths (vLLM's numpy buffers, CPU)."""
    ref = V1_RUNNER_TABLE.MultiGroupBlockTable(8, 256, False, torch.device("cpu"),
                                               GROUP_BLOCK_SIZES, [16, 4])
    rng = random.Random(3)
    for _ in range(300):
        op = rng.choice(["add", "append", "clear", "move", "swap"])
        row, other = rng.randrange(8), rng.randrange(8)
        if op in ("add", "append"):
            lens = [int(n) for n in tables.num_blocks_per_row[:, row]] if op == "append" else [0, 0]
            ids = _random_ids(rng, lens)
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


@pytest.mark.skipif(CPU_RUNNER_TABLE is None,
                    reason="this vLLM release has no CPU-runner CPUBlockTables (added in 0.34.0)")
def test_rows_follow_vllms_cpu_runner_block_tables(tables):
    """add_row and append_row write what vLLM 0.34.0's CPUBlockTables.append_block_ids
    writes with overwrite True and False: the same tables and row lengths."""
    ref = CPU_RUNNER_TABLE.CPUBlockTables(GROUP_BLOCK_SIZES, 8, 256, list(GROUP_WIDTHS),
                                          torch.device("cpu"))
    rng = random.Random(5)
    for _ in range(300):
        op, row = rng.choice(["add", "append"]), rng.randrange(8)
        lens = [int(n) for n in tables.num_blocks_per_row[:, row]] if op == "append" else [0, 0]
        ids = _random_ids(rng, lens)
        getattr(tables, f"{op}_row")(ids, row)
        ref.append_block_ids(row, ids, overwrite=(op == "add"))
        for g in range(2):
            assert np.array_equal(tables.block_table(g).numpy(), ref.block_tables_np[g]), (op, g)
            assert np.array_equal(tables.num_blocks_per_row[g].numpy(), ref.num_blocks_np[g]), \
                (op, g)
