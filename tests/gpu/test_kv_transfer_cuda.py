"""KV-store copies to and from a GPU against their CPU twin, byte for byte: both store
layouts, pinned or not, every kind of id set, chunked staging, and the stream ordering a
rank relies on (kernels queued after ``load_blocks`` see the rows; the store holds the bytes
when ``store_blocks`` returns). Skipped without CUDA (run by scripts/gpu_check.sh)."""

from __future__ import annotations

import os
import random

import pytest

torch = pytest.importorskip("torch")

from shmkv.ranks import transfer  # noqa: E402
from shmkv.ranks.kv_store import BLOCK_MAJOR, KV_LAYOUTS, KVStore  # noqa: E402
from tests.conftest import unique_pool_name  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]

NUM_BLOCKS = 64
ROWS = 40
GEOMETRY = {"num_layers": 4, "block_size": 16, "num_kv_heads": 2, "head_size": 64,
            "dtype": "bfloat16"}


def _id_sets() -> dict[str, tuple[list[int], list[int]]]:
    rng = random.Random(11)
    return {
        "consecutive": (list(range(10, 10 + ROWS)), list(range(ROWS))),
        "random": (rng.sample(range(NUM_BLOCKS), ROWS), rng.sample(range(ROWS), ROWS)),
        "runs": ([1, 2, 3, 30, 31, 63, 0], [5, 6, 7, 8, 9, 0, 39]),
        "one": ([NUM_BLOCKS - 1], [0]),
        "empty": ([], []),
    }


@pytest.fixture
def names():
    made: list[str] = []

    def make() -> str:
        made.append(unique_pool_name("kvg"))
        return made[-1]

    yield make
    for n in made:
        KVStore.unlink(n)


def _fill(t: torch.Tensor, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    b = t.view(torch.uint8)
    b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=gen))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.uint8)


def _store_pair(names, layout: str, pinned: bool) -> tuple[KVStore, KVStore]:
    """Two stores with the same random bytes: one copied to the GPU, one to the CPU."""
    a = KVStore.create(names(), num_blocks=NUM_BLOCKS, layout=layout, **GEOMETRY)
    b = KVStore.create(names(), num_blocks=NUM_BLOCKS, layout=layout, **GEOMETRY)
    _fill(a.kv, 1)
    b.kv.copy_(a.kv)
    if pinned:
        a.pin()
    return a, b


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "pageable"])
@pytest.mark.parametrize("layout", KV_LAYOUTS)
@pytest.mark.parametrize("ids", list(_id_sets()))
def test_cuda_copies_equal_the_cpu_twin(names, layout, pinned, ids):
    host_ids, rows = _id_sets()[ids]
    gpu_store, cpu_store = _store_pair(names, layout, pinned)
    try:
        gpu = gpu_store.allocate_device_cache("cuda", ROWS)
        cpu = cpu_store.allocate_device_cache("cpu", ROWS)
        gpu_store.load_blocks(gpu, host_ids, rows)
        cpu_store.load_blocks(cpu, host_ids, rows)
        torch.cuda.synchronize()
        assert torch.equal(_bytes(gpu), _bytes(cpu)), f"{layout}/{ids}: load"
        _fill(cpu, 2)
        gpu.copy_(cpu.to("cuda"))
        targets = [(h + 5) % NUM_BLOCKS for h in host_ids]
        gpu_store.store_blocks(gpu, targets, rows)
        cpu_store.store_blocks(cpu, targets, rows)
        # no synchronize: store_blocks returns once the store holds the bytes
        assert torch.equal(_bytes(gpu_store.kv), _bytes(cpu_store.kv)), f"{layout}/{ids}: store"
        del gpu, cpu
    finally:
        gpu_store.close()
        cpu_store.close()


def test_kernels_queued_after_a_load_see_its_rows(names):
    """No host sync between load_blocks and the next kernel on the current stream, also a
    non-default one; many chunks, so later DMAs overlap earlier index kernels."""
    gpu_store, cpu_store = _store_pair(names, BLOCK_MAJOR, pinned=True)
    try:
        host_ids = random.Random(5).sample(range(NUM_BLOCKS), ROWS)
        rows = list(range(ROWS))
        cpu = cpu_store.allocate_device_cache("cpu", ROWS)
        cpu_store.load_blocks(cpu, host_ids, rows)
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            gpu = gpu_store.allocate_device_cache("cuda", ROWS)
            plan = transfer.plan_transfer(host_ids, rows, NUM_BLOCKS, ROWS, unique="device")
            transfer.copy_staged(gpu_store.kv, gpu, plan, to_device=True, non_blocking=True,
                                 copy_stream=gpu_store._copy_stream(gpu.device),
                                 chunk_bytes=3 * gpu[:, :, 0].numel() * 2)
            seen = gpu.clone()  # queued on `side` right after the copies
        side.synchronize()
        assert torch.equal(_bytes(seen), _bytes(cpu))
        del gpu, seen
    finally:
        gpu_store.close()
        cpu_store.close()


def test_many_processes_pin_one_store(names):
    """Two processes pin the same shared store at once (each registers its own mapping)
    and load from it; each gets the store's bytes."""
    import subprocess
    import sys
    from pathlib import Path

    name = names()
    store = KVStore.create(name, num_blocks=NUM_BLOCKS, layout=BLOCK_MAJOR, **GEOMETRY)
    try:
        _fill(store.kv, 3)
        code = f"""
import torch
from shmkv.ranks.kv_store import KVStore
s = KVStore.attach({name!r})
s.pin()
ids = [63, 1, 2, 3, 40, 7, 9, 0]
dev = s.allocate_device_cache("cuda", len(ids))
s.load_blocks(dev, ids, list(range(len(ids))))
torch.cuda.synchronize()
ref = torch.stack([s.kv[b] for b in ids], 2)  # [layers, 2, rows, ...]
assert torch.equal(dev.cpu().view(torch.uint8), ref.contiguous().view(torch.uint8))
del dev, ref
s.close()
"""
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
        procs = [subprocess.Popen([sys.executable, "-c", code], env=env) for _ in range(2)]
        assert [p.wait(timeout=120) for p in procs] == [0, 0]
    finally:
        store.close()
