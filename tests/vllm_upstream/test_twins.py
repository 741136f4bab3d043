"""Public-call twins of the upstream tests that ``expectations.DESELECTED`` leaves out as
"private:" (they read vLLM-private structure). Each twin drives the behaviour the upstream test
checks through public calls only, on vLLM 0.33.0's classes and on shmkv's, and both must give
the same trace (block ids, hits, free-queue order, events).

vLLM's side gets vLLM's ``KVCacheConfig`` and specs; shmkv's gets the same config as shmkv
takes it (``shmkv_upstream_plugin.to_shmkv``: specs bridged) and a pool from ``make_pool``. Both use
vLLM's ``Request`` objects hashed by the shmkv pool's hasher (same hashes on both sides).
"""

from __future__ import annotations

import pytest

import shmkv
from tests.vllm_upstream.shmkv_upstream_plugin import to_shmkv

torch = pytest.importorskip("torch")
vspecs = pytest.importorskip("vllm.v1.kv_cache_interface")
vkvm = pytest.importorskip("vllm.v1.core.kv_cache_manager")
vbp = pytest.importorskip("vllm.v1.core.block_pool")
vrequest = pytest.importorskip("vllm.v1.request")
vsampling = pytest.importorskip("vllm.sampling_params")

pytestmark = pytest.mark.differential
IMPLS = ("vllm", "shmkv")


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.delenv("SHMKV_PREFIX_CACHE_RETENTION_INTERVAL", raising=False)


def full(block_size):
    return vspecs.FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1,
                                    dtype=torch.float32)


def swa(block_size, window):
    return vspecs.SlidingWindowSpec(block_size=block_size, num_kv_heads=1, head_size=1,
                                    dtype=torch.float32, sliding_window=window)


def config(num_blocks, *specs):
    return vspecs.KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[],
        kv_cache_groups=[vspecs.KVCacheGroupSpec([f"layer{i}"], s)
                         for i, s in enumerate(specs)])


class Side:
    """One implementation's manager (or bare pool) and a request factory."""

    def __init__(self, impl, make_pool, cfg, hash_block_size, events=False, manager=True,
                 **kwargs):
        self.impl = impl
        self.hasher_pool = make_pool(4, hash_block_size=hash_block_size)
        self.hasher = self.hasher_pool.make_block_hasher()
        self.manager = None
        if impl == "vllm":
            if manager:
                self.manager = vkvm.KVCacheManager(
                    cfg, max_model_len=4096, scheduler_block_size=kwargs.pop(
                        "scheduler_block_size", hash_block_size),
                    hash_block_size=hash_block_size, enable_caching=True,
                    enable_kv_cache_events=events, **kwargs)
                self.pool = self.manager.block_pool
            else:
                self.pool = vbp.BlockPool(cfg.num_blocks, True, hash_block_size,
                                          enable_kv_cache_events=events)
        else:
            self.pool = make_pool(cfg.num_blocks, hash_block_size=hash_block_size,
                                  enable_kv_cache_events=events, partial_keys=True)
            if manager:
                self.manager = shmkv.KVCacheManager(
                    to_shmkv(cfg), max_model_len=4096, scheduler_block_size=kwargs.pop(
                        "scheduler_block_size", hash_block_size),
                    hash_block_size=hash_block_size, enable_caching=True,
                    enable_kv_cache_events=events, block_pool=self.pool, **kwargs)

    def request(self, rid, tokens):
        return vrequest.Request(rid, list(tokens), vsampling.SamplingParams(max_tokens=8),
                                None, block_hasher=self.hasher)

    def free_ids(self):
        if self.impl == "vllm":
            return [b.block_id for b in self.pool.free_block_queue.get_all_free_blocks()]
        return self.pool.get_free_block_ids()

    def admit(self, req, num_external=0):
        """get_computed_blocks + allocate_slots of the whole prompt; the trace of both."""
        hit, n, _ = self.manager.get_computed_blocks(req)
        new = self.manager.allocate_slots(req, req.num_tokens - n - num_external, n, hit,
                                          num_external_computed_tokens=num_external)
        if new is None:
            return (n, hit.get_block_ids(), None)
        req.num_computed_tokens = req.num_tokens
        return (n, hit.get_block_ids(), new.get_block_ids())


def both(make_pool, scenario, *args, **kwargs):
    traces = {impl: scenario(impl, make_pool, *args, **kwargs) for impl in IMPLS}
    assert traces["shmkv"] == traces["vllm"]
    return traces["vllm"]


def event_trace(events):
    return [(type(e).__name__,
             tuple(getattr(e, "block_hashes", ()) or ()),
             getattr(e, "parent_block_hash", None),
             tuple(getattr(e, "token_ids", ()) or ()),
             getattr(e, "block_size", None),
             getattr(e, "group_idx", None),
             getattr(e, "kv_cache_spec_kind", None)) for e in events]


# ------------------------------------------------------------------ twins

def _local_and_external(impl, make_pool, num_groups):
    bs = 4
    side = Side(impl, make_pool, config(30, *[full(bs) for _ in range(num_groups)]), bs)
    trace = [side.free_ids()[:12]]
    a = side.request("a", range(5 * bs + 1))
    trace.append(side.admit(a))
    side.manager.free(a)
    trace.append(side.free_ids())
    # Two local hit blocks, then 2 blocks' worth of tokens from an external connector.
    b = side.request("b", list(range(2 * bs)) + [99] * (3 * bs) + [7])
    trace.append(side.admit(b, num_external=2 * bs))
    trace.append(side.free_ids())
    side.manager.free(b)
    trace.append(side.free_ids())
    return trace


@pytest.mark.parametrize("num_groups", [1, 2, 3])
def test_free_queue_order_after_local_and_external_hit(make_pool, num_groups):
    """The hit, the new blocks and the free queue's order (public listing) after a local hit
    plus external tokens, on both. (It was the twin of vLLM's test_cache_hit_local_and_external*,
    which read the list's sentinel nodes; those now run on shmkv as they are.)"""
    trace = both(make_pool, _local_and_external, num_groups)
    assert trace[3][0] == 2 * 4


def _events(impl, make_pool, blocks_to_cache):
    bs = 4
    side = Side(impl, make_pool, config(blocks_to_cache + 2, full(bs)), bs, events=True)
    a = side.request("a", range(blocks_to_cache * bs + 1))
    trace = [side.admit(a)]
    trace.append(event_trace(side.manager.take_events()))
    trace.append(side.manager.take_events())           # drained: nothing twice
    side.manager.free(a)
    b = side.request("b", [1000 + i for i in range(blocks_to_cache * bs + 1)])
    trace.append(side.admit(b))
    trace.append(event_trace(side.manager.take_events()))
    side.manager.free(b)
    trace.append(side.manager.reset_prefix_cache())
    trace.append(event_trace(side.manager.take_events()))
    return trace


@pytest.mark.parametrize("blocks_to_cache", [2, 3, 10])
def test_kv_cache_events_drained_by_take_events(make_pool, blocks_to_cache):
    """Twin of test_kv_cache_events: the stored / removed events, and that take_events
    drains them (the upstream test reads the private queue for that)."""
    trace = both(make_pool, _events, blocks_to_cache)
    assert trace[2] == []
    assert trace[1][0][0] == "BlockStored" and len(trace[1][0][1]) == blocks_to_cache


def _group_idx(impl, make_pool, monkeypatch):
    bs = 4
    side = Side(impl, make_pool, config(5, full(bs)), bs, events=True)
    module = vkvm if impl == "vllm" else __import__(
        "shmkv.core.kv_cache_manager", fromlist=["logger"])
    warnings = []
    monkeypatch.setattr(module.logger, "warning",
                        lambda msg, *a, **k: warnings.append(msg % a if a else msg))
    req = side.request("a", range(bs + 1))
    blocks = side.pool.get_new_blocks(1)
    side.pool.cache_full_blocks(req, blocks, 0, 1, bs, 1)     # group 1 of a 1-group model
    events = side.manager.take_events()
    return [event_trace(events), warnings]


def test_out_of_range_group_idx_is_warned_and_left_unannotated(make_pool, monkeypatch):
    """Twin of test_block_stored_event_group_idx_out_of_bounds: a BlockStored of a group the
    manager does not have is returned unannotated, with vLLM's warning."""
    trace = both(make_pool, _group_idx, monkeypatch)
    assert trace[1] == ["Group index `1` not in KV cache metadata"]
    assert trace[0][0][5] == 1 and trace[0][0][6] is None


def _evict_then_hit(impl, make_pool, specs, evict):
    bs = 4
    side = Side(impl, make_pool, config(40, *specs), bs,
                scheduler_block_size=max(s.block_size for s in specs))
    a = side.request("a", range(8 * bs + 1))
    trace = [side.admit(a)]
    table = side.manager.get_block_ids("a")
    side.manager.free(a)
    side.pool.evict_blocks({table[g][i] for g, i in evict if table[g][i] != 0})
    b = side.request("b", range(8 * bs + 1))
    trace.append(side.admit(b))
    trace.append(side.free_ids())
    return trace


@pytest.mark.parametrize("specs, evict", [
    ((full(4),), [(0, 5)]),
    ((full(4), swa(4, 8)), [(1, 6)]),
    ((full(4), swa(4, 8)), [(0, 3)]),
    ((full(4), swa(4, 8)), [(1, 6), (1, 7)]),
    ((full(8), swa(4, 8)), [(1, 5)]),
    ((swa(4, 8),), [(0, 7)]),
], ids=["full", "hybrid-swa-tail", "hybrid-full-mid", "hybrid-swa-two", "block-sizes", "swa"])
def test_hits_after_evicting_chosen_blocks(make_pool, specs, evict):
    """Twin of the tests that pop keys out of the private index (test_prefill_hybrid_model,
    test_eagle_with_sliding_window, test_different_block_size, *_possible_cached_prefix,
    test_sliding_window_cache_hit_with_finer_hash_alignment): evict the chosen cached
    blocks through evict_blocks and compare the next hit."""
    both(make_pool, _evict_then_hit, specs, evict)


def _two_blocks_one_hash(impl, make_pool):
    bs = 4
    side = Side(impl, make_pool, config(6, full(bs)), bs, manager=False)
    r1, r2 = side.request("1", range(bs)), side.request("2", range(bs))
    a, b = side.pool.get_new_blocks(2)
    side.pool.cache_full_blocks(r1, [a], 0, 1, bs, 0)
    side.pool.cache_full_blocks(r2, [b], 0, 1, bs, 0)
    key = r1.block_hashes[0]
    trace = [[x.block_id for x in side.pool.get_cached_block(key, [0]) or []]]
    side.pool.free_blocks([a, b])
    side.pool.evict_blocks({a.block_id})
    trace.append([x.block_id for x in side.pool.get_cached_block(key, [0]) or []])
    side.pool.evict_blocks({b.block_id})
    trace.append(side.pool.get_cached_block(key, [0]))
    trace.append(side.free_ids())
    return trace


def test_evicting_one_of_two_blocks_with_one_hash(make_pool):
    """Twin of test_maybe_evict_cached_block: two blocks under one key; evicting one leaves
    the other reachable, evicting both leaves none."""
    trace = both(make_pool, _two_blocks_one_hash)
    assert trace[0] == [1] and trace[1] == [2] and trace[2] is None


def _partial(impl, make_pool, dcp):
    hbs = 2
    bs = 4 * dcp
    side = Side(impl, make_pool, config(8, full(bs)), hbs, manager=False)
    req = side.request("a", range(2 * bs - 2))
    blocks = side.pool.get_new_blocks(2)
    side.pool.cache_full_blocks(req, blocks, 0, 1, bs, 0)
    side.pool.cache_partial_block(req, blocks[1], 2 * bs - 2, 0, bs)
    full_key = req.block_hashes[bs // hbs - 1]
    part_key = req.block_hashes[(2 * bs - 2) // hbs - 1]
    ids = lambda key: [x.block_id for x in side.pool.get_cached_block(key, [0]) or []]  # noqa
    trace = [ids(full_key), ids(part_key)]
    side.pool.free_blocks(blocks)
    side.pool.evict_blocks({blocks[1].block_id})
    trace += [ids(full_key), ids(part_key)]
    side.pool.cache_partial_block(req, blocks[0], bs - 2, 0, bs)
    trace.append(ids(req.block_hashes[(bs - 2) // hbs - 1]))
    trace.append(side.pool.reset_prefix_cache())
    trace += [ids(full_key), ids(part_key), ids(req.block_hashes[(bs - 2) // hbs - 1])]
    return trace


@pytest.mark.parametrize("dcp", [1, 2, 4])
def test_partial_entries_gone_after_evict_and_reset(make_pool, dcp):
    """Twin of the partial-entry tests that read the private reverse map
    (test_evict_cached_block_removes_full_hash_and_partial_entry,
    test_reset_prefix_cache_clears_partial_entry_metadata,
    test_cache_partial_block_duplicate_checks_all_blocks_for_hash): a partial entry is
    found, goes with its block's eviction and with a reset."""
    trace = both(make_pool, _partial, dcp)
    assert trace[1] == [2] and trace[3] == [] and trace[-3:] == [[], [], []]


def _skipped(impl, make_pool, spec):
    bs = 4
    side = Side(impl, make_pool, config(40, spec), bs)
    a = side.request("a", range(10 * bs))
    trace = [side.admit(a), side.manager.get_block_ids("a"), side.free_ids()]
    for _ in range(6):
        a.append_output_token_ids(1)
        new = side.manager.allocate_slots(a, 1)
        a.num_computed_tokens = a.num_tokens
        trace += [new.get_block_ids() if new else None, side.manager.get_block_ids("a"),
                  side.free_ids()]
    return trace


@pytest.mark.parametrize("spec", [
    swa(4, 8), swa(4, 5),
    vspecs.ChunkedLocalAttentionSpec(block_size=4, num_kv_heads=1, head_size=1,
                                     dtype=torch.float32, attention_chunk_size=8),
], ids=["swa8", "swa5", "chunked8"])
def test_remove_skipped_blocks_frees_the_same_blocks(make_pool, spec):
    """Twin of test_*_remove_skipped_blocks*: the blocks a sliding-window / chunked-local
    request stops needing are freed (replaced by the null block) at the same steps, in the
    same order."""
    both(make_pool, _skipped, spec)


def _counts_keys(impl, make_pool):
    bs = 4
    side = Side(impl, make_pool, config(5, full(bs)), bs, manager=False)
    req = side.request("0", range(14))
    blocks = side.pool.get_new_blocks(3)
    side.pool.cache_full_blocks(req, blocks[:2], 0, 2, bs, 0)
    trace = [[x.block_id for x in side.pool.get_cached_block(h, [0]) or []]
             for h in req.block_hashes]
    side.pool.cache_full_blocks(req, blocks, 2, 3, bs, 0)
    trace += [[x.block_id for x in side.pool.get_cached_block(h, [0]) or []]
              for h in req.block_hashes]
    trace.append([b.block_hash is not None for b in blocks])
    return trace


def test_cache_full_blocks_counts_keys(make_pool):
    """Twin of test_cache_blocks / test_cache_blocks_multi_group: the blocks cache_full_blocks
    caches, taken from the pool (the upstream tests cache standalone KVCacheBlock(0..) objects,
    and block 0 is shmkv's null block)."""
    both(make_pool, _counts_keys)


@pytest.mark.parametrize("interval", [-32, 24])
def test_bad_retention_interval_message_is_vllms(make_pool, interval):
    """vLLM's message for a negative or unaligned prefix_cache_retention_interval (vLLM raises
    ValueError; shmkv's UsageError is one)."""
    import re

    msgs = {}
    for impl in IMPLS:
        cfg = config(20, full(16), swa(16, 32))
        cfg.prefix_cache_retention_interval = interval
        with pytest.raises(ValueError) as info:
            Side(impl, make_pool, cfg, 16)
        msgs[impl] = str(info.value)
    want = (rf"prefix_cache_retention_interval \({interval}\) must be non-negative and a "
            r"multiple of scheduler_block_size \(16\)")
    assert re.search(want, msgs["vllm"]) and re.search(want, msgs["shmkv"])

