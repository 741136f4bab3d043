"""Shared block tables, slot mapping and the KV store, in one process: vLLM's row semantics,
the seqlock's refusals, zero-copy views, header validation and bad input."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from shmkv.errors import (  # noqa: E402
    LayoutMismatchError,
    SegmentExistsError,
    SegmentNotFoundError,
    TornReadError,
    UsageError,
)
from shmkv.pool import layout as L  # noqa: E402
from shmkv.ranks import slot_mapping as slot_mapping_module  # noqa: E402
from shmkv.ranks import table_writer as table_writer_module  # noqa: E402
from shmkv.ranks.block_table import (  # noqa: E402
    BT_HEADER_DTYPE,
    KV_HEADER_DTYPE,
    PAD_SLOT_ID,
    KVStore,
    SharedBlockTables,
    batch_token_indices,
    block_tables_segment_name,
    compute_slot_mapping,
    kv_store_segment_name,
)
from tests.conftest import unique_pool_name  # noqa: E402


@pytest.fixture
def name():
    n = unique_pool_name("bt")
    yield n
    SharedBlockTables.unlink(n)
    KVStore.unlink(n)
    assert not os.path.exists(f"/dev/shm{block_tables_segment_name(n)}")
    assert not os.path.exists(f"/dev/shm{kv_store_segment_name(n)}")


@pytest.fixture
def tables(name):
    t = SharedBlockTables.create(name, max_num_reqs=8, max_model_len=64, block_sizes=[4, 16])
    yield t
    t.close()


@pytest.fixture(params=["c", "numpy"])
def rank_path(request, monkeypatch):
    """The rank side's two paths: the C helpers (when the kernel is built) and numpy, the
    reference they are held to."""
    if request.param == "c":
        if slot_mapping_module.c_slot_mappings is None:
            pytest.skip("the C kernel is not built")
    else:
        monkeypatch.setattr(slot_mapping_module, "c_slot_mappings", None)
        monkeypatch.setattr(slot_mapping_module, "c_token_indices", None)
    return request.param


@pytest.fixture(params=["c", "python"])
def writer_path(request, monkeypatch):
    """add_rows / append_rows: the C pass (when built) and the Python paths."""
    if request.param == "c":
        if table_writer_module._c_scatter_rows is None:
            pytest.skip("the C kernel is not built")
    else:
        monkeypatch.setattr(table_writer_module, "_c_scatter_rows", None)
    return request.param


def _state(t: SharedBlockTables) -> tuple:
    return (t.seq, t.step, t.num_blocks_per_row.clone(),
            [t.block_table(g).clone() for g in range(t.num_groups)])


def _same(a: tuple, b: tuple) -> bool:
    return (a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])
            and all(torch.equal(x, y) for x, y in zip(a[3], b[3], strict=True)))


def test_import_shmkv_does_not_import_torch():
    code = ("import sys, shmkv, shmkv.cli, shmkv.pool.layout; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_scheduler_writes_tables_without_loading_torch(name):
    """The writer side (rows, commit), the model config, the KV-cache config and the rank
    messages never import torch: a scheduler process does not pay for it."""
    code = f"""
import sys
from shmkv.ranks.block_table import SharedBlockTables
from shmkv.serve.config import TinyModelConfig, make_kv_cache_config
from shmkv.messages import ExecuteModel, ScheduledRequest, encode
from shmkv.serve.rank import RankClient
t = SharedBlockTables.create({name!r}, max_num_reqs=32, max_model_len=16, block_sizes=[4, 4])
t.add_row(([1, 2], [3]), 0)
t.append_rows([([4], [])], [0])
t.add_rows([([5], [6])] * 30, list(range(2, 32)))  # the vectorised path
t.clear_row(1)
t.commit(0)
make_kv_cache_config(TinyModelConfig(), 10, 4)
encode(ExecuteModel(step=0, requests=[ScheduledRequest("r", 0, [1], 0)]))
t.close()
SharedBlockTables.unlink({name!r})
assert 'torch' not in sys.modules, 'torch imported'
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_create_sizes_names_and_mode(name, tables):
    assert tables.block_sizes == (4, 16)
    assert tables.max_num_blocks_per_req == (16, 4)  # cdiv(64, bs)
    assert tables.step == -1 and tables.seq == 0
    path = f"/dev/shm{block_tables_segment_name(name)}"
    assert block_tables_segment_name(name) == f"/shmkv_bt-{name}-v{L.BT_LAYOUT_VERSION}"
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert tables.block_table(0).dtype == torch.int32
    assert tuple(tables.block_table(1).shape) == (8, 4)


def test_commit_publishes_and_read_copies(name, tables):
    tables.add_row(([1, 2, 3], [9]), 2)
    assert tables.seq % 2 == 1  # a write is in progress
    tables.commit(0)
    assert tables.seq == 2 and tables.step == 0
    reader = SharedBlockTables.attach(name)
    try:
        snap = reader.read([2, 0])
        assert snap.step == 0
        assert snap.block_tables[0][0, :4].tolist() == [1, 2, 3, 0]
        assert snap.block_tables[1][0, :2].tolist() == [9, 0]
        assert snap.num_blocks.tolist() == [[3, 0], [1, 0]]
        tables.append_row(([4], []), 2)
        tables.commit(5)
        assert snap.block_tables[0][0, 3] == 0  # a snapshot is a copy
        assert reader.read([2], min_step=5).block_tables[0][0, :4].tolist() == [1, 2, 3, 4]
    finally:
        reader.close()


def test_reader_refuses_a_table_being_written(name, tables):
    """While a write is in progress, read() times out (TornReadError) rather than return a
    half-written table, and so does waiting for a step not yet published."""
    tables.add_row(([1], [2]), 0)
    reader = SharedBlockTables.attach(name)
    try:
        with pytest.raises(TornReadError, match="no consistent state"):
            reader.read(timeout_s=0.05)
        tables.commit(1)
        assert reader.read().step == 1
        with pytest.raises(TornReadError, match="waiting for step 2"):
            reader.read(min_step=2, timeout_s=0.05)
    finally:
        reader.close()


def test_zero_copy_reading_sees_writes_and_flags_a_broken_handshake(name, tables):
    """reading() yields the shared tensors themselves: a later write shows through them
    without a copy, and since it overlapped the read, leaving the block raises."""
    tables.add_row(([5, 6], [7]), 1)
    tables.commit(0)
    reader = SharedBlockTables.attach(name)
    try:
        start, end = reader.data_address_range()
        view = reader.block_table(0)
        assert start <= view.data_ptr() < end  # the tensor lies inside the mapping
        with reader.reading(step=0) as snap:
            assert snap.block_tables[0] is view
            assert view[1, :2].tolist() == [5, 6]
        with pytest.raises(TornReadError, match="handshake"):
            with reader.reading(step=0) as snap:
                tables.append_row(([8], []), 1)
                assert snap.block_tables[0][1, 2] == 8  # the writer's store, seen in place
        tables.commit(1)
    finally:
        reader.close()


@pytest.mark.parametrize("call,match", [
    (lambda t: t.add_row(([1],), 0), "1 KV-cache groups; these tables have 2"),
    (lambda t: t.add_row(([1], [2]), 8), r"row 8 out of range \[0, 8\)"),
    (lambda t: t.add_row(([1], [2]), -1), "out of range"),
    (lambda t: t.add_row(([1], [2]), True), "row must be an int"),
    (lambda t: t.add_row(([1], [1, 2, 3, 4, 5]), 0), "exceed the table's width of 4"),
    (lambda t: t.append_row(([1] * 15, [1]), 3), r"group 0, row 3: 2 \+ 15 blocks exceed"),
    (lambda t: t.add_row(([1, -2], [2]), 0), "block ids must lie in"),
    (lambda t: t.add_row(([1, 1 << 31], [2]), 0), "block ids must lie in"),
    (lambda t: t.move_row(0, 9), "tgt 9 out of range"),
    (lambda t: t.commit(0), "step 0 is not after the last published step 0"),
    (lambda t: t.commit(1.0), "step must be an int"),
    (lambda t: t.read([0, 8]), r"rows must lie in \[0, 8\)"),
])
def test_bad_input_is_refused_and_changes_nothing(tables, call, match):
    tables.add_row(([1, 2], [3]), 3)
    tables.commit(0)
    before = _state(tables)
    with pytest.raises(UsageError, match=match):
        call(tables)
    assert _same(before, _state(tables))


@pytest.mark.parametrize("kwargs,match", [
    ({"max_num_reqs": 0, "max_model_len": 8, "block_sizes": [4]}, "max_num_reqs"),
    ({"max_num_reqs": 2, "max_model_len": 8, "block_sizes": []}, "1..8 KV-cache groups"),
    ({"max_num_reqs": 2, "max_model_len": 8, "block_sizes": [4, 0]}, "block size"),
    ({"max_num_reqs": 2, "max_model_len": 8, "block_sizes": [4], "max_num_blocks_per_req": [1, 2]},
     "2 entries for 1 block sizes"),
])
def test_create_rejects_bad_sizes(name, kwargs, match):
    with pytest.raises(UsageError, match=match):
        SharedBlockTables.create(name, **kwargs)
    assert not os.path.exists(f"/dev/shm{block_tables_segment_name(name)}")


def test_attach_validates_the_header_naming_the_field(name, tables):
    with pytest.raises(SegmentExistsError):
        SharedBlockTables.create(name, max_num_reqs=8, max_model_len=64, block_sizes=[4])
    with pytest.raises(SegmentNotFoundError):
        SharedBlockTables.attach(name + "-nope")
    hdr = np.ndarray((1,), BT_HEADER_DTYPE, buffer=tables._segment.buf)
    for field, value, match in [
        ("magic", 1234, "header field magic is '0x4d2', expected '0x1a5e4b7674626c31'"),
        ("layout_version", 99,
         f"header field layout_version is 99, expected {L.BT_LAYOUT_VERSION}"),
        ("total_bytes", 64, "header field total_bytes is 64"),
        ("num_groups", 9, "header field num_groups is 9, expected 1..8"),
    ]:
        saved = hdr[field].copy()
        hdr[field] = value
        try:
            with pytest.raises(LayoutMismatchError, match=match):
                SharedBlockTables.attach(name)
        finally:
            hdr[field] = saved
    del hdr
    SharedBlockTables.attach(name).close()


def _slots_by_loop(table, req_indices, positions, bs):
    return [int(table[r, p // bs]) * bs + p % bs if r >= 0 else PAD_SLOT_ID
            for r, p in zip(req_indices.tolist(), positions.tolist(), strict=True)]


@pytest.mark.parametrize("kind", ["prefill", "decode", "mixed"])
def test_slot_mapping_matches_the_formula(kind, rank_path):
    """Slots of prefill (many tokens per request), decode (one) and mixed batches equal
    block_id * block_size + position % block_size, token by token."""
    rng = random.Random(kind)
    bs, width, num_reqs = 16, 32, 12
    table = torch.randint(1, 10_000, (num_reqs, width), dtype=torch.int32)
    starts, counts = [], []
    for _ in range(num_reqs):
        n = {"prefill": rng.randint(1, 200), "decode": 1,
             "mixed": rng.choice([1, rng.randint(1, 200)])}[kind]
        start = 0 if kind == "prefill" else rng.randrange(width * bs - n)
        starts.append(start)
        counts.append(n)
    req_indices, positions = batch_token_indices(counts, starts)
    assert req_indices.numel() == sum(counts)
    assert positions[: counts[0]].tolist() == list(range(starts[0], starts[0] + counts[0]))
    slots = compute_slot_mapping(table, req_indices, positions, bs)
    assert slots.dtype == torch.int64
    assert slots.tolist() == _slots_by_loop(table, req_indices, positions, bs)


def test_slot_mapping_pads_and_refuses_out_of_range_positions(rank_path):
    table = torch.tensor([[3, 4], [5, 6]], dtype=torch.int32)
    slots = compute_slot_mapping(table, torch.tensor([1, -1, 0]), torch.tensor([5, 0, 0]), 4)
    assert slots.tolist() == [6 * 4 + 1, PAD_SLOT_ID, 12]
    with pytest.raises(UsageError, match=r"positions must lie in \[0, 8\)"):
        compute_slot_mapping(table, torch.tensor([0]), torch.tensor([8]), 4)
    with pytest.raises(UsageError, match="row index 2 out of range"):
        compute_slot_mapping(table, torch.tensor([2]), torch.tensor([0]), 4)
    with pytest.raises(UsageError, match="one length"):
        batch_token_indices([1, 2], [0])


def test_snapshot_slot_mappings_per_group(tables, rank_path):
    tables.add_row(([1, 2, 3], [7]), 4)
    tables.commit(0)
    snap = tables.read([4])
    req_indices, positions = batch_token_indices([3], [3])
    sm = snap.slot_mappings(req_indices, positions)
    assert sm[0].tolist() == [1 * 4 + 3, 2 * 4 + 0, 2 * 4 + 1]
    assert sm[1].tolist() == [7 * 16 + 3, 7 * 16 + 4, 7 * 16 + 5]


# --------------------------------------------------------------------------- KV store

def test_kv_store_layers_share_one_segment(name):
    with KVStore.create(name, num_layers=3, num_blocks=10, block_size=4, num_kv_heads=2,
                        head_size=8, dtype="float16") as kv:
        other = KVStore.attach(name)
        try:
            assert other.dtype == torch.float16 and len(other.key_cache) == 3
            k, v = other.layer(2)
            assert tuple(k.shape) == (10, 4, 2, 8) and tuple(v.shape) == (10, 4, 2, 8)
            kv.value_cache[2][7, 1, 0, 3] = 1.5
            assert float(v[7, 1, 0, 3]) == 1.5  # the other mapping sees it, no copy
            assert float(other.key_cache[2][7, 1, 0, 3]) == 0.0
            assert kv.kv.data_ptr() % 4096 == 0  # page-aligned, as cudaHostRegister wants
            assert os.stat(f"/dev/shm{kv_store_segment_name(name)}").st_mode & 0o777 == 0o600
        finally:
            del k, v
            other.close()
    assert not os.path.exists(f"/dev/shm{kv_store_segment_name(name)}")


@pytest.mark.parametrize("kwargs,match", [
    ({"num_layers": 0}, "num_layers must be a positive int"),
    ({"head_size": 2.0}, "head_size must be a positive int"),
    ({"dtype": "int7"}, "dtype 'int7' is not one of"),
])
def test_kv_store_rejects_bad_arguments(name, kwargs, match):
    args = {"num_layers": 1, "num_blocks": 4, "block_size": 4, "num_kv_heads": 1, "head_size": 8}
    args.update(kwargs)
    with pytest.raises(UsageError, match=match):
        KVStore.create(name, **args)
    assert not os.path.exists(f"/dev/shm{kv_store_segment_name(name)}")


def test_kv_store_attach_validates_the_header(name):
    kv = KVStore.create(name, num_layers=1, num_blocks=4, block_size=4, num_kv_heads=1,
                        head_size=8)
    try:
        hdr = np.ndarray((1,), KV_HEADER_DTYPE, buffer=kv._segment.buf)
        for field, value, match in [
            ("magic", 7, "header field magic is '0x7'"),
            ("layout_version", 99,
             f"header field layout_version is 99, expected {L.KV_LAYOUT_VERSION}"),
            ("dtype", b"int7", "header field dtype is 'int7'"),
            ("element_bytes", 2, "header field element_bytes is 2, expected 4"),
            ("num_blocks", 5, "header field total_bytes"),
        ]:
            saved = hdr[field].copy()
            hdr[field] = value
            try:
                with pytest.raises(LayoutMismatchError, match=match):
                    KVStore.attach(name)
            finally:
                hdr[field] = saved
        del hdr
        KVStore.attach(name).close()
        with pytest.raises(SegmentNotFoundError):
            KVStore.attach(name + "-nope")
    finally:
        kv.close()


def test_kv_store_load_and_store_blocks_round_trip_on_cpu(name):
    """load_blocks / store_blocks (the host <-> device copies) work on any device; on CPU
    they move rows between the store and a private tensor by block id."""
    with KVStore.create(name, num_layers=2, num_blocks=6, block_size=2, num_kv_heads=1,
                        head_size=4) as kv:
        kv.kv.copy_(torch.arange(kv.kv.numel(), dtype=torch.float32).view_as(kv.kv))
        dev = kv.allocate_device_cache("cpu", num_blocks=3)
        kv.load_blocks(dev, [4, 1], device_block_ids=[0, 2])
        assert torch.equal(dev[:, :, 0], kv.kv[:, :, 4])
        assert torch.equal(dev[:, :, 2], kv.kv[:, :, 1])
        dev[:, :, 0] += 1000
        kv.store_blocks(dev, [5], device_block_ids=[0])
        assert torch.equal(kv.kv[:, :, 5], dev[:, :, 0])
        kv.load_blocks(dev, [1, 2], device_block_ids=[1, 2])
        assert torch.equal(dev[:, :, 1:3], kv.kv[:, :, 1:3])
        with pytest.raises(UsageError, match=r"device_block_ids must lie in \[0, 3\)"):
            kv.load_blocks(dev, [1], device_block_ids=[3])
        with pytest.raises(UsageError, match=r"block_ids must lie in \[0, 6\): found 6"):
            kv.store_blocks(dev, [6], device_block_ids=[0])
        with pytest.raises(UsageError, match="does not match"):
            kv.load_blocks(torch.zeros(2, 2, 3, 2, 1, 5), [1])
        with pytest.raises(UsageError, match="CUDA"):
            if not torch.cuda.is_available():
                kv.pin()
            else:
                raise UsageError("CUDA present: covered by the gpu tests")


# --------------------------------------------------------------------------- GPU (skipped here)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.gpu
@needs_cuda
def test_pinned_store_copies_blocks_to_and_from_a_gpu(name):
    with KVStore.create(name, num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2,
                        head_size=8) as kv:
        kv.pin()
        assert kv.is_pinned
        kv.kv.normal_()
        dev = kv.allocate_device_cache("cuda")
        kv.load_blocks(dev, [3, 5])
        torch.cuda.synchronize()
        assert torch.equal(dev[:, :, 3].cpu(), kv.kv[:, :, 3])
        dev[:, :, 6] = 2.0
        kv.store_blocks(dev, [6])
        assert bool((kv.kv[:, :, 6] == 2.0).all())
        kv.unpin()
        assert not kv.is_pinned


# --------------------------------------------------------------------------- batched rows

def test_add_rows_and_append_rows_equal_the_row_by_row_calls(name, writer_path):
    """Both paths: row by row for a few rows, vectorised for many."""
    rng = random.Random(11)
    with SharedBlockTables.create(name, max_num_reqs=64, max_model_len=64,
                                  block_sizes=[4, 16]) as batched:
        single = SharedBlockTables.create(name + "-1", max_num_reqs=64, max_model_len=64,
                                          block_sizes=[4, 16])
        try:
            for step in range(40):
                rows = rng.sample(range(64), rng.choice([rng.randint(1, 8), rng.randint(25, 64)]))
                appending = rng.random() < 0.5
                ids = []
                for r in rows:
                    lens = ([int(n) for n in single.num_blocks_per_row[:, r]] if appending
                            else [0, 0])
                    ids.append(([rng.randrange(1, 99) for _ in range(rng.randint(0, 16 - lens[0]))],
                                [rng.randrange(1, 99) for _ in range(rng.randint(0, 4 - lens[1]))]))
                (batched.append_rows if appending else batched.add_rows)(ids, rows)
                for r, row_ids in zip(rows, ids, strict=True):
                    (single.append_row if appending else single.add_row)(row_ids, r)
                batched.commit(step)
                single.commit(step)
                for g in range(2):
                    assert torch.equal(batched.block_table(g), single.block_table(g))
                assert torch.equal(batched.num_blocks_per_row, single.num_blocks_per_row)
        finally:
            single.close()
            SharedBlockTables.unlink(name + "-1")


def test_a_few_rows_of_arrays_or_numpy_ints_end_the_same_as_lists(name, writer_path):
    """The few-row path's plain-list plan gives way to the row-by-row checks for ids that
    are arrays, tensors or numpy ints (and row indices that are numpy ints): the tables
    end the same as with lists."""
    kinds = [lambda ids: ids, np.array, torch.tensor, lambda ids: [np.int64(i) for i in ids]]
    made = []
    try:
        for k, kind in enumerate(kinds):
            t = SharedBlockTables.create(f"{name}-{k}", max_num_reqs=8, max_model_len=64,
                                         block_sizes=[4, 16])
            made.append(t)
            rows = [np.int64(5), 1] if k == 3 else [5, 1]
            t.add_rows([(kind([7, 8]), kind([9])), (kind([1]), kind([2, 3]))], rows)
            t.append_rows([(kind([4]), kind([])), (kind([6, 6]), kind([5]))], [1, 5])
            t.commit(0)
        for t in made[1:]:
            for g in range(2):
                assert torch.equal(t.block_table(g), made[0].block_table(g))
            assert torch.equal(t.num_blocks_per_row, made[0].num_blocks_per_row)
        assert made[0].num_blocks_per_row[:, 5].tolist() == [4, 2]
        assert made[0].block_table(0)[5, :4].tolist() == [7, 8, 6, 6]
    finally:
        for k, t in enumerate(made):
            t.close()
            SharedBlockTables.unlink(f"{name}-{k}")


@pytest.mark.parametrize("call,match", [
    (lambda t: t.add_rows([([1], [2])], [0, 1]), "1 rows of block ids for 2 row indices"),
    (lambda t: t.add_rows([([1], [2]), ([1], [2])], [1, 1]), "a row appears twice"),
    (lambda t: t.add_rows([([1], [2])], [8]), r"rows must lie in \[0, 8\)"),
    (lambda t: t.add_rows([([1],)], [0]), "row 0: block ids for 1 KV-cache groups"),
    (lambda t: t.append_rows([([1], [2]), ([1] * 15, [])], [0, 3]),
     r"group 0, row 3: 2 \+ 15 blocks exceed"),
    (lambda t: t.add_rows([([1], [2]), ([1], [-5])], [0, 1]), "group 1.*block ids must lie in"),
])
@pytest.mark.parametrize("row_by_row_max", [24, 0], ids=["row-by-row", "vectorised"])
def test_batched_bad_input_is_refused_and_changes_nothing(tables, call, match, row_by_row_max,
                                                         monkeypatch, writer_path):
    monkeypatch.setattr(table_writer_module, "_ROW_BY_ROW_MAX", row_by_row_max)
    tables.add_row(([1, 2], [3]), 3)
    tables.commit(0)
    before = _state(tables)
    with pytest.raises(UsageError, match=match):
        call(tables)
    assert _same(before, _state(tables))


def test_compute_slot_mappings_reads_the_shared_rows_in_place(name, tables, rank_path):
    """Slots straight from the shared tables equal those of a gathered snapshot; rows are
    table rows, req_indices index the rows list."""
    tables.add_rows([([1, 2, 3], [7]), ([4, 5], [8])], [6, 2])
    tables.commit(3)
    reader = SharedBlockTables.attach(name)
    try:
        req_indices, positions = batch_token_indices([5, 1], [2, 7])
        step, direct = reader.compute_slot_mappings([6, 2], req_indices, positions, min_step=3)
        snap = reader.read([6, 2])
        assert step == 3
        for a, b in zip(direct, snap.slot_mappings(req_indices, positions), strict=True):
            assert torch.equal(a, b)
        assert direct[0].tolist() == [1 * 4 + 2, 1 * 4 + 3, 2 * 4, 2 * 4 + 1, 2 * 4 + 2, 5 * 4 + 3]
        with pytest.raises(UsageError, match="rows must lie"):
            reader.compute_slot_mappings([9], req_indices[:1], positions[:1])
        with pytest.raises(UsageError, match="req_indices must lie"):
            reader.compute_slot_mappings([6], [1], positions[:1])
        with pytest.raises(UsageError, match="positions must lie"):
            reader.compute_slot_mappings([6], [0], [64])
        with pytest.raises(UsageError, match="1 req_indices but 2 positions"):
            reader.compute_slot_mappings([6], [0], [1, 2])
        assert [s.tolist() for s in reader.compute_slot_mappings([6], [], [])[1]] == [[], []]
        tables.append_row(([9], []), 6)
        with pytest.raises(TornReadError):
            reader.compute_slot_mappings([6], req_indices[:1], positions[:1], timeout_s=0.05)
    finally:
        reader.close()


def _outcome(fn, *args) -> tuple:
    """What a call gave: its tensors (dtype and values) or its exception (type, message)."""
    try:
        result = fn(*args)
    except Exception as exc:  # noqa: BLE001 - the exception is the outcome compared
        return ("raised", type(exc).__name__, str(exc))
    if isinstance(result[0], int):  # compute_slot_mappings: (step, slots per group)
        return ("ok", result[0], [(str(t.dtype), t.tolist()) for t in result[1]])
    return ("ok", [(str(t.dtype), t.tolist()) for t in result])


def _both_paths(monkeypatch, fn, *args) -> tuple[tuple, tuple]:
    c = _outcome(fn, *args)
    with monkeypatch.context() as m:
        m.setattr(slot_mapping_module, "c_slot_mappings", None)
        m.setattr(slot_mapping_module, "c_token_indices", None)
        reference = _outcome(fn, *args)
    return c, reference


def _container(rng: random.Random, values: list):
    """``values`` as one of the shapes callers pass: lists, tuples, arrays, tensors, and
    a few the C helpers refuse (int32, floats, bools, numpy ints, 2-d)."""
    kind = rng.choice(["list", "tuple", "np64", "t64"] * 4 + [
        "np32", "t32", "float", "bool", "npint", "2d", "strided"])
    if kind in ("np32", "t32") and any(abs(v) >= 2**31 for v in values):
        kind = "list"  # not representable in int32
    if kind == "list":
        return list(values)
    if kind == "tuple":
        return tuple(values)
    if kind in ("np64", "np32"):
        return np.array(values, dtype=np.int64 if kind == "np64" else np.int32)
    if kind in ("t64", "t32"):
        return torch.tensor(values, dtype=torch.int64 if kind == "t64" else torch.int32)
    if kind == "float":
        return [float(v) for v in values]
    if kind == "bool":
        return [bool(v) for v in values]
    if kind == "npint":
        return [np.int64(v) for v in values]
    if kind == "2d":
        return np.array(values, dtype=np.int64).reshape(1, -1)
    return np.repeat(np.array(values, dtype=np.int64), 2)[::2]  # a strided view


@pytest.mark.skipif(slot_mapping_module.c_token_indices is None,
                    reason="the C kernel is not built")
def test_the_c_rank_helpers_answer_as_numpy_does_for_every_input(name, tables, monkeypatch):
    """Random batches, good and bad, in every container: batch_token_indices and
    compute_slot_mappings give the same tensors or the same error on the C path as on
    numpy's (the C helpers take what they can read exactly, numpy the rest)."""
    rng = random.Random(7)
    tables.add_rows([([1, 2, 3, 4, 5], [7, 8]), ([4, 5], [9])], [6, 2])
    tables.commit(1)
    reader = SharedBlockTables.attach(name)
    c_took = {"token_indices": 0, "slot_mappings": 0}
    op = slot_mapping_module.c_operand
    try:
        for _ in range(1500):
            n = rng.randint(0, 5)
            counts = [rng.choice([0, 1, 1, 2, 5, 9, -1]) for _ in range(n)]
            starts = [rng.choice([0, 3, 30, 60, -2, 2**62, 2**63 - 3]) for _ in range(
                n + rng.choice([0, 0, 0, 1]))]
            args = (_container(rng, counts), _container(rng, starts))
            c, ref = _both_paths(monkeypatch, batch_token_indices, *args)
            assert c == ref, (counts, starts)
            operands = [op(a) for a in args]
            if all(x is not None for x in operands) and slot_mapping_module.c_token_indices(
                    *operands, np.empty(0, np.int64), np.empty(0, np.int64)) >= 0:
                c_took["token_indices"] += 1
            rows = [rng.choice([0, 2, 6, 6, 7, 7, 8, -1]) for _ in range(rng.randint(1, 3))]
            t = rng.randint(0, 6)
            req = [rng.choice([0, 0, 0, 1, 2, -1]) for _ in range(t)]
            pos = [rng.choice([0, 5, 19, 33, 50, 63, 64, -1])
                   for _ in range(t + rng.choice([0, 0, 0, 1]))]
            args = (_container(rng, rows), _container(rng, req), _container(rng, pos))
            c, ref = _both_paths(monkeypatch, reader.compute_slot_mappings, *args)
            assert c == ref, (rows, req, pos)
            operands = [op(a) for a in args]
            if all(x is not None for x in operands) and slot_mapping_module.c_slot_mappings(
                    reader._tables_c, reader.block_sizes, *operands, None):
                c_took["slot_mappings"] += 1
        # Enough of the cases went the C way for the comparison to mean something.
        assert min(c_took.values()) >= 80, c_took
        reader.close()
        c, ref = _both_paths(monkeypatch, reader.compute_slot_mappings, [6], [0], [0])
        assert c == ref and c[1] == "PoolClosedError"
    finally:
        reader.close()


@pytest.mark.skipif(slot_mapping_module.c_token_indices is None,
                    reason="the C kernel is not built")
def test_the_c_rank_helpers_take_a_regular_batch_and_refuse_the_rest(tables):
    """The C path is the one a regular batch takes (so the comparison above compares two
    paths), and it writes nothing when it says no."""
    token_indices = slot_mapping_module.c_token_indices
    slot_mappings = slot_mapping_module.c_slot_mappings
    req, pos = np.full(3, -7, np.int64), np.full(3, -7, np.int64)
    assert token_indices([2, 3], [0, 10], req, pos) == 5  # too short: nothing written
    assert req.tolist() == pos.tolist() == [-7, -7, -7]
    assert token_indices([2, 1], [0, 10], req, pos) == 3
    assert (req.tolist(), pos.tolist()) == ([0, 0, 1], [0, 1, 10])
    assert token_indices([1, -1], [0, 0], req, pos) == -1
    assert token_indices([1.0], [0], req, pos) == -1
    assert token_indices([1, 1], [0], req, pos) == -1
    tables.add_row(([1, 2], [7]), 3)
    tables.commit(1)
    groups = tables._tables_c
    out = np.full((2, 2), -7, np.int64)
    assert slot_mappings(groups, tables.block_sizes, [3], [0, 0], [1, 5], None) is True
    assert slot_mappings(groups, tables.block_sizes, [3], [0, 0], [1, 5], out) is True
    assert out.tolist() == [[1 * 4 + 1, 2 * 4 + 1], [7 * 16 + 1, 7 * 16 + 5]]
    out[:] = -7
    for rows, req_i, pos_i in [([8], [0], [0]), ([3], [1], [0]), ([3], [0], [64]),
                               ([3], [0], [-1]), ([3], [0, 0], [0]), ([3], [0], [0.5])]:
        assert slot_mappings(groups, tables.block_sizes, rows, req_i, pos_i, out[:, :1]
                             .copy()) is False
    assert slot_mappings(groups, tables.block_sizes, [3], [0], [0], out) is False  # wrong size
    assert (out == -7).all()
    with pytest.raises(TypeError):  # no group: a caller's bug, not a batch to refuse
        slot_mappings((), (), [3], [0], [0], None)
    with pytest.raises(TypeError):
        table_writer_module._c_scatter_rows((), tables._num_blocks_np, [1], [[]], False, 9,
                                           lambda: None)


@pytest.mark.skipif(slot_mapping_module.c_token_indices is None,
                    reason="the C kernel is not built")
def test_inputs_changed_between_the_c_check_and_the_c_pass_go_the_numpy_way(
        name, tables, monkeypatch):
    """Another thread may change the caller's lists between the C helper's check and its
    pass: the pass then refuses them, and the answer is numpy's on what the lists became
    (here an error), never the unwritten output buffer."""
    real_slots, real_tokens = (slot_mapping_module.c_slot_mappings,
                               slot_mapping_module.c_token_indices)
    rows, counts = [6], [2, 3]
    calls = {"slots": 0, "tokens": 0}

    def slots_then_meddle(*args):
        calls["slots"] += 1
        if calls["slots"] == 2:  # the pass after the check
            rows[0] = 9
        return real_slots(*args)

    def tokens_then_meddle(*args):
        calls["tokens"] += 1
        if calls["tokens"] == 2:  # the prefill's second, sized call
            counts[1] = -1
        return real_tokens(*args)

    monkeypatch.setattr(slot_mapping_module, "c_slot_mappings", slots_then_meddle)
    monkeypatch.setattr(slot_mapping_module, "c_token_indices", tokens_then_meddle)
    tables.add_row(([1, 2], [7]), 6)
    tables.commit(1)
    with pytest.raises(UsageError, match=r"rows must lie in \[0, 8\), got 9"):
        tables.compute_slot_mappings(rows, [0], [1])
    with pytest.raises(UsageError, match="must be >= 0"):
        batch_token_indices(counts, [0, 10])
    assert calls == {"slots": 2, "tokens": 2}


@pytest.mark.skipif(table_writer_module._c_scatter_rows is None,
                    reason="the C kernel is not built")
def test_the_c_row_writer_ends_as_the_python_one_on_random_batches(name, monkeypatch):
    """Random add_rows / append_rows, good and bad (rows repeated or out of range, ids
    negative or too many, wrong group counts, numpy ints, arrays), on two tables: one
    through the C pass, one through Python. After every call both hold the same rows,
    lengths and seqlock word, or both raised the same error."""
    rng = random.Random(5)
    c_tables = SharedBlockTables.create(name, max_num_reqs=16, max_model_len=64,
                                        block_sizes=[4, 16])
    py_tables = SharedBlockTables.create(name + "-py", max_num_reqs=16, max_model_len=64,
                                         block_sizes=[4, 16])
    took = 0
    try:
        for step in range(1, 400):
            rows = [rng.choice(list(range(16)) * 3 + [16, -1]) for _ in range(rng.randint(0, 6))]
            ids = []
            for _ in rows:
                row = [[rng.choice([1, 5, 90, 2**31 - 1, 2**31, -1] if rng.random() < 0.1
                                   else [1, 5, 90]) for _ in range(rng.randint(0, limit))]
                       for limit in (5, 2)]
                kind = rng.random()
                if kind < 0.05:
                    row = row[:1]
                elif kind < 0.1:
                    row = [np.array(row[0], dtype=np.int64), row[1]]
                elif kind < 0.15:
                    row = [[np.int64(i) for i in row[0]], tuple(row[1])]
                ids.append(tuple(row) if kind > 0.9 else row)
            appending = rng.random() < 0.7
            outcomes = []
            for t, fast in ((c_tables, True), (py_tables, False)):
                with monkeypatch.context() as m:
                    if not fast:
                        m.setattr(table_writer_module, "_c_scatter_rows", None)
                    try:
                        (t.append_rows if appending else t.add_rows)(ids, rows)
                        outcomes.append("ok")
                    except UsageError as exc:
                        outcomes.append(str(exc))
            assert outcomes[0] == outcomes[1], (rows, ids)
            assert _same(_state(c_tables), _state(py_tables)), (rows, ids)
            if outcomes[0] == "ok" and rows and all(type(r) is list for r in ids):
                took += 1
            if rng.random() < 0.3:
                c_tables.commit(step)
                py_tables.commit(step)
            if rng.random() < 0.1:  # keep room in the rows
                c_tables.clear()
                py_tables.clear()
        assert took >= 50, took  # enough calls went the C way to compare two paths
    finally:
        for t, n in ((c_tables, name), (py_tables, name + "-py")):
            t.close()
            SharedBlockTables.unlink(n)


@pytest.mark.skipif(table_writer_module._c_scatter_rows is None,
                    reason="the C kernel is not built")
def test_the_c_row_writer_checks_all_before_begin_write_and_stores_what_it_checked(tables):
    """It calls begin_write only once everything is checked (a refusal calls nothing and
    writes nothing), an exception from begin_write writes nothing, and what it stores is
    what it checked, even if the caller's lists change inside begin_write (another thread
    may run there)."""
    scatter = table_writer_module._c_scatter_rows
    groups, lengths = tables._tables_c, tables._num_blocks_np
    calls = []
    before = _state(tables)
    for rows, ids in [([1, 1], [[[1], [2]], [[3], [4]]]), ([1], [[[1] * 17, [2]]]),
                      ([1], [[[-1], [2]]]), ([1], [[[1]]]), ([1], [[[1.0], [2]]])]:
        assert scatter(groups, lengths, rows, ids, True, 99, lambda: calls.append(1)) is False
    assert calls == [] and _same(before, _state(tables))

    def fail():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        scatter(groups, lengths, [2], [[[7], [8]]], False, 99, fail)
    assert _same(before, _state(tables))
    ids = [[[7, 8], [9]]]

    def meddle():
        ids[0][0][:] = [-5] * 40  # a thread changing the lists mid-call
        ids.clear()

    assert scatter(groups, lengths, [2], ids, False, 99, meddle) is True
    assert tables._tables_np[0][2, :3].tolist() == [7, 8, 0]
    assert tables._tables_np[1][2, :2].tolist() == [9, 0]
    assert tables._num_blocks_np[:, 2].tolist() == [2, 1]


def _open_and_fill(handle: bytes, done) -> None:
    from shmkv.ranks.block_table import open_device_tensor

    t = open_device_tensor(handle)
    t.fill_(3.0)
    torch.cuda.synchronize()
    done.set()


@pytest.mark.gpu
@needs_cuda
def test_device_tensor_is_shared_through_cuda_ipc():
    """A KV tensor on the GPU, exported as a CUDA IPC handle: another process maps the same
    device memory and its write shows in the exporter's tensor."""
    import multiprocessing as mp

    from shmkv.ranks.block_table import export_device_tensor

    ctx = mp.get_context("spawn")
    t = torch.zeros(4, 16, device="cuda")
    done = ctx.Event()
    p = ctx.Process(target=_open_and_fill, args=(export_device_tensor(t), done))
    p.start()
    try:
        assert done.wait(120)
        p.join(60)
        assert p.exitcode == 0
        assert bool((t == 3.0).all())
    finally:
        if p.is_alive():
            p.kill()
            p.join(10)


def test_export_device_tensor_refuses_a_cpu_tensor():
    from shmkv.ranks.block_table import export_device_tensor

    with pytest.raises(UsageError, match="needs a CUDA tensor"):
        export_device_tensor(torch.zeros(2))


def test_use_after_close_is_a_clear_error(name):
    from shmkv.errors import PoolClosedError

    t = SharedBlockTables.create(name, max_num_reqs=2, max_model_len=8, block_sizes=[4])
    t.close()
    t.close()  # idempotent
    for call in (lambda: t.add_row(([1],), 0), lambda: t.commit(0), lambda: t.read(),
                 lambda: t.block_table(0), lambda: t.step):
        with pytest.raises(PoolClosedError, match="was closed"):
            call()
    kv = KVStore.create(name, num_layers=1, num_blocks=2, block_size=4, num_kv_heads=1,
                        head_size=4)
    kv.close()
    with pytest.raises(PoolClosedError, match="was closed"):
        kv.layer(0)


def test_a_writer_that_died_mid_step_leaves_the_tables_unreadable_until_a_successor_commits(
        name, tables):
    tables.add_row(([1], [2]), 0)
    tables.commit(0)
    tables.add_row(([9, 9], [9]), 0)  # ... and the writer dies here: seq stays odd
    successor = SharedBlockTables.attach(name)
    reader = SharedBlockTables.attach(name)
    try:
        with pytest.raises(TornReadError):
            reader.read(timeout_s=0.05)
        successor.add_row(([3], [4]), 0)
        with pytest.raises(TornReadError):  # still odd while the successor writes
            reader.read(timeout_s=0.05)
        successor.commit(1)
        snap = reader.read([0])
        assert snap.step == 1 and snap.block_tables[0][0, 0] == 3 and snap.num_blocks[0, 0] == 1
    finally:
        successor.close()
        reader.close()
