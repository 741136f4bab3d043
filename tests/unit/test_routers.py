"""The routers users run in front of replicas, on small hand-made cases: each routes as its
source says (SGLang's cache-aware policy, llm-d's weighted scorers), and bad settings are
refused naming the flag."""

from __future__ import annotations

import pytest

from shmkv.errors import UsageError
from shmkv.serve.routing import (
    LlmdScorer,
    RouterConfig,
    SchedulerMetrics,
    SGLangCacheAware,
    TokenRadixTree,
    make_router,
)

# ---------------------------------------------------------------------------- radix tree


def test_radix_tree_sizes_split_and_match():
    """A tenant's size is the number of distinct prefixes it was sent (the source's char
    count); a split keeps every tenant's count; a match stops inside a node it does not
    cover whole, naming that node's tenants."""
    t = TokenRadixTree()
    t.insert([1, 2, 3, 4], 0)
    assert t.size(0) == 4
    t.insert([1, 2, 5], 1)  # splits [1,2,3,4] into [1,2] -> [3,4]
    assert (t.size(0), t.size(1)) == (4, 3)
    t.insert([1, 2, 3, 4], 1)
    assert t.size(1) == 5
    assert t.prefix_match([1, 2, 3, 9]) == (3, {0, 1})  # stopped inside [3,4]
    assert t.prefix_match([1, 2, 5, 6]) == (3, {1})
    assert t.prefix_match([1, 2]) == (2, {0, 1})
    assert t.prefix_match([7]) == (0, {0, 1})  # the root: every tenant
    t.remove_tenant(1)
    assert t.size(1) == 0 and t.prefix_match([1, 2, 5, 6]) == (2, {0})


# ---------------------------------------------------------------------------- SGLang


def _sglang(**kw) -> SGLangCacheAware:
    return SGLangCacheAware(**kw)


def test_sglang_defaults_are_the_routers():
    """sgl-router's CLI defaults: cache_threshold 0.3, balance_abs 64, balance_rel 1.5."""
    r = make_router("sglang-cache-aware")
    assert (r.cache_threshold, r.balance_abs_threshold, r.balance_rel_threshold) == (
        0.3, 64, 1.5)


def test_sglang_imbalance_first_shortest_queue():
    """Imbalanced (max - min > abs and max > min * rel): the least loaded scheduler, even
    though another holds the whole prompt; the prompt then goes into its tree too."""
    r = _sglang(balance_abs_threshold=4, balance_rel_threshold=1.5)
    prompt = list(range(1, 11))
    assert r.route(prompt, None, [0, 1, 2], {0: 0, 1: 0, 2: 0}) == 0  # cold: smallest tree
    # 0 holds it all; loads 6 / 1 / 3: 6 - 1 > 4 and 6 > 1.5: imbalanced -> 1
    assert r.route(prompt, None, [0, 1, 2], {0: 6, 1: 1, 2: 3}) == 1
    assert r.num_imbalanced == 1
    assert r.tree.prefix_match(prompt)[1] == {0, 1}
    # 6 - 2 = 4 is not > 4: balanced, the cache wins
    assert r.route(prompt, None, [0, 2], {0: 6, 2: 2}) == 0
    # both rules must hold: 20 - 14 > 4 but 20 < 14 * 1.5: balanced, the cache wins
    assert r.route(prompt, None, [0, 2], {0: 20, 2: 14}) == 0


def test_sglang_cache_threshold():
    """The best match wins only above cache_threshold (strictly); at or below it, the
    smallest tree."""
    r = _sglang(cache_threshold=0.3)
    r.route([1, 2, 3, 50, 51, 52, 53], None, [0, 1], {})  # -> 0 (both empty: the first)
    r.route([9] * 8, None, [0, 1], {})  # -> 1 (smallest tree)
    assert r.tree.size(0) == 7 and r.tree.size(1) == 8
    # 3 of 10 tokens match 0's tree: 0.3 is not > 0.3 -> smallest tree, 0 (7 < 8)
    assert r.route([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], None, [0, 1], {}) == 0
    r2 = _sglang(cache_threshold=0.3)
    r2.route([1, 2, 3, 50], None, [0, 1], {})  # -> 0
    r2.route([9] * 2, None, [0, 1], {})  # -> 1, the smaller tree now
    # 3 of 9 match 0: 0.33 > 0.3 -> 0, though 1's tree is smaller
    assert r2.route([1, 2, 3, 4, 5, 6, 7, 8, 9], None, [0, 1], {}) == 0
    assert r2.num_cache_hits == 1


def test_sglang_smallest_tree_and_salt_and_forget():
    """No match: the smallest tree; a salted prompt matches only its salt's prompts; a
    forgotten (dead) scheduler's tree is gone."""
    r = _sglang()
    live = [0, 1, 2]
    assert [r.route([k] * 5, None, live, {}) for k in (1, 2, 3)] == [0, 1, 2]
    assert r.route([4] * 3, None, live, {}) == 0  # sizes 5, 5, 5: the first
    assert r.route([2] * 5, None, live, {}) == 1  # the full match
    # another salt: no match; the smallest trees are 1's and 2's (5, 5; 0's is 8): the first
    assert r.route([2] * 5, "tenant-b", live, {}) == 1
    assert r.tree.size(1) == 11  # the salt and 5 tokens more
    r.forget(1)
    assert r.route([2] * 5, None, [0, 2], {}) == 2  # 1's prompts are gone with it


# ---------------------------------------------------------------------------- llm-d


def test_llm_d_weighted_scores():
    """Weighted sum of prefix (3), queue (2) and KV-cache (2) scores; the highest wins."""
    r = LlmdScorer(block_size=2)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]  # 4 blocks
    r._record(r.block_hashes(prompt, None), 0)
    idle = {0: SchedulerMetrics(), 1: SchedulerMetrics()}
    assert r.scores(r.block_hashes(prompt, None), [0, 1], idle) == {
        0: (1.0, 1.0, 1.0), 1: (0.0, 1.0, 1.0)}
    assert r.route(prompt, None, [0, 1], {}, idle) == 0  # 7 against 4
    # 0's queue is the longest and its pool 60% used: 3 + 0 + 0.8 = 3.8 < 0 + 2 + 2 = 4
    busy = {0: SchedulerMetrics(num_waiting=4, kv_cache_usage=0.6), 1: SchedulerMetrics()}
    assert r.route(prompt, None, [0, 1], {}, busy) == 1
    # half the prompt cached on 0: 1.5 + 0 + 2 * 0.9 = 3.3 > 0 + 2 + 2 * 0.3 = 2.6
    r2 = LlmdScorer(block_size=2)
    r2._record(r2.block_hashes(prompt[:4], None), 0)
    m = {0: SchedulerMetrics(num_waiting=3, kv_cache_usage=0.1),
         1: SchedulerMetrics(num_waiting=1, kv_cache_usage=0.7)}
    assert r2.route(prompt, None, [0, 1], {}, m) == 0
    # with the prefix scorer's weight at 1: 0.5 + 0 + 1.8 = 2.3 < 2.6
    r3 = LlmdScorer(block_size=2, prefix_weight=1.0)
    r3._record(r3.block_hashes(prompt[:4], None), 0)
    assert r3.route(prompt, None, [0, 1], {}, m) == 1


def test_llm_d_prefix_index_is_what_it_routed():
    """The index learns from its own picks (every block of the prompt, full blocks only,
    salted); the walk stops at the first block nobody holds, and counts every holder of
    each block before it; an LRU per scheduler; forget drops a scheduler."""
    r = LlmdScorer(block_size=2, lru_capacity_per_server=3)
    assert r.block_hashes([1, 2, 3], None) == r.block_hashes([1, 2], None)  # full blocks
    assert r.block_hashes([1, 2], "a") != r.block_hashes([1, 2], None)
    first = r.route([1, 2, 3, 4], None, [0, 1], {})  # a tie: the next in turn
    hashes = r.block_hashes([1, 2, 3, 4, 5, 6], None)
    assert r.scores(hashes, [0, 1], {})[first][0] == pytest.approx(2 / 3)
    r._record(hashes[1:2], 1 - first)  # the other holds block 1 only: it still counts
    assert r.scores(hashes, [0, 1], {})[1 - first][0] == pytest.approx(1 / 3)
    r._record(r.block_hashes([7, 8, 9, 10], None), first)  # 4 blocks > LRU 3
    assert first not in r.index.get(hashes[0], set())  # the oldest went
    r.forget(1 - first)
    assert all(1 - first not in s for s in r.index.values())


def test_llm_d_ties_go_in_turn():
    """Equal totals: the next scheduler in turn (the source picks at random)."""
    r = LlmdScorer(block_size=4)
    assert {r.route([k], None, [0, 1, 2], {}) for k in range(6)} == {0, 1, 2}


# ---------------------------------------------------------------------------- settings


@pytest.mark.parametrize("kw, flag", [
    ({"cache_threshold": 1.5}, "--cache-threshold"),
    ({"cache_threshold": -0.1}, "--cache-threshold"),
    ({"balance_abs_threshold": -1}, "--balance-abs-threshold"),
    ({"balance_rel_threshold": 0.5}, "--balance-rel-threshold"),
    ({"balance_rel_threshold": float("nan")}, "--balance-rel-threshold"),
    ({"prefix_weight": -1.0}, "--prefix-scorer-weight"),
    ({"prefix_weight": 0.0, "queue_weight": 0.0, "kv_weight": 0.0}, "all 0"),
])
def test_bad_router_settings_are_refused(kw, flag):
    """A setting out of range names its flag and the range."""
    with pytest.raises(UsageError, match=flag):
        make_router("sglang-cache-aware", config=RouterConfig(**kw))


def test_unknown_router_lists_the_known():
    with pytest.raises(UsageError, match="llm-d-scorer"):
        make_router("sglang")
