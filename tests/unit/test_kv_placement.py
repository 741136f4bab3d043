"""The rank's two KV placements in one process, driven through ``ModelRunner`` with real
block tables and a real ``KVStore``: every token equals the no-cache reference, the host
placement copies prefix hits in from the store and completed blocks out to it (and reads
nothing else from it), a block id that came back fuller than the rank's copy is copied in
again, and a request whose row went to another frees its cache rows."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from shmkv.messages import ExecuteModel, ScheduledRequest  # noqa: E402
from shmkv.ranks.block_table import KVStore, SharedBlockTables  # noqa: E402
from shmkv.serve.model import TinyModelConfig, TinyTransformer  # noqa: E402
from shmkv.serve.placement import HostCache, KVPlacement  # noqa: E402
from shmkv.serve.rank import ModelRunner  # noqa: E402
from tests.conftest import unique_pool_name  # noqa: E402

BS = 4
FULL = TinyModelConfig(sliding_window=(None, None, None))  # one KV-cache group


class _Rig:
    """Block tables and a KV store of ``num_blocks``; ``runner(kind)`` opens a rank on
    them; ``step(reqs)`` writes the rows (``(req_id, row, ids per group, tokens, start)``),
    commits and executes."""

    def __init__(self, config: TinyModelConfig, num_blocks: int = 40) -> None:
        self.name = unique_pool_name("place")
        self.config = config
        self.groups = len(config.group_windows())
        self.tables = SharedBlockTables.create(self.name, max_num_reqs=4, max_model_len=64,
                                               block_sizes=[BS] * self.groups)
        self.store = KVStore.create(self.name, num_layers=config.num_layers,
                                    num_blocks=num_blocks, block_size=BS,
                                    num_kv_heads=config.num_kv_heads,
                                    head_size=config.head_size)
        self.store.kv[:, :, 0] = float("nan")  # the null block: a read of it poisons logits
        self.step_no = 0
        self.runners: list[ModelRunner] = []

    def runner(self, kind: str) -> ModelRunner:
        r = ModelRunner(self.name, KVPlacement(kind, "cpu", "float32", self.name), self.config)
        self.runners.append(r)
        return r

    def step(self, runner, reqs) -> list[int]:
        for _, row, ids, _, _ in reqs:
            self.tables.add_row(ids, row)
        self.step_no += 1
        self.tables.commit(self.step_no)
        return runner.execute(ExecuteModel(step=self.step_no, requests=[
            ScheduledRequest(rid, row, list(tokens), start)
            for rid, row, _, tokens, start in reqs]))

    def close(self) -> None:
        for r in self.runners:
            r.close()
        self.tables.close()
        self.store.close()
        SharedBlockTables.unlink(self.name)
        KVStore.unlink(self.name)
        assert [e for e in os.listdir("/dev/shm") if self.name in e] == []


@pytest.fixture
def rig():
    made = []

    def make(config=FULL, **kw):
        made.append(_Rig(config, **kw))
        return made[-1]

    yield make
    for r in made:
        r.close()


def _decode(rig, runner, rid, row, ids, prompt, start, steps):
    """Prefill ``prompt[start:]`` then decode; returns the generated tokens."""
    out = rig.step(runner, [(rid, row, ids, prompt[start:], start)])
    seq = list(prompt) + out
    for _ in range(steps - 1):
        out += rig.step(runner, [(rid, row, ids, [seq[-1]], len(seq) - 1)])
        seq.append(out[-1])
    return out


def test_host_placement_copies_hits_in_and_completed_blocks_out(rig):
    """A prompt of 10 tokens fills blocks 1, 2 (and 3 partly): after the prefill the store
    holds exactly the full blocks, byte for byte the rank's copies; a second request hitting
    them (start 8) copies both in and decodes the reference's tokens; with the store's copy
    of blocks 1 and 2 spoiled, the same request decodes other tokens (the host copy is what it
    read)."""
    r = rig()
    model = TinyTransformer(FULL)
    host = r.runner("host")
    cache: HostCache = host.kv_store
    prompt = [5, 9, 14, 3, 77, 21, 8, 60, 33, 2]
    out = _decode(r, host, "a", 0, ([1, 2, 3, 4],), prompt, 0, 4)
    assert out == model.reference_generate(prompt, 4)
    assert cache.num_loaded_blocks == 0
    assert cache.num_stored_blocks == 3  # blocks 1, 2 at the prefill; 3 when decode filled it
    rows = {e.block_id: e.row for e in cache._held["a"].groups[0].values()}
    for b in (1, 2, 3):
        assert torch.equal(r.store.kv[:, :, b], cache.kv[:, :, rows[b]])
    assert torch.count_nonzero(r.store.kv[:, :, 4]) == 0  # partial: never stored

    other = prompt[:8] + [40, 41, 42]
    got = _decode(r, host, "b", 1, ([1, 2, 5, 7],), other, 8, 3)
    assert got == model.reference_generate(other, 3)
    assert cache.num_loaded_blocks == 2
    gen = torch.Generator().manual_seed(0)
    r.store.kv[:, :, 1:3] = 10 * torch.randn(r.store.kv[:, :, 1:3].shape, generator=gen)
    spoiled = _decode(r, host, "c", 2, ([1, 2, 6, 8],), other, 8, 3)
    assert spoiled != got


def test_both_placements_give_the_reference_tokens_and_the_same_store(rig):
    """With a sliding-window group, two requests sharing a prefix: the device placement
    (attending over the store in place) and the host placement give the reference's tokens,
    and the store holds the same bytes in every full block afterwards (the CPU twin)."""
    config = TinyModelConfig()  # full attention + a window of 8: two groups
    model = TinyTransformer(config)
    stores = {}
    for kind in ("device", "host"):
        r = rig(config)
        runner = r.runner(kind)
        prompt = list(range(3, 17))
        ids_a = ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])
        assert _decode(r, runner, "a", 0, ids_a, prompt, 0, 5) == model.reference_generate(
            prompt, 5)
        other = prompt[:12] + [50, 51]
        ids_b = ([1, 2, 3, 11, 12], [0, 7, 8, 13, 14])  # window: block 0 of group 1 is null
        assert _decode(r, runner, "b", 1, ids_b, other, 12, 4) == model.reference_generate(
            other, 4)
        stores[kind] = r.store.kv.clone()
    full = [1, 2, 3, 4, 6, 7, 8, 9, 11, 13]  # blocks the two requests completed
    torch.testing.assert_close(stores["host"][:, :, full], stores["device"][:, :, full],
                               rtol=0, atol=1e-5)


def test_a_block_id_back_with_more_tokens_than_the_rank_holds_is_copied_in_again(rig):
    """Request x writes block 2 half (its prompt ends there) and is preempted; request y,
    with the same first 8 tokens, fills block 2 and stores it; x comes back in another row
    hitting blocks 1 and 2: the rank's copy of block 2 holds 2 of the 4 tokens, so it is
    copied in from the store, and x decodes the reference's tokens."""
    r = rig()
    model = TinyTransformer(FULL)
    host = r.runner("host")
    cache: HostCache = host.kv_store
    base = [11, 12, 13, 14, 15, 16, 17, 18]
    r.step(host, [("x", 0, ([1, 2],), base[:6], 0)])  # block 2: positions 4, 5 only
    y_prompt = base + [19]
    _decode(r, host, "y", 1, ([1, 2, 3],), y_prompt, 0, 1)
    loaded = cache.num_loaded_blocks
    x_prompt = base + [20, 21]
    got = _decode(r, host, "x", 2, ([1, 2, 4],), x_prompt, 8, 3)
    assert got == model.reference_generate(x_prompt, 3)
    assert cache.num_loaded_blocks == loaded + 1  # block 2 again; block 1 was whole


def test_a_row_taken_by_another_request_frees_the_old_requests_cache_rows(rig):
    """Rows of a finished request come back to the cache when its table row is reused."""
    r = rig()
    host = r.runner("host")
    cache: HostCache = host.kv_store
    r.step(host, [("a", 0, ([1, 2, 3],), list(range(1, 11)), 0)])
    assert cache.num_rows_in_use == 3
    r.step(host, [("b", 0, ([4],), [7, 7], 0)])
    assert cache.num_rows_in_use == 1 and "a" not in cache._held


@pytest.mark.parametrize("kv, layout", [("host", "block_major"), ("device", "layer_major")])
def test_the_pool_store_is_block_major_for_the_host_tier_only(kv, layout):
    """The host placement's store moves whole blocks (one copy per run of ids), so it is
    block-major; a device placement on the CPU attends over the store in place, so its
    store stays layer-major."""
    from types import SimpleNamespace

    from shmkv.serve.placement import PoolKV

    name = unique_pool_name("poolkv")
    run = SimpleNamespace(kv=kv, device="cpu", dtype="float32")
    pool_kv = PoolKV(name, FULL, 8, BS, run)
    try:
        assert pool_kv.store.layout == layout
        assert KVStore.attach(name).layout == layout
    finally:
        pool_kv.close()


def test_a_preempted_request_back_never_writes_a_cached_block_again(rig):
    """x's prompt fills blocks 1 and 2, which are stored (and so cached by its scheduler);
    x is preempted and comes back with both as hits, computing its last prompt token again
    (start 7). The rank copies both hits in and stores nothing: a cached block's bytes never
    change while another rank may be copying them in. (Before: the rank kept its own copies
    from before the preemption and stored block 2 a second time.)"""
    r = rig()
    model = TinyTransformer(FULL)
    host = r.runner("host")
    cache: HostCache = host.kv_store
    prompt = [5, 9, 14, 3, 77, 21, 8, 60]
    first = r.step(host, [("x", 0, ([1, 2],), prompt, 0)])
    assert cache.num_stored_blocks == 2 and cache.num_loaded_blocks == 0
    stored = r.store.kv[:, :, 1:3].clone()
    again = r.step(host, [("x", 0, ([1, 2],), prompt[7:], 7)])  # back after a preemption
    assert again == first == model.reference_generate(prompt, 1)
    assert cache.num_stored_blocks == 2, "a cached block was stored again"
    assert cache.num_loaded_blocks == 2
    assert torch.equal(r.store.kv[:, :, 1:3], stored)
    assert cache.num_rows_in_use == 2
