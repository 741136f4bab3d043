"""Differential tests: shmkv's single-type managers against vLLM 0.33.0's own managers (over
vLLM's own BlockPool), call for call.

A seeded workload drives one KV-cache group the way vLLM's ``KVCacheManager.allocate_slots``
does: a new request looks up its prefix-cache hit (``find_longest_cache_hit``), frees what the
window no longer needs (``remove_skipped_blocks``), asks for its demand
(``get_num_blocks_to_allocate``), takes the hit (``add_local_computed_blocks``), gets fresh
blocks (``allocate_new_blocks``) and caches its full blocks (``cache_blocks``); running
requests prefill in chunks and decode token by token (some with speculative lookahead);
requests are finished or preempted by ``free``. Prompts share a few "system prompt" prefixes,
so hits, shared blocks and evictions are common, and the pool is small, so some admissions do
not fit (both sides must then refuse).

After every call both sides must agree on the return value (hit block ids and length, demand,
new block ids), on every request's block ids and cached-block count, and on the pool's
free-queue order; shmkv's ``check_invariants`` runs after each step. The same request objects
(shmkv ``Request``, sha256 hashes at the group's block size) are handed to both sides.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from shmkv import Request
from shmkv.core import kv_cache_interface as shm_specs
from shmkv.core import single_type_kv_cache_manager as shm_managers

torch = pytest.importorskip("torch")
vllm_specs = pytest.importorskip("vllm.v1.kv_cache_interface")
vllm_managers = pytest.importorskip("vllm.v1.core.single_type_kv_cache_manager")
vllm_block_pool = pytest.importorskip("vllm.v1.core.block_pool")

pytestmark = pytest.mark.differential

BLOCK_SIZE = 4
VOCAB = 50
CKPT = {"num_prefill_checkpoint_blocks": 1, "prefill_checkpoint_alignment": 1}


def _attention(kind: str, **extra):
    common = {"block_size": BLOCK_SIZE, "num_kv_heads": 1, "head_size": 8}
    ours = getattr(shm_specs, kind)(**common, dtype="float16", **extra)
    theirs = getattr(vllm_specs, kind)(**common, dtype=torch.float16, **extra)
    return ours, theirs


def _mamba(mode: str, num_speculative_blocks: int, **extra):
    kw = {"mamba_cache_mode": mode, "num_speculative_blocks": num_speculative_blocks, **extra}
    ours = shm_specs.MambaSpec(BLOCK_SIZE, ((2, 4),), ("float32",), **kw)
    theirs = vllm_specs.MambaSpec(BLOCK_SIZE, ((2, 4),), (torch.float32,), **kw)
    return ours, theirs


@dataclass
class Setup:
    """One group's spec on both sides, which manager class runs it, and the workload shape."""

    name: str
    specs: tuple
    manager: str
    enable_caching: bool = True
    max_spec_tokens: int = 0  # speculative lookahead tokens per decode step
    chunk_multiple: int = 1  # prefill chunks are multiples of this many blocks
    pass_prompt_len: bool = False  # remove_skipped_blocks gets num_prompt_tokens (R-SWA)
    num_steps: int = 120
    scheduler_block_size: int = BLOCK_SIZE  # the hit alignment and the cache-mask alignment
    retention_interval: int | None = None  # sparse caching (sliding window, Mamba)
    eagle: bool = False  # use_eagle on the manager, drop_eagle_block in lookups
    num_groups: int = 1  # groups of this spec on the one pool; a hit must hit in all
    external: bool = False  # some admissions also get KV-connector (external) tokens
    zeroing: bool = False  # needs_kv_cache_zeroing: new block ids are recorded
    hash_block_size: int = BLOCK_SIZE  # request hashes are this fine; blocks may be coarser
    stop_at_boundary: bool = False  # some prefill chunks end on the prompt's last boundary


SETUPS = [
    Setup("full", _attention("FullAttentionSpec"), "FullAttentionManager"),
    Setup("full-nocache", _attention("FullAttentionSpec"), "FullAttentionManager",
          enable_caching=False),
    Setup("full-lookahead", _attention("FullAttentionSpec"), "FullAttentionManager",
          max_spec_tokens=3),
    Setup("mla", _attention("MLAAttentionSpec"), "FullAttentionManager"),
    Setup("swa-4", _attention("SlidingWindowSpec", sliding_window=4), "SlidingWindowManager"),
    Setup("swa-9", _attention("SlidingWindowSpec", sliding_window=9), "SlidingWindowManager",
          max_spec_tokens=2),
    Setup("swa-extra", _attention("SlidingWindowSpec", sliding_window=6,
                                  extra_retained_tokens=3), "SlidingWindowManager"),
    Setup("chunked-8", _attention("ChunkedLocalAttentionSpec", attention_chunk_size=8),
          "ChunkedLocalAttentionManager"),
    Setup("chunked-12", _attention("ChunkedLocalAttentionSpec", attention_chunk_size=12),
          "ChunkedLocalAttentionManager"),
    Setup("rswa", _attention("RSWASpec", rswa_window=3), "RSWAManager", pass_prompt_len=True,
          num_steps=400),
    Setup("mamba-none", _mamba("none", 0), "MambaManager", enable_caching=False),
    Setup("mamba-none-spec", _mamba("none", 2), "MambaManager", enable_caching=False,
          max_spec_tokens=2),
    Setup("mamba-all", _mamba("all", 0), "MambaManager", enable_caching=False),
    Setup("mamba-align", _mamba("align", 0), "MambaManager", chunk_multiple=1),
    Setup("mamba-align-spec", _mamba("align", 1), "MambaManager", max_spec_tokens=1),
    # Alignment bigger than the block: aligned hits, sparse sliding-window caching.
    Setup("full-align-8", _attention("FullAttentionSpec"), "FullAttentionManager",
          scheduler_block_size=8, chunk_multiple=2),
    Setup("full-eagle", _attention("FullAttentionSpec"), "FullAttentionManager", eagle=True),
    Setup("swa-align-16", _attention("SlidingWindowSpec", sliding_window=4),
          "SlidingWindowManager", scheduler_block_size=16, chunk_multiple=4),
    Setup("swa-align-8-eagle", _attention("SlidingWindowSpec", sliding_window=4),
          "SlidingWindowManager", scheduler_block_size=8, chunk_multiple=2, eagle=True),
    Setup("swa-retain-0", _attention("SlidingWindowSpec", sliding_window=5),
          "SlidingWindowManager", scheduler_block_size=8, chunk_multiple=2,
          retention_interval=0),
    Setup("swa-retain-16", _attention("SlidingWindowSpec", sliding_window=4),
          "SlidingWindowManager", scheduler_block_size=8, chunk_multiple=2,
          retention_interval=16),
    Setup("swa-retain-16-eagle", _attention("SlidingWindowSpec", sliding_window=4),
          "SlidingWindowManager", scheduler_block_size=8, chunk_multiple=2,
          retention_interval=16, eagle=True),
    Setup("mamba-align-8", _mamba("align", 0), "MambaManager", scheduler_block_size=8,
          chunk_multiple=2),
    Setup("mamba-retain-0", _mamba("align", 0), "MambaManager", scheduler_block_size=8,
          chunk_multiple=2, retention_interval=0),
    Setup("mamba-retain-16", _mamba("align", 0), "MambaManager", scheduler_block_size=8,
          chunk_multiple=2, retention_interval=16),
    # Two groups of one spec (what a Unitary/Hybrid coordinator drives), KV-connector tokens,
    # worker zeroing.
    Setup("full-2groups", _attention("FullAttentionSpec"), "FullAttentionManager",
          num_groups=2, zeroing=True),
    Setup("swa-2groups", _attention("SlidingWindowSpec", sliding_window=6),
          "SlidingWindowManager", num_groups=2, external=True),
    Setup("chunked-2groups", _attention("ChunkedLocalAttentionSpec", attention_chunk_size=8),
          "ChunkedLocalAttentionManager", num_groups=2, external=True, zeroing=True),
    Setup("full-external", _attention("FullAttentionSpec"), "FullAttentionManager",
          external=True, zeroing=True),
    Setup("mamba-align-2groups", _mamba("align", 0), "MambaManager", num_groups=2),
    # Hashes finer than the blocks (the pool's hash_block_size 2, blocks of 4): coarse views.
    Setup("swa-coarse", _attention("SlidingWindowSpec", sliding_window=6),
          "SlidingWindowManager", hash_block_size=2),
    Setup("chunked-coarse", _attention("ChunkedLocalAttentionSpec", attention_chunk_size=8),
          "ChunkedLocalAttentionManager", hash_block_size=2),
    Setup("mamba-none-coarse", _mamba("none", 1), "MambaManager", enable_caching=False,
          hash_block_size=2),
    # Block-aligned chunks never end on the prompt's last hash boundary inside a block, so
    # vLLM keys no partial tail here.
    Setup("mamba-align-coarse", _mamba("align", 0), "MambaManager", hash_block_size=2),
    # Partial-tail keys (BlockPool.cache_partial_block): with blocks coarser than the hashes,
    # full attention keys the prompt's last hash boundary inside its block, as its own key
    # (promoted to the full key once the block fills) or as an alias of the full key.
    Setup("full-coarse", _attention("FullAttentionSpec"), "FullAttentionManager",
          hash_block_size=2),
    Setup("full-coarse-eagle", _attention("FullAttentionSpec"), "FullAttentionManager",
          hash_block_size=2, eagle=True),
    Setup("full-coarse-2groups", _attention("FullAttentionSpec"), "FullAttentionManager",
          hash_block_size=2, num_groups=2, zeroing=True),
    # Fine-grained hits (alignment = hash_block_size < block size): a hit may end inside a
    # block, on a partial key; the request then gets a private copy of that block (COW).
    Setup("full-fine", _attention("FullAttentionSpec"), "FullAttentionManager",
          hash_block_size=2, scheduler_block_size=2),
    Setup("full-fine-eagle", _attention("FullAttentionSpec"), "FullAttentionManager",
          hash_block_size=2, scheduler_block_size=2, eagle=True, zeroing=True),
    Setup("full-fine-external", _attention("FullAttentionSpec"), "FullAttentionManager",
          hash_block_size=2, scheduler_block_size=2, external=True),
    # Mamba "align" partial tails: a chunk ending on the prompt's last hash boundary inside a
    # block keys that state block there; its producer's next step moves the key to a private
    # copy (move_block_hashes); with fine-grained hits, later requests hit it and copy it.
    Setup("mamba-align-coarse-tail", _mamba("align", 0), "MambaManager", hash_block_size=2,
          stop_at_boundary=True),
    Setup("mamba-align-fine", _mamba("align", 0), "MambaManager", hash_block_size=2,
          scheduler_block_size=2, stop_at_boundary=True),
    Setup("mamba-align-fine-spec", _mamba("align", 1), "MambaManager", hash_block_size=2,
          scheduler_block_size=2, stop_at_boundary=True, max_spec_tokens=1),
    # Mamba "align" prefill checkpoints: a chunk crossing the prompt's boundary exports the
    # state there into the block before its running one, keyed at the checkpoint.
    Setup("mamba-ckpt", _mamba("align", 0, **CKPT), "MambaManager"),
    Setup("mamba-ckpt-coarse", _mamba("align", 0, **CKPT), "MambaManager", hash_block_size=2),
    Setup("mamba-ckpt-fine", _mamba("align", 0, **CKPT), "MambaManager", hash_block_size=2,
          scheduler_block_size=2),
    Setup("mamba-ckpt-fine-spec", _mamba("align", 1, **CKPT), "MambaManager",
          hash_block_size=2, scheduler_block_size=2, max_spec_tokens=1),
    Setup("mamba-ckpt-align2", _mamba("align", 0, num_prefill_checkpoint_blocks=1,
                                      prefill_checkpoint_alignment=2), "MambaManager",
          hash_block_size=2, scheduler_block_size=2, stop_at_boundary=True),
    Setup("mamba-ckpt-retain-0", _mamba("align", 0, **CKPT), "MambaManager",
          scheduler_block_size=8, chunk_multiple=2, retention_interval=0),
    Setup("mamba-ckpt-retain-16", _mamba("align", 0, **CKPT), "MambaManager",
          scheduler_block_size=8, chunk_multiple=2, retention_interval=16),
]


class Side:
    """One library's pool and its managers (one per group, in group order)."""

    def __init__(self, managers, pool, free_ids):
        self.managers = managers
        self.pool = pool
        self._free_ids = free_ids

    def state(self):
        per_group = [
            ({r: _ids(blocks) for r, blocks in m.req_to_blocks.items()},
             dict(m.num_cached_block), m.take_new_block_ids())
            for m in self.managers
        ]
        return per_group, self._free_ids()


def _ids(blocks):
    return [b.block_id for b in blocks]


def _make_sides(setup: Setup, num_blocks: int, make_pool):
    ours_spec, theirs_spec = setup.specs
    shm_pool = make_pool(num_blocks, enable_caching=setup.enable_caching,
                         hash_block_size=setup.hash_block_size,
                         partial_keys=setup.hash_block_size != BLOCK_SIZE)
    vllm_pool = vllm_block_pool.BlockPool(num_blocks, setup.enable_caching,
                                          setup.hash_block_size)
    ours, theirs = [], []
    for group_id in range(setup.num_groups):
        kwargs = {"enable_caching": setup.enable_caching, "kv_cache_group_id": group_id,
                  "scheduler_block_size": setup.scheduler_block_size,
                  "needs_kv_cache_zeroing": setup.zeroing}
        ours.append(getattr(shm_managers, setup.manager)(ours_spec, block_pool=shm_pool,
                                                         **kwargs))
        theirs.append(getattr(vllm_managers, setup.manager)(theirs_spec, block_pool=vllm_pool,
                                                            **kwargs))
        ours[-1].use_eagle = theirs[-1].use_eagle = setup.eagle
    return (
        Side(ours, shm_pool, shm_pool.get_free_block_ids),
        Side(theirs, vllm_pool,
             lambda: _ids(vllm_pool.free_block_queue.get_all_free_blocks())),
    )


def _both(label, ours, theirs, call):
    """Runs ``call(side, group)`` for each group on both sides; both raise the same error
    type or return equal values. Returns the per-group results."""
    results = []
    for side in (ours, theirs):
        out = []
        for group in range(len(side.managers)):
            try:
                out.append(("ok", call(side, group)))
            except (ValueError, AssertionError) as exc:
                out.append(("err", type(exc).__name__))
                break
        results.append(out)
    assert results[0] == results[1], f"{label}: shmkv {results[0]} != vLLM {results[1]}"
    return [value for _, value in results[0]]


@dataclass
class Live:
    request: Request
    num_computed: int = 0


def _maybe_stop_at_boundary(setup: Setup, rng: random.Random, req: Request, num_computed: int,
                            chunk: int) -> int:
    """With ``stop_at_boundary``, half the time shortens a prefill chunk to end on the
    prompt's last reusable hash boundary (where Mamba "align" keys a partial tail)."""
    if not setup.stop_at_boundary or rng.random() < 0.5:
        return chunk
    hbs = setup.hash_block_size
    boundary = (req.num_prompt_tokens - 1) // hbs * hbs
    if setup.eagle:
        boundary = max(req.num_prompt_tokens // hbs * hbs - hbs, 0)
    if num_computed < boundary < num_computed + chunk:
        return boundary - num_computed
    return chunk


def _run(setup: Setup, seed: int, make_pool):
    rng = random.Random(seed)
    num_blocks = rng.choice([24, 40, 64]) * setup.num_groups
    ours, theirs = _make_sides(setup, num_blocks, make_pool)
    hasher = ours.pool.make_block_hasher()
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randrange(4, 26))] for _ in range(3)]
    group_ids = list(range(setup.num_groups))
    live: dict[str, Live] = {}
    next_id = 0

    def allocate(label, live_req: Live, num_new_tokens: int, hits=None, hit_len: int = 0,
                 num_external: int = 0, num_lookahead: int = 0) -> bool:
        """vLLM's allocate_slots for these groups; False when the pool cannot fit it."""
        req = live_req.request
        rid = req.request_id
        is_new = rid not in ours.managers[0].num_cached_block
        total = live_req.num_computed + hit_len + num_external
        main = total + num_new_tokens
        need_slot = main + num_lookahead
        skip_kwargs = {"num_prompt_tokens": req.num_prompt_tokens} if setup.pass_prompt_len else {}
        _both(f"{label} remove_skipped_blocks", ours, theirs,
              lambda s, g: s.managers[g].remove_skipped_blocks(rid, total, **skip_kwargs))

        def hit_of(s, g):
            if hits is None:
                return []
            return hits[0 if s is ours else 1][g]

        demands = _both(f"{label} get_num_blocks_to_allocate", ours, theirs,
                        lambda s, g: s.managers[g].get_num_blocks_to_allocate(
                            rid, need_slot, hit_of(s, g), total, hit_len, main))
        if sum(demands) > ours.pool.get_num_free_blocks():
            return False
        if is_new:  # the coordinator's allocate_new_computed_blocks: touch all, then external
            _both(f"{label} add_local_computed_blocks", ours, theirs,
                  lambda s, g: s.managers[g].add_local_computed_blocks(
                      rid, hit_of(s, g), hit_len, num_external))
            if num_external:
                _both(f"{label} allocate_external_computed_blocks", ours, theirs,
                      lambda s, g: s.managers[g].allocate_external_computed_blocks(
                          rid, hit_len, num_external))
        _both(f"{label} allocate_new_blocks", ours, theirs,
              lambda s, g: _ids(s.managers[g].allocate_new_blocks(rid, need_slot, main)))
        live_req.num_computed = main
        if setup.enable_caching:
            # The replay boundary: where a resend of this prompt would stop its hit.
            boundaries = [req.num_prompt_tokens - 1] if setup.retention_interval is not None else []
            _both(f"{label} cache_blocks", ours, theirs,
                  lambda s, g: s.managers[g].cache_blocks(
                      req, min(main, req.num_tokens), setup.retention_interval,
                      replay_boundaries=boundaries))
        return True

    for step in range(setup.num_steps):
        label = f"seed {seed} step {step}"
        for side in (ours, theirs):
            for manager in side.managers:
                manager.new_step_starts()
        action = rng.random()
        if action < 0.3 or not live:
            # A new request: shared prefix + random tail, admitted with its first chunk.
            prompt = list(rng.choice(prefixes)) if rng.random() < 0.8 else []
            prompt += [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 20))]
            rid = f"r{next_id}"
            next_id += 1
            req = Request(rid, prompt, block_hasher=hasher)
            hit_len = 0
            hits = None
            if setup.enable_caching:
                def lookup(s, req=req):
                    blocks, length = type(s.managers[0]).find_longest_cache_hit(
                        req.block_hashes, req.num_tokens - 1, group_ids, s.pool,
                        s.managers[0].kv_cache_spec, setup.eagle, setup.scheduler_block_size)
                    return blocks, length

                results = [lookup(ours), lookup(theirs)]
                assert ([_ids(b) for b in results[0][0]], results[0][1]) == (
                    [_ids(b) for b in results[1][0]], results[1][1]), (
                    f"{label} find_longest_cache_hit")
                hits = (results[0][0], results[1][0])
                hit_len = results[0][1]
            # External tokens end on a block boundary, before the last prompt token.
            num_external = 0
            if setup.external and rng.random() < 0.4:
                room = (req.num_tokens - 1 - hit_len) // BLOCK_SIZE
                num_external = BLOCK_SIZE * rng.randrange(room + 1) if room > 0 else 0
            live_req = Live(req)
            remaining = req.num_tokens - hit_len - num_external
            chunk = remaining
            if rng.random() < 0.4:
                unit = BLOCK_SIZE * setup.chunk_multiple
                chunk = min(remaining, unit * rng.randrange(1, 4))
            chunk = _maybe_stop_at_boundary(setup, rng, req, hit_len + num_external, chunk)
            if allocate(label, live_req, chunk, hits, hit_len, num_external):
                live[rid] = live_req
            else:
                _both(f"{label} free (refused)", ours, theirs,
                      lambda s, g, rid=rid: s.managers[g].free(rid))
        elif action < 0.8:
            rid = rng.choice(sorted(live))
            live_req = live[rid]
            req = live_req.request
            if live_req.num_computed < req.num_tokens:
                # Next prefill chunk.
                remaining = req.num_tokens - live_req.num_computed
                unit = BLOCK_SIZE * setup.chunk_multiple
                chunk = remaining if rng.random() < 0.5 else min(
                    remaining, unit * rng.randrange(1, 3))
                chunk = _maybe_stop_at_boundary(setup, rng, req, live_req.num_computed, chunk)
                allocate(label, live_req, chunk)
            else:
                # Decode: one new token, with speculative lookahead slots.
                req.append_output_token_ids(rng.randrange(VOCAB))
                lookahead = rng.randrange(setup.max_spec_tokens + 1)
                allocate(label, live_req, 1, num_lookahead=lookahead)  # refused: retried later
        else:
            # Finish (or preempt) one request, sometimes several.
            for rid in rng.sample(sorted(live), k=min(len(live), rng.choice([1, 1, 2]))):
                _both(f"{label} free", ours, theirs,
                      lambda s, g, rid=rid: s.managers[g].free(rid))
                del live[rid]
        assert ours.state() == theirs.state(), f"{label}: state differs"
        ours.pool.check_invariants()


@pytest.mark.parametrize("setup", SETUPS, ids=[s.name for s in SETUPS])
@pytest.mark.parametrize("seed", range(6))
def test_managers_match_vllm(setup, seed, make_pool):
    """The same call sequence gives the same hits, demands, block ids and free queue."""
    _run(setup, seed, make_pool)

