"""Block hashing, as vLLM 0.33.0 computes it (``vllm/v1/core/kv_cache_utils.py`` and
``vllm/utils/hashing.py``), written for shmkv without vLLM, cbor2 or torch.

A request's tokens are cut into ``hash_block_size``-token blocks; block ``i`` hashes to

    h_i = H((h_{i-1} or NONE_HASH, tuple(tokens_i), extra_keys_i))

so every hash fingerprints the whole prefix that ends at its block. ``extra_keys_i`` is
``None`` or a tuple of tagged keys, in this order:

    ("lora", lora_name, lora_path)            every block of a LoRA request
    ("mm", identifier, offset - block_start)  each multimodal item overlapping the block
    ("cache_salt", salt)                      only the block that starts at token 0
    ("prompt_embeds", sha256(raw bytes))      every block of a prompt-embeds request

``H`` is :func:`sha256` (pickle, highest protocol, then SHA-256; vLLM's default) or
:func:`sha256_cbor` (canonical CBOR, then SHA-256; language independent). Both return the
same bytes as vLLM's functions of the same names for the same input; ``sha256_cbor`` uses
the small canonical CBOR encoder below (:func:`cbor_dumps`), byte-for-byte
``cbor2.dumps(obj, canonical=True)`` for the types that occur in block-hash inputs.

``NONE_HASH`` (the parent of block 0) is ``H(seed)``: the seed is ``PYTHONHASHSEED`` when
that is set, else the fixed ``"vllm-none-hash"`` (vLLM's rule for cryptographic hashes), see
:func:`none_hash`. There is no module-global NONE_HASH: callers pass it in, and a pool keeps
the one every process agrees on.

Duck typing: a request is anything with ``.all_token_ids``, ``.num_tokens`` and
``.block_hashes`` (the hasher), plus, when used, ``.lora_request`` (``.lora_name``,
``.lora_path``), ``.mm_features`` (items with ``.identifier`` and ``.mm_position.offset`` /
``.length``, sorted by offset), ``.cache_salt`` and ``.prompt_embeds`` (a torch tensor, a
numpy array, or anything whose row slices expose their raw bytes through the buffer
protocol). vLLM's ``Request`` qualifies, and so does :class:`shmkv.core.request.Request`.

This module never imports torch: a torch tensor can only reach it if torch is imported.
"""

from __future__ import annotations

import bisect
import hashlib
import os
import pickle
import struct
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from shmkv.errors import UsageError

__all__ = [
    "DEFAULT_NONE_HASH_SEED",
    "HASH_FN_NAMES",
    "BlockHashListWithBlockSize",
    "RequestBlockHasher",
    "cbor_dumps",
    "generate_block_hash_extra_keys",
    "generate_lookahead_block_hash_extra_keys",
    "get_hash_fn_by_name",
    "get_request_block_hasher",
    "hash_block_tokens",
    "need_extra_keys",
    "none_hash",
    "resolve_none_hash_seed",
    "sha256",
    "sha256_cbor",
    "to_event_extra_keys",
]

# --------------------------------------------------------------------------- hash functions


def sha256(obj: Any) -> bytes:
    """SHA-256 of ``pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)``: vLLM's default
    prefix-caching hash.

    Pickle memoises objects by identity, so the bytes (and the digest) depend on which
    sub-objects are the *same object*, not only on their values; vLLM shares this property.
    """
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def sha256_cbor(obj: Any) -> bytes:
    """SHA-256 of the canonical CBOR encoding of ``obj`` (see :func:`cbor_dumps`)."""
    return hashlib.sha256(cbor_dumps(obj)).digest()


_HASH_FNS: dict[str, Callable[[Any], bytes]] = {"sha256": sha256, "sha256_cbor": sha256_cbor}
HASH_FN_NAMES: tuple[str, ...] = tuple(_HASH_FNS)


def get_hash_fn_by_name(name: str) -> Callable[[Any], bytes]:
    """The hash function called ``name``: ``"sha256"`` or ``"sha256_cbor"``.

    vLLM also offers ``xxhash`` / ``xxhash_cbor``; shmkv does not, because vLLM gives them a
    random per-process NONE_HASH that processes sharing a pool could not agree on.
    """
    try:
        return _HASH_FNS[name]
    except (KeyError, TypeError):
        raise UsageError(
            f"unsupported hash function {name!r}; valid names: {', '.join(HASH_FN_NAMES)}"
        ) from None


# --------------------------------------------------------------------------- canonical CBOR
#
# RFC 8949 with cbor2's canonical choices: every length and integer in its shortest head;
# integers outside [-2**64, 2**64 - 1] as bignums (tag 2, or tag 3 holding -1 - n) whose
# payload is the minimal big-endian byte string; floats in the shortest of half / single /
# double that holds the value exactly, NaN as f97e00 and infinities as half floats; tuples
# and lists as definite-length arrays; bytearray as a byte string; str as UTF-8 (lone
# surrogates raise UnicodeEncodeError, as in cbor2). Subclasses (IntEnum, str subclasses...)
# encode as their base type. Anything else (dict, set, numpy scalars, memoryview...) raises
# TypeError: none of it occurs in block-hash inputs.

_HEAD1 = struct.Struct(">BB").pack
_HEAD2 = struct.Struct(">BH").pack
_HEAD4 = struct.Struct(">BI").pack
_HEAD8 = struct.Struct(">BQ").pack
_HALF = struct.Struct(">e")
_SINGLE = struct.Struct(">f")
_DOUBLE = struct.Struct(">Bd").pack
_SMALL_UINT = [bytes((i,)) for i in range(24)]
_SMALL_NINT = [bytes((0x20 | i,)) for i in range(24)]
_2_64 = 1 << 64


def _head(major: int, n: int, out: bytearray) -> None:
    mt = major << 5
    if n < 24:
        out.append(mt | n)
    elif n < 0x100:
        out += _HEAD1(mt | 24, n)
    elif n < 0x10000:
        out += _HEAD2(mt | 25, n)
    elif n < 0x100000000:
        out += _HEAD4(mt | 26, n)
    else:
        out += _HEAD8(mt | 27, n)


def _encode_int(n: int, out: bytearray) -> None:
    if n >= 0:
        if n < 24:
            out += _SMALL_UINT[n]
        elif n < _2_64:
            _head(0, n, out)
        else:
            payload = n.to_bytes((n.bit_length() + 7) // 8, "big")
            out += b"\xc2"  # tag 2: unsigned bignum
            _head(2, len(payload), out)
            out += payload
    else:
        m = -1 - n
        if m < 24:
            out += _SMALL_NINT[m]
        elif m < _2_64:
            _head(1, m, out)
        else:
            payload = m.to_bytes((m.bit_length() + 7) // 8, "big")
            out += b"\xc3"  # tag 3: negative bignum
            _head(2, len(payload), out)
            out += payload


def _encode_float(x: float, out: bytearray) -> None:
    if x != x:
        out += b"\xf9\x7e\x00"
        return
    if x in (float("inf"), float("-inf")):
        out += b"\xf9\x7c\x00" if x > 0 else b"\xf9\xfc\x00"
        return
    try:
        half = _HALF.pack(x)
        if _HALF.unpack(half)[0] == x:
            out += b"\xf9"
            out += half
            return
    except OverflowError:
        pass
    try:
        single = _SINGLE.pack(x)
        if _SINGLE.unpack(single)[0] == x:
            out += b"\xfa"
            out += single
            return
    except OverflowError:
        pass
    out += _DOUBLE(0xFB, x)


_UINT16: list[bytes] | None = None  # encodings of 0..65535, built on first use (~3 MB)
_INT_ONLY = {int}


def _int_bytes(n: int) -> bytes:
    out = bytearray()
    _encode_int(n, out)
    return bytes(out)


def _encode_ints(items: Sequence[int]) -> bytes:
    """The concatenated encodings of plain ints (a block's token ids): the hot path."""
    global _UINT16
    table = _UINT16
    if table is None:
        table = _UINT16 = [_int_bytes(i) for i in range(0x10000)]
    return b"".join(
        [
            table[x]
            if 0 <= x < 0x10000
            else _HEAD4(0x1A, x)
            if 0 <= x < 0x100000000
            else _int_bytes(x)
            for x in items
        ]
    )


def _encode(obj: Any, out: bytearray) -> None:
    t = type(obj)
    if t is int:
        if 0 <= obj < 24:
            out += _SMALL_UINT[obj]
        else:
            _encode_int(obj, out)
    elif t is tuple or t is list:
        _head(4, len(obj), out)
        if obj and set(map(type, obj)) == _INT_ONLY:
            out += _encode_ints(obj)
        else:
            for item in obj:
                _encode(item, out)
    elif t is bytes:
        _head(2, len(obj), out)
        out += obj
    elif t is str:
        data = obj.encode("utf-8")
        _head(3, len(data), out)
        out += data
    elif obj is None:
        out += b"\xf6"
    elif obj is True:
        out += b"\xf5"
    elif obj is False:
        out += b"\xf4"
    elif t is float:
        _encode_float(obj, out)
    # Subclasses of the supported types (bool cannot be subclassed).
    elif isinstance(obj, int):
        _encode_int(int(obj), out)
    elif isinstance(obj, (tuple, list)):
        _head(4, len(obj), out)
        for item in obj:
            _encode(item, out)
    elif isinstance(obj, (bytes, bytearray)):
        _head(2, len(obj), out)
        out += obj
    elif isinstance(obj, str):
        data = str.encode(obj, "utf-8")
        _head(3, len(data), out)
        out += data
    elif isinstance(obj, float):
        _encode_float(float(obj), out)
    else:
        raise TypeError(f"cannot CBOR-encode an object of type {t.__qualname__}")


def cbor_dumps(obj: Any) -> bytes:
    """Canonical CBOR encoding of ``obj``: the bytes of ``cbor2.dumps(obj, canonical=True)``.

    Supports None, bool, int (any size), float, bytes, bytearray, str, tuple and list;
    raises TypeError for anything else.
    """
    out = bytearray()
    _encode(obj, out)
    return bytes(out)


# --------------------------------------------------------------------------- NONE_HASH

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
_NON_CRYPTO_HASH_NAMES = frozenset({"xxhash", "xxhash_cbor"})


def resolve_none_hash_seed() -> str:
    """The seed vLLM 0.33.0 derives NONE_HASH from for a cryptographic hash:
    ``PYTHONHASHSEED`` if it is set (even to ``""``), else ``"vllm-none-hash"``."""
    seed = os.environ.get("PYTHONHASHSEED")
    return DEFAULT_NONE_HASH_SEED if seed is None else seed


def none_hash(hash_fn: Callable[[Any], bytes], seed: str | None = None) -> bytes:
    """``hash_fn(seed)``: the parent hash of a request's first block (vLLM's ``NONE_HASH``).

    With ``seed=None`` the seed follows vLLM 0.33.0's rule (:func:`resolve_none_hash_seed`),
    so every process with the same environment gets the same value; pass ``seed`` to pin it
    (a pool stores the result so that all attached processes agree). vLLM gives xxhash a
    random per-process seed when PYTHONHASHSEED is unset, which no pool could share: such a
    hash function is refused unless a seed is given or PYTHONHASHSEED is set.
    """
    if not callable(hash_fn):
        raise UsageError(f"hash_fn must be callable, got {type(hash_fn).__name__}")
    if seed is None:
        if (
            getattr(hash_fn, "__name__", None) in _NON_CRYPTO_HASH_NAMES
            and os.environ.get("PYTHONHASHSEED") is None
        ):
            raise UsageError(
                f"{hash_fn.__name__} gets a random per-process NONE_HASH in vLLM; "
                "set PYTHONHASHSEED or pass seed= so that processes agree"
            )
        seed = resolve_none_hash_seed()
    elif not isinstance(seed, str):
        raise UsageError(f"seed must be a str, got {type(seed).__name__}")
    return hash_fn(seed)


# --------------------------------------------------------------------------- block hashes


def hash_block_tokens(
    hash_fn: Callable[[Any], bytes],
    none_hash: bytes,
    parent: bytes | None,
    token_ids: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
) -> bytes:
    """The hash of one full block: ``hash_fn((parent or none_hash, tuple(token_ids),
    extra_keys))``. ``parent`` is the previous block's hash, or None for the first block."""
    return hash_fn((parent or none_hash, tuple(token_ids), extra_keys))


# --------------------------------------------------------------------------- extra keys


def need_extra_keys(request: Any) -> bool:
    """Whether any block of ``request`` can carry extra keys (LoRA, multimodal items,
    cache_salt or prompt embeddings)."""
    return bool(
        getattr(request, "lora_request", None)
        or getattr(request, "mm_features", None)
        or getattr(request, "cache_salt", None)
        or getattr(request, "prompt_embeds", None) is not None
    )


def _mm_extra_keys(
    request: Any, start: int, end: int, start_mm_idx: int
) -> tuple[list[tuple[str, Any, int]], int]:
    """("mm", identifier, offset - start) for each multimodal item overlapping
    ``[start, end)``, scanning from ``start_mm_idx`` (-k: the k-th item from the end);
    returns the keys and the index to resume from for the next block."""
    features = getattr(request, "mm_features", None)
    if not features:
        return [], start_mm_idx
    last = features[-1].mm_position
    if last.offset + last.length <= start:
        return [], start_mm_idx  # every item ends before this block
    n = len(features)
    if start_mm_idx < 0:
        if -start_mm_idx > n:
            raise UsageError(f"start_mm_idx {start_mm_idx} is out of range for {n} mm_features")
        start_mm_idx += n
    keys: list[tuple[str, Any, int]] = []
    idx = start_mm_idx
    while idx < n:
        feature = features[idx]
        identifier = feature.identifier
        if identifier is None:
            raise UsageError(f"mm_features[{idx}].identifier is None")
        pos = feature.mm_position
        offset = pos.offset
        item_end = offset + pos.length
        if end <= offset:
            break  # the block ends before this item
        if start >= item_end:
            idx += 1  # the block is past this item
            continue
        keys.append(("mm", identifier, offset - start))
        if end >= item_end:
            idx += 1  # the item ends inside the block; the next one may start there too
        else:
            break  # the item runs past the block
    return keys, idx


def _prompt_embeds_digest(embeds: Any, start: int, end: int) -> bytes:
    """SHA-256 of the raw bytes of rows ``[start, end)`` of ``embeds``, as vLLM's
    ``tensor_data`` lays them out (C order, native byte order)."""
    block = embeds[start:end]
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(block, torch.Tensor):
        data: Any = block.flatten().cpu().contiguous().view(torch.uint8).numpy().data
    else:
        try:
            view = memoryview(block)
        except (TypeError, ValueError):  # e.g. numpy dtypes the buffer protocol lacks
            data = block.tobytes()
        else:
            data = view if view.c_contiguous else view.tobytes()
    return hashlib.sha256(data).digest()


def _prompt_embeds_extra_keys(request: Any, start: int, end: int) -> list[tuple[str, bytes]]:
    embeds = getattr(request, "prompt_embeds", None)
    if embeds is None:
        return []
    memo = getattr(request, "_prompt_embeds_per_block_hashes", None)
    digest = memo.get((start, end)) if memo is not None else None
    if digest is None:
        digest = _prompt_embeds_digest(embeds, start, end)
        if memo is not None:
            memo[(start, end)] = digest
    return [("prompt_embeds", digest)]


def generate_block_hash_extra_keys(
    request: Any, start_token_idx: int, end_token_idx: int, start_mm_idx: int
) -> tuple[tuple[Any, ...] | None, int]:
    """The extra keys of the block ``[start_token_idx, end_token_idx)`` of ``request``, in
    vLLM 0.33.0's order (LoRA, multimodal, cache_salt, prompt embeds), or None when there
    are none; and the multimodal index the next block's scan resumes from."""
    mm_keys, next_mm_idx = _mm_extra_keys(request, start_token_idx, end_token_idx, start_mm_idx)
    keys: list[Any] = []
    lora = getattr(request, "lora_request", None)
    if lora:
        keys.append(("lora", lora.lora_name, lora.lora_path))
    keys += mm_keys
    if start_token_idx == 0:
        salt = getattr(request, "cache_salt", None)
        if salt:
            keys.append(("cache_salt", salt))
    keys += _prompt_embeds_extra_keys(request, start_token_idx, end_token_idx)
    return (tuple(keys) if keys else None), next_mm_idx


def generate_lookahead_block_hash_extra_keys(
    request: Any,
    start_token_idx: int,
    end_token_idx: int,
    hash_end_token_idx: int,
    start_mm_idx: int,
) -> tuple[tuple[Any, ...] | None, int]:
    """Extra keys over the block and its lookahead tokens ``[start, hash_end)``; the
    returned mm index steps back to the first item that reaches past ``end_token_idx``, so
    the next block sees it again."""
    keys, mm_idx = generate_block_hash_extra_keys(
        request, start_token_idx, hash_end_token_idx, start_mm_idx
    )
    features = getattr(request, "mm_features", None)
    while mm_idx > 0:
        pos = features[mm_idx - 1].mm_position
        if pos.offset + pos.length <= end_token_idx:
            break
        mm_idx -= 1
    return keys, mm_idx


def to_event_extra_keys(
    extra_keys: Iterable[tuple[Any, ...] | None] | None,
) -> list[tuple[Any, ...] | None] | None:
    """The per-block extra keys as vLLM publishes them in ``BlockStored.extra_keys``:
    untagged (the LoRA name, ``(identifier, offset)`` for an mm item, the salt, the
    prompt-embeds digest); None for an empty or missing list."""
    if not extra_keys:
        return None
    event_keys = [
        None if keys is None else tuple(key[1:] if key[0] == "mm" else key[1] for key in keys)
        for keys in extra_keys
    ]
    return event_keys or None


# --------------------------------------------------------------------------- request hasher


def _check_positive_int(name: str, value: Any) -> int:
    if type(value) is not int or value <= 0:
        raise UsageError(f"{name} must be a positive int, got {value!r}")
    return value


def _first_mm_idx(features: Sequence[Any], start: int) -> int:
    """Index of the first mm item that ends after token ``start`` (items sorted by offset
    and not overlapping)."""
    return bisect.bisect_left(
        features, start + 1, key=lambda f: f.mm_position.offset + f.mm_position.length
    )


class RequestBlockHasher:
    """``hasher(request)`` -> the hashes of the request's full blocks not yet in
    ``request.block_hashes`` (vLLM's ``get_request_block_hasher``); a request calls it when
    it is built and whenever tokens are appended, and extends its ``block_hashes``.

    ``num_hash_lookahead_tokens`` L > 0 (speculative decoding): each block's hash also covers
    the L tokens after it, so it appears only once they exist; its extra keys become
    ``(E, t)`` (L == 1) or ``(E, *tokens)``, E being the extra keys of the block and those
    tokens.
    """

    __slots__ = ("hash_block_size", "hash_fn", "none_hash", "num_hash_lookahead_tokens")

    def __init__(
        self,
        hash_block_size: int,
        hash_fn: Callable[[Any], bytes],
        none_hash: bytes,
        num_hash_lookahead_tokens: int = 0,
    ) -> None:
        self.hash_block_size = _check_positive_int("hash_block_size", hash_block_size)
        if not callable(hash_fn):
            raise UsageError(f"hash_fn must be callable, got {type(hash_fn).__name__}")
        if not isinstance(none_hash, bytes) or not none_hash:
            raise UsageError(f"none_hash must be non-empty bytes, got {none_hash!r}")
        if type(num_hash_lookahead_tokens) is not int or num_hash_lookahead_tokens < 0:
            raise UsageError(
                f"num_hash_lookahead_tokens must be an int >= 0, got {num_hash_lookahead_tokens!r}"
            )
        self.hash_fn = hash_fn
        self.none_hash = none_hash
        self.num_hash_lookahead_tokens = num_hash_lookahead_tokens

    def __repr__(self) -> str:
        name = getattr(self.hash_fn, "__name__", repr(self.hash_fn))
        return (
            f"RequestBlockHasher(hash_block_size={self.hash_block_size}, hash_fn={name}, "
            f"num_hash_lookahead_tokens={self.num_hash_lookahead_tokens})"
        )

    def __call__(self, request: Any) -> list[bytes]:
        bs = self.hash_block_size
        lookahead = self.num_hash_lookahead_tokens
        block_hashes = request.block_hashes
        start = len(block_hashes) * bs
        num_tokens = request.num_tokens - lookahead
        if start + bs > num_tokens:
            return []
        hash_fn = self.hash_fn
        parent = block_hashes[-1] if block_hashes else None
        tokens = request.all_token_ids
        new_hashes: list[bytes] = []

        if not lookahead and not need_extra_keys(request):
            # Fast path: no block of this request has extra keys.
            parent = parent or self.none_hash
            for block_start in range(start, num_tokens - bs + 1, bs):
                parent = hash_fn((parent, tuple(tokens[block_start : block_start + bs]), None))
                new_hashes.append(parent)
            return new_hashes

        mm_idx = 0
        features = getattr(request, "mm_features", None)
        if start > 0 and features:
            last = features[-1].mm_position
            if last.offset + last.length > start:
                mm_idx = _first_mm_idx(features, start)
        none = self.none_hash
        while start + bs <= num_tokens:
            end = start + bs
            if lookahead:
                hash_end = end + lookahead
                extra, mm_idx = generate_lookahead_block_hash_extra_keys(
                    request, start, end, hash_end, mm_idx
                )
                if lookahead == 1:
                    extra = (extra, tokens[end])
                else:
                    extra = (extra, *tokens[end:hash_end])
            else:
                extra, mm_idx = generate_block_hash_extra_keys(request, start, end, mm_idx)
            parent = hash_fn((parent or none, tuple(tokens[start:end]), extra))
            new_hashes.append(parent)
            start = end
        return new_hashes


def get_request_block_hasher(
    hash_block_size: int,
    hash_fn: Callable[[Any], bytes],
    none_hash: bytes,
    num_hash_lookahead_tokens: int = 0,
) -> RequestBlockHasher:
    """vLLM's name for :class:`RequestBlockHasher` (which takes NONE_HASH explicitly)."""
    return RequestBlockHasher(hash_block_size, hash_fn, none_hash, num_hash_lookahead_tokens)


# --------------------------------------------------------------------------- coarse views


class BlockHashListWithBlockSize:
    """``block_hashes`` (computed every ``hash_block_size`` tokens) viewed at
    ``target_block_size``, a multiple k of it: element i is fine hash (i+1)·k−1, which
    already chains over the whole prefix of the coarse block. Lazy; supports ``len``, int
    and slice indexing and iteration, as vLLM 0.33.0's class of the same name."""

    __slots__ = ("block_hashes", "scale_factor")

    def __init__(
        self, block_hashes: Sequence[bytes], hash_block_size: int, target_block_size: int
    ) -> None:
        _check_positive_int("hash_block_size", hash_block_size)
        _check_positive_int("target_block_size", target_block_size)
        if target_block_size % hash_block_size:
            raise UsageError(
                f"target_block_size {target_block_size} is not a multiple of "
                f"hash_block_size {hash_block_size}"
            )
        self.block_hashes = block_hashes
        self.scale_factor = target_block_size // hash_block_size

    def __len__(self) -> int:
        return len(self.block_hashes) // self.scale_factor

    def __getitem__(self, idx: int | slice) -> Any:
        if isinstance(idx, int):
            return self.block_hashes[(idx + 1) * self.scale_factor - 1]
        if isinstance(idx, slice):
            k = self.scale_factor
            return [self.block_hashes[(i + 1) * k - 1] for i in range(*idx.indices(len(self)))]
        raise TypeError(f"Invalid index type: {type(idx)!r}")

    def __iter__(self) -> Iterator[bytes]:
        k = self.scale_factor
        for i in range(len(self)):
            yield self.block_hashes[(i + 1) * k - 1]
