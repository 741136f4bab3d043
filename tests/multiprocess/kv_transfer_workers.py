"""Processes for the KV-transfer tests (module level, so spawn can import them). Exit code 0
is success; a failure prints why to stderr."""

from __future__ import annotations

import sys
import traceback

import torch

from shmkv import BlockPool
from shmkv.ranks.kv_store import KVStore


def block_pattern(store: KVStore, worker: int, block_id: int) -> torch.Tensor:
    """The bytes worker ``worker`` writes into block ``block_id``, in the device cache's
    order ``[layers, 2, block_size, heads, head_size]``, as uint8 (every bit pattern)."""
    gen = torch.Generator().manual_seed(1_000_003 * worker + block_id)
    elements = 2 * store.num_layers * store.block_size * store.num_kv_heads * store.head_size
    return torch.randint(0, 256, (elements * store.dtype.itemsize,), dtype=torch.uint8,
                         generator=gen)


def store_then_load(name: str, worker: int, num_blocks: int, ids_out, all_ids, done,
                    timeout_s: float = 60.0) -> None:
    """Takes ``num_blocks`` blocks from the shared pool (so its ids are disjoint from the
    other workers'), stores its pattern into them with ``store_blocks`` from a private
    cache at scrambled rows, reports them; then, given every worker's ids, loads ALL of them
    into a fresh cache in one call and checks every row's bytes against its writer's
    pattern. Frees its blocks at the end."""
    try:
        pool = BlockPool.attach(name, label=f"kv-{worker}")
        store = KVStore.attach(name)
        blocks = pool.get_new_blocks(num_blocks)
        ids = [b.block_id for b in blocks]
        rows = list(range(num_blocks))[::-1]
        cache = store.allocate_device_cache("cpu", num_blocks)
        for block_id, row in zip(ids, rows, strict=True):
            target = cache[:, :, row]  # a strided view: assign, never write a reshaped copy
            target.copy_(block_pattern(store, worker, block_id).view(store.dtype)
                         .view(target.shape))
        store.store_blocks(cache, ids, rows)
        ids_out.put((worker, ids))
        if not done.wait(timeout_s):
            raise AssertionError("the parent never sent every worker's ids")
        everyone = all_ids.get(timeout=timeout_s)
        flat = [(w, b) for w, w_ids in sorted(everyone.items()) for b in w_ids]
        fresh = store.allocate_device_cache("cpu", len(flat))
        store.load_blocks(fresh, [b for _, b in flat], list(range(len(flat))))
        for row, (w, b) in enumerate(flat):
            got = fresh[:, :, row].reshape(-1).view(torch.uint8)
            if not torch.equal(got, block_pattern(store, w, b)):
                raise AssertionError(f"worker {worker}: block {b} (written by worker {w}) "
                                     f"does not hold its bytes")
        pool.free_blocks(blocks)
        del cache, fresh, got
        store.close()
        pool.close()
    except BaseException:
        traceback.print_exc(file=sys.stderr)
        sys.exit(1)
