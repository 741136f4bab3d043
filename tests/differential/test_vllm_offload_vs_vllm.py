"""Differential test: shmkv's SharedCPUOffloadingManager against vLLM 0.33.0's own
CPUOffloadingManager (LRU), call for call, on seeded random scheduler-like sequences.

Both managers get the same calls: requests (some with key positions, as the connector
records them, some without), lookups, prepare_store / complete_store (failures included),
prepare_load / complete_load pins, touch, on_request_finished, reset_cache, take_events and
get_stats. After every call the answers must be equal: lookup results, ``keys_to_store``,
``evicted_keys``, ``None`` for a refused store, the events (keys, order, flags) and the stats
gauges. Chunk ids may differ, so for each manager the test checks that a key loads from the
chunk it was stored in and that no two live keys share a chunk. The pool's invariants are
checked along the way and at the end.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

pytest.importorskip("vllm.v1.kv_offload.cpu.manager")

from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key  # noqa: E402
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager  # noqa: E402

from shmkv.vllm import SharedCPUOffloadingManager  # noqa: E402
from tests.conftest import unique_pool_name  # noqa: E402

pytestmark = pytest.mark.differential


def _key(i: int, group: int = 0, width: int = 32):
    return make_offload_key(i.to_bytes(width, "big"), group)


class _Chunks:
    """One manager's key -> chunk map, checked on every store and load."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.chunk_of: dict[bytes, int] = {}

    def stored(self, keys, spec, evicted) -> None:
        for key in evicted:
            self.chunk_of.pop(key, None)
        for key, chunk in zip(keys, spec.block_ids.tolist(), strict=True):
            self.chunk_of[key] = chunk
        live = list(self.chunk_of.values())
        assert len(live) == len(set(live)), f"{self.label}: two live keys share a chunk"

    def loaded(self, keys, spec) -> None:
        got = spec.block_ids.tolist()
        assert got == [self.chunk_of[k] for k in keys], f"{self.label}: load from wrong chunk"

    def dropped(self, keys) -> None:
        for key in keys:
            self.chunk_of.pop(key, None)


def _events(manager) -> list[tuple]:
    """Each event's fields (vLLM 0.34's request context by its id: the contexts are the
    twins' own objects)."""
    return [(tuple(e.keys), e.removed, e.metadata_only, e.medium,
             getattr(e, "removal_expected", None),
             getattr(getattr(e, "req_context", None), "req_id", None))
            for e in manager.take_events()]


def _gauges(manager) -> dict:
    """vLLM's CPU-tier figures (the shared tier's own counters, ``shmkv_*``, left out)."""
    return {k: v for k, v in manager.get_stats().reduce().items()
            if not k.startswith("shmkv_")}


def _run(seed: int, num_chunks: int, num_ops: int, *, key_width: int = 32) -> None:
    rng = random.Random(seed)
    print(f"seed {seed}")
    name = unique_pool_name("dv")
    ours = SharedCPUOffloadingManager(name, num_chunks, enable_events=True)
    ref = CPUOffloadingManager(num_chunks, cache_policy="lru", enable_events=True)
    try:
        chunks = (_Chunks("vllm"), _Chunks("shmkv"))
        universe = [_key(i, g, key_width) for i in range(3 * num_chunks) for g in (0, 1)]
        requests: list[tuple[ReqContext, ReqContext]] = []
        stores: list[list[bytes]] = []  # in-flight store jobs (keys_to_store)
        loads: list[list[bytes]] = []  # in-flight load jobs
        pending: set[bytes] = set()  # keys whose store is in flight
        seen: Counter[str] = Counter()  # what the sequence exercised
        walks: dict[int, list[bytes]] = {}  # request -> its positioned keys, in order
        for step in range(num_ops):
            op = rng.random()
            label = f"seed {seed} step {step}"
            if not requests or op < 0.08:
                pair = (ReqContext(f"r{step}"), ReqContext(f"r{step}"))
                if rng.random() < 0.6:  # the connector records end-token positions
                    placed = {}
                    for k in rng.sample(universe, rng.randint(1, 8)):
                        placed[k] = position = rng.randint(1, 64) * 16
                        for ctx in pair:
                            ctx.set_offload_key_position(k, position)
                    walks[id(pair[1])] = sorted(placed, key=placed.__getitem__)
                assert ref.on_new_request(pair[0]) == ours.on_new_request(pair[1])
                requests.append(pair)
                continue
            pair = rng.choice(requests)
            walk = walks.get(id(pair[1]))
            if op < 0.16 and walk:
                # a scheduler step: the connector walks the request's keys of one group in
                # position order, inside the manager's lock, up to the first MISS, and
                # loads the leading HITs (only lookups and loads: vLLM's manager pins no
                # lookup, so a store here could evict what shmkv's step still pins)
                group = walk[rng.randrange(len(walk))][-4:]
                walk = [k for k in walk if k[-4:] == group]
                with ref.lock, ours.lock:
                    answers = []
                    for key in walk:
                        answers.append(ref.lookup(key, pair[0]))
                        assert answers[-1] == ours.lookup(key, pair[1]), label
                        if answers[-1] == LookupResult.MISS:
                            break
                    for key in walk[:len(answers)]:  # asked again: the kept answers
                        assert ref.lookup(key, pair[0]) == ours.lookup(key, pair[1]), label
                    hits = []
                    for key, answer in zip(walk, answers, strict=False):
                        if answer != LookupResult.HIT:
                            break
                        hits.append(key)
                    if hits and rng.random() < 0.7:
                        spec_ref = ref.prepare_load(hits, pair[0])
                        spec_ours = ours.prepare_load(hits, pair[1])
                        chunks[0].loaded(hits, spec_ref)
                        chunks[1].loaded(hits, spec_ours)
                        loads.append(hits)
                seen["step walk"] += 1
            elif op < 0.30:
                key = rng.choice(universe)
                result = ref.lookup(key, pair[0])
                assert result == ours.lookup(key, pair[1]), label
                seen[result.name] += 1
            elif op < 0.52:
                keys = rng.sample(universe, rng.randint(1, max(2, num_chunks // 2)))
                out_ref, out_ours = ref.prepare_store(keys, pair[0]), ours.prepare_store(
                    keys, pair[1])
                assert (out_ref is None) == (out_ours is None), label
                seen["refused" if out_ref is None else "evicting"
                     if out_ref.evicted_keys else "stored"] += 1
                if out_ref is not None:
                    assert out_ref.keys_to_store == out_ours.keys_to_store, label
                    assert out_ref.evicted_keys == out_ours.evicted_keys, label
                    for c, out in zip(chunks, (out_ref, out_ours), strict=True):
                        c.stored(out.keys_to_store, out.store_spec, out.evicted_keys)
                    if out_ref.keys_to_store:
                        stores.append(out_ref.keys_to_store)
                        pending.update(out_ref.keys_to_store)
            elif op < 0.64 and stores:
                job = stores.pop(rng.randrange(len(stores)))
                success = rng.random() < 0.8
                extra = [rng.choice(universe)] if rng.random() < 0.3 else []
                ref.complete_store(job + extra, pair[0], success=success)
                ours.complete_store(job + extra, pair[1], success=success)
                seen["failed store" if not success else "completed"] += 1
                done = pending.intersection(job + extra)  # any in-flight key is finished
                pending.difference_update(done)
                if not success:
                    for c in chunks:
                        c.dropped(done)
            elif op < 0.74:
                hits = [k for k in rng.sample(universe, 6)
                        if ref.lookup(k, pair[0]) == LookupResult.HIT]
                assert hits == [k for k in hits
                                if ours.lookup(k, pair[1]) == LookupResult.HIT], label
                if hits:
                    spec_ref = ref.prepare_load(hits, pair[0])
                    spec_ours = ours.prepare_load(hits, pair[1])
                    chunks[0].loaded(hits, spec_ref)
                    chunks[1].loaded(hits, spec_ours)
                    loads.append(hits)
            elif op < 0.82 and loads:
                job = loads.pop(rng.randrange(len(loads)))
                ref.complete_load(job, pair[0])
                ours.complete_load(job, pair[1])
            elif op < 0.89:
                keys = rng.sample(universe, rng.randint(1, 5))
                if hasattr(ref, "touch"):  # vLLM 0.34 dropped touch (its connector never called it)
                    ref.touch(keys, pair[0])
                    ours.touch(keys, pair[1])
            elif op < 0.95:
                requests.remove(pair)
                ref.on_request_finished(pair[0])
                ours.on_request_finished(pair[1])
            elif op < 0.965:
                ref.reset_cache()
                ours.reset_cache()
                stores.clear()  # the scheduler never completes pre-reset jobs
                loads.clear()
                pending.clear()
                for c in chunks:
                    c.chunk_of.clear()
            else:
                assert _events(ref) == _events(ours), label
                assert _gauges(ref) == pytest.approx(_gauges(ours)), label
                ours.pool.check_invariants()
        assert _events(ref) == _events(ours)
        assert _gauges(ref) == pytest.approx(_gauges(ours))
        for key in universe:
            assert ref.lookup(key, requests[0][0] if requests else ReqContext("x")) == \
                ours.lookup(key, requests[0][1] if requests else ReqContext("x"))
        ours.pool.check_invariants()
        print(dict(seen))
        for what in ("HIT", "HIT_PENDING", "MISS", "refused", "evicting", "failed store",
                     "step walk"):
            assert seen[what], f"seed {seed}: the sequence never exercised {what}"
    finally:
        ours.close()
        SharedCPUOffloadingManager.unlink(name)


@pytest.mark.parametrize("seed", range(6))
def test_random_sequences_match_vllm(seed):
    """Random scheduler-like call sequences get vLLM's answers, events and gauges."""
    _run(seed, num_chunks=8 + 4 * (seed % 3), num_ops=700)


def test_short_hashes_match_vllm():
    """Keys with block hashes shorter than 32 bytes (vLLM's tests use such) behave alike."""
    _run(100, num_chunks=6, num_ops=500, key_width=3)
