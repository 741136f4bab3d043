"""Managers over partial-block keys, on both kernels: full attention keys a prompt's tail
inside its block and a later request that hits inside the block gets a private copy; Mamba
"align" keys the state at the prompt's boundary, moves the key to a copy while its producer
runs on, and exports prefill checkpoints; a pool without alias rows warns.

Blocks are 8 tokens and hashes 2 (four hash units per block), so a prompt of 13 tokens has
its last reusable boundary at 12 tokens, half way into its second block.
"""

from __future__ import annotations

import logging

import pytest

from shmkv import Request
from shmkv.core.kv_cache_coordinator import get_kv_cache_coordinator, partial_hash_hits_enabled
from shmkv.core.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    is_mamba_prefill_checkpoint_valid,
)
from shmkv.core.single_type_kv_cache_manager import (
    FullAttentionManager,
    MambaManager,
    SlidingWindowManager,
)

HBS = 2
BS = 8


def full_spec():
    return FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype="float16")


def mamba_spec(**extra):
    return MambaSpec(BS, ((2, 4),), ("float32",), mamba_cache_mode="align", **extra)


@pytest.fixture
def pool(make_pool):
    return make_pool(24, hash_block_size=HBS, partial_keys=True)


def manager(cls, spec, pool, alignment=BS):
    m = cls(spec, block_pool=pool, enable_caching=True, kv_cache_group_id=0,
            scheduler_block_size=BS)
    m.cache_hit_alignment_tokens = alignment  # what a coordinator sets for sub-block hits
    return m


def admit(m, req, num_tokens, hit=(), hit_len=0):
    """allocate_slots for one group: the demand, the hit, new blocks, then caching."""
    demand = m.get_num_blocks_to_allocate(req.request_id, num_tokens, list(hit), hit_len,
                                          hit_len, num_tokens)
    m.add_local_computed_blocks(req.request_id, list(hit), hit_len, 0)
    new = m.allocate_new_blocks(req.request_id, num_tokens, num_tokens)
    m.cache_blocks(req, num_tokens, replay_boundaries=[])
    return demand, new


def test_full_attention_keys_the_prompt_tail_inside_its_block(pool):
    m = manager(FullAttentionManager, full_spec(), pool)
    hasher = pool.make_block_hasher()
    producer = Request("p", list(range(13)), block_hasher=hasher)
    _, blocks = admit(m, producer, 13)
    tail = blocks[1]
    # Block 0 is full (its own key, 8 tokens); block 1 is keyed at 12 tokens (of 16).
    assert blocks[0].block_hash_num_tokens == 8
    assert tail.block_hash_num_tokens == 12
    assert tail.block_hash[:32] == producer.block_hashes[5]
    # A request sharing those 12 tokens, looking up at hash granularity, hits inside block 1.
    consumer = Request("c", list(range(12)) + [99, 98, 97], block_hasher=hasher)
    hit, hit_len = FullAttentionManager.find_longest_cache_hit(
        consumer.block_hashes, consumer.num_tokens - 1, [0], pool, full_spec(), False, HBS)
    assert hit_len == 12 and hit[0] == [blocks[0], tail]
    # Block-aligned lookups see only the full block.
    _, aligned_len = FullAttentionManager.find_longest_cache_hit(
        consumer.block_hashes, consumer.num_tokens - 1, [0], pool, full_spec(), False, BS)
    assert aligned_len == 8
    pool.check_invariants()


def test_a_hit_inside_a_block_gets_a_private_copy(pool):
    m = manager(FullAttentionManager, full_spec(), pool, alignment=HBS)
    hasher = pool.make_block_hasher()
    _, blocks = admit(m, Request("p", list(range(13)), block_hasher=hasher), 13)
    m.free("p")
    consumer = Request("c", list(range(12)) + [99, 98, 97], block_hasher=hasher)
    hit, hit_len = FullAttentionManager.find_longest_cache_hit(
        consumer.block_hashes, 14, [0], pool, full_spec(), False, HBS)
    # The demand counts the two evictable hit blocks and the copy (the 15 tokens fit in two
    # blocks, both hit).
    demand, new = admit(m, consumer, 15, hit[0], hit_len)
    assert demand == 2 + 1
    (copy,) = new
    assert m.req_to_blocks["c"] == [blocks[0], copy]
    assert m.take_pending_cow_copies() == [(blocks[1], copy)]
    # Both ends stay referenced until the copy has run: the source by the hit, the copy by
    # the request and once more; the copy is the consumer's to cache (as a full block once
    # it fills, under the consumer's own hashes).
    assert blocks[1].ref_cnt == 1 and copy.ref_cnt == 2
    assert m.num_cached_block["c"] == 1
    assert copy.block_hash_num_tokens == 14  # the consumer's own tail key, 14 tokens
    pool.free_blocks([blocks[1], copy])  # what the scheduler does after the copy
    m.free("c")
    pool.check_invariants()


def test_a_full_block_gets_the_tail_key_as_an_alias(pool):
    m = manager(FullAttentionManager, full_spec(), pool)
    hasher = pool.make_block_hasher()
    req = Request("p", list(range(16)), block_hasher=hasher)  # boundary 14, in full block 1
    _, blocks = admit(m, req, 16)
    assert blocks[1].block_hash_num_tokens == 16  # its own key is the full one
    assert pool.get_cached_block(req.block_hashes[6], [0]) == [blocks[1]]  # the alias, 14
    pool.check_invariants()


def test_mamba_producer_moves_its_tail_key_to_a_copy(pool):
    m = manager(MambaManager, mamba_spec(), pool, alignment=HBS)
    req = Request("p", list(range(13)), block_hasher=pool.make_block_hasher())
    # The first chunk stops on the prompt's boundary (12, inside block 1): the state block
    # there takes the key, and the producer is marked for copy-on-write.
    _, first = admit(m, req, 12)
    source = m.req_to_blocks["p"][1]
    assert source.block_hash_num_tokens == 12
    assert m.num_cached_block["p"] == 1 and "p" in m._partial_hit_reqs
    assert source.block_hash in m.cached_blocks_this_step
    m.new_step_starts()
    # The next step runs on the same block (the table only grows): the key moves to a fresh
    # copy that the worker fills first; the source gets one more reference until then.
    m.remove_skipped_blocks("p", 12)
    m.get_num_blocks_to_allocate("p", 13, [], 12, 0, 13)
    new = m.allocate_new_blocks("p", 13, 13)
    assert new == []  # nothing new in the table
    ((src, copy),) = m.take_pending_cow_copies()
    assert src is source and source.block_hash is None and source.ref_cnt == 2
    assert copy.block_hash_num_tokens == 12 and copy.ref_cnt == 1
    assert copy.block_hash in m.cached_blocks_this_step
    offloads = m.take_pending_boundary_state_offloads()
    assert ("p", 0, copy, 12) in offloads
    pool.free_blocks([src, copy])
    m.free("p")
    pool.check_invariants()


def test_mamba_prefill_checkpoint_is_kept_at_the_boundary(pool):
    spec = mamba_spec(num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=1)
    m = manager(MambaManager, spec, pool, alignment=HBS)
    assert m.has_prefill_checkpoint_blocks
    req = Request("p", list(range(21)), block_hasher=pool.make_block_hasher())
    # One chunk of 21 tokens crosses the boundary (20): the checkpoint goes in the block
    # before the running state's (index cdiv(21, 8) - 2 = 1), keyed at 20 tokens.
    demand, new = admit(m, req, 21)
    assert demand == 2  # the checkpoint's block and the running state's
    assert m._checkpoints["p"] == (20, 1)
    assert new == m.req_to_blocks["p"]  # the null before them is returned too, as in vLLM
    checkpoint, running = m.req_to_blocks["p"][1:]
    assert checkpoint.block_hash_num_tokens == 20
    assert pool.get_cached_block(req.block_hashes[9], [0]) == [checkpoint]
    assert m.req_to_blocks["p"][0].is_null
    assert running.block_hash is None
    m.free("p")
    pool.check_invariants()


def test_checkpoint_validity_rules():
    # A chunk [0, 21) over 8-token blocks may export the state at 20 (block 1 > block -1).
    assert is_mamba_prefill_checkpoint_valid(0, 21, 20, 2, 8, 1)
    assert not is_mamba_prefill_checkpoint_valid(0, 21, 20, 2, 8, None)  # backend can't
    assert not is_mamba_prefill_checkpoint_valid(0, 21, 20, 2, 8, 3)  # off its grid
    assert not is_mamba_prefill_checkpoint_valid(1, 21, 20, 2, 8, 1)  # start off a boundary
    assert not is_mamba_prefill_checkpoint_valid(16, 21, 20, 2, 8, 1)  # no block before
    assert not is_mamba_prefill_checkpoint_valid(0, 20, 20, 2, 8, 1)  # not inside the chunk


def test_partial_hash_hits_need_mamba_align_and_fine_grained_managers():
    def groups(*specs):
        return [KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(specs)]

    assert partial_hash_hits_enabled(groups(full_spec(), mamba_spec()), HBS)
    assert not partial_hash_hits_enabled(groups(full_spec(), mamba_spec()), BS)
    assert not partial_hash_hits_enabled(groups(full_spec()), HBS)
    assert partial_hash_hits_enabled(groups(full_spec(), mamba_spec()), HBS,
                                     manager_classes=[FullAttentionManager, MambaManager])
    assert not partial_hash_hits_enabled(groups(full_spec(), mamba_spec()), HBS,
                                         manager_classes=[SlidingWindowManager, MambaManager])


def test_hybrid_coordinator_turns_sub_block_hits_on(make_pool, caplog):
    specs = [full_spec(), mamba_spec()]
    config = KVCacheConfig(24, [], [KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(specs)])
    pool = make_pool(24, hash_block_size=HBS, partial_keys=True)
    coordinator = get_kv_cache_coordinator(
        config, max_model_len=128, max_in_flight_tokens=128, use_eagle=False, enable_caching=True,
        enable_kv_cache_events=False, dcp_world_size=1, pcp_world_size=1,
        hash_block_size=HBS, scheduler_block_size=BS, block_pool=pool)
    assert coordinator.enable_partial_hash_hits
    assert all(m.cache_hit_alignment_tokens == HBS for m in coordinator.single_type_managers)
    # A pool without alias rows still works, with a warning that partial keys are dropped.
    plain = make_pool(24, hash_block_size=HBS)
    with caplog.at_level(logging.WARNING, logger="shmkv.core.kv_cache_coordinator"):
        get_kv_cache_coordinator(
            config, max_model_len=128, max_in_flight_tokens=128, use_eagle=False,
            enable_caching=True, enable_kv_cache_events=False, dcp_world_size=1, pcp_world_size=1,
            hash_block_size=HBS, scheduler_block_size=BS, block_pool=plain)
    assert any("partial_keys=True" in r.getMessage() for r in caplog.records)
