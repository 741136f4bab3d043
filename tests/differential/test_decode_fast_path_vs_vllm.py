"""Differential test of the decode steps ``allocate_slots`` answers without the pool (the
no-pool path, ``KVCacheManager._slots_already_allocated``) against vLLM 0.33.0's manager.

Running requests of a full-attention model are stepped with every argument that decides
whether a step may skip the pool drawn at random: draft tokens (``num_new_tokens > 1``, capped
at ``num_tokens`` for caching), lookahead slots, ``reserved_blocks`` up to above the free
count, ``full_sequence_must_fit``, ``delay_cache_blocks``, ``has_scheduled_reqs``, a watermark
with the request's status sometimes WAITING, an explicit empty hit, and a small
``max_model_len`` that clamps the slots. The pool is small so refusals happen. After every
call both sides agree on the result, every block table, the free-queue order, usage and the
events' bytes; shmkv's ``check_invariants`` runs every step. The run must have taken the
no-pool path (no lock hold) and the general path for empty results both, or it proves
nothing.
"""

from __future__ import annotations

import random

import pytest

from shmkv import KVCacheManager
from shmkv import events as shm_events
from shmkv.core import kv_cache_interface as shm_specs
from tests.differential.test_kv_cache_manager_vs_vllm import (
    BS,
    VOCAB,
    TwinRequest,
    _attn,
    _event_bytes,
    _ids,
)

torch = pytest.importorskip("torch")
vllm_specs = pytest.importorskip("vllm.v1.kv_cache_interface")
vllm_manager = pytest.importorskip("vllm.v1.core.kv_cache_manager")
vllm_request = pytest.importorskip("vllm.v1.request")
vllm_kv_events = pytest.importorskip("vllm.distributed.kv_events")

pytestmark = pytest.mark.differential

MAX_MODEL_LEN = 48
NUM_BLOCKS = 40


@pytest.fixture(autouse=True)
def _bytes_event_hashes(monkeypatch):
    """vLLM's events carry the hash bytes, as shmkv's do."""
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    monkeypatch.delenv("SHMKV_PREFIX_CACHE_RETENTION_INTERVAL", raising=False)


def _managers(make_pool, groups: int, watermark: float):
    pool = make_pool(NUM_BLOCKS, hash_block_size=BS, enable_kv_cache_events=True)

    def config(mod):
        return mod.KVCacheConfig(NUM_BLOCKS, [], [
            mod.KVCacheGroupSpec([f"layer{i}"], _attn(mod, "FullAttentionSpec"))
            for i in range(groups)])

    common = {"max_model_len": MAX_MODEL_LEN, "scheduler_block_size": BS,
              "hash_block_size": BS, "enable_kv_cache_events": True, "watermark": watermark}
    ours = KVCacheManager(config(shm_specs), block_pool=pool, **common)
    theirs = vllm_manager.KVCacheManager(config(vllm_specs), **common)
    return ours, theirs, pool


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("groups,watermark", [(1, 0.0), (1, 0.2), (2, 0.0)])
def test_decode_steps_match_vllm(groups, watermark, seed, make_pool):
    rng = random.Random(seed)
    ours, theirs, pool = _managers(make_pool, groups, watermark)
    lock = pool.lock()
    hasher = pool.make_block_hasher()
    system = [rng.randrange(VOCAB) for _ in range(9)]
    running: list[tuple[TwinRequest, TwinRequest]] = []
    counts = {"no_pool": 0, "general_empty": 0, "new_blocks": 0, "refused": 0}
    next_id = 0
    RUNNING = vllm_request.RequestStatus.RUNNING

    def compare(label, a, b):
        assert a == b, f"{label}: shmkv {a!r} != vLLM {b!r}"

    def check_state(label):
        for o, t in running:
            compare(f"{label} table", ours.get_block_ids(o.request_id),
                    theirs.get_block_ids(t.request_id))
        compare(f"{label} usage", ours.usage, theirs.usage)
        compare(f"{label} free queue", pool.get_free_block_ids(),
                [b.block_id for b in theirs.block_pool.free_block_queue.get_all_free_blocks()])
        assert (_event_bytes(ours.take_events(), shm_events.KVEventBatch)
                == _event_bytes(theirs.take_events(), vllm_kv_events.KVEventBatch)), label
        pool.check_invariants()

    def finish(pair):
        ours.free(pair[0])
        theirs.free(pair[1])
        running.remove(pair)

    for step in range(250):
        label = f"seed {seed} step {step}"
        ours.new_step_starts()
        theirs.new_step_starts()
        if len(running) < 3 or rng.random() < 0.08:
            prompt = system + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 14))]
            pair = tuple(TwinRequest(f"r{next_id}", prompt, block_hasher=hasher)
                         for _ in range(2))
            next_id += 1
            results = []
            for m, r in zip((ours, theirs), pair, strict=True):
                hit, n, _ = m.get_computed_blocks(r)
                results.append((n, _ids(m.allocate_slots(r, r.num_tokens - n, n, hit))))
            compare(f"{label} admit", results[0], results[1])
            if results[0][1] is not None:
                for r in pair:
                    r.num_computed_tokens = r.num_tokens
                    r.status = RUNNING
                running.append(pair)
            check_state(label)
            continue
        pair = rng.choice(running)
        o, t = pair
        if o.num_computed_tokens >= MAX_MODEL_LEN - 1:
            finish(pair)
            check_state(label)
            continue
        if o.num_computed_tokens >= o.num_tokens:  # sample this step's token
            token = rng.randrange(VOCAB)
            for r in pair:
                r.append_output_token_ids(token)
        drafts = rng.choice([0, 0, 0, 1, 3])
        num_new = o.num_tokens - o.num_computed_tokens + drafts
        free = pool.get_num_free_blocks()
        kwargs = {
            "num_lookahead_tokens": rng.choice([0, 0, 0, 1, 2, 5]),
            "reserved_blocks": rng.choice([0, 0, 0, 0, free, free + 1]),
            "full_sequence_must_fit": rng.random() < 0.1,
            "delay_cache_blocks": rng.random() < 0.1,
            "has_scheduled_reqs": rng.random() < 0.8,
        }
        if rng.random() < 0.1:
            kwargs["new_computed_blocks"] = "empty"
        status = rng.choice([RUNNING] * 8 + [vllm_request.RequestStatus.WAITING])
        results = []
        before = lock.num_acquired
        for m, r in zip((ours, theirs), pair, strict=True):
            r.status = status
            kw = dict(kwargs)
            if kw.get("new_computed_blocks") == "empty":
                kw["new_computed_blocks"] = m.empty_kv_cache_blocks
            results.append(_ids(m.allocate_slots(r, num_new, **kw)))
            r.status = RUNNING
        took_lock = lock.num_acquired != before
        compare(f"{label} decode {kwargs} status {status}", results[0], results[1])
        res = results[0]
        if res is None:
            counts["refused"] += 1
            finish(pair)
        else:
            if not any(res):
                counts["general_empty" if took_lock else "no_pool"] += 1
            else:
                assert took_lock
                counts["new_blocks"] += 1
            accepted = rng.randint(0, drafts)  # drafts the model accepted, appended
            tokens = [rng.randrange(VOCAB) for _ in range(accepted)]
            for r in pair:
                if tokens:
                    r.append_output_token_ids(tokens)
                r.num_computed_tokens += num_new - drafts + accepted
        check_state(label)
    for pair in list(running):
        finish(pair)
    check_state("final")
    assert pool.get_num_free_blocks() == NUM_BLOCKS - 1
    assert counts["no_pool"] > 0 and counts["general_empty"] > 0, counts
    assert counts["new_blocks"] > 0 and counts["refused"] > 0, counts
