"""The host placement of ``shmkv run`` (a rank's own cache, hits copied in from the KV
store, completed blocks copied out) over a block-major store: the reference's tokens, and
the store's full blocks hold the same bytes as over a layer-major store."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from shmkv.ranks.kv_store import BLOCK_MAJOR, LAYER_MAJOR, KVStore  # noqa: E402
from shmkv.serve.model import TinyModelConfig, TinyTransformer  # noqa: E402
from tests.unit.test_kv_placement import _decode, _Rig  # noqa: E402


def _rig_with(layout: str, config: TinyModelConfig) -> _Rig:
    rig = _Rig(config)
    if layout != LAYER_MAJOR:  # the same store, in the other layout
        shape = {f: getattr(rig.store, f) for f in (
            "num_layers", "num_blocks", "block_size", "num_kv_heads", "head_size")}
        rig.store.close()
        KVStore.unlink(rig.name)
        rig.store = KVStore.create(rig.name, layout=layout, **shape)
        rig.store.kv[0] = float("nan")  # the null block, as the rig does
    return rig


def test_host_placement_over_a_block_major_store():
    config = TinyModelConfig()  # full attention + a window of 8: two groups
    model = TinyTransformer(config)
    blocks = {}
    for layout in (LAYER_MAJOR, BLOCK_MAJOR):
        rig = _rig_with(layout, config)
        try:
            runner = rig.runner("host")
            prompt = list(range(3, 17))
            ids_a = ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])
            assert _decode(rig, runner, "a", 0, ids_a, prompt, 0, 5) == \
                model.reference_generate(prompt, 5)
            other = prompt[:12] + [50, 51]
            ids_b = ([1, 2, 3, 11, 12], [0, 7, 8, 13, 14])
            assert _decode(rig, runner, "b", 1, ids_b, other, 12, 4) == \
                model.reference_generate(other, 4)
            assert runner.kv_store.num_loaded_blocks > 0  # b's hits came from the store
            full = [1, 2, 3, 4, 6, 7, 8, 9, 11, 13]  # the blocks the two requests completed
            blocks[layout] = torch.stack([
                torch.stack([torch.stack([rig.store.key_cache[i][b], rig.store.value_cache[i][b]])
                             for i in range(rig.store.num_layers)]) for b in full])
        finally:
            rig.close()
    assert torch.equal(blocks[BLOCK_MAJOR], blocks[LAYER_MAJOR])
    assert int(torch.count_nonzero(blocks[BLOCK_MAJOR])) > 0
