"""Differential test: ``num_hash_lookahead_tokens`` on shmkv's BlockPool against vLLM 0.33.0's.

With L lookahead tokens each block hash also covers the L tokens after its block (vLLM's
speculative decoding: the drafter's KV at a block's last position depends on them), so a
block's hash exists only once those tokens do, and every ``BlockStored`` says which tokens
they were (``lookahead_token_ids``) and gives extra keys over the same window. The same
seeded workload runs on a shmkv pool created with ``num_hash_lookahead_tokens=L`` and on
vLLM's ``BlockPool(num_hash_lookahead_tokens=L)``: requests share prefixes (some with LoRA or
a ``cache_salt``), grow a few tokens at a time, cache their full blocks, key their last hash
boundary inside a bigger block (``cache_partial_block``), re-announce hits
(``emit_cached_block_events``) and are freed. After every call both pools must agree on the
free queue and on the events' msgpack bytes; shmkv's ``check_invariants`` runs each time.
The hashes come from the shmkv pool's own hasher, which must equal vLLM's request block hasher
with the same lookahead.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest

from shmkv import BlockPool, KVCacheManager
from shmkv import events as shm_events
from shmkv.core import kv_cache_interface as shm_specs
from shmkv.errors import SegmentNotFoundError, UsageError

vllm_block_pool = pytest.importorskip("vllm.v1.core.block_pool")
vllm_kv_cache_utils = pytest.importorskip("vllm.v1.core.kv_cache_utils")
vllm_kv_events = pytest.importorskip("vllm.distributed.kv_events")
vllm_hashing = pytest.importorskip("vllm.utils.hashing")
vllm_lora_request = pytest.importorskip("vllm.lora.request")
vllm_envs = pytest.importorskip("vllm.envs")

pytestmark = pytest.mark.differential

HBS = 4  # hash block size
BLOCK = 8  # the group's block size: two hash units, so partial keys exist
VOCAB = 50
_LORA = vllm_lora_request.LoRARequest("adapter-a", 1, "/loras/a")


@pytest.fixture(autouse=True)
def _bytes_event_hashes(monkeypatch):
    """vLLM's events carry the hash bytes, as shmkv's do."""
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    assert vllm_envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES is False


@dataclass(eq=False)
class Request:
    """What both pools and vLLM's hasher read of a request."""

    request_id: str
    all_token_ids: list[int]
    cache_salt: str | None = None
    lora_request: Any = None
    session_id: str | None = None
    mm_features: list[Any] = field(default_factory=list)
    prompt_embeds: Any = None
    block_hashes: list[bytes] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def _all_token_ids(self) -> list[int]:  # what vLLM 0.34's hasher and events read
        return self.all_token_ids


def _events(pool_events, batch_cls) -> bytes:
    return msgspec.msgpack.encode(batch_cls(ts=0.0, events=pool_events))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("lookahead", [1, 2, 5])
def test_lookahead_events_and_queue_match_vllm(make_pool, monkeypatch, lookahead, seed):
    rng = random.Random(f"hash-lookahead-{lookahead}-{seed}")
    num_blocks = 24
    ours = make_pool(num_blocks, hash_block_size=HBS, enable_kv_cache_events=True,
                     partial_keys=True, num_hash_lookahead_tokens=lookahead)
    theirs = vllm_block_pool.BlockPool(num_blocks, True, HBS, enable_kv_cache_events=True,
                                       num_hash_lookahead_tokens=lookahead)
    # vLLM's hasher, chained on the pool's NONE_HASH, must give the pool's hashes.
    monkeypatch.setattr(vllm_kv_cache_utils, "NONE_HASH", ours.none_hash, raising=False)
    vllm_hasher = vllm_kv_cache_utils.get_request_block_hasher(
        HBS, vllm_hashing.sha256, lookahead)
    ours_hasher = ours.make_block_hasher()
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randrange(5, 30))] for _ in range(3)]
    # request -> (our blocks, their blocks, blocks cached so far)
    live: dict[str, tuple[Request, list, list, list[int]]] = {}
    counts = {"stored": 0, "lookahead_ids": 0, "partial": 0, "emitted": 0}

    def rehash(req: Request) -> None:
        new = ours_hasher(req)
        assert new == vllm_hasher(req), f"{req.request_id}: hashes differ"
        req.block_hashes.extend(new)

    def check(label: str) -> None:
        ob = _events(ours.take_events(), shm_events.KVEventBatch)
        tb = _events(theirs.take_events(), vllm_kv_events.KVEventBatch)
        assert ob == tb, f"{label}: events differ"
        for event in msgspec.msgpack.decode(tb, type=vllm_kv_events.KVEventBatch).events:
            if isinstance(event, vllm_kv_events.BlockStored):
                counts["stored"] += 1
                counts["lookahead_ids"] += len(event.lookahead_token_ids or ())
                assert len(event.lookahead_token_ids) == len(event.block_hashes)
        assert ours.get_free_block_ids() == [
            b.block_id for b in theirs.free_block_queue.get_all_free_blocks()], label
        ours.check_invariants()

    def grow(rid: str, n: int) -> None:
        req, ob, tb, cached = live[rid]
        req.all_token_ids += [rng.randrange(VOCAB) for _ in range(n)]
        rehash(req)
        if hasattr(theirs, "get_lookahead_token_ids"):  # public in vLLM 0.34
            for end in range(HBS, req.num_tokens + 1, HBS):
                assert (ours.get_lookahead_token_ids(req, end)
                        == list(theirs.get_lookahead_token_ids(req, end)))
                assert (ours.generate_event_extra_keys(req, end - HBS, end, 0)
                        == theirs.generate_event_extra_keys(req, end - HBS, end, 0))
        need = -(-req.num_tokens // BLOCK) - len(ob)
        if need > 0:
            if need > ours.get_num_free_blocks():
                return
            ob += ours.get_new_blocks(need)
            tb += theirs.get_new_blocks(need)
            assert [b.block_id for b in ob] == [b.block_id for b in tb]
        num_full = len(req.block_hashes) * HBS // BLOCK
        if num_full > cached[0]:
            ours.cache_full_blocks(req, ob, cached[0], num_full, BLOCK, 0)
            theirs.cache_full_blocks(req, tb, cached[0], num_full, BLOCK, 0)
            cached[0] = num_full
        # The last hash boundary inside the block being filled gets a partial key.
        num_hashed = len(req.block_hashes) * HBS
        if num_hashed % BLOCK and num_hashed // BLOCK < len(ob):
            i = num_hashed // BLOCK
            ours.cache_partial_block(req, ob[i], num_hashed, 0, BLOCK)
            theirs.cache_partial_block(req, tb[i], num_hashed, 0, BLOCK)
            counts["partial"] += 1

    for step in range(60):
        label = f"lookahead {lookahead} seed {seed} step {step}"
        action = rng.random()
        if action < 0.3 or not live:
            rid = f"r{step}"
            req = Request(rid, list(rng.choice(prefixes)),
                          cache_salt=rng.choice([None, None, "tenant-b"]),
                          lora_request=rng.choice([None, None, _LORA]))
            live[rid] = (req, [], [], [0])
            grow(rid, rng.randrange(0, 12))
            if req.block_hashes and live[rid][1]:
                num_hit = min(len(req.block_hashes) * HBS // BLOCK, len(live[rid][1]))
                ours.emit_cached_block_events(req, num_hit, BLOCK, 0)
                theirs.emit_cached_block_events(req, num_hit, BLOCK, 0)
                counts["emitted"] += num_hit > 0
        elif action < 0.45:
            rid = rng.choice(sorted(live))
            _, ob, tb, _ = live.pop(rid)
            ours.free_blocks(reversed(ob))
            theirs.free_blocks(reversed(tb))
        else:
            grow(rng.choice(sorted(live)), rng.choice([1, 2, 3, HBS, BLOCK + 1]))
        check(label)
    for rid in sorted(live):
        _, ob, tb, _ = live.pop(rid)
        ours.free_blocks(reversed(ob))
        theirs.free_blocks(reversed(tb))
    check("final")
    assert counts["stored"] > 0 and counts["lookahead_ids"] > 0 and counts["partial"] > 0
    assert counts["emitted"] > 0


def test_lookahead_is_the_pools_for_every_process(make_pool):
    """An attaching process reads the lookahead from the segment and hashes with it."""
    pool = make_pool(8, hash_block_size=HBS, num_hash_lookahead_tokens=3)
    other = BlockPool.attach(pool.pool_name)
    try:
        assert other.num_hash_lookahead_tokens == 3
        req = Request("a", list(range(3 * HBS + 3)))
        assert other.make_block_hasher()(req) == pool.make_block_hasher()(req)
        assert len(pool.make_block_hasher()(req)) == 3  # the third waits for 3 more tokens
        assert len(pool.make_block_hasher()(Request("b", list(range(3 * HBS + 2))))) == 2
    finally:
        other.close()
    pool.check_invariants()


@pytest.mark.parametrize("bad", [-1, 1.5, None, "2", (1 << 16) + 1])
def test_bad_lookahead_is_refused(kernel, pool_name, bad):
    """A bad num_hash_lookahead_tokens is a UsageError naming it; no segment is left."""
    with pytest.raises(UsageError, match="num_hash_lookahead_tokens"):
        BlockPool.create(pool_name, 8, num_hash_lookahead_tokens=bad, kernel=kernel)
    with pytest.raises(SegmentNotFoundError):
        BlockPool.attach(pool_name)


def test_bool_lookahead_is_taken_as_vllm_takes_it(make_pool):
    """vLLM's callers may pass a bool (its own tests do): True is one token, False none."""
    assert make_pool(8, num_hash_lookahead_tokens=True).num_hash_lookahead_tokens == 1
    assert make_pool(8, num_hash_lookahead_tokens=False).num_hash_lookahead_tokens == 0


def test_manager_refuses_another_lookahead(make_pool):
    """A manager whose lookahead is not the pool's would key blocks its peers never find."""
    pool = make_pool(16, hash_block_size=HBS, num_hash_lookahead_tokens=2)
    spec = shm_specs.FullAttentionSpec(block_size=HBS, num_kv_heads=1, head_size=8,
                                       dtype="float16")
    config = shm_specs.KVCacheConfig(16, [], [shm_specs.KVCacheGroupSpec(["l0"], spec)])
    with pytest.raises(UsageError, match="num_hash_lookahead_tokens=1 but the pool's block "
                                         "hashes cover 2"):
        KVCacheManager(config, 256, HBS, HBS, num_hash_lookahead_tokens=1, block_pool=pool)
    KVCacheManager(config, 256, HBS, HBS, num_hash_lookahead_tokens=2, block_pool=pool)
    pool.check_invariants()
