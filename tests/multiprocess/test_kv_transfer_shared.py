"""Several processes storing and loading blocks of ONE block-major KV store at once: each
stores its own blocks (ids from the shared pool, so disjoint), then every process loads
every block and finds the bytes its writer stored."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from shmkv import BlockPool  # noqa: E402
from shmkv.ranks.kv_store import BLOCK_MAJOR, KVStore  # noqa: E402
from tests.conftest import unique_pool_name  # noqa: E402
from tests.multiprocess import kv_transfer_workers as workers  # noqa: E402
from tests.multiprocess.conftest import JOIN_TIMEOUT_S, join_processes, kill_processes  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.long]

NUM_WORKERS = 2
BLOCKS_PER_WORKER = 7


def test_processes_store_and_load_disjoint_blocks_of_one_store(spawn_ctx):
    name = unique_pool_name("kvmp")
    procs = []
    pool = BlockPool.create(name, NUM_WORKERS * BLOCKS_PER_WORKER + 3)
    store = KVStore.create(name, num_layers=2, num_blocks=pool.num_gpu_blocks, block_size=4,
                           num_kv_heads=2, head_size=8, dtype="bfloat16", pool=name,
                           layout=BLOCK_MAJOR)
    try:
        ids_out, all_ids = spawn_ctx.Queue(), spawn_ctx.Queue()
        done = spawn_ctx.Event()
        procs = [spawn_ctx.Process(target=workers.store_then_load,
                                   args=(name, w, BLOCKS_PER_WORKER, ids_out, all_ids, done))
                 for w in range(NUM_WORKERS)]
        for p in procs:
            p.start()
        everyone = dict(ids_out.get(timeout=JOIN_TIMEOUT_S) for _ in procs)
        flat = [b for ids in everyone.values() for b in ids]
        assert len(set(flat)) == NUM_WORKERS * BLOCKS_PER_WORKER and 0 not in flat
        for _ in procs:
            all_ids.put(everyone)
        done.set()
        assert join_processes(procs) == [0] * NUM_WORKERS
        for w, ids in everyone.items():  # the parent's own mapping holds them too
            for b in ids:
                assert torch.equal(store.kv[b].reshape(-1).view(torch.uint8),
                                   workers.block_pattern(store, w, b)), (w, b)
        checker = BlockPool.attach(name, label="checker")
        try:
            checker.check_invariants()
            assert checker.get_num_free_blocks() == checker.num_gpu_blocks - 1
        finally:
            checker.close()
    finally:
        kill_processes(procs)
        store.close()
        KVStore.unlink(name)
        pool.close()
        BlockPool.unlink(name)
    assert [e for e in os.listdir("/dev/shm") if name in e] == []
