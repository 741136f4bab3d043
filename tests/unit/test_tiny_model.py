"""The tiny model: paged forward through block tables and the KV store equals the no-cache
reference in greedy tokens (full and sliding-window layers, prefix reuse, null blocks
outside the window), and a read of the null block is refused."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from shmkv.core.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec  # noqa: E402
from shmkv.errors import UsageError  # noqa: E402
from shmkv.ranks.block_table import KVStore, batch_token_indices, compute_slot_mapping  # noqa: E402
from shmkv.serve.model import TinyModelConfig, TinyTransformer, make_kv_cache_config  # noqa: E402
from tests.conftest import unique_pool_name  # noqa: E402

BS = 4


@pytest.fixture
def kv():
    name = unique_pool_name("tm")
    store = KVStore.create(name, num_layers=3, num_blocks=40, block_size=BS, num_kv_heads=2,
                           head_size=16)
    store.kv[:, :, 0] = float("nan")  # the null block: any read of it poisons the logits
    yield store
    store.close()
    KVStore.unlink(name)


def _generate_paged(model, kv, prompt, tables, max_new, first_position=0):
    """Greedy decode of one request, prefilling from ``first_position`` (the tokens before
    it must already be in ``kv``)."""
    tokens, out, start = list(prompt), [], first_position
    new = tokens[start:]
    for _ in range(max_new):
        req_indices, positions = batch_token_indices([len(new)], [start])
        slots = [compute_slot_mapping(t, req_indices, positions, BS) for t in tables]
        logits = model.forward_paged(torch.tensor(new), positions, torch.tensor([0, len(new)]),
                                     torch.tensor([start + len(new)]), tables, slots, kv)
        nxt = int(logits[0].argmax())
        out.append(nxt)
        start += len(new)
        new = [nxt]
    return out


def test_config_maps_layers_to_groups_and_builds_the_kv_cache_config():
    c = TinyModelConfig(num_layers=4, sliding_window=(16, None, 8, None))
    assert c.group_windows() == [None, 8, 16]
    assert c.layer_groups() == [2, 0, 1, 0]
    cfg = make_kv_cache_config(c, num_blocks=100, block_size=BS)
    assert cfg.num_blocks == 100
    specs = [g.kv_cache_spec for g in cfg.kv_cache_groups]
    assert isinstance(specs[0], FullAttentionSpec)
    assert isinstance(specs[1], SlidingWindowSpec) and specs[1].sliding_window == 8
    assert [g.layer_names for g in cfg.kv_cache_groups] == [["layers.1", "layers.3"],
                                                             ["layers.2"], ["layers.0"]]
    with pytest.raises(UsageError, match="3 entries for 4 layers"):
        TinyModelConfig(num_layers=4, sliding_window=(None, 8, None))


def test_weights_come_from_the_seed():
    a, b = TinyTransformer(TinyModelConfig()), TinyTransformer(TinyModelConfig())
    c = TinyTransformer(TinyModelConfig(seed=1))
    assert torch.equal(a.lm_head.weight, b.lm_head.weight)
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


def test_paged_generation_equals_the_reference_with_prefix_reuse(kv):
    """A second request reuses the first one's prefix blocks (computed K/V, read back) and
    the sliding-window group's blocks wholly before the window are the null block: the
    tokens still equal the reference's."""
    model = TinyTransformer(TinyModelConfig())  # layers: full, window 8, full
    prefix = [5, 17, 3, 88, 41, 2, 9, 60, 33, 71, 12, 8, 50, 19, 27, 64]  # 4 blocks
    a = prefix + [1, 2, 3]
    tables_a = [torch.arange(1, 11, dtype=torch.int32)[None],
                torch.arange(11, 21, dtype=torch.int32)[None]]
    assert _generate_paged(model, kv, a, tables_a, 8) == model.reference_generate(a, 8)
    b = prefix + [40, 41, 42, 43, 44]
    full_b = torch.tensor([[1, 2, 3, 4, 21, 22, 23, 24, 25, 26]], dtype=torch.int32)
    swa_b = torch.tensor([[0, 0, 13, 14, 31, 32, 33, 34, 35, 36]], dtype=torch.int32)
    got = _generate_paged(model, kv, b, [full_b, swa_b], 8, first_position=len(prefix))
    assert got == model.reference_generate(b, 8)


def test_a_read_of_the_null_block_is_refused(kv):
    model = TinyTransformer(TinyModelConfig())
    tables = [torch.tensor([[1, 2, 3]], dtype=torch.int32),
              torch.tensor([[0, 5, 6]], dtype=torch.int32)]  # block 0 inside the window
    req_indices, positions = batch_token_indices([2], [4])
    slots = [compute_slot_mapping(t, req_indices, positions, BS) for t in tables]
    with pytest.raises(UsageError, match="null block"):
        model.forward_paged(torch.tensor([1, 2]), positions, torch.tensor([0, 2]),
                            torch.tensor([6]), tables, slots, kv)
