"""Differential test: ``CircularBufferSpec`` groups (``CircularBufferManager``) on shmkv and on
vLLM 0.33.0, alone behind full attention or beside Mamba "align": one ring block per request
for its whole life, claimed at its first allocation (or an external load), never cached, never
skipped, never recorded for worker zeroing; the other groups' hits are unchanged by it.
"""

from __future__ import annotations

import pytest

from tests.vllm_upstream.test_twins import IMPLS, Side, config, full

torch = pytest.importorskip("torch")
vspecs = pytest.importorskip("vllm.v1.kv_cache_interface")

pytestmark = pytest.mark.differential
HBS = 4


def ring(block_size):
    return vspecs.CircularBufferSpec(block_size=block_size, num_kv_heads=1, head_size=1,
                                     dtype=torch.float32)


def mamba(block_size):
    return vspecs.MambaSpec(block_size=block_size, shapes=(1, 1), dtypes=(torch.float32,),
                            mamba_cache_mode="align")


def _scenario(impl, make_pool, specs, num_external):
    side = Side(impl, make_pool, config(40, *specs), HBS,
                scheduler_block_size=max(s.block_size for s in specs))
    trace = []
    reqs = []
    for i in range(3):
        r = side.request(f"r{i}", [7] * (5 * HBS) + [i] * (3 * HBS + 1))
        trace.append(side.admit(r, num_external=num_external if i == 2 else 0))
        reqs.append(r)
        for _ in range(HBS + 1):             # decode: the ring block stays the one block
            r.append_output_token_ids(1)
            new = side.manager.allocate_slots(r, 1)
            r.num_computed_tokens = r.num_tokens
            trace.append(new.get_block_ids() if new is not None else None)
        trace.append(side.manager.get_block_ids(r.request_id))
        trace.append(side.manager.take_new_block_ids())
    for r in reqs[:2]:
        side.manager.free(r)
    trace.append(side.free_ids())
    again = side.request("again", [7] * (5 * HBS) + [0] * (3 * HBS + 1))
    trace.append(side.admit(again))
    trace.append(side.free_ids())
    return trace


@pytest.mark.parametrize("specs, num_external", [
    ((full(HBS), ring(8)), 0),
    ((full(HBS), ring(8)), 2 * HBS),
    ((full(HBS), mamba(8), ring(8)), 0),
], ids=["full+ring", "full+ring-external", "full+mamba+ring"])
def test_circular_buffer_matches_vllm(make_pool, specs, num_external):
    traces = {impl: _scenario(impl, make_pool, specs, num_external) for impl in IMPLS}
    assert traces["shmkv"] == traces["vllm"]
    ring_gid = len(specs) - 1
    # Per request: admit, HBS + 1 decode steps, its block table, the ids to zero.
    per_req = 1 + (HBS + 1) + 2
    tables = [traces["vllm"][i * per_req + per_req - 2] for i in range(3)]
    assert all(len(t[ring_gid]) == 1 for t in tables)
    assert all(len(t[0]) > 1 for t in tables)
