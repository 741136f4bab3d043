"""The serving run's token check catches a stale block (issue 15, item 12): one request is
served through the paged model with a wrong KV block in its block table on purpose, and
the run's check (``runner._check_tokens``, counted as ``report.figures`` counts
``token_mismatches``) finds mismatches > 0; the same request with the right blocks has none.
So "every token is checked" proves what it claims."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from shmkv.ranks.block_table import KVStore, batch_token_indices, compute_slot_mapping  # noqa: E402
from shmkv.serve.model import TinyModelConfig, TinyTransformer  # noqa: E402
from shmkv.serve.runner import RequestRecord, _check_tokens  # noqa: E402
from tests.conftest import unique_pool_name  # noqa: E402

BS = 4


@pytest.fixture
def kv():
    name = unique_pool_name("tc")
    store = KVStore.create(name, num_layers=3, num_blocks=40, block_size=BS, num_kv_heads=2,
                           head_size=16)
    yield store
    store.close()
    KVStore.unlink(name)


def _serve(model, kv, prompt, tables, max_new, first_position=0):
    """Greedy decode of one request through block tables (prefill from first_position)."""
    out, start = [], first_position
    new = list(prompt)[start:]
    for _ in range(max_new):
        req_indices, positions = batch_token_indices([len(new)], [start])
        slots = [compute_slot_mapping(t, req_indices, positions, BS) for t in tables]
        logits = model.forward_paged(torch.tensor(new), positions, torch.tensor([0, len(new)]),
                                     torch.tensor([start + len(new)]), tables, slots, kv)
        out.append(int(logits[0].argmax()))
        start += len(new)
        new = [out[-1]]
    return out


def _mismatches(model, prompt, out) -> int:
    rec = RequestRecord(trace=None, prompt_token_ids=list(prompt),
                        result=SimpleNamespace(output_token_ids=out))
    _check_tokens(model, rec)
    assert rec.checked == len(out)
    # report.figures: token_mismatches = sum(checked - mismatch) over mismatched requests
    return rec.checked - rec.mismatch if rec.mismatch >= 0 else 0


def test_a_wrong_block_is_caught_by_the_token_check(kv):
    model = TinyTransformer(TinyModelConfig())  # layers: full, window 8, full
    other = [80, 81, 82, 83, 84, 85, 86, 87]  # another request's KV fills blocks 30, 31
    _serve(model, kv, other + [1], [torch.tensor([[30, 31, 32]], dtype=torch.int32),
                                    torch.tensor([[33, 34, 35]], dtype=torch.int32)], 1)
    prefix = [5, 17, 3, 88, 41, 2, 9, 60]  # 2 blocks: computed once into blocks 1, 2 / 11, 12
    a = prefix + [7, 7, 7]
    out_a = _serve(model, kv, a, [torch.arange(1, 11, dtype=torch.int32)[None],
                                  torch.arange(11, 21, dtype=torch.int32)[None]], 6)
    assert _mismatches(model, a, out_a) == 0  # the check passes a correct run
    b = prefix + [40, 41, 42]
    right = [torch.tensor([[1, 2, 21, 22, 23, 24]], dtype=torch.int32),
             torch.tensor([[11, 12, 25, 26, 27, 28]], dtype=torch.int32)]
    out_b = _serve(model, kv, b, right, 6, first_position=len(prefix))
    assert _mismatches(model, b, out_b) == 0
    # The same request, its first prefix block swapped for the other request's (stale KV).
    wrong = [torch.tensor([[30, 2, 21, 22, 23, 24]], dtype=torch.int32),
             torch.tensor([[33, 12, 25, 26, 27, 28]], dtype=torch.int32)]
    out_wrong = _serve(model, kv, b, wrong, 6, first_position=len(prefix))
    assert _mismatches(model, b, out_wrong) > 0
