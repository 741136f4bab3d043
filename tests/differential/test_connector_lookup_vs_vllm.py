"""Differential test: ``KVCacheManager.get_computed_blocks_for_connector`` (vLLM 0.33.0's
local lookup for a request scheduled with a KV connector) on shmkv and on vLLM.

A hybrid model (full attention + Mamba "align") caches a prompt; chosen cached blocks are then
evicted so that the groups' own hits diverge (Mamba shorter: the full-attention hit is the
local prefix and ``hit_diverged`` is True; full attention shorter: the reconciled
``get_computed_blocks`` answer). Single-type models answer ``get_computed_blocks``' triple.
"""

from __future__ import annotations

import pytest

from tests.vllm_upstream.test_twins import IMPLS, Side, config, full

torch = pytest.importorskip("torch")
vspecs = pytest.importorskip("vllm.v1.kv_cache_interface")

pytestmark = pytest.mark.differential
BS = 16


def mamba():
    return vspecs.MambaSpec(BS, ((2, 4),), (torch.float32,), mamba_cache_mode="align")


def _scenario(impl, make_pool, specs, evict):
    side = Side(impl, make_pool, config(60, *specs), BS)
    a = side.request("a", range(6 * BS + 3))
    trace = [side.admit(a)]
    table = side.manager.get_block_ids("a")
    side.manager.free(a)
    side.pool.evict_blocks({table[g][i] for g, i in evict if table[g][i] != 0})
    b = side.request("b", range(6 * BS + 3))
    blocks, n, boundary, diverged = side.manager.get_computed_blocks_for_connector(b)
    trace.append((blocks.get_block_ids(), n, boundary, diverged))
    new = side.manager.allocate_slots(b, b.num_tokens - n, n, blocks)
    trace.append(new.get_block_ids() if new else None)
    return trace


@pytest.mark.parametrize("specs, evict", [
    ((full(BS),), []),
    ((full(BS),), [(0, 2)]),
    ((full(BS), mamba()), []),
    ((full(BS), mamba()), [(1, 5)]),
    ((full(BS), mamba()), [(0, 3)]),
    ((full(BS), mamba()), [(1, 5), (1, 4)]),
], ids=["full", "full-evicted", "hybrid", "hybrid-mamba-evicted", "hybrid-fa-evicted",
        "hybrid-mamba-two"])
def test_connector_lookup_matches_vllm(make_pool, specs, evict):
    traces = {impl: _scenario(impl, make_pool, specs, evict) for impl in IMPLS}
    assert traces["shmkv"] == traces["vllm"]
