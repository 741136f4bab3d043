"""The token check of ``shmkv run``: every generated token against the model's no-cache
greedy reference (``forward_reference``), on the run's device and in its dtype. In float32
a difference fails the run; in bfloat16 (``RunDevice.exact_tokens`` False) it is reported
with the reference's logit gap at the first wrong token (``shmkv/serve/report.py``)."""

from __future__ import annotations

__all__ = ["reference_tokens"]


def reference_tokens(model, prompt_token_ids: list[int], output_token_ids: list[int]) -> list[int]:
    """The no-cache reference's greedy token after each prefix ``prompt + output[:k]``, from
    one causal ``forward_reference`` over ``prompt + output[:-1]``.

    It is ``reference_generate(prompt, len(output))`` whenever ``output`` is right, and its
    first difference from ``output`` is at the same index as ``reference_generate``'s
    otherwise: the logits at a position depend only on the tokens up to it, and up to the
    first wrong token both runs feed the same tokens. One forward instead of one per token.
    """
    return _reference_logits(model, prompt_token_ids, output_token_ids).argmax(-1).tolist()


def _reference_logits(model, prompt_token_ids: list[int], output_token_ids: list[int]):
    seq = list(prompt_token_ids) + list(output_token_ids[:-1])
    return model.forward_reference(seq)[len(prompt_token_ids) - 1:]


def _check_tokens(model, rec) -> None:
    """Checks ``rec`` (a runner's ``RequestRecord``): its first wrong token (``mismatch``,
    -1: none) and, if there is one, how far the reference's logit of its own choice there
    lies above its logit of the served token (``logit_gap``: a greedy flip between
    near-equal logits, in bfloat16, has a small one)."""
    out = list(rec.result.output_token_ids)
    logits = _reference_logits(model, rec.prompt_token_ids, out)
    ref = logits.argmax(-1).tolist()
    rec.mismatch = next((k for k, (a, b) in enumerate(zip(out, ref, strict=True)) if a != b),
                        -1)
    if rec.mismatch >= 0:
        row = logits[rec.mismatch]
        rec.logit_gap = float(row[ref[rec.mismatch]] - row[out[rec.mismatch]])
    rec.checked = len(out)
