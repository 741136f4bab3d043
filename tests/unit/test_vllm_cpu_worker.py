"""shmkv's transfer worker for vLLM's CPU platform (``shmkv/vllm/cpu_worker.py``) over a real
vLLM ``SharedOffloadRegion``: stores put each block's bytes where vLLM's own handler puts
them (chunk row, this worker's slot, tensor area, sub-block), loads bring them back byte for
byte, runs of consecutive blocks are single copies, and bad transfers are refused. Each
transfer test runs with the device side in both of vLLM's forms: a ``GPULoadStoreSpec`` of
block ids (up to 0.33) and, where the installed vLLM has them, 0.34's ``DevicePointers``
made by vLLM's own ``resolve_device_pointers``."""

from __future__ import annotations

import os
import uuid

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm.v1.kv_offload.cpu.shared_offload_region")

from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec  # noqa: E402
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion  # noqa: E402

from shmkv.errors import UsageError  # noqa: E402
from shmkv.vllm.compat import DEVICE_POINTERS  # noqa: E402
from shmkv.vllm.cpu_worker import CPUTransferWorker, copy_runs  # noqa: E402

FORMS = ["block_ids", pytest.param("device_pointers", marks=pytest.mark.skipif(
    not DEVICE_POINTERS, reason="this vLLM passes block ids only (DevicePointers: 0.34)"))]


def _device(form: str, kv: CanonicalKVCaches, block_ids, group_sizes, block_indices):
    """The device side of a transfer in vLLM's ``form``."""
    spec = GPULoadStoreSpec(block_ids, group_sizes=group_sizes, block_indices=block_indices)
    if form == "block_ids":
        return spec
    from vllm.v1.kv_offload.pointer_utils import resolve_device_pointers

    return resolve_device_pointers(spec, kv)

PAGES = (2048, 2048)  # two KV tensors (say K and V of one layer group), bytes per block
NUM_BLOCKS = 12
NUM_CHUNKS = 8


@pytest.fixture
def engine_id():
    name = f"shmkv-test-cpuw-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield name
    for suffix in ("", ".0"):
        try:
            os.unlink(f"/dev/shm/vllm_offload_{name}.mmap{suffix}")
        except FileNotFoundError:
            pass


def _kv(seed: int) -> CanonicalKVCaches:
    gen = torch.Generator().manual_seed(seed)
    tensors = [CanonicalKVCacheTensor(
        tensor=torch.randint(-128, 127, (NUM_BLOCKS, page), dtype=torch.int8, generator=gen),
        page_size_bytes=page) for page in PAGES]
    refs = [[CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=page)
             for i, page in enumerate(PAGES)]]
    return CanonicalKVCaches(tensors=tensors, group_data_refs=refs)


def _region(engine_id: str, bpc: int, world: int, rank: int) -> SharedOffloadRegion:
    slot = sum(PAGES) * bpc
    return SharedOffloadRegion(engine_id=engine_id, num_chunks=NUM_CHUNKS, rank=rank,
                               kv_bytes_per_chunk=slot * world, cpu_page_size=slot,
                               barrier=None)


def _expected_offset(chunk: int, sub: int, t_idx: int, bpc: int, world: int,
                     rank: int) -> int:
    """Where vLLM's handler puts sub-block ``sub`` of chunk ``chunk`` of tensor ``t_idx``:
    row ``chunk`` (every worker's slot), this worker's slot, the tensor's area in the slot
    (the tensors' areas in order), the sub-block's page."""
    slot = sum(PAGES) * bpc
    return (chunk * slot * world + rank * slot + sum(PAGES[:t_idx]) * bpc
            + sub * PAGES[t_idx])


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("bpc,world,rank", [(1, 1, 0), (2, 1, 0), (1, 2, 1), (2, 2, 1)])
def test_a_store_lands_where_vllm_puts_it_and_loads_back(engine_id, bpc, world, rank, form):
    """Device blocks 3, 4, 7 stored from one block into their chunks (the first chunk's
    first sub-block skipped when a chunk holds 2) are at vLLM's offsets in the region, and
    a second worker over the same region loads them into blocks 0..2 byte for byte."""
    kv = _kv(1)
    storer = CPUTransferWorker(kv, bpc, _region(engine_id, bpc, world, rank))
    device_ids, index = [3, 4, 7], 1
    num_chunks = -(-(index % bpc + len(device_ids)) // bpc)
    chunk_ids = [5, 2, 6][:num_chunks]
    gpu = _device(form, kv, device_ids, [3], [index])
    assert storer.submit_store(11, gpu, CPULoadStoreSpec(chunk_ids))
    done = storer.get_finished()
    assert [(r.job_id, r.success) for r in done] == [(11, True)]
    assert done[0].transfer_size == 3 * sum(PAGES)
    assert storer.get_finished() == []

    view = _region(engine_id, bpc, world, rank)
    raw = np.asarray(view.create_kv_memoryview()).reshape(-1)
    skip = index % bpc
    for k, block in enumerate(device_ids):
        chunk, sub = chunk_ids[(skip + k) // bpc], (skip + k) % bpc
        for t_idx, page in enumerate(PAGES):
            at = _expected_offset(chunk, sub, t_idx, bpc, world, rank)
            assert bytes(raw[at:at + page]) == kv.tensors[t_idx].tensor[block].numpy(
            ).tobytes(), (block, t_idx)
    del raw
    view.cleanup()

    fresh = _kv(2)
    loader = CPUTransferWorker(fresh, bpc, _region(engine_id, bpc, world, rank))
    dst = _device(form, fresh, [0, 1, 2], [3], [index])
    assert loader.submit_load(12, CPULoadStoreSpec(chunk_ids), dst)
    assert [r.job_id for r in loader.get_finished()] == [12]
    for t_idx in range(len(PAGES)):
        assert torch.equal(fresh.tensors[t_idx].tensor[:3], kv.tensors[t_idx].tensor[device_ids])
    storer.shutdown()
    loader.shutdown()


def test_consecutive_blocks_move_in_one_copy_per_run():
    """Runs: consecutive device blocks on consecutive sub-blocks are one copy; a jump on
    either side starts a new run; a chunk boundary splits a run only when the region's
    sub-blocks are not one strided view."""
    dev = np.array([4, 5, 6, 7, 9, 10])
    subs = np.array([8, 9, 10, 11, 12, 14])
    assert copy_runs(dev, subs, True, 2) == [(4, 8, 4), (9, 12, 1), (10, 14, 1)]
    assert copy_runs(dev, subs, False, 2) == [(4, 8, 2), (6, 10, 2), (9, 12, 1), (10, 14, 1)]
    assert copy_runs(np.array([], dtype=np.int64), np.array([], dtype=np.int64), True, 1) == []


@pytest.mark.parametrize("form", FORMS)
def test_a_transfer_that_does_not_match_its_groups_is_refused(engine_id, form):
    """Block counts that do not add up to the group sizes, or another number of groups,
    are a UsageError naming the numbers, and nothing is reported done."""
    kv = _kv(1)
    worker = CPUTransferWorker(kv, 1, _region(engine_id, 1, 1, 0))
    with pytest.raises(UsageError, match=r"3 blocks and 2 chunks does not match its group "
                                         r"sizes \[3\] \(they need 3 and 3\)"):
        worker.submit_store(1, _device(form, kv, [0, 1, 2], [3], [0]),
                            CPULoadStoreSpec([0, 1]))
    if form == "block_ids":  # vLLM's resolver asserts the group count itself
        with pytest.raises(UsageError, match="names 2 KV-cache groups, the worker has 1"):
            worker.submit_store(2, GPULoadStoreSpec([0, 1], group_sizes=[1, 1],
                                                    block_indices=[0, 0]),
                                CPULoadStoreSpec([0, 1]))
    with pytest.raises(UsageError, match=r"chunk ids in \[0, 8\]; there are 8"):
        worker.submit_load(3, CPULoadStoreSpec([0, 8]), _device(form, kv, [0, 1], [2], [0]))
    assert worker.get_finished() == []
    worker.shutdown()


@pytest.mark.skipif(not DEVICE_POINTERS, reason="DevicePointers: vLLM 0.34")
def test_device_pointers_that_are_not_the_workers_rows_are_refused(engine_id):
    """vLLM 0.34's device pointers must each start a row of the layer reference's tensor,
    copy its page, and name the same blocks for every layer of a group; anything else (a
    foreign tensor's addresses, an address inside a row, a short copy, layers disagreeing,
    another group count) is a UsageError and nothing is copied or reported."""
    from dataclasses import replace

    from vllm.v1.kv_offload.base import DevicePointers

    kv = _kv(1)
    worker = CPUTransferWorker(kv, 1, _region(engine_id, 1, 1, 0))
    before = [t.tensor.clone() for t in kv.tensors]
    good = _device("device_pointers", kv, [0, 1], [2], [0])
    foreign = _device("device_pointers", _kv(2), [0, 1], [2], [0])
    inside = replace(good, ptrs=good.ptrs + np.uint64(8))
    short = replace(good, sizes=good.sizes - np.uint64(1))
    disagree = replace(good, ptrs=np.concatenate([good.ptrs[:2], good.ptrs[2:][::-1]]))
    two_groups = DevicePointers(ptrs=good.ptrs, sizes=good.sizes, group_block_counts=(1, 1),
                                group_data_ref_counts=(2, 2), block_indices=(0, 0))
    for bad, match in ((foreign, "not rows of KV tensor 0"), (inside, "not rows of KV tensor"),
                       (short, "bytes per block of KV tensor 0, whose page is 2048"),
                       (disagree, "different blocks for the layers of KV-cache group 0"),
                       (two_groups, "names 2 KV-cache groups, the worker has 1")):
        with pytest.raises(UsageError, match=match):
            worker.submit_load(4, CPULoadStoreSpec([0, 1]), bad)
    assert worker.get_finished() == []
    assert all(torch.equal(a, t.tensor) for a, t in zip(before, kv.tensors, strict=True))
    worker.shutdown()
