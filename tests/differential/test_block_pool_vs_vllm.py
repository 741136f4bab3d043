"""Differential tests: shmkv's BlockPool against vLLM 0.33.0's own BlockPool, call for call.

Both pools are driven by the same seeded random workload, modelled on vLLM's scheduler:
requests share "system prompt" prefixes, are admitted with prefix-cache lookups
(``get_cached_block`` + ``touch``) and fresh blocks (``get_new_blocks``), grow token by token
(``cache_full_blocks``, sometimes with a ``block_mask``), lose leading blocks to a sliding
window (null blocks), and are finished (``free_blocks`` in reverse order), alone or several at
once. ``evict_blocks``, ``reset_prefix_cache`` and out-of-blocks allocations are mixed in.
Block hashes come from vLLM's own request block hasher (sha256), and the same request object
is handed to both pools.

After every call the two pools must agree on the return value (or the ``ValueError`` message),
the free-queue order, every block's ``ref_cnt`` / ``block_hash`` / ``block_hash_num_tokens``,
the prefix-cache lookups of every cached key, the usage and free count, and the events: the
msgpack bytes of a ``KVEventBatch`` built with each library's own classes must be identical,
and each library must decode the other's bytes. shmkv's ``check_invariants`` runs each time.

vLLM publishes event hashes as ints unless ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``; shmkv
always publishes bytes, so the workload runs with that variable set to 0 (see
``test_default_int_event_hashes_match``).
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest

from shmkv import BlockPool
from shmkv import events as shm_events

vllm_block_pool = pytest.importorskip("vllm.v1.core.block_pool")
vllm_kv_cache_utils = pytest.importorskip("vllm.v1.core.kv_cache_utils")
vllm_kv_events = pytest.importorskip("vllm.distributed.kv_events")
vllm_hashing = pytest.importorskip("vllm.utils.hashing")
vllm_lora_request = pytest.importorskip("vllm.lora.request")
vllm_envs = pytest.importorskip("vllm.envs")

pytestmark = pytest.mark.differential

# vLLM 0.34's free_blocks(evict_first=True): freed cached blocks go to the front too.
VLLM_EVICT_FIRST = "evict_first" in inspect.signature(
    vllm_block_pool.BlockPool.free_blocks).parameters

INT_HASHES_ENV = "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"
HASH_BLOCK_SIZE = 16
VOCAB = 1000

vllm_kv_cache_utils.init_none_hash(vllm_hashing.sha256)
_block_hasher = vllm_kv_cache_utils.get_request_block_hasher(HASH_BLOCK_SIZE, vllm_hashing.sha256)
_vllm_batch_decoder = msgspec.msgpack.Decoder(vllm_kv_events.KVEventBatch)
_LORAS = [
    vllm_lora_request.LoRARequest("adapter-a", 1, "/loras/a"),
    vllm_lora_request.LoRARequest("adapter-b", 2, "/loras/b"),
]


@pytest.fixture(autouse=True)
def _bytes_event_hashes(monkeypatch):
    """vLLM events carry the hash bytes, as shmkv's do (vLLM reads the variable lazily)."""
    monkeypatch.setenv(INT_HASHES_ENV, "0")
    assert vllm_envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES is False, "vLLM's env cache is on"


# --------------------------------------------------------------------------- requests


@dataclass(eq=False)
class Request:
    """What vLLM's BlockPool and block hasher read of a ``vllm.v1.request.Request``, plus the
    scheduler's per-request bookkeeping (block ids per group, cached block counts)."""

    request_id: int
    all_token_ids: list[int]
    cache_salt: str | None = None
    lora_request: Any = None
    session_id: str | None = None
    mm_features: list[Any] = field(default_factory=list)
    prompt_embeds: Any = None
    block_hashes: list[bytes] = field(default_factory=list)
    # Scheduler state: block ids per KV-cache group (0 = null block), blocks cached so far.
    block_ids: dict[int, list[int]] = field(default_factory=dict)
    num_cached: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.block_hashes.extend(_block_hasher(self))

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def _all_token_ids(self) -> list[int]:  # what vLLM 0.34's hasher and events read
        return self.all_token_ids

    def append_tokens(self, token_ids: list[int]) -> None:
        self.all_token_ids.extend(token_ids)
        self.block_hashes.extend(_block_hasher(self))

    def hashes_at(self, block_size: int) -> list[bytes]:
        """The request's hashes at ``block_size`` (the last fine hash of each block)."""
        k = block_size // HASH_BLOCK_SIZE
        return self.block_hashes[k - 1 :: k]


# --------------------------------------------------------------------------- the twin pools


def _normalize(result: Any) -> Any:
    """Block lists become id lists, so results of both pools compare."""
    if isinstance(result, list):
        return [b.block_id for b in result]
    return result


class TwinPools:
    """A shmkv pool and a vLLM pool fed the same calls, compared after each one."""

    def __init__(self, shm: BlockPool, ref: Any, label: str) -> None:
        self.shm = shm
        self.ref = ref
        self.label = label
        self.num_calls = 0
        self.num_events = 0

    def call(self, what: str, fn: Callable[[Any, Callable[[list[int]], list[Any]]], Any]) -> Any:
        """Runs ``fn(pool, handles)`` on both pools; returns the common (normalized) result,
        or ``ValueError`` if both raised one with the same message."""
        outcomes = []
        for pool in (self.shm, self.ref):
            handles = pool.blocks
            try:
                outcome = ("ok", _normalize(fn(pool, lambda ids, h=handles: [h[i] for i in ids])))
            except ValueError as exc:
                outcome = ("ValueError", str(exc))
            outcomes.append(outcome)
        self.num_calls += 1
        where = f"{self.label}, call #{self.num_calls}: {what}"
        assert outcomes[0] == outcomes[1], f"{where}: shmkv {outcomes[0]} != vLLM {outcomes[1]}"
        self.compare(where)
        kind, value = outcomes[0]
        return ValueError(value) if kind == "ValueError" else value

    def compare(self, where: str) -> None:
        """Asserts that the two pools are in the same state and recorded the same events."""
        shm, ref = self.shm, self.ref
        shm.check_invariants()
        assert shm.get_free_block_ids() == [
            b.block_id for b in ref.free_block_queue.get_all_free_blocks()
        ], f"{where}: free queue"
        assert [b.ref_cnt for b in shm.blocks] == [b.ref_cnt for b in ref.blocks], (
            f"{where}: ref_cnt"
        )
        shm_keys = [(b.block_hash, b.block_hash_num_tokens) for b in shm.blocks]
        ref_keys = [(b.block_hash, b.block_hash_num_tokens) for b in ref.blocks]
        assert shm_keys == ref_keys, f"{where}: block_hash / block_hash_num_tokens"
        assert shm.get_num_free_blocks() == ref.get_num_free_blocks(), f"{where}: free count"
        assert shm.get_usage() == ref.get_usage(), f"{where}: usage"
        # Every cached key finds the same (first cached) block in both pools.
        keys = {key for key, _ in ref_keys if key is not None}
        assert (
            len(shm.cached_block_hash_to_block) == len(ref.cached_block_hash_to_block) == len(keys)
        ), f"{where}: number of cached keys"
        assert not ref.cached_block_hashes_by_block, f"{where}: vLLM holds secondary keys"
        for key in keys:
            block_hash, group_id = key[:-4], int.from_bytes(key[-4:], "big")
            found = [
                _normalize(pool.get_cached_block(block_hash, [group_id])) for pool in (shm, ref)
            ]
            assert found[0] == found[1], f"{where}: get_cached_block of a cached key"
        self.compare_events(where)

    def compare_events(self, where: str) -> None:
        """Asserts that both pools recorded the same events, down to the msgpack bytes."""
        shm_batch = shm_events.KVEventBatch(ts=0.0, events=self.shm.take_events())
        ref_batch = vllm_kv_events.KVEventBatch(ts=0.0, events=self.ref.take_events())
        shm_bytes = msgspec.msgpack.encode(shm_batch)
        ref_bytes = msgspec.msgpack.encode(ref_batch)
        assert shm_bytes == ref_bytes, (
            f"{where}: events differ\n  shmkv: {shm_batch}\n  vLLM:  {ref_batch}"
        )
        assert _vllm_batch_decoder.decode(shm_bytes) == ref_batch, f"{where}: vLLM decoding"
        assert shm_events.decode_batch(ref_bytes) == shm_batch, f"{where}: shmkv decoding"
        self.num_events += len(shm_batch.events)


# --------------------------------------------------------------------------- the workload


@dataclass(frozen=True)
class Scenario:
    """One pool configuration: its size, caching, and the block size of each KV-cache group."""

    num_blocks: int
    enable_caching: bool
    group_block_sizes: tuple[int, ...]  # group id -> block size

    @property
    def lookups(self) -> list[list[int]]:
        """Group ids looked up together: groups of one block size share a lookup."""
        by_size: dict[int, list[int]] = {}
        for group_id, size in enumerate(self.group_block_sizes):
            by_size.setdefault(size, []).append(group_id)
        return list(by_size.values())

    def __str__(self) -> str:
        sizes = "+".join(map(str, self.group_block_sizes))
        return f"{self.num_blocks}blk-{'cache' if self.enable_caching else 'nocache'}-bs{sizes}"


class Workload:
    """Scheduler-like random calls on a TwinPools; ``step()`` makes one random move."""

    def __init__(self, twin: TwinPools, scenario: Scenario, rng: random.Random) -> None:
        self.twin = twin
        self.scenario = scenario
        self.rng = rng
        self.groups = list(range(len(scenario.group_block_sizes)))
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.next_id = 0
        self.system_prompts = [
            [rng.randrange(VOCAB) for _ in range(rng.choice([16, 37, 64, 100, 250]))]
            for _ in range(3)
        ]
        self.op_counts: dict[str, int] = {}

    # ------------------------------------------------------------ helpers

    def block_size(self, group_id: int) -> int:
        return self.scenario.group_block_sizes[group_id]

    def new_request(self) -> Request:
        rng = self.rng
        if self.finished and rng.random() < 0.15:  # the same prompt again: full-prompt hits
            old = rng.choice(self.finished)
            tokens = list(old.all_token_ids)
            salt, lora, session = old.cache_salt, old.lora_request, old.session_id
        else:
            tokens = list(rng.choice(self.system_prompts)) if rng.random() < 0.75 else []
            suffix = rng.randint(1, 400) if rng.random() < 0.1 else rng.randint(1, 60)
            tokens += [rng.randrange(VOCAB) for _ in range(suffix)]
            salt = rng.choice([None, None, None, None, "salt-a", "salt-b"])
            lora = rng.choice([None, None, None, None, *_LORAS])
            session = rng.choice([None, None, "session-1"])
        self.next_id += 1
        return Request(self.next_id, tokens, cache_salt=salt, lora_request=lora, session_id=session)

    def free_request_blocks(self, req: Request) -> None:
        """Frees a request's blocks, group by group, last block first (vLLM's order); where
        vLLM has it, now and then with ``evict_first`` (its offload connector's lazy mode)."""
        first = VLLM_EVICT_FIRST and self.rng.random() < 0.25
        for group_id in self.groups:
            ids = req.block_ids.get(group_id, [])
            self.twin.call(
                f"free_blocks(reversed({ids}), evict_first={first})",
                lambda pool, h, ids=ids: pool.free_blocks(reversed(h(ids)), evict_first=first)
                if first else pool.free_blocks(reversed(h(ids))),
            )
        req.block_ids.clear()

    def allocate(self, req: Request, group_id: int, num_tokens: int) -> bool:
        """Gets the blocks ``num_tokens`` needs in a group; False if the pool ran out."""
        need = -(-num_tokens // self.block_size(group_id)) - len(req.block_ids[group_id])
        if need <= 0:
            return True
        got = self.twin.call(f"get_new_blocks({need})", lambda pool, h: pool.get_new_blocks(need))
        if isinstance(got, ValueError):
            assert str(got) == f"Cannot get {need} free blocks from the pool"
            return False
        req.block_ids[group_id].extend(got)
        return True

    def cache(self, req: Request, group_id: int) -> None:
        """Caches the request's new full blocks in a group, sometimes with a block mask."""
        bs = self.block_size(group_id)
        ids = req.block_ids[group_id]
        start = req.num_cached[group_id]
        end = min(req.num_tokens // bs, len(ids))
        if start >= end:
            return
        mask = None
        if self.rng.random() < 0.25:
            mask = [self.rng.random() < 0.7 for _ in range(end - start)]
        # vLLM asserts that a block to cache holds no key, or a shorter one. That can only fail
        # without caching: get_new_blocks then leaves stale keys on reused blocks.
        ref_blocks = self.twin.ref.blocks
        for i in range(start, end):
            blk = ref_blocks[ids[i]]
            if (
                blk.block_hash is not None
                and (mask is None or mask[i - start])
                and blk.block_hash_num_tokens >= (i + 1) * bs
            ):
                assert not self.scenario.enable_caching, f"block {blk} to cache holds a key"
                return
        self.twin.call(
            f"cache_full_blocks(req {req.request_id}, {ids}, {start}, {end}, {bs}, {group_id}, "
            f"mask={mask})",
            lambda pool, h: pool.cache_full_blocks(req, h(ids), start, end, bs, group_id, mask),
        )
        req.num_cached[group_id] = end

    def find_hits(self, req: Request) -> dict[int, list[int]]:
        """vLLM's longest-prefix lookup: block by block until the first miss, never the
        whole prompt (the last token is always computed)."""
        hits: dict[int, list[int]] = {g: [] for g in self.groups}
        for group_ids in self.scenario.lookups:
            bs = self.block_size(group_ids[0])
            hashes = req.hashes_at(bs)[: (req.num_tokens - 1) // bs]
            for block_hash in hashes:
                found = self.twin.call(
                    f"get_cached_block(<hash of req {req.request_id}>, {group_ids})",
                    lambda pool, h, bh=block_hash, g=group_ids: pool.get_cached_block(bh, g),
                )
                if found is None:
                    break
                for group_id, block_id in zip(group_ids, found, strict=True):
                    hits[group_id].append(block_id)
        return hits

    # ------------------------------------------------------------ moves

    def admit(self) -> None:
        """A new request: prefix-cache hits are touched, the rest of the prompt allocated and
        the prompt's full blocks cached; on out-of-blocks everything is given back."""
        req = self.new_request()
        hits = self.find_hits(req)
        for group_id in self.groups:
            req.block_ids[group_id] = list(hits[group_id])
            req.num_cached[group_id] = len(hits[group_id])
            self.twin.call(
                f"touch({hits[group_id]})", lambda pool, h, ids=hits[group_id]: pool.touch(h(ids))
            )
        for group_id in self.groups:
            if not self.allocate(req, group_id, req.num_tokens):
                self.free_request_blocks(req)
                return
        for group_id in self.groups:
            self.cache(req, group_id)
        self.running.append(req)

    def decode(self) -> None:
        """A running request gains tokens, new blocks and new cached blocks; it is preempted
        (its blocks freed) if the pool runs out."""
        req = self.rng.choice(self.running)
        req.append_tokens([self.rng.randrange(VOCAB) for _ in range(self.rng.randint(1, 40))])
        for group_id in self.groups:
            if not self.allocate(req, group_id, req.num_tokens):
                self.running.remove(req)
                self.free_request_blocks(req)
                return
        for group_id in self.groups:
            self.cache(req, group_id)

    def finish(self) -> None:
        """A running request finishes and frees its blocks."""
        req = self.running.pop(self.rng.randrange(len(self.running)))
        self.free_request_blocks(req)
        self.finished.append(req)

    def finish_many(self) -> None:
        """Several requests finish in one free_blocks call per group (shared hit blocks then
        appear more than once in the call)."""
        reqs = self.rng.sample(self.running, min(len(self.running), self.rng.randint(2, 4)))
        for group_id in self.groups:
            ids = [i for req in reqs for i in reversed(req.block_ids[group_id])]
            self.twin.call(f"free_blocks({ids})", lambda pool, h, ids=ids: pool.free_blocks(h(ids)))
        for req in reqs:
            req.block_ids.clear()
            self.running.remove(req)
            self.finished.append(req)

    def slide_window(self) -> None:
        """Leading blocks of a group fall out of a sliding window: they become the null block
        and are freed last-first, as vLLM's SlidingWindowManager does."""
        req = self.rng.choice(self.running)
        group_id = self.rng.choice(self.groups)
        ids = req.block_ids[group_id]
        upto = self.rng.randint(1, max(1, len(ids) - 1))
        removed = [ids[i] for i in range(upto - 1, -1, -1) if ids[i] != 0]
        for i in range(upto):
            ids[i] = 0
        self.twin.call(
            f"free_blocks({removed}) (sliding window)", lambda pool, h: pool.free_blocks(h(removed))
        )

    def evict(self) -> None:
        """A KV connector reports blocks that failed to load (the same set goes to both)."""
        n = self.scenario.num_blocks
        block_ids = set(self.rng.sample(range(n), self.rng.randint(1, min(n, 6))))
        self.twin.call(f"evict_blocks({block_ids})", lambda pool, h: pool.evict_blocks(block_ids))

    def reset(self) -> None:
        """reset_prefix_cache(), which only succeeds once every request is finished."""
        if self.rng.random() < 0.4:
            while self.running:
                self.finish()
        self.twin.call("reset_prefix_cache()", lambda pool, h: pool.reset_prefix_cache())

    def probe(self) -> None:
        """A lookup of a known or unknown hash in some groups, and an over-sized allocation."""
        rng = self.rng
        known = [r for r in self.running + self.finished[-5:] if r.block_hashes]
        if known and rng.random() < 0.8:
            block_hash = rng.choice(rng.choice(known).block_hashes)
        else:
            block_hash = rng.randbytes(32)
        group_ids = rng.choice([[0], [0, 1], [1], [1, 0]])
        self.twin.call(
            f"get_cached_block(<hash>, {group_ids})",
            lambda pool, h: pool.get_cached_block(block_hash, group_ids),
        )
        too_many = self.twin.shm.get_num_free_blocks() + rng.randint(1, 3)
        got = self.twin.call(
            f"get_new_blocks({too_many})", lambda pool, h: pool.get_new_blocks(too_many)
        )
        assert str(got) == f"Cannot get {too_many} free blocks from the pool"

    def step(self) -> None:
        moves: list[tuple[Callable[[], None], float]] = [
            (self.admit, 3.0),
            (self.probe, 0.5),
            (self.evict, 0.5),
            (self.reset, 0.15),
        ]
        if self.running:
            moves += [(self.decode, 4.0), (self.finish, 1.5), (self.slide_window, 0.4)]
        if len(self.running) >= 2:
            moves.append((self.finish_many, 0.5))
        move = self.rng.choices([m for m, _ in moves], [w for _, w in moves])[0]
        self.op_counts[move.__name__] = self.op_counts.get(move.__name__, 0) + 1
        move()


# --------------------------------------------------------------------------- tests


def _make_twin(make_pool, scenario: Scenario, label: str) -> TwinPools:
    shm = make_pool(
        scenario.num_blocks,
        enable_caching=scenario.enable_caching,
        hash_block_size=HASH_BLOCK_SIZE,
        enable_kv_cache_events=True,
    )
    ref = vllm_block_pool.BlockPool(
        scenario.num_blocks, scenario.enable_caching, HASH_BLOCK_SIZE, enable_kv_cache_events=True
    )
    twin = TwinPools(shm, ref, label)
    twin.compare(f"{label}: a new pool")
    return twin


SCENARIOS = [
    # (scenario, seeds, moves per seed)
    (Scenario(24, True, (16,)), [0, 1, 2], 300),
    (Scenario(96, True, (16,)), [3, 4], 300),  # requests of 24+ blocks: the bulk numpy paths
    (Scenario(8, True, (16,)), [5], 300),  # constantly out of blocks
    (Scenario(2, True, (16,)), [6], 100),  # a single usable block
    (Scenario(48, True, (32,)), [7, 8], 300),  # the coarse view: every 2nd fine hash
    (Scenario(64, True, (16, 16)), [9, 10], 250),  # two groups looked up together
    (Scenario(64, True, (16, 32)), [11, 12], 250),  # two groups of different block sizes
    (Scenario(32, False, (16,)), [13, 14], 300),
    (Scenario(48, False, (32, 16)), [15], 250),
]


@pytest.mark.parametrize(
    ("scenario", "seed", "num_moves"),
    [pytest.param(s, seed, n, id=f"{s}-seed{seed}") for s, seeds, n in SCENARIOS for seed in seeds],
)
def test_random_workload_matches_vllm(make_pool, monkeypatch, scenario, seed, num_moves):
    """A seeded scheduler-like workload leaves both pools identical after every call."""
    # Odd seeds publish vLLM's default 64-bit integer hashes, even seeds the 32 bytes.
    monkeypatch.setenv(INT_HASHES_ENV, "1" if seed % 2 else "0")
    print(f"differential seed={seed} scenario={scenario} moves={num_moves}")
    label = f"seed={seed} {scenario}"
    twin = _make_twin(make_pool, scenario, label)
    work = Workload(twin, scenario, random.Random(seed))
    for _ in range(num_moves):
        work.step()
    while work.running:
        work.finish()
    assert twin.call("reset_prefix_cache()", lambda pool, h: pool.reset_prefix_cache()) is True
    print(f"{twin.num_calls} calls, {twin.num_events} events, moves {work.op_counts}")
    assert twin.num_events > 0 or not scenario.enable_caching


def test_out_of_blocks_message_matches_vllm(make_pool):
    """Asking for more blocks than are free raises the same ValueError in both pools."""
    twin = _make_twin(make_pool, Scenario(5, True, (16,)), "out-of-blocks")
    assert twin.call("get_new_blocks(5)", lambda pool, h: pool.get_new_blocks(5)).args == (
        "Cannot get 5 free blocks from the pool",
    )
    assert twin.call("get_new_blocks(4)", lambda pool, h: pool.get_new_blocks(4)) == [1, 2, 3, 4]
    assert twin.call("get_new_blocks(1)", lambda pool, h: pool.get_new_blocks(1)).args == (
        "Cannot get 1 free blocks from the pool",
    )
    assert twin.call("get_new_blocks(0)", lambda pool, h: pool.get_new_blocks(0)) == []


def test_default_int_event_hashes_match(make_pool, monkeypatch):
    """With vLLM's default event settings both pools publish the same BlockStored bytes."""
    monkeypatch.delenv(INT_HASHES_ENV, raising=False)
    if not vllm_envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES:
        pytest.skip("vLLM's default changed: events carry hash bytes")
    twin = _make_twin(make_pool, Scenario(6, True, (16,)), "int hashes")
    req = Request(1, list(range(40)))
    twin.call("get_new_blocks(3)", lambda pool, h: pool.get_new_blocks(3))
    twin.call(
        "cache_full_blocks(req, [1, 2, 3], 0, 2, 16, 0)",
        lambda pool, h: pool.cache_full_blocks(req, h([1, 2, 3]), 0, 2, 16, 0),
    )
