"""Differential test: shmkv's KVCacheManager (over a shmkv pool) against vLLM 0.33.0's own
KVCacheManager, driven by the same request stream, call for call.

A small scheduler loop admits requests whose prompts share a few "system prompts" (some with a
``cache_salt``), prefills them in chunks, decodes them token by token (some steps with
speculative lookahead), finishes or aborts some, and preempts a running request (``free``) when
its decode step does not fit, re-admitting it later with a fresh lookup. Some setups adopt
KV-connector tokens at admission (``num_external_computed_tokens``, half of them with
``delay_cache_blocks``) or give encoder tokens to a cross-attention group. The pool is small,
so evictions and refusals are common. Both managers get twin request objects with the same
tokens and block hashes (shmkv's hasher at the pool's hash block size).

After every call both sides must agree on the hit (block ids per group, tokens, shared-prefix
boundary), on ``allocate_slots``' result (new block ids per group, or None), on every running
request's block table, on usage, on the free-queue order, on the prefix-cache stats and on
the events, down to their msgpack bytes; shmkv's ``check_invariants`` runs every step.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from math import lcm

import pytest

from shmkv import KVCacheManager
from shmkv import Request as ShmRequest
from shmkv import events as shm_events
from shmkv.core import kv_cache_interface as shm_specs

torch = pytest.importorskip("torch")
msgspec = pytest.importorskip("msgspec")
vllm_specs = pytest.importorskip("vllm.v1.kv_cache_interface")
vllm_manager = pytest.importorskip("vllm.v1.core.kv_cache_manager")
vllm_request = pytest.importorskip("vllm.v1.request")
vllm_kv_events = pytest.importorskip("vllm.distributed.kv_events")
vllm_envs = pytest.importorskip("vllm.envs")

pytestmark = pytest.mark.differential

BS = 4
VOCAB = 40


@pytest.fixture(autouse=True)
def _bytes_event_hashes(monkeypatch):
    """vLLM's events carry the hash bytes, as shmkv's do."""
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    monkeypatch.delenv("SHMKV_PREFIX_CACHE_RETENTION_INTERVAL", raising=False)
    assert vllm_envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES is False


class TwinRequest(ShmRequest):
    """shmkv's Request plus the scheduler fields vLLM's manager reads."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.status = vllm_request.RequestStatus.WAITING
        self.num_preemptions = 0
        self.num_in_flight_tokens = 0
        self.skip_reading_prefix_cache = False


def _attn(mod, kind, **extra):
    dtype = torch.float16 if mod is vllm_specs else "float16"
    return getattr(mod, kind)(block_size=BS, num_kv_heads=1, head_size=8, dtype=dtype, **extra)


def _mamba(mod, **extra):
    dtype = torch.float32 if mod is vllm_specs else "float32"
    return mod.MambaSpec(BS, ((2, 4),), (dtype,), mamba_cache_mode="align", **extra)


GROUPS = {
    "full": lambda m: [_attn(m, "FullAttentionSpec")],
    "swa": lambda m: [_attn(m, "SlidingWindowSpec", sliding_window=8)],
    "full+swa": lambda m: [_attn(m, "FullAttentionSpec"),
                           _attn(m, "SlidingWindowSpec", sliding_window=6)],
    "full+swa+swa": lambda m: [_attn(m, "FullAttentionSpec"),
                               _attn(m, "SlidingWindowSpec", sliding_window=6),
                               _attn(m, "SlidingWindowSpec", sliding_window=6)],
    "full+chunked": lambda m: [_attn(m, "FullAttentionSpec"),
                               _attn(m, "ChunkedLocalAttentionSpec", attention_chunk_size=8)],
    "full+mamba": lambda m: [_attn(m, "FullAttentionSpec"), _mamba(m)],
    # Mamba "align" with a prefill checkpoint block (a backend that exports any position).
    "full+mamba-ckpt": lambda m: [_attn(m, "FullAttentionSpec"),
                                  _mamba(m, num_prefill_checkpoint_blocks=1,
                                         prefill_checkpoint_alignment=1)],
    "full+cross": lambda m: [_attn(m, "FullAttentionSpec"), _attn(m, "CrossAttentionSpec")],
    # A DCP draft: an MLA group that keeps its KV replicated (dcp_sharded=False) next to a
    # sharded target and a (always replicated) Mamba group.
    "full+mla-replicated+mamba": lambda m: [_attn(m, "FullAttentionSpec"),
                                            _attn(m, "MLAAttentionSpec", dcp_sharded=False),
                                            _mamba(m)],
}


@dataclass
class Setup:
    name: str
    groups: str
    enable_caching: bool = True
    retention: int | None = None
    max_lookahead: int = 0
    external: bool = False  # some admissions adopt KV-connector tokens
    encoder_tokens: int = 0  # cross-attention tokens given at admission
    use_eagle: bool = False
    num_steps: int = 150
    hash_block_size: int = BS  # finer hashes than the blocks: partial-tail keys, partial hits
    stop_at_boundary: bool = False  # chunks may end on the prompt's reusable hash boundary,
    # and new prompts may repeat an earlier one up to its boundary (sub-block hits)
    junction: bool = False  # enable_mamba_shared_prefix_checkpoint; requests keep the
    # shared-prefix boundary of their lookup, and a chunk may end there (the scheduler's split)
    dcp: int = 1  # decode-context parallelism: sharded groups' blocks span dcp x BS tokens
    hash_lookahead: int = 0  # num_hash_lookahead_tokens: each hash also covers the next L
    # tokens (the pool's, so its hasher's), events carry them, Mamba checkpoints move back
    vllm_objects: bool = False  # shmkv's manager is given vLLM's own KVCacheConfig and specs


SETUPS = [
    Setup("full", "full"),
    Setup("full-nocache", "full", enable_caching=False),
    Setup("full-lookahead", "full", max_lookahead=3),
    Setup("swa", "swa"),
    Setup("full+swa", "full+swa"),
    Setup("full+swa-retention", "full+swa", retention=8),
    Setup("full+swa+swa", "full+swa+swa"),
    Setup("full+chunked", "full+chunked"),
    Setup("full+mamba", "full+mamba"),
    Setup("full+mamba-retention0", "full+mamba", retention=0),
    Setup("full-external", "full", external=True),
    Setup("full+swa-external", "full+swa", external=True),
    Setup("full+cross-nocache", "full+cross", enable_caching=False, encoder_tokens=10),
    Setup("full-eagle", "full", use_eagle=True, max_lookahead=2),
    Setup("full+swa-eagle", "full+swa", use_eagle=True, max_lookahead=2),
    Setup("full+mamba-eagle", "full+mamba", use_eagle=True),
    # Hashes finer than the blocks (hash_block_size 2, blocks of 4). Full attention keys
    # each prompt's last hash boundary inside its block (cache_partial_block); with a Mamba
    # "align" group, hits may end inside a block (enable_partial_hash_hits), the hit's last
    # block is then copied (copy-on-write), and a Mamba producer's key moves to a copy.
    Setup("full+swa-coarse", "full+swa", hash_block_size=2),
    Setup("full+mamba-coarse", "full+mamba", hash_block_size=2),
    Setup("full+mamba-coarse-tails", "full+mamba", hash_block_size=2, stop_at_boundary=True),
    Setup("full+mamba-coarse-eagle", "full+mamba", hash_block_size=2, use_eagle=True),
    Setup("full+mamba-coarse-tails-eagle", "full+mamba", hash_block_size=2, use_eagle=True,
          stop_at_boundary=True),
    # (No Mamba setup with KV-connector tokens: vLLM 0.33.0's Mamba "align" demand does not
    # count the blocks allocate_external_computed_blocks takes, so its allocate_slots can
    # raise "Cannot get 1 free blocks from the pool"; shmkv does the same.)
    Setup("full+swa-coarse-external", "full+swa", hash_block_size=2, external=True),
    Setup("full+mamba-coarse-retention0", "full+mamba", hash_block_size=2, retention=0),
    Setup("full+mamba-ckpt", "full+mamba-ckpt"),
    Setup("full+mamba-ckpt-coarse", "full+mamba-ckpt", hash_block_size=2),
    Setup("full+mamba-ckpt-coarse-tails", "full+mamba-ckpt", hash_block_size=2,
          stop_at_boundary=True),
    Setup("full+mamba-ckpt-coarse-retention0", "full+mamba-ckpt", hash_block_size=2,
          retention=0),
    Setup("full+mamba-ckpt-coarse-eagle", "full+mamba-ckpt", hash_block_size=2,
          use_eagle=True),
    # The shared-prefix junction (EAGLE + sub-block hits): Mamba keys the state where a
    # lookup found other requests' hits diverge from the cache.
    Setup("full+mamba-coarse-junction-eagle", "full+mamba", hash_block_size=2,
          use_eagle=True, stop_at_boundary=True, junction=True),
    # Decode-context parallelism on a hybrid model: full attention's blocks span dcp x BS
    # tokens, Mamba's stay BS (replicated snapshots). Hits may end inside a full-attention
    # block even with hashes as coarse as the Mamba blocks, and are then copied on write.
    Setup("full+mamba-dcp2", "full+mamba", dcp=2),
    Setup("full+mamba-dcp2-tails", "full+mamba", dcp=2, stop_at_boundary=True),
    Setup("full+mamba-dcp2-eagle", "full+mamba", dcp=2, use_eagle=True),
    Setup("full+mamba-dcp2-retention0", "full+mamba", dcp=2, retention=0),
    Setup("full+mamba-dcp4-tails", "full+mamba", dcp=4, stop_at_boundary=True),
    Setup("full+mamba-dcp2-coarse-tails", "full+mamba", dcp=2, hash_block_size=2,
          stop_at_boundary=True),
    Setup("full+mamba-dcp2-coarse-tails-eagle", "full+mamba", dcp=2, hash_block_size=2,
          use_eagle=True, stop_at_boundary=True),
    Setup("full+mamba-ckpt-dcp2-tails", "full+mamba-ckpt", dcp=2, stop_at_boundary=True),
    Setup("full+mla-replicated+mamba-dcp2-tails", "full+mla-replicated+mamba", dcp=2,
          stop_at_boundary=True),
    # num_hash_lookahead_tokens: a block's hash waits for the L tokens after it, so hits,
    # keys, events (lookahead_token_ids) and the Mamba checkpoint boundary all move.
    Setup("full-hashla1", "full", hash_lookahead=1, max_lookahead=1),
    Setup("full+swa-hashla2", "full+swa", hash_lookahead=2),
    Setup("full+mamba-hashla2", "full+mamba", hash_lookahead=2),
    Setup("full+mamba-coarse-tails-hashla2", "full+mamba", hash_block_size=2,
          stop_at_boundary=True, hash_lookahead=2),
    Setup("full+mamba-ckpt-coarse-tails-hashla3", "full+mamba-ckpt", hash_block_size=2,
          stop_at_boundary=True, hash_lookahead=3),
    Setup("full+mamba-coarse-tails-hashla1-eagle", "full+mamba", hash_block_size=2,
          use_eagle=True, stop_at_boundary=True, hash_lookahead=1),
    # vLLM's own KVCacheConfig and specs given to shmkv's manager as they are (item 6).
    Setup("full+swa-vllm-objects", "full+swa", vllm_objects=True),
    Setup("full+chunked-vllm-objects", "full+chunked", vllm_objects=True),
    Setup("full+mamba-ckpt-coarse-tails-vllm-objects", "full+mamba-ckpt", hash_block_size=2,
          stop_at_boundary=True, vllm_objects=True),
    Setup("full+cross-nocache-vllm-objects", "full+cross", enable_caching=False,
          encoder_tokens=10, vllm_objects=True),
]


def _config(mod, setup: Setup, num_blocks: int):
    groups = [mod.KVCacheGroupSpec([f"layer{i}"], spec)
              for i, spec in enumerate(GROUPS[setup.groups](mod))]
    return mod.KVCacheConfig(num_blocks, [], groups,
                             prefix_cache_retention_interval=setup.retention)


def _make_managers(setup: Setup, num_blocks: int, make_pool):
    hbs = setup.hash_block_size
    # Under DCP the full-attention blocks (dcp x BS) are coarser than the hashes even at
    # hbs == BS, so partial keys are needed then too.
    pool = make_pool(num_blocks, enable_caching=setup.enable_caching, hash_block_size=hbs,
                     enable_kv_cache_events=True, partial_keys=hbs != BS or setup.dcp > 1,
                     num_hash_lookahead_tokens=setup.hash_lookahead)
    common = {"max_model_len": 256, "scheduler_block_size": lcm(BS * setup.dcp, BS),
              "hash_block_size": hbs, "dcp_world_size": setup.dcp,
              "enable_caching": setup.enable_caching, "log_stats": True,
              "enable_kv_cache_events": True, "use_eagle": setup.use_eagle,
              "num_hash_lookahead_tokens": setup.hash_lookahead}
    if setup.junction:
        common["enable_mamba_shared_prefix_checkpoint"] = True
    ours = KVCacheManager(_config(vllm_specs if setup.vllm_objects else shm_specs, setup,
                                  num_blocks), block_pool=pool, **common)
    theirs = vllm_manager.KVCacheManager(_config(vllm_specs, setup, num_blocks), **common)
    return ours, theirs, pool


def _ids(blocks):
    return None if blocks is None else blocks.get_block_ids()


def _event_bytes(events, batch_cls):
    return msgspec.msgpack.encode(batch_cls(ts=0.0, events=events))


class Twin:
    def __init__(self, ours_req: TwinRequest, theirs_req: TwinRequest):
        self.ours = ours_req
        self.theirs = theirs_req

    def both(self):
        return (self.ours, self.theirs)


def _run(setup: Setup, seed: int, make_pool) -> dict:
    rng = random.Random(seed)
    num_blocks = rng.choice([32, 48, 80])
    ours, theirs, pool = _make_managers(setup, num_blocks, make_pool)
    hasher = pool.make_block_hasher()
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randrange(6, 30))] for _ in range(3)]
    waiting: list[Twin] = []
    running: list[Twin] = []
    counts = {"hits": 0, "event_bytes": 0, "refused": 0, "preempted": 0}
    next_id = 0

    def compare(label, a, b):
        assert a == b, f"{label}: shmkv {a!r} != vLLM {b!r}"
        return a

    def drain_copies(label):
        """The scheduler's side of copy-on-write: the copies to run, then their retained
        endpoints freed (the copy has run)."""
        oc, oret = ours.take_kv_cache_block_copies()
        tc, tret = theirs.take_kv_cache_block_copies()
        compare(f"{label} copies", [(c.src_block_id, c.dst_block_id) for c in oc],
                [(c.src_block_id, c.dst_block_id) for c in tc])
        counts["copies"] = counts.get("copies", 0) + len(oc)
        pool.free_blocks(oret)
        theirs.block_pool.free_blocks(tret)
        offloads = ours.take_boundary_state_offloads(), theirs.take_boundary_state_offloads()
        compare(f"{label} boundary offloads", *offloads)

    def check_state(label):
        drain_copies(label)
        for t in running:
            rid = t.ours.request_id
            compare(f"{label} table {rid}", ours.get_block_ids(rid), theirs.get_block_ids(rid))
        compare(f"{label} usage", ours.usage, theirs.usage)
        compare(f"{label} free queue", pool.get_free_block_ids(),
                [b.block_id for b in theirs.block_pool.free_block_queue.get_all_free_blocks()])
        ob = _event_bytes(ours.take_events(), shm_events.KVEventBatch)
        tb = _event_bytes(theirs.take_events(), vllm_kv_events.KVEventBatch)
        assert ob == tb, f"{label}: events differ"
        counts["event_bytes"] += len(ob)
        pool.check_invariants()

    def boundary_of(prompt_len: int) -> int:
        return shm_specs.get_mamba_prefill_checkpoint_position(
            prompt_len, setup.hash_block_size, setup.use_eagle, setup.hash_lookahead)

    def maybe_stop(req, num_computed: int, n: int) -> int:
        """With stop_at_boundary, half the time ends the chunk on the prompt's boundary;
        with a junction, always on the shared-prefix boundary first, as the scheduler."""
        junction = getattr(req, "shared_prefix_boundary", 0) if setup.junction else 0
        if num_computed < junction < num_computed + n:
            return junction - num_computed
        if setup.stop_at_boundary and rng.random() < 0.5:
            b = boundary_of(req.num_prompt_tokens)
            if num_computed < b < num_computed + n:
                return b - num_computed
        return n

    past_prompts: list[list[int]] = []

    def admit(twin: Twin, label: str) -> None:
        o, t = twin.both()
        ob, on, osp = ours.get_computed_blocks(o)
        tb, tn, tsp = theirs.get_computed_blocks(t)
        compare(f"{label} hit", (_ids(ob), on, osp), (_ids(tb), tn, tsp))
        if setup.junction:  # the scheduler keeps it on the request
            o.shared_prefix_boundary = osp
            t.shared_prefix_boundary = tsp
        ours.record_prefix_cache_stats(o, on)
        theirs.record_prefix_cache_stats(t, tn)
        counts["hits"] += on > 0
        remaining = o.num_tokens - on
        ext = 0
        kwargs = {"num_encoder_tokens": setup.encoder_tokens}
        if setup.external and remaining > 2 * BS and rng.random() < 0.4:
            ext = BS * rng.randint(1, (remaining - 1) // BS)  # tokens a connector will load
            kwargs.update(num_external_computed_tokens=ext,
                          delay_cache_blocks=rng.random() < 0.5)
            counts["external"] = counts.get("external", 0) + 1
        chunk = min(remaining - ext, rng.choice([BS, 2 * BS, 3 * BS + 1, 64]))
        chunk = maybe_stop(o, on + ext, chunk)
        res_o = ours.allocate_slots(o, chunk, on, ob, **kwargs)
        res_t = theirs.allocate_slots(t, chunk, tn, tb, **kwargs)
        compare(f"{label} allocate (admit)", _ids(res_o), _ids(res_t))
        if res_o is None:
            counts["refused"] += 1
            return
        waiting.remove(twin)
        running.append(twin)
        for r in twin.both():
            r.num_computed_tokens = on + ext + chunk
            r.status = vllm_request.RequestStatus.RUNNING

    def preempt(twin: Twin, label: str) -> None:
        ours.free(twin.ours)
        theirs.free(twin.theirs)
        running.remove(twin)
        waiting.append(twin)
        counts["preempted"] += 1
        for r in twin.both():
            r.num_computed_tokens = 0
            r.num_preemptions += 1
            r.status = vllm_request.RequestStatus.PREEMPTED

    for step in range(setup.num_steps):
        label = f"{setup.name} seed {seed} step {step}"
        ours.new_step_starts()
        theirs.new_step_starts()
        action = rng.random()
        if action < 0.25 or not running:
            prompt = list(rng.choice(prefixes)) + [
                rng.randrange(VOCAB) for _ in range(rng.randrange(0, 20))]
            if setup.stop_at_boundary:
                if past_prompts and rng.random() < 0.4:  # an earlier prompt, to its boundary
                    earlier = rng.choice(past_prompts)
                    prompt = earlier[:boundary_of(len(earlier))] + [
                        rng.randrange(VOCAB) for _ in range(rng.randrange(1, 8))]
                past_prompts.append(prompt)
            salt = rng.choice([None, None, "tenant-b"])
            rid = f"r{next_id}"
            next_id += 1
            twin = Twin(*(TwinRequest(rid, prompt, block_hasher=hasher, cache_salt=salt)
                          for _ in range(2)))
            waiting.append(twin)
            admit(twin, label)
        elif action < 0.32 and waiting:
            admit(rng.choice(waiting), label)
        elif action < 0.42:
            twin = rng.choice(running)  # finish or abort
            ours.free(twin.ours)
            theirs.free(twin.theirs)
            running.remove(twin)
        elif action < 0.44:
            compare(f"{label} reset", ours.reset_prefix_cache(), theirs.reset_prefix_cache())
        else:
            twin = rng.choice(running)
            o, t = twin.both()
            lookahead = rng.randrange(setup.max_lookahead + 1)
            if o.num_computed_tokens >= o.num_tokens:  # decode: sample one token first
                token = rng.randrange(VOCAB)
                o.append_output_token_ids(token)
                t.append_output_token_ids(token)
            n = min(o.num_tokens - o.num_computed_tokens, rng.choice([1, BS, 64]))
            n = maybe_stop(o, o.num_computed_tokens, n)
            res_o = ours.allocate_slots(o, n, num_lookahead_tokens=lookahead)
            res_t = theirs.allocate_slots(t, n, num_lookahead_tokens=lookahead)
            compare(f"{label} allocate", _ids(res_o), _ids(res_t))
            if res_o is None:
                preempt(twin, label)
            else:
                o.num_computed_tokens += n
                t.num_computed_tokens += n
        check_state(label)
    so, st = ours.make_prefix_cache_stats(), theirs.make_prefix_cache_stats()
    compare("stats", (so.requests, so.queries, so.hits, so.preempted_requests,
                      so.preempted_queries, so.preempted_hits, so.reset),
            (st.requests, st.queries, st.hits, st.preempted_requests, st.preempted_queries,
             st.preempted_hits, st.reset))
    for twin in list(running):
        ours.free(twin.ours)
        theirs.free(twin.theirs)
    running.clear()
    check_state("final")
    assert pool.get_num_free_blocks() == num_blocks - 1
    return counts


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("setup", SETUPS, ids=lambda s: s.name)
def test_kv_cache_manager_matches_vllm(setup, seed, make_pool):
    counts = _run(setup, seed, make_pool)
    if setup.enable_caching and setup.retention is None:
        assert counts["hits"] > 0  # sparse retention may leave a short run without hits
    assert counts["event_bytes"] > 0 or not setup.enable_caching


@pytest.mark.parametrize("groups", ["full", "full+swa"])
def test_accepts_vllm_request_objects(groups, make_pool):
    """vLLM's own Request objects drive shmkv's manager (duck typed) as they drive vLLM's."""
    sampling = pytest.importorskip("vllm.sampling_params")
    setup = Setup(groups, groups)
    ours, theirs, pool = _make_managers(setup, 40, make_pool)
    hasher = pool.make_block_hasher()

    def vreq(rid, tokens):
        return vllm_request.Request(rid, list(tokens), sampling.SamplingParams(max_tokens=8),
                                    None, block_hasher=hasher)

    results = {}
    for side, m in (("ours", ours), ("theirs", theirs)):
        out = []
        for i, extra in enumerate(([1, 2, 3], [4, 5, 6, 7, 8])):
            r = vreq(f"r{i}", list(range(24)) + extra)
            hit, n, _ = m.get_computed_blocks(r)
            new = m.allocate_slots(r, r.num_tokens - n, n, hit)
            r.num_computed_tokens = r.num_tokens
            r.append_output_token_ids(9)
            grow = m.allocate_slots(r, 1)
            out.append((hit.get_block_ids(), n, new.get_block_ids(), grow.get_block_ids(),
                        m.get_block_ids(r.request_id)))
        results[side] = out
    assert results["ours"] == results["theirs"]
    assert results["ours"][1][1] == 24
    pool.check_invariants()
