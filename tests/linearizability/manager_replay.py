"""Manager-level replay: one vLLM ``KVCacheManager`` per recorded process, all over ONE
vLLM ``BlockPool``.

vLLM's coordinator builds a private pool; each manager here is built as vLLM builds it, then
handed the shared pool in the three places that keep it (the manager, its coordinator, and
each single-type manager, with the pool's null block), so their calls meet in one pool as the
processes' calls met in shmkv's.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from vllm.v1.core import kv_cache_manager as vllm_manager
from vllm.v1.request import RequestStatus

from shmkv import Request as ShmRequest
from shmkv.hashing import RequestBlockHasher, get_hash_fn_by_name
from shmkv.pool.recorder import Opened, Released
from tests.linearizability.checker import Replayer, Step, _events, _Mismatch, _recorded_events
from tests.linearizability.manager_workers import MANAGER_KWARGS, manager_config


class _TwinRequest(ShmRequest):
    """shmkv's Request plus the scheduler fields vLLM's manager reads."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.status = RequestStatus.WAITING
        self.num_preemptions = 0
        self.num_in_flight_tokens = 0
        self.skip_reading_prefix_cache = False


def _ids(blocks) -> list[list[int]] | None:
    return None if blocks is None else [list(g) for g in blocks.get_block_ids()]


class ManagerReplayer(Replayer):
    def __init__(self, config: Opened) -> None:
        super().__init__(config)
        import vllm.v1.kv_cache_interface as vllm_specs

        self._specs = vllm_specs
        self._num_blocks = config.num_blocks
        self.hasher = RequestBlockHasher(config.hash_block_size, get_hash_fn_by_name("sha256"),
                                         config.none_hash, 0)
        self.managers: dict[tuple[int, int], Any] = {}
        self.requests: dict[tuple[tuple[int, int], str], _TwinRequest] = {}

    def manager(self, who: tuple[int, int]):
        if who not in self.managers:
            mgr = vllm_manager.KVCacheManager(manager_config(self._specs, self._num_blocks),
                                              **MANAGER_KWARGS)
            shared = self.pool
            mgr.block_pool = shared
            mgr.coordinator.block_pool = shared
            for single in mgr.coordinator.single_type_managers:
                single.block_pool = shared
                single._null_block = shared.null_block
            self.managers[who] = mgr
        return self.managers[who]

    def _held_by(self, who: tuple[int, int]) -> Counter:
        """The references the requests of ``who``'s vLLM manager hold."""
        held: Counter = Counter()
        mgr = self.managers.get(who)
        if mgr is not None:
            for single in mgr.coordinator.single_type_managers:
                for blocks in single.req_to_blocks.values():
                    held.update(b.block_id for b in blocks if not b.is_null)
        return held

    def step(self, s: Step) -> None:
        where = f"hold {s.seq}, pid {s.who[0]}, call {s.n}"
        if isinstance(s.rec, Released):
            who = (s.rec.pid, s.rec.slot)
            refs, mine = Counter(dict(s.rec.blocks)), self._held_by(who)
            if mine != refs:
                raise _Mismatch(f"{where}: released slot {s.rec.slot} gave back "
                                f"{sorted(refs.items())}; its vLLM manager's requests hold "
                                f"{sorted(mine.items())}")
            self.pool.free_blocks([self.pool.blocks[b] for b, c in s.rec.blocks
                                   for _ in range(c)])
            self.managers.pop(who, None)  # the process is gone, or closed
            return
        op, a, ex = s.rec.op, s.rec.args, s.exit
        mgr = self.manager(s.who)
        got: Any = None
        if op == "mgr.admit":
            req = _TwinRequest(a["request_id"], a["tokens"], block_hasher=self.hasher)
            hit, num_hit, boundary = mgr.get_computed_blocks(req)
            new = mgr.allocate_slots(req, req.num_tokens - num_hit, num_hit, hit)
            if new is not None:
                req.num_computed_tokens = req.num_tokens
                self.requests[(s.who, a["request_id"])] = req
            got = [_ids(hit), num_hit, boundary, _ids(new)]
        elif op == "mgr.decode":
            req = self.requests[(s.who, a["request_id"])]
            req.append_output_token_ids(a["token"])
            new = mgr.allocate_slots(req, 1)
            if new is not None:
                req.num_computed_tokens += 1
            got = _ids(new)
        elif op == "mgr.free":
            mgr.free(self.requests.pop((s.who, a["request_id"])))
        elif op == "mgr.evict_blocks":
            mgr.evict_blocks(a["block_ids"])
        elif op == "mgr.reset_prefix_cache":
            got = mgr.reset_prefix_cache()
        else:
            raise _Mismatch(f"{where}: {op} is not modelled by the manager checker")
        if ex.error_type is not None:
            raise _Mismatch(f"{where}: {op} raised {ex.error_type}: {ex.error} in shmkv")
        if got != ex.result:
            raise _Mismatch(f"{where}: {op}({a.get('request_id', '')}): shmkv answered "
                            f"{ex.result!r}, vLLM {got!r}")
        mine_ev, theirs = _recorded_events(ex), _events(self.pool)
        if mine_ev != theirs:
            raise _Mismatch(f"{where}: {op} events: shmkv {mine_ev!r}, vLLM {theirs!r}")
