"""Routing policies of the front end: which scheduler serves a request.

- ``round-robin``: the live schedulers in turn.
- ``least-loaded``: the scheduler with the fewest requests in flight (sent, not finished).
- ``prefix-aware``: the scheduler holding the longest cached prefix of the prompt, unless it
  has ``balance_slack`` more requests in flight than the least loaded one (then the least
  loaded: SGLang's cache-aware router makes the same trade); no hit at all: least loaded.

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

from collections.abc import Mapping, Sequence
from typing import Protocol

from shmkv.core.request import Request
from shmkv.errors import UsageError
from shmkv.events import BlockRemoved, BlockStored

__all__ = [
    "ROUTING_POLICIES", "LeastLoaded", "PrefixAware", "PrefixView", "PrivatePoolsView",
    "RoundRobin", "SharedPoolView", "make_router",
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


class RoundRobin:
    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def route(self, token_ids, cache_salt, live: Sequence[int], load: Mapping[int, int]) -> int:
        if not live:
            raise UsageError("no live scheduler to route to")
        choice = live[self._next % len(live)]
        self._next += 1
        return choice


class LeastLoaded:
    name = "least-loaded"

    def __init__(self) -> None:
        self._next = 0

    def route(self, token_ids, cache_salt, live, load) -> int:
        if not live:
            raise UsageError("no live scheduler to route to")
        # Ties go round robin, so an idle node does not pile everything on scheduler 0.
        self._next += 1
        n = len(live)
        order = [live[(self._next + k) % n] for k in range(n)]
        return min(order, key=lambda i: load.get(i, 0))


class PrefixAware:
    name = "prefix-aware"

    def __init__(self, view: PrefixView, balance_slack: int = 4) -> None:
        self.view = view
        self.balance_slack = balance_slack
        self._least = LeastLoaded()
        self.num_routed_to_holder = 0

    def route(self, token_ids, cache_salt, live, load) -> int:
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


ROUTING_POLICIES = ("round-robin", "least-loaded", "prefix-aware")


def make_router(policy: str, view: PrefixView | None = None, balance_slack: int = 4):
    """A router by name (one of ``ROUTING_POLICIES``)."""
    if policy == "round-robin":
        return RoundRobin()
    if policy == "least-loaded":
        return LeastLoaded()
    if policy == "prefix-aware":
        if view is None:
            raise UsageError("prefix-aware routing needs a prefix view")
        return PrefixAware(view, balance_slack)
    raise UsageError(f"unknown routing policy {policy!r}; one of {', '.join(ROUTING_POLICIES)}")
