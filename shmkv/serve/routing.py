"""Routing policies of the front end: which scheduler serves a request.

- ``round-robin``: the live schedulers in turn.
- ``least-loaded``: the scheduler with the fewest requests in flight (sent, not finished).
- ``prefix-aware``: the scheduler holding the longest cached prefix of the prompt, unless it
  has ``balance_slack`` more requests in flight than the least loaded one (then the least
  loaded); no hit at all: least loaded. It is an *oracle*: it looks the prompt up in the
  pools themselves (:class:`PrefixView`), which no router in front of real replicas can.
- ``sglang-cache-aware`` (:class:`SGLangCacheAware`): SGLang's router (``cache_aware``), an
  approximate per-scheduler radix tree fed by what it routed, with its load-balance
  thresholds.
- ``llm-d-scorer`` (:class:`LlmdScorer`): llm-d's inference scheduler, a weighted sum of a
  prefix-cache scorer (its own approximate index of what it routed), a queue scorer and a
  KV-cache utilization scorer, and the highest total wins.

The two baselines see only what a router in front of replicas sees: the prompts they routed
and, for llm-d, the figures each scheduler reports a few times a second
(:class:`SchedulerMetrics`); they never look into the pools.

Who holds a prefix (:class:`PrefixView`):

- private pools (:class:`PrivatePoolsView`): the front end attaches to every scheduler's
  pool and looks the prompt's block hashes up in each (each pool has its own NONE_HASH, so
  the prompt is hashed once per pool); a scheduler's hit length is its own pool's.
- one shared pool (:class:`SharedPoolView`): every scheduler hits every cached block, so
  "who holds it" means who computed it. The pool's global event log says which process slot
  stored each key (``BlockStored``) and when it left (``BlockRemoved``); the view follows
  the log and keeps ``key -> scheduler`` (slots are mapped to schedulers by the process
  table's labels, ``scheduler-<i>``). The holder of a prompt is the scheduler that stored
  the deepest block of its cached prefix. Events lost to ring overflow leave the map
  approximate, never wrong about hits (hits are the pool's business, routing only steers).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from shmkv.core.request import Request
from shmkv.errors import UsageError
from shmkv.events import BlockRemoved, BlockStored

__all__ = [
    "BASELINE_ROUTERS", "ROUTING_POLICIES", "LeastLoaded", "LlmdScorer", "PrefixAware",
    "PrefixView", "PrivatePoolsView", "RoundRobin", "RouterConfig", "SGLangCacheAware",
    "SchedulerMetrics", "SharedPoolView", "TokenRadixTree", "make_router",
]

_LOW_64_BITS = (1 << 64) - 1


def _event_key(h: bytes | int) -> int:
    """Events carry a hash as the low 64 bits of the digest (vLLM's default) or the digest;
    both compare as that integer."""
    return h & _LOW_64_BITS if isinstance(h, int) else int.from_bytes(h, "big") & _LOW_64_BITS


class PrefixView(Protocol):
    def holders(self, token_ids: Sequence[int], cache_salt: str | None,
                schedulers: Sequence[int]) -> dict[int, int]:
        """Scheduler index -> cached prefix length in blocks (only schedulers with a hit)."""


class PrivatePoolsView:
    """Looks a prompt up in each scheduler's own pool."""

    def __init__(self, pools: Sequence) -> None:
        self.pools = list(pools)
        self.hashers = [p.make_block_hasher() for p in self.pools]

    def holders(self, token_ids, cache_salt, schedulers) -> dict[int, int]:
        out = {}
        for i in schedulers:
            req = Request("route", token_ids, block_hasher=self.hashers[i],
                          cache_salt=cache_salt)
            n = len(self.pools[i].get_cached_prefix(req.block_hashes))
            if n:
                out[i] = n
        return out


class SharedPoolView:
    """Who stored the cached prefix of a prompt in one shared pool (module docstring)."""

    def __init__(self, pool) -> None:
        self.pool = pool
        self.hasher = pool.make_block_hasher()
        self.cursor = pool.event_cursor(from_start=False)
        self.owner: dict[int, int] = {}  # event key -> scheduler index
        self.slot_to_scheduler: dict[int, int] = {}
        self.events_lost = 0

    def _scheduler_of(self, slot: int) -> int | None:
        if slot not in self.slot_to_scheduler:
            for proc in self.pool.processes():
                label = proc["label"]
                if label.startswith("scheduler-") and label[10:].isdigit():
                    self.slot_to_scheduler[proc["slot"]] = int(label[10:])
        return self.slot_to_scheduler.get(slot)

    def sync(self) -> None:
        """Applies the log's new events to the owner map."""
        events, lost = self.pool.read_events(self.cursor)
        self.events_lost += lost
        for logged in events:
            ev = logged.event
            if isinstance(ev, BlockStored):
                if ev.group_idx not in (None, 0):
                    continue
                sched = self._scheduler_of(logged.slot)
                if sched is None:
                    continue
                for h in ev.block_hashes:
                    self.owner[_event_key(h)] = sched
            elif isinstance(ev, BlockRemoved):
                if ev.group_idx not in (None, 0):
                    continue
                for h in ev.block_hashes:
                    self.owner.pop(_event_key(h), None)
            else:  # AllBlocksCleared
                self.owner.clear()

    def holders(self, token_ids, cache_salt, schedulers) -> dict[int, int]:
        self.sync()
        req = Request("route", token_ids, block_hasher=self.hasher, cache_salt=cache_salt)
        depth, holder = 0, None
        for h in req.block_hashes:
            sched = self.owner.get(_event_key(h))
            if sched is None:
                break
            depth, holder = depth + 1, sched
        return {holder: depth} if holder is not None and holder in schedulers else {}


@dataclass(frozen=True)
class SchedulerMetrics:
    """What a scheduler last reported (its ``SchedulerStats``, a few times a second): what
    llm-d's scorers read from a vLLM pod's ``/metrics``."""

    num_waiting: int = 0  # requests queued, not yet scheduled (vLLM num_requests_waiting)
    kv_cache_usage: float = 0.0  # blocks in use / blocks of its pool (gpu_cache_usage_perc)


class _Router:
    """What every router offers besides ``route``."""

    name = ""

    def forget(self, scheduler: int) -> None:
        """``scheduler`` died or restarted with an empty cache: routers that remember what
        they sent it drop that (SGLang's ``remove_tenant``, llm-d's clean-up of inactive
        pods)."""


class RoundRobin(_Router):
    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def route(self, token_ids, cache_salt, live: Sequence[int], load: Mapping[int, int],
              metrics: Mapping[int, SchedulerMetrics] | None = None) -> int:
        if not live:
            raise UsageError("no live scheduler to route to")
        choice = live[self._next % len(live)]
        self._next += 1
        return choice


class LeastLoaded(_Router):
    name = "least-loaded"

    def __init__(self) -> None:
        self._next = 0

    def route(self, token_ids, cache_salt, live, load, metrics=None) -> int:
        if not live:
            raise UsageError("no live scheduler to route to")
        # Ties go round robin, so an idle node does not pile everything on scheduler 0.
        self._next += 1
        n = len(live)
        order = [live[(self._next + k) % n] for k in range(n)]
        return min(order, key=lambda i: load.get(i, 0))


class PrefixAware(_Router):
    name = "prefix-aware"

    def __init__(self, view: PrefixView, balance_slack: int = 4) -> None:
        self.view = view
        self.balance_slack = balance_slack
        self._least = LeastLoaded()
        self.num_routed_to_holder = 0

    def route(self, token_ids, cache_salt, live, load, metrics=None) -> int:
        least = self._least.route(token_ids, cache_salt, live, load)
        held = self.view.holders(token_ids, cache_salt, live)
        if not held:
            return least
        best = max(held.values())
        choice = min((i for i, n in held.items() if n == best), key=lambda i: load.get(i, 0))
        if load.get(choice, 0) - load.get(least, 0) > self.balance_slack:
            return least
        self.num_routed_to_holder += 1
        return choice




# ---------------------------------------------------------------------- baselines users run


def _check_live(live: Sequence[int]) -> None:
    if not live:
        raise UsageError("no live scheduler to route to")


class _RadixNode:
    __slots__ = ("children", "parent", "tenants", "text")

    def __init__(self, text: tuple, parent: _RadixNode | None, tenants: set[int]) -> None:
        self.text = text
        self.parent = parent
        self.children: dict = {}
        self.tenants = tenants


class TokenRadixTree:
    """SGLang router's approximate tree (``sgl-router/src/tree.rs``) over token ids instead
    of characters: one radix tree for every scheduler ("tenant"), each node listing the
    tenants whose inserted prompts cover all of its text.

    - :meth:`insert` adds a prompt for a tenant, splitting a node where the prompt leaves
      it; a tenant's size (:meth:`size`) grows by the length of every node it newly covers
      (the source's ``tenant_char_count``): the number of distinct prefixes it was sent.
    - :meth:`prefix_match` walks the prompt down the tree and stops at the first node it
      does not cover whole (counting the part it does cover), giving the matched length and
      the tenants of the node where it stopped.
    - :meth:`remove_tenant` drops a tenant from every node (a node left with none goes).

    The source's LRU eviction (every ``eviction_interval_secs``, 120 s, down to
    ``max_tree_size``, 2**26 characters a tenant) is left out: no run of shmkv comes near
    that size."""

    def __init__(self) -> None:
        self.root = _RadixNode((), None, set())
        self._size: dict[int, int] = {}

    def size(self, tenant: int) -> int:
        return self._size.get(tenant, 0)

    def add_tenant(self, tenant: int) -> None:
        """Registers a tenant with an empty tree (the source's ``insert("", url)``)."""
        self.root.tenants.add(tenant)
        self._size.setdefault(tenant, 0)

    def insert(self, tokens: Sequence, tenant: int) -> None:
        self.add_tenant(tenant)
        key = tuple(tokens)
        node, i, n = self.root, 0, len(key)
        while i < n:
            child = node.children.get(key[i])
            if child is None:
                new = _RadixNode(key[i:], node, {tenant})
                node.children[key[i]] = new
                self._size[tenant] += n - i
                return
            shared = _common_prefix(child.text, key, i)
            if shared < len(child.text):  # split: node -> mid -> child
                mid = _RadixNode(child.text[:shared], node, set(child.tenants))
                child.text = child.text[shared:]
                child.parent = mid
                mid.children[child.text[0]] = child
                node.children[key[i]] = mid
                child = mid
            if tenant not in child.tenants:
                child.tenants.add(tenant)
                self._size[tenant] += len(child.text)
            i += shared
            node = child

    def prefix_match(self, tokens: Sequence) -> tuple[int, set[int]]:
        """(tokens matched, tenants of the node where the match stopped)."""
        key = tuple(tokens)
        node, i, n = self.root, 0, len(key)
        while i < n:
            child = node.children.get(key[i])
            if child is None:
                break
            shared = _common_prefix(child.text, key, i)
            i += shared
            node = child
            if shared < len(child.text):
                break
        return i, node.tenants

    def remove_tenant(self, tenant: int) -> None:
        stack = [self.root]
        while stack:
            node = stack.pop()
            node.tenants.discard(tenant)
            for first, child in list(node.children.items()):
                if tenant in child.tenants and len(child.tenants) == 1:
                    del node.children[first]  # its subtree was this tenant's alone
                else:
                    stack.append(child)
        self._size.pop(tenant, None)


def _common_prefix(text: tuple, key: tuple, start: int) -> int:
    """How many leading items of ``text`` equal ``key[start:]``'s."""
    m = min(len(text), len(key) - start)
    if text[:m] == key[start:start + m]:
        return m
    lo, hi = 0, m  # text[:lo] matches, text[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if text[:mid] == key[start:start + mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _salted(token_ids: Sequence[int], cache_salt: str | None) -> list:
    """The router's key of a prompt: its tokens, after the salt when it has one (a salted
    prompt shares no cache with the same tokens under another salt, so a router that put
    them in one tree would promise hits the pools cannot give)."""
    return list(token_ids) if cache_salt is None else [("salt", cache_salt), *token_ids]


class SGLangCacheAware(_Router):
    """SGLang's cache-aware router, as ``sgl-project/sglang``
    ``sgl-router/src/policies/cache_aware.rs`` implements it (``CacheAwarePolicy::
    select_worker``, read at commit 026f853ba7ae; its tree in ``sgl-router/src/tree.rs``;
    defaults from the router's CLI: ``cache_threshold`` 0.3, ``balance_abs_threshold`` 64,
    ``balance_rel_threshold`` 1.5), over token ids:

    1. the loads are the requests in flight per scheduler (the source's ``worker.load()``);
       the system is imbalanced when ``max - min > balance_abs_threshold`` and
       ``max > min * balance_rel_threshold``: then the least loaded scheduler (the first of
       the lowest), and the prompt is still inserted into its tree;
    2. else the prompt is matched in the tree (:class:`TokenRadixTree`); match rate =
       tokens matched / prompt tokens; above ``cache_threshold``: a tenant of the node where
       the match stopped (the source takes its hash map's first key, which is arbitrary;
       here a seeded random choice, so runs repeat);
    3. else the scheduler with the smallest tree (the first of the smallest).

    The chosen scheduler's tree gets the prompt. A dead scheduler's tenant is removed
    (:meth:`forget`, the source's ``remove_worker``). The prompt key starts with the
    request's cache salt when it has one (:func:`_salted`).
    """

    name = "sglang-cache-aware"

    def __init__(self, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5, seed: int = 0) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.tree = TokenRadixTree()
        self._rng = random.Random(seed)
        self.num_imbalanced = 0  # requests routed by the imbalance rule
        self.num_cache_hits = 0  # ... to the best match
        self.num_smallest_tree = 0  # ... to the smallest tree

    def route(self, token_ids, cache_salt, live, load, metrics=None) -> int:
        _check_live(live)
        for i in live:
            self.tree.add_tenant(i)
        key = _salted(token_ids, cache_salt)
        loads = [load.get(i, 0) for i in live]
        hi, lo = max(loads), min(loads)
        if hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold:
            choice = min(live, key=lambda i: load.get(i, 0))
            self.num_imbalanced += 1
        else:
            matched, tenants = self.tree.prefix_match(key)
            matched -= 1 if cache_salt is not None and matched else 0  # not the salt
            rate = matched / len(token_ids) if len(token_ids) else 0.0
            holders = sorted(t for t in tenants if t in live)
            if rate > self.cache_threshold and holders:
                choice = self._rng.choice(holders)
                self.num_cache_hits += 1
            else:
                choice = min(live, key=self.tree.size)
                self.num_smallest_tree += 1
        self.tree.insert(key, choice)
        return choice

    def forget(self, scheduler: int) -> None:
        self.tree.remove_tenant(scheduler)


class LlmdScorer(_Router):
    """llm-d's inference scheduler (the endpoint picker of ``llm-d/llm-d-inference-scheduler``,
    built on ``kubernetes-sigs/gateway-api-inference-extension``) in the default profile of
    GIE's chart (``config/charts/inferencepool/templates/epp-config.yaml``, read at commit
    0ae94dfbf9dc: ``default-plugins.yaml``): three scorers, each giving every scheduler a
    score in [0, 1], summed with weights (prefix-cache 3, queue 2, KV-cache utilization 2);
    the highest total wins (``max-score-picker``; the source breaks ties at random, here
    the next in turn, so runs repeat).

    - prefix-cache scorer (GIE ``pkg/epp/scheduling/framework/plugins/multi/prefix/
      plugin.go``, approximate mode, ``matchLongestPrefix`` and ``PreRequest``): the
      prompt's full blocks (``block_size`` tokens, chained hashes, the cache salt in the
      first; at most ``max_prefix_blocks`` 256) are looked up in an index of what the
      router itself sent where; walking the blocks in order until one is held by no
      scheduler, every scheduler holding a block gets one more; score = its count / the
      prompt's blocks. After the pick, the chosen scheduler is recorded for every block of
      the prompt, in an LRU of ``lru_capacity_per_server`` (31,250) blocks per scheduler.
    - queue scorer (GIE ``.../plugins/scorer/queue.go``): ``(max - q) / (max - min)`` of the
      waiting queues the schedulers last reported, 1 for all when they are equal.
    - KV-cache utilization scorer (GIE ``.../plugins/scorer/kvcache_utilization.go``):
      ``1 - usage``, the share of its pool's blocks in use it last reported.

    The figures (:class:`SchedulerMetrics`) are what the schedulers report every 50 ms
    (GIE's metrics refresh interval), so they lag as llm-d's scrapes do; a scheduler that
    has reported nothing yet counts as idle and empty.
    """

    name = "llm-d-scorer"

    def __init__(self, block_size: int = 16, prefix_weight: float = 3.0,
                 queue_weight: float = 2.0, kv_weight: float = 2.0,
                 max_prefix_blocks: int = 256, lru_capacity_per_server: int = 31250) -> None:
        self.block_size = block_size
        self.weights = (prefix_weight, queue_weight, kv_weight)
        self.max_prefix_blocks = max_prefix_blocks
        self.lru_capacity_per_server = lru_capacity_per_server
        self.index: dict[int, set[int]] = {}  # block hash -> schedulers sent it
        self.lru: dict[int, OrderedDict] = {}  # scheduler -> its block hashes, oldest first
        self._next = 0

    def block_hashes(self, token_ids: Sequence[int], cache_salt: str | None) -> list[int]:
        b = self.block_size
        parent = hash(("llm-d", cache_salt))
        out = []
        for k in range(min(len(token_ids) // b, self.max_prefix_blocks)):
            parent = hash((parent, tuple(token_ids[k * b:(k + 1) * b])))
            out.append(parent)
        return out

    def scores(self, hashes: list[int], live: Sequence[int],
               metrics: Mapping[int, SchedulerMetrics]) -> dict[int, tuple[float, ...]]:
        """Scheduler -> (prefix, queue, kv-cache) scores, before the weights."""
        matched = dict.fromkeys(live, 0)
        for h in hashes:
            holders = self.index.get(h)
            if not holders:
                break
            for s in holders:
                if s in matched:
                    matched[s] += 1
        m = {i: metrics.get(i, SchedulerMetrics()) for i in live}
        qs = [m[i].num_waiting for i in live]
        q_hi, q_lo = max(qs), min(qs)
        out = {}
        for i in live:
            prefix = matched[i] / len(hashes) if hashes else 0.0
            queue = 1.0 if q_hi == q_lo else (q_hi - m[i].num_waiting) / (q_hi - q_lo)
            kv = min(max(1.0 - m[i].kv_cache_usage, 0.0), 1.0)
            out[i] = (prefix, queue, kv)
        return out

    def route(self, token_ids, cache_salt, live, load, metrics=None) -> int:
        _check_live(live)
        hashes = self.block_hashes(token_ids, cache_salt)
        scores = self.scores(hashes, live, metrics or {})
        self._next += 1
        n = len(live)
        order = [live[(self._next + k) % n] for k in range(n)]
        total = {i: sum(w * s for w, s in zip(self.weights, scores[i], strict=True))
                 for i in live}
        choice = max(order, key=lambda i: total[i])  # the first of the highest, in turn
        self._record(hashes, choice)
        return choice

    def _record(self, hashes: list[int], scheduler: int) -> None:
        lru = self.lru.setdefault(scheduler, OrderedDict())
        for h in hashes:
            self.index.setdefault(h, set()).add(scheduler)
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > self.lru_capacity_per_server:
            old, _ = lru.popitem(last=False)
            holders = self.index.get(old)
            if holders is not None:
                holders.discard(scheduler)
                if not holders:
                    del self.index[old]

    def forget(self, scheduler: int) -> None:
        for h in self.lru.pop(scheduler, {}):
            holders = self.index.get(h)
            if holders is not None:
                holders.discard(scheduler)
                if not holders:
                    del self.index[h]


@dataclass(frozen=True)
class RouterConfig:
    """The routers' settings (``shmkv run`` / ``shmkv replay`` flags); the defaults are the
    sources' own (see each router's docstring)."""

    balance_slack: int = 4  # prefix-aware
    cache_threshold: float = 0.3  # sglang-cache-aware
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    prefix_weight: float = 3.0  # llm-d-scorer
    queue_weight: float = 2.0
    kv_weight: float = 2.0

    def validate(self) -> None:
        """Raises:
            UsageError: naming the flag, the value and the range."""
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise UsageError(f"--cache-threshold {self.cache_threshold!r}: must be between 0 "
                             "and 1 (a share of the prompt matched; SGLang's default 0.3)")
        if self.balance_abs_threshold < 0:
            raise UsageError(f"--balance-abs-threshold {self.balance_abs_threshold!r}: must be "
                             "a whole number >= 0 (requests in flight; SGLang's default 64)")
        if not 1.0 <= self.balance_rel_threshold < float("inf"):
            raise UsageError(f"--balance-rel-threshold {self.balance_rel_threshold!r}: must be "
                             "a finite number >= 1 (max load / min load; SGLang's default 1.5)")
        if self.balance_slack < 0:
            raise UsageError(f"--balance-slack {self.balance_slack!r}: must be a whole number "
                             ">= 0")
        weights = {"--prefix-scorer-weight": self.prefix_weight,
                   "--queue-scorer-weight": self.queue_weight,
                   "--utilization-scorer-weight": self.kv_weight}
        for flag, w in weights.items():
            if not 0.0 <= w < float("inf"):
                raise UsageError(f"{flag} {w!r}: must be a finite number >= 0 (llm-d's "
                                 "defaults: prefix 3, queue 2, kv 2)")
        if not any(weights.values()):
            raise UsageError("--prefix-scorer-weight, --queue-scorer-weight and "
                             "--utilization-scorer-weight are all 0: give at least one a weight")


ROUTING_POLICIES = ("round-robin", "least-loaded", "prefix-aware", "sglang-cache-aware",
                    "llm-d-scorer")
# The routers of real deployments that know about prefixes (the oracle does not count).
BASELINE_ROUTERS = ("sglang-cache-aware", "llm-d-scorer")


def make_router(policy: str, view: PrefixView | None = None,
                config: RouterConfig | int = RouterConfig(), *, block_size: int = 16):
    """A router by name (one of ``ROUTING_POLICIES``); ``config`` an int is the prefix-aware
    ``balance_slack`` alone.

    Raises:
        UsageError: an unknown name (listing the known ones), a setting out of range, or
            prefix-aware without a view.
    """
    if isinstance(config, int):
        config = RouterConfig(balance_slack=config)
    config.validate()
    if policy == "round-robin":
        return RoundRobin()
    if policy == "least-loaded":
        return LeastLoaded()
    if policy == "prefix-aware":
        if view is None:
            raise UsageError("prefix-aware routing needs a prefix view")
        return PrefixAware(view, config.balance_slack)
    if policy == "sglang-cache-aware":
        return SGLangCacheAware(config.cache_threshold, config.balance_abs_threshold,
                                config.balance_rel_threshold)
    if policy == "llm-d-scorer":
        return LlmdScorer(block_size, config.prefix_weight, config.queue_weight,
                          config.kv_weight)
    raise UsageError(f"unknown routing policy {policy!r}; use one of "
                     f"{', '.join(ROUTING_POLICIES)}")
