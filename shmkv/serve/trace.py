"""Trace formats of ``shmkv run --trace`` / ``shmkv replay``, and the infinite-cache bound.

Two formats, one JSON object a line (``--trace-format``; :func:`detect_format` reads the
first non-blank line when it is not given):

- ``shmkv``: shmkv's own, token ids (:mod:`shmkv.serve.workload`).
- ``mooncake``: the Mooncake FAST'25 traces (``kvcache-ai/Mooncake``,
  ``FAST25-release/traces/``), which Dynamo's router benchmark and aiperf replay::

      {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, ...]}

  ``timestamp`` in ms since the trace began, lengths in tokens, ``hash_ids`` one id per
  block of ``trace_block_tokens`` (512) prompt tokens; equal ids mean equal blocks (with
  equal prefixes: an id names a prefix, not only a block). Unknown fields are ignored.

How a Mooncake line becomes a request (:func:`read_mooncake`): each hash id becomes one
block of the run's ``block_size`` tokens, drawn deterministically from the id
(:func:`block_tokens`: equal ids give equal tokens; two different ids give the same block
with probability ``(vocab_size - 1) ** -block_size``, 96**-16 = 1.9e-32 for the tiny
model); the lengths are scaled by ``block_size / trace_block_tokens`` (16/512 = 1/32 by
default: 6,758 tokens become 212, i.e. 13.25 blocks, the first 14 ids' tokens cut to 212),
the output to at least one token. A request longer than ``max_model_len`` is capped: its
output to at most half of ``max_model_len``, then its prompt to what is left (the leading
blocks stay, so the prefix structure does). ``timestamp`` becomes ``arrival_s`` (seconds);
the runner honours it only with ``--time-scale``.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import msgspec

from shmkv.errors import UsageError
from shmkv.serve.workload import TraceRequest, read_trace

__all__ = ["TRACE_FORMATS", "TraceInfo", "block_tokens", "detect_format",
           "infinite_cache_bound", "load_trace", "read_mooncake"]

TRACE_FORMATS = ("shmkv", "mooncake")
TRACE_BLOCK_TOKENS = 512


class MooncakeLine(msgspec.Struct):
    """One line of a Mooncake trace (unknown fields ignored)."""

    timestamp: int | float
    input_length: int
    output_length: int
    hash_ids: list[int]


@dataclass
class TraceInfo:
    """What loading a trace did (printed in the report, ``trace`` in the JSON)."""

    path: str
    format: str
    requests: int
    block_size: int
    trace_block_tokens: int | None = None  # mooncake: tokens per hash id in the trace
    scale: float | None = None  # mooncake: block_size / trace_block_tokens
    capped: int = 0  # requests capped to max_model_len
    max_model_len: int | None = None
    unique_blocks: int | None = None  # mooncake: distinct hash ids used

    def to_dict(self) -> dict:
        return asdict(self)

    def text(self) -> str:
        if self.format != "mooncake":
            return f"{self.path}: shmkv trace, {self.requests:,} requests"
        return (f"{self.path}: Mooncake trace, {self.requests:,} requests; one "
                f"{self.trace_block_tokens}-token block (hash id) = one {self.block_size}-token"
                f" block, lengths scaled by {self.block_size}/{self.trace_block_tokens} = "
                f"{self.scale:g}; {self.capped:,} requests capped to --max-model-len "
                f"{self.max_model_len}")


def detect_format(path: str | Path) -> str:
    """``mooncake`` if the first non-blank, non-comment line has ``hash_ids``, else
    ``shmkv``."""
    with open(path, "rb") as f:
        for line in f:
            text = line.strip()
            if not text or text.startswith(b"#"):
                continue
            try:
                obj = msgspec.json.decode(text)
            except msgspec.DecodeError:
                return "shmkv"  # read_trace names the line
            return "mooncake" if isinstance(obj, dict) and "hash_ids" in obj else "shmkv"
    return "shmkv"


_token_cache: dict[tuple[int, int, int], list[int]] = {}


def block_tokens(hash_id: int, block_size: int, vocab_size: int) -> list[int]:
    """The ``block_size`` tokens of a hash id: BLAKE2b of the id, two bytes a token, each
    in ``[1, vocab_size)`` (token 0 is left out, as the chat workload does)."""
    key = (hash_id, block_size, vocab_size)
    got = _token_cache.get(key)
    if got is None:
        digest = b""
        counter = 0
        while len(digest) < 2 * block_size:
            digest += hashlib.blake2b(f"{hash_id}:{counter}".encode(), digest_size=64).digest()
            counter += 1
        got = [1 + int.from_bytes(digest[2 * k:2 * k + 2], "little") % (vocab_size - 1)
               for k in range(block_size)]
        _token_cache[key] = got
    return got


_line_decoder = msgspec.json.Decoder(MooncakeLine)


def read_mooncake(path: str | Path, *, block_size: int, vocab_size: int, max_model_len: int,
                  trace_block_tokens: int = TRACE_BLOCK_TOKENS,
                  ) -> tuple[list[TraceRequest], TraceInfo]:
    """A Mooncake trace as shmkv requests (module docstring).

    Raises:
        UsageError: a line that is not a JSON object with the four fields of the right
            types, a length < 0 (input < 1), a negative id, or ``hash_ids`` shorter than
            ``input_length`` needs: naming the file, the line and the field.
        OSError: the file cannot be read.
    """
    if block_size < 1 or trace_block_tokens < 1:
        raise UsageError("--block-size and --trace-block-tokens must be >= 1")
    if vocab_size < 2:
        raise UsageError(f"vocab_size must be >= 2, got {vocab_size}")
    scale = block_size / trace_block_tokens
    out: list[TraceRequest] = []
    capped = 0
    ids_used: set[int] = set()
    max_out = max(1, max_model_len // 2)
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            text = line.strip()
            if not text or text.startswith(b"#"):
                continue
            where = f"{path}:{number}"
            try:
                m = _line_decoder.decode(text)
            except msgspec.ValidationError as exc:
                raise UsageError(f"{where}: not a Mooncake trace line: {_field_of(exc)}"
                                 ) from None
            except msgspec.DecodeError as exc:
                raise UsageError(f"{where}: not JSON: {exc}") from None
            if m.input_length < 1:
                raise UsageError(f"{where}: field input_length must be >= 1, got "
                                 f"{m.input_length}")
            if m.output_length < 0:
                raise UsageError(f"{where}: field output_length must be >= 0, got "
                                 f"{m.output_length}")
            if m.timestamp < 0:
                raise UsageError(f"{where}: field timestamp must be >= 0, got {m.timestamp}")
            need = math.ceil(m.input_length / trace_block_tokens)
            if len(m.hash_ids) < need:
                raise UsageError(
                    f"{where}: field hash_ids has {len(m.hash_ids)} ids, input_length "
                    f"{m.input_length} needs {need} (one per {trace_block_tokens} tokens)")
            for k, h in enumerate(m.hash_ids[:need]):
                if h < 0:
                    raise UsageError(f"{where}: field hash_ids[{k}] is negative ({h})")
            n = max(1, math.ceil(m.input_length * scale))
            new = max(1, round(m.output_length * scale))
            was_capped = False
            if n + new > max_model_len:
                was_capped = True
                new = min(new, max_out)
                n = min(n, max_model_len - new)
            if n < 1:
                raise UsageError(f"{where}: --max-model-len {max_model_len} leaves no room "
                                 "for a prompt")
            capped += was_capped
            blocks = -(-n // block_size)
            tokens: list[int] = []
            for h in m.hash_ids[:blocks]:
                tokens += block_tokens(h, block_size, vocab_size)
                ids_used.add(h)
            out.append(TraceRequest(request_id=f"m{number}", prompt_token_ids=tokens[:n],
                                    max_tokens=new, arrival_s=m.timestamp / 1000.0))
    if not out:
        raise UsageError(f"{path}: no requests")
    info = TraceInfo(path=str(path), format="mooncake", requests=len(out),
                     block_size=block_size, trace_block_tokens=trace_block_tokens,
                     scale=scale, capped=capped, max_model_len=max_model_len,
                     unique_blocks=len(ids_used))
    return out, info


def _field_of(exc: msgspec.ValidationError) -> str:
    """msgspec's message, saying 'field X' (``at `$.hash_ids[3]` `` -> field hash_ids[3])."""
    msg = str(exc)
    if "missing required field" in msg:
        name = msg.split("`")[1] if "`" in msg else "?"
        return f"field {name} is missing"
    if " - at `$." in msg:
        what, at = msg.split(" - at `$.", 1)
        return f"field {at.rstrip('`')}: {what}"
    return msg


def load_trace(path: str | Path, fmt: str | None, *, block_size: int, vocab_size: int,
               max_model_len: int, trace_block_tokens: int = TRACE_BLOCK_TOKENS,
               ) -> tuple[list[TraceRequest], TraceInfo]:
    """Reads a trace of either format (``fmt`` None: :func:`detect_format`)."""
    fmt = fmt or detect_format(path)
    if fmt not in TRACE_FORMATS:
        raise UsageError(f"--trace-format must be one of {', '.join(TRACE_FORMATS)}, got "
                         f"{fmt!r}")
    if fmt == "mooncake":
        return read_mooncake(path, block_size=block_size, vocab_size=vocab_size,
                             max_model_len=max_model_len,
                             trace_block_tokens=trace_block_tokens)
    workload = read_trace(path, vocab_size=vocab_size)
    return workload, TraceInfo(path=str(path), format="shmkv", requests=len(workload),
                               block_size=block_size, max_model_len=max_model_len)


def infinite_cache_bound(requests: Iterable[tuple[Sequence[int], Sequence[int] | None,
                                                  str | None]],
                         block_size: int) -> dict:
    """The prefix hits an infinite cache would give, requests taken in order.

    ``requests``: ``(prompt_token_ids, computed_token_ids, cache_salt)`` each;
    ``computed_token_ids`` (prompt plus output but the last token, what a run writes into
    the KV cache) or None for the prompt alone. A request's hit is the longest run of its
    leading full blocks that any earlier request computed, capped (as
    ``get_computed_blocks``) so that its last prompt token is computed: at most
    ``(len(prompt) - 1) // block_size`` blocks. Equal blocks are equal token runs with
    equal prefixes and salt (chained 64-bit hashes of the token tuples here, as the pool
    chains its block hashes)."""
    seen: set = set()
    prompt_total = hit_total = 0
    for prompt, computed, salt in requests:
        n = len(prompt)
        limit = (n - 1) // block_size
        parent = hash(("salt", salt))
        hit = 0
        keys = []
        for b in range(n // block_size):
            parent = hash((parent, tuple(prompt[b * block_size:(b + 1) * block_size])))
            keys.append(parent)
            if hit == b and b < limit and parent in seen:
                hit = b + 1
        prompt_total += n
        hit_total += hit * block_size
        seen.update(keys)
        if computed is not None and len(computed) > n:
            parent = keys[-1] if keys else hash(("salt", salt))
            for b in range(n // block_size, len(computed) // block_size):
                parent = hash((parent, tuple(computed[b * block_size:(b + 1) * block_size])))
                seen.add(parent)
    return {"prompt_tokens": prompt_total, "prefill_tokens_saved": hit_total,
            "prefix_hit_rate": hit_total / prompt_total if prompt_total else 0.0}
