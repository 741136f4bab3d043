"""Worker processes that each run their own KVCacheManager on one shared pool (module level, so
spawn can import them). Exit code 0 is success; failures print why to stderr."""

from __future__ import annotations

import random
import sys
import time
import traceback

from shmkv import BlockPool, KVCacheManager, Request
from shmkv.core.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

BS = 4
SYSTEM_PROMPT = list(range(1000, 1064))  # 64 tokens: 16 blocks


def make_manager(pool: BlockPool, kind: str) -> KVCacheManager:
    """kind: "full", "full+swa", "full+mamba" (Mamba "align": states at block ends) or
    "full+mamba-dcp2" (the same under decode-context parallelism 2: full-attention blocks
    span 2 x BS tokens, Mamba's stay BS)."""
    specs = [FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype="float16")]
    if kind == "full+swa":
        specs.append(SlidingWindowSpec(block_size=BS, num_kv_heads=1, head_size=8,
                                       dtype="float16", sliding_window=8))
    elif kind in ("full+mamba", "full+mamba-dcp2"):
        specs.append(MambaSpec(BS, ((2, 4),), ("float32",), mamba_cache_mode="align"))
    dcp = 2 if kind.endswith("-dcp2") else 1
    groups = [KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(specs)]
    config = KVCacheConfig(pool.num_gpu_blocks, [], groups)
    return KVCacheManager(config, 4096, scheduler_block_size=BS * dcp, hash_block_size=BS,
                          dcp_world_size=dcp, block_pool=pool)


def serve(name: str, kernel: str, kind: str, seed: int, num_requests: int,
          min_hit: int, duration_s: float) -> None:
    """Serves requests that start with SYSTEM_PROMPT (prefill in chunks, a few decode steps,
    finish or preempt), with its own KVCacheManager. Fails unless every admission hits at
    least ``min_hit`` tokens; checks that held blocks stay held. The prefill stops once at the
    end of the system prompt, so a Mamba state is kept there (a hit needs one)."""
    rng = random.Random(seed)
    try:
        pool = BlockPool.attach(name, kernel=kernel, label=f"manager-{seed}")
        m = make_manager(pool, kind)
        hasher = pool.make_block_hasher()
        running: list[Request] = []
        hits: list[int] = []
        served = 0
        deadline = time.monotonic() + duration_s
        while served < num_requests or running:
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out with {served} served, {len(running)} running")
            m.new_step_starts()
            if served < num_requests and (len(running) < 4 or rng.random() < 0.3):
                tokens = SYSTEM_PROMPT + [rng.randrange(50_000) for _ in range(rng.randint(1, 30))]
                r = Request(f"{seed}-{served}", tokens, block_hasher=hasher)
                hit, n, _ = m.get_computed_blocks(r)
                first = len(SYSTEM_PROMPT) if n < len(SYSTEM_PROMPT) else r.num_tokens
                if m.allocate_slots(r, first - n, n, hit) is None:
                    continue  # the pool is full for now: retry later (a fresh lookup)
                r.num_computed_tokens = first
                if first < r.num_tokens and m.allocate_slots(r, r.num_tokens - first) is None:
                    m.free(r)
                    continue
                hits.append(n)
                r.num_computed_tokens = r.num_tokens
                running.append(r)
                served += 1
            else:
                r = running[rng.randrange(len(running))]
                r.append_output_token_ids(rng.randrange(50_000))
                if m.allocate_slots(r, 1) is None or rng.random() < 0.2:
                    m.free(r)  # preempted or finished
                    running.remove(r)
                    continue
                r.num_computed_tokens += 1
            for r in running:  # a request's blocks stay referenced while it runs
                for group in m.get_blocks(r.request_id).blocks:
                    for b in group:
                        if not b.is_null and b.ref_cnt < 1:
                            raise AssertionError(f"held block {b.block_id} was freed")
        if min_hit and (not hits or min(hits) < min_hit):
            raise AssertionError(f"hits {hits} below {min_hit}")
        pool.check_invariants()
        pool.close()
    except BaseException:  # noqa: BLE001  (report anything, then fail)
        traceback.print_exc()
        sys.exit(1)


PARTIAL_PROMPT = list(range(2000, 2015))  # 15 tokens: reusable boundary 14, inside block 3


def serve_partial(name: str, kernel: str, role: str, results) -> None:
    """Full + Mamba "align", 4-token blocks over 2-token hashes (sub-block hits on). The
    producer prefills PARTIAL_PROMPT in two chunks, stopping on its boundary (14) so the
    Mamba state there is kept, then finishes; the consumer's prompt shares those 14 tokens
    and must hit all of them, inside a block: it gets private copies of the two tail blocks.
    Each runs the copies (drains them and frees what they kept) as vLLM's scheduler does.
    Puts (hit tokens, copies, block ids per group) on ``results``."""
    try:
        pool = BlockPool.attach(name, kernel=kernel, label=f"partial-{role}")
        specs = [FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype="float16"),
                 MambaSpec(BS, ((2, 4),), ("float32",), mamba_cache_mode="align")]
        groups = [KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(specs)]
        m = KVCacheManager(KVCacheConfig(pool.num_gpu_blocks, [], groups), 4096,
                           scheduler_block_size=BS, hash_block_size=2, block_pool=pool)
        assert m.coordinator.enable_partial_hash_hits
        tokens = PARTIAL_PROMPT if role == "producer" else PARTIAL_PROMPT[:14] + [7, 8, 9]
        r = Request(role, tokens, block_hasher=pool.make_block_hasher())
        num_copies = 0

        def run_copies():
            nonlocal num_copies
            copies, retained = m.take_kv_cache_block_copies()
            num_copies += len(copies)
            pool.free_blocks(retained)

        m.new_step_starts()
        hit, n, _ = m.get_computed_blocks(r)
        first = 14 - n if role == "producer" else r.num_tokens - n
        assert m.allocate_slots(r, first, n, hit) is not None
        r.num_computed_tokens = n + first
        tables = m.get_block_ids(role)
        run_copies()
        if r.num_computed_tokens < r.num_tokens:
            m.new_step_starts()
            assert m.allocate_slots(r, r.num_tokens - r.num_computed_tokens) is not None
            r.num_computed_tokens = r.num_tokens
            run_copies()
        m.free(r)
        results.put((n, num_copies, [list(t) for t in tables]))
        pool.check_invariants()
        pool.close()
    except BaseException:  # noqa: BLE001  (report anything, then fail)
        traceback.print_exc()
        sys.exit(1)


def make_dcp_manager(specs_mod, num_blocks: int, dcp: int, hash_block_size: int,
                     block_pool=None):
    """Full attention + Mamba "align" (blocks of BS) under decode-context parallelism
    ``dcp``, from ``specs_mod`` (shmkv's specs, or vLLM's for its own manager in the test)."""
    import importlib

    if specs_mod == "vllm":
        import torch

        specs = importlib.import_module("vllm.v1.kv_cache_interface")
        from vllm.v1.core.kv_cache_manager import KVCacheManager as manager_cls
        f16, f32 = torch.float16, torch.float32
    else:
        specs = importlib.import_module("shmkv.core.kv_cache_interface")
        manager_cls = KVCacheManager
        f16, f32 = "float16", "float32"
    groups = [
        specs.KVCacheGroupSpec(["full"], specs.FullAttentionSpec(
            block_size=BS, num_kv_heads=1, head_size=8, dtype=f16)),
        specs.KVCacheGroupSpec(["mamba"], specs.MambaSpec(
            BS, ((2, 4),), (f32,), mamba_cache_mode="align")),
    ]
    kwargs = {"block_pool": block_pool} if block_pool is not None else {}
    return manager_cls(specs.KVCacheConfig(num_blocks, [], groups), 4096, enable_caching=True,
                       scheduler_block_size=BS * dcp, hash_block_size=hash_block_size,
                       dcp_world_size=dcp, **kwargs)


def drive_dcp_request(m, r, stops, free_blocks) -> tuple:
    """One request through ``m`` as vLLM's scheduler would: look it up, prefill in chunks
    ending at each of ``stops`` past the hit (a Mamba state is kept where a chunk ends),
    run the copies after each step (drain them, free what they kept), then free it.
    Returns (hit tokens, blocks per group of the hit, copies as (src, dst), block ids per
    group after the first chunk)."""
    m.new_step_starts()
    hit, n, _ = m.get_computed_blocks(r)
    hit_lens = [len(g) for g in hit.blocks]
    copies: list[tuple[int, int]] = []

    def run_copies():
        done, retained = m.take_kv_cache_block_copies()
        copies.extend((c.src_block_id, c.dst_block_id) for c in done)
        free_blocks(retained)

    ends = [s for s in stops if n < s < r.num_tokens] + [r.num_tokens]
    if m.allocate_slots(r, ends[0] - n, n, hit) is None:
        raise AssertionError(f"{r.request_id}: the first chunk did not fit")
    r.num_computed_tokens = ends[0]
    tables = [list(t) for t in m.get_block_ids(r.request_id)]
    run_copies()
    for end in ends[1:]:
        m.new_step_starts()
        if m.allocate_slots(r, end - r.num_computed_tokens) is None:
            raise AssertionError(f"{r.request_id}: a chunk did not fit")
        r.num_computed_tokens = end
        run_copies()
    m.free(r)
    m.new_step_starts()
    return n, hit_lens, copies, tables


def serve_dcp(name: str, kernel: str, dcp: int, rid: str, tokens: list[int],
              stops: list[int], results) -> None:
    """One process of a DCP pair: its own KVCacheManager (full attention + Mamba "align",
    ``dcp_world_size=dcp``) on the shared pool, one request (``drive_dcp_request``); puts
    its result on ``results``."""
    try:
        pool = BlockPool.attach(name, kernel=kernel, label=f"dcp-{rid}")
        m = make_dcp_manager("shmkv", pool.num_gpu_blocks, dcp, pool.hash_block_size, pool)
        assert m.coordinator.enable_partial_hash_hits
        r = Request(rid, tokens, block_hasher=pool.make_block_hasher())
        results.put(drive_dcp_request(m, r, stops, pool.free_blocks))
        pool.check_invariants()
        pool.close()
    except BaseException:  # noqa: BLE001  (report anything, then fail)
        traceback.print_exc()
        sys.exit(1)
