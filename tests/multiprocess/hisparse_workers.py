"""Worker functions for tests/multiprocess/test_hisparse_shared.py (importable under spawn)."""

from __future__ import annotations

import os
import signal

from shmkv import (
    BlockPool,
    FullAttentionSpec,
    HiSparseHotSpec,
    HiSparseResidentSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    Request,
    get_hisparse_coordinator,
)
from shmkv.core.kv_cache_interface import KVCacheGroupRole

BS = 4
HOST_BLOCKS = 24


def hisparse_config(num_blocks: int) -> KVCacheConfig:
    source = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype="float16")
    return KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], hisparse_host_num_blocks=HOST_BLOCKS,
        kv_cache_groups=[
            KVCacheGroupSpec(["source"], source, host_resident=True,
                             role=KVCacheGroupRole.HISPARSE_SOURCE),
            KVCacheGroupSpec(["indexer"], source, enable_kv_transfer=False,
                             role=KVCacheGroupRole.HISPARSE_INDEXER),
            KVCacheGroupSpec(["resident"], HiSparseResidentSpec(block_size=BS, page_size=64),
                             enable_kv_transfer=False),
            KVCacheGroupSpec(["hot"], HiSparseHotSpec(block_size=BS, page_size=64,
                                                      blocks_per_request=2),
                             enable_kv_transfer=False),
        ])


def serve(name: str, request_id: str, prompt: list[int], results, die: bool) -> None:
    """Attaches, admits ``prompt`` (host hit first), writes every sealed page back (all
    transfers reported done), and either finishes the request or, with ``die``, reports and
    kills itself with SIGKILL while it holds device and host blocks."""
    pool = BlockPool.attach(name, label=request_id)
    manager = KVCacheManager(hisparse_config(pool.num_gpu_blocks), max_model_len=64,
                             scheduler_block_size=BS, hash_block_size=BS, enable_caching=True,
                             block_pool=pool)
    coordinator = get_hisparse_coordinator(manager)
    host = coordinator.get_host_block_pool()
    req = Request(request_id, prompt, block_hasher=pool.make_block_hasher())
    hit, num_hit, _ = manager.get_computed_blocks(req)
    assert manager.allocate_slots(req, req.num_tokens - num_hit, num_hit, hit) is not None
    coordinator.advance_scheduled([(request_id, req.num_tokens)])
    req.num_computed_tokens = req.num_tokens
    command = coordinator.build_offload_command()
    counts = {t.transfer_id: 1 for t in command.page_transfers}
    coordinator.update_spills(counts, counts)
    manager.cache_blocks(req, req.num_tokens)
    pool.check_invariants()
    host.check_invariants()
    if die:
        results.put((num_hit, host.get_num_free_blocks(), pool.get_num_free_blocks()))
        results.close()
        results.join_thread()  # the report is written before the kill
        os.kill(os.getpid(), signal.SIGKILL)
    manager.free(req)
    results.put((num_hit, host.get_num_free_blocks(), pool.get_num_free_blocks()))
    pool.close()


def read_then_lose(name: str, ready, taken, results) -> None:
    """Admits a 5-page prompt, writes it back, moves the request to reading from the host
    (its clean pages are unpinned), then, once another process has taken every free block,
    reports its resident row before and after (the worker's residency update)."""
    pool = BlockPool.attach(name, label="reader")
    manager = KVCacheManager(hisparse_config(pool.num_gpu_blocks), max_model_len=64,
                             scheduler_block_size=BS, hash_block_size=BS, enable_caching=True,
                             block_pool=pool)
    coordinator = get_hisparse_coordinator(manager)
    req = Request("r", list(range(5 * BS)), block_hasher=pool.make_block_hasher())
    assert manager.allocate_slots(req, req.num_tokens) is not None
    coordinator.advance_scheduled([("r", req.num_tokens)])
    req.num_computed_tokens = req.num_tokens
    command = coordinator.build_offload_command()
    counts = {t.transfer_id: 1 for t in command.page_transfers}
    coordinator.update_spills(counts, counts)
    for hot in coordinator.hot_managers:
        hot.require_hot("r")
    req.append_output_token_ids(1)
    assert manager.allocate_slots(req, 1) is not None
    coordinator.advance_scheduled([("r", req.num_tokens)])   # unpins the clean pages
    resident = coordinator.resident_managers[0]
    before = [b.block_id for b in resident.get_residency_row("r")]
    ready.set()
    assert taken.wait(30)
    update = coordinator.take_residency_updates(["r"])["r"]
    after = [b.block_id for b in resident.get_residency_row("r")]
    pool.check_invariants()
    results.put((before, after, update.block_ids[0]))
    manager.free(req)
    pool.close()


def take_everything(name: str, ready, taken) -> None:
    """Takes every free block of the device pool (so the reader's unpinned copies too) and
    gives them back, then says so."""
    assert ready.wait(30)
    pool = BlockPool.attach(name, label="taker")
    pool.free_blocks(pool.get_new_blocks(pool.get_num_free_blocks()))
    taken.set()
    pool.close()


def take_host_blocks_then_sigkill(name: str, num_blocks: int, ready) -> None:
    """Attaches, takes ``num_blocks`` blocks of the host tier, says so, and dies by SIGKILL
    holding them."""
    pool = BlockPool.attach(name, label="host-taker")
    host = pool.tier("host", HOST_BLOCKS, enable_caching=True)
    host.get_new_blocks(num_blocks)
    ready.set()
    os.kill(os.getpid(), signal.SIGKILL)
