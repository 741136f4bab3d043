"""Processes of the manager-level linearizability test: each drives its own shmkv
``KVCacheManager`` over one recorded pool, every manager call recorded as one hold."""

from __future__ import annotations

import logging
import random
import sys
import time
import traceback

from shmkv import BlockPool, KVCacheManager
from shmkv import Request as ShmRequest
from shmkv.core import kv_cache_interface as specs

BS = 16
MAX_MODEL_LEN = 512


def manager_config(mod, num_blocks: int):
    """One full-attention group of 16-token blocks (``mod``: shmkv's or vLLM's specs)."""
    if mod is specs:
        dtype: object = "float16"  # shmkv takes a name: the workers never import torch
    else:
        import torch

        dtype = torch.float16
    spec = mod.FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=dtype)
    return mod.KVCacheConfig(num_blocks, [], [mod.KVCacheGroupSpec(["layer0"], spec)])


MANAGER_KWARGS = {"max_model_len": MAX_MODEL_LEN, "scheduler_block_size": BS,
                  "hash_block_size": BS, "enable_caching": True,
                  "enable_kv_cache_events": True}


def _ids(blocks) -> list[list[int]] | None:
    return None if blocks is None else [list(g) for g in blocks.get_block_ids()]


def manager_churn(name: str, kernel: str, seed: int, shared_seed: int, num_ops: int,
                  record: str, ready, go, progress) -> None:
    """Admit (lookup + allocate in one hold), decode a token, free, evict, reset: each a
    recorded ``mgr.*`` call."""
    logging.disable(logging.WARNING)
    try:
        pool = BlockPool.attach(name, kernel=kernel, label=f"mgr-{seed}", record=record,
                                stuck_after_s=0.5)
        mgr = KVCacheManager(manager_config(specs, pool.num_gpu_blocks), block_pool=pool,
                             **MANAGER_KWARGS)
        hasher = pool.make_block_hasher()
        rng = random.Random(seed)
        shared = random.Random(shared_seed)
        prompts = [[shared.randrange(50_000) for _ in range(64)] for _ in range(4)]
        running: dict[str, ShmRequest] = {}
        ready.set()
        if not go.wait(60):
            raise TimeoutError("no go from the test within 60 s")
        for step in range(num_ops):
            progress.value = step
            if rng.random() < 0.7:  # let the others run: the processes' holds interleave
                time.sleep(rng.uniform(0, 0.0003))
            roll = rng.random()
            if roll < 0.45 or not running:
                rid = f"{seed}-{step}"
                tokens = rng.choice(prompts)[: rng.choice([16, 32, 48, 64])] + [
                    rng.randrange(50_000) for _ in range(rng.randint(1, 40))]
                req = ShmRequest(rid, tokens, block_hasher=hasher)

                def admit(req=req):
                    hit, num_hit, boundary = mgr.get_computed_blocks(req)
                    new = mgr.allocate_slots(req, req.num_tokens - num_hit, num_hit, hit)
                    if new is not None:
                        req.num_computed_tokens = req.num_tokens
                    return _ids(hit), num_hit, boundary, _ids(new)

                got = pool.record_call("mgr.admit", {"request_id": rid, "tokens": tokens},
                                       admit, answer=list)
                if got[3] is not None:
                    running[rid] = req
            elif roll < 0.65:
                rid = rng.choice(list(running))
                req = running[rid]
                tok = rng.randrange(50_000)

                def decode(req=req, tok=tok):
                    req.append_output_token_ids(tok)
                    new = mgr.allocate_slots(req, 1)
                    if new is not None:
                        req.num_computed_tokens += 1
                    return _ids(new)

                pool.record_call("mgr.decode", {"request_id": rid, "token": tok}, decode,
                                 answer=lambda x: x)
            elif roll < 0.92:
                rid = rng.choice(list(running))
                pool.record_call("mgr.free", {"request_id": rid}, mgr.free, running.pop(rid))
            elif roll < 0.97:
                ids = sorted(rng.sample(range(pool.num_gpu_blocks), rng.randint(1, 4)))
                pool.record_call("mgr.evict_blocks", {"block_ids": ids}, mgr.evict_blocks, ids)
            else:
                pool.record_call("mgr.reset_prefix_cache", {}, mgr.reset_prefix_cache,
                                 answer=bool)
        pool.close()  # gives back what its running requests hold
    except BaseException:  # noqa: BLE001  (report anything, then fail)
        traceback.print_exc()
        sys.exit(1)
