"""shmkv.hashing and shmkv.core.request: hash functions, the canonical CBOR encoder (fixed vectors
always, byte-for-byte against cbor2 when it is importable), NONE_HASH, the block-hash chain,
extra keys (order, cache_salt on block 0 only, multimodal offsets, prompt embeds), event
extra keys, the request block hasher, the coarse view, and validation errors."""

from __future__ import annotations

import hashlib
import math
import os
import pickle
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmkv import UsageError
from shmkv.core.request import (
    ConstantList,
    LoRARequest,
    MultiModalFeatureSpec,
    PlaceholderRange,
    Request,
)
from shmkv.hashing import (
    DEFAULT_NONE_HASH_SEED,
    HASH_FN_NAMES,
    BlockHashListWithBlockSize,
    RequestBlockHasher,
    cbor_dumps,
    generate_block_hash_extra_keys,
    generate_lookahead_block_hash_extra_keys,
    get_hash_fn_by_name,
    get_request_block_hasher,
    hash_block_tokens,
    need_extra_keys,
    none_hash,
    resolve_none_hash_seed,
    sha256,
    sha256_cbor,
    to_event_extra_keys,
)

try:
    import cbor2
except ImportError:  # shmkv does not depend on cbor2; only the cross-checks need it
    cbor2 = None

needs_cbor2 = pytest.mark.skipif(cbor2 is None, reason="cbor2 is not installed")
HASH_FNS = [sha256, sha256_cbor]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _no_hash_seed(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)


def mm(identifier: str, offset: int, length: int) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(None, "image", identifier, PlaceholderRange(offset, length))


def make_request(tokens, hbs=4, hash_fn=sha256, **kwargs) -> Request:
    hasher = RequestBlockHasher(hbs, hash_fn, none_hash(hash_fn))
    return Request("r", tokens, block_hasher=hasher, **kwargs)


# --------------------------------------------------------------------------- hash functions


def test_sha256_is_pickle_then_sha256():
    obj = (b"\x00" * 32, (1, 2, 3), (("cache_salt", "s"),))
    expected = hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()
    assert sha256(obj) == expected
    assert len(sha256(obj)) == 32


def test_sha256_cbor_is_cbor_then_sha256():
    obj = (b"\x00" * 32, (1, 2, 3), None)
    assert sha256_cbor(obj) == hashlib.sha256(cbor_dumps(obj)).digest()
    assert sha256_cbor(obj) != sha256(obj)


def test_get_hash_fn_by_name():
    assert HASH_FN_NAMES == ("sha256", "sha256_cbor")
    assert get_hash_fn_by_name("sha256") is sha256
    assert get_hash_fn_by_name("sha256_cbor") is sha256_cbor
    for bad in ("xxhash", "md5", "", None, 3):
        with pytest.raises(UsageError, match="valid names: sha256, sha256_cbor"):
            get_hash_fn_by_name(bad)
    assert issubclass(UsageError, ValueError)


# --------------------------------------------------------------------------- canonical CBOR

# (value, canonical encoding): RFC 8949 appendix A, plus cbor2 6.3's canonical choices.
CBOR_VECTORS = [
    (None, "f6"),
    (False, "f4"),
    (True, "f5"),
    (0, "00"),
    (1, "01"),
    (23, "17"),
    (24, "1818"),
    (100, "1864"),
    (255, "18ff"),
    (256, "190100"),
    (1000, "1903e8"),
    (65535, "19ffff"),
    (65536, "1a00010000"),
    (1000000, "1a000f4240"),
    (2**32 - 1, "1affffffff"),
    (2**32, "1b0000000100000000"),
    (1000000000000, "1b000000e8d4a51000"),
    (2**64 - 1, "1bffffffffffffffff"),
    (2**64, "c249010000000000000000"),
    (2**100, "c24d10000000000000000000000000"),
    (-1, "20"),
    (-10, "29"),
    (-24, "37"),
    (-25, "3818"),
    (-100, "3863"),
    (-1000, "3903e7"),
    (-(2**64), "3bffffffffffffffff"),
    (-(2**64) - 1, "c349010000000000000000"),
    (-(2**100), "c34d0fffffffffffffffffffffffff"),
    (0.0, "f90000"),
    (-0.0, "f98000"),
    (1.0, "f93c00"),
    (1.5, "f93e00"),
    (65504.0, "f97bff"),
    (65519.0, "fa477fef00"),
    (100000.0, "fa47c35000"),
    (3.4028234663852886e38, "fa7f7fffff"),
    (1.1, "fb3ff199999999999a"),
    (1.0e300, "fb7e37e43c8800759c"),
    (5.960464477539063e-8, "f90001"),
    (2.0**-25, "fa33000000"),
    (1e-8, "fb3e45798ee2308c3a"),
    (float("inf"), "f97c00"),
    (float("-inf"), "f9fc00"),
    (float("nan"), "f97e00"),
    (b"", "40"),
    (b"\x01\x02\x03\x04", "4401020304"),
    (bytearray(b"x"), "4178"),
    ("", "60"),
    ("a", "6161"),
    ("IETF", "6449455446"),
    ("\u00fc", "62c3bc"),
    ("\u6c34", "63e6b0b4"),
    ("\U00010151", "64f0908591"),
    ((), "80"),
    ([1, 2, 3], "83010203"),
    ((1, [2, 3], (4, 5)), "8301820203820405"),
    (tuple(range(1, 26)), "98190102030405060708090a0b0c0d0e0f101112131415161718181819"),
    ((1, (2, None)), "82018202f6"),
]


@pytest.mark.parametrize("value, encoded", CBOR_VECTORS, ids=lambda v: repr(v)[:30])
def test_cbor_vectors(value, encoded):
    assert cbor_dumps(value).hex() == encoded


@needs_cbor2
def test_cbor_vectors_are_cbor2s():
    for value, encoded in CBOR_VECTORS:
        assert cbor2.dumps(value, canonical=True).hex() == encoded, value


def test_cbor_long_heads():
    assert cbor_dumps(b"x" * 300)[:3] == bytes.fromhex("59012c")
    assert cbor_dumps("y" * 70000)[:5] == bytes.fromhex("7a00011170")
    assert cbor_dumps((0,) * 256)[:3] == bytes.fromhex("990100")
    assert cbor_dumps(-(2**63))[:1] == b"\x3b"


def test_cbor_subclasses_encode_as_base_type():
    import enum

    class Tok(enum.IntEnum):
        A = 5

    class S(str):
        pass

    class T(tuple):
        pass

    assert cbor_dumps(Tok.A) == cbor_dumps(5)
    assert cbor_dumps(S("x")) == cbor_dumps("x")
    assert cbor_dumps(T((1, "a"))) == cbor_dumps((1, "a"))


@pytest.mark.parametrize(
    "value", [{}, {1: 2}, set(), frozenset(), object(), np.int64(3), memoryview(b"x"), 1j]
)
def test_cbor_rejects_unsupported_types(value):
    with pytest.raises(TypeError, match="cannot CBOR-encode"):
        cbor_dumps((1, value))


def test_cbor_rejects_lone_surrogates():
    with pytest.raises(UnicodeEncodeError):
        cbor_dumps("\ud800")


_cbor_leaves = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**200), max_value=2**200)
    | st.sampled_from([2**64 - 1, 2**64, -(2**64), -(2**64) - 1, 2**32, -(2**32) - 1])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.floats(width=16)
    | st.floats(width=32)
    | st.binary(max_size=40)
    | st.text(max_size=20)
)
_cbor_values = st.recursive(
    _cbor_leaves,
    lambda children: st.lists(children, max_size=6) | st.lists(children, max_size=6).map(tuple),
    max_leaves=30,
)
_block_hash_inputs = st.tuples(
    st.binary(min_size=32, max_size=32),
    st.lists(st.integers(min_value=0, max_value=2**40), max_size=40).map(tuple),
    st.none()
    | st.lists(
        st.tuples(st.just("lora"), st.text(max_size=8), st.text(max_size=8))
        | st.tuples(st.just("mm"), st.text(max_size=8), st.integers(-100, 100))
        | st.tuples(st.just("cache_salt"), st.text(max_size=8))
        | st.tuples(st.just("prompt_embeds"), st.binary(min_size=32, max_size=32)),
        min_size=1,
        max_size=4,
    ).map(tuple),
)


@needs_cbor2
@settings(max_examples=300, deadline=None)
@given(_cbor_values)
def test_cbor_matches_cbor2(value):
    assert cbor_dumps(value) == cbor2.dumps(value, canonical=True)


@needs_cbor2
@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.integers()
        | st.integers(0, 2**17)
        | st.sampled_from([0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64, -1]),
        max_size=40,
    )
)
def test_cbor_int_sequences_match_cbor2(ints):
    """Sequences of plain ints take the table-driven path (token ids)."""
    assert cbor_dumps(ints) == cbor2.dumps(ints, canonical=True)
    assert cbor_dumps(tuple(ints)) == cbor2.dumps(tuple(ints), canonical=True)


@needs_cbor2
@settings(max_examples=200, deadline=None)
@given(_block_hash_inputs)
def test_cbor_matches_cbor2_on_block_hash_inputs(value):
    encoded = cbor2.dumps(value, canonical=True)
    assert cbor_dumps(value) == encoded
    assert sha256_cbor(value) == hashlib.sha256(encoded).digest()


@settings(max_examples=300, deadline=None)
@given(st.floats(allow_nan=False))
def test_cbor_float_is_shortest_exact(x):
    """Without cbor2 too: the encoding decodes back to x, and no shorter width holds x."""
    enc = cbor_dumps(x)
    widths = {0xF9: ">e", 0xFA: ">f", 0xFB: ">d"}
    fmt = widths[enc[0]]
    assert struct.unpack(fmt, enc[1:])[0] == x
    assert math.copysign(1, struct.unpack(fmt, enc[1:])[0]) == math.copysign(1, x)
    for shorter in [f for f in (">e", ">f") if struct.calcsize(f) < struct.calcsize(fmt)]:
        try:
            assert struct.unpack(shorter, struct.pack(shorter, x))[0] != x
        except OverflowError:
            pass


# --------------------------------------------------------------------------- NONE_HASH


@pytest.mark.parametrize("hash_fn", HASH_FNS)
def test_none_hash_default_seed(hash_fn):
    assert resolve_none_hash_seed() == DEFAULT_NONE_HASH_SEED == "vllm-none-hash"
    assert none_hash(hash_fn) == hash_fn("vllm-none-hash")
    assert none_hash(hash_fn) == none_hash(hash_fn)  # deterministic, no random seed


@pytest.mark.parametrize("hash_fn", HASH_FNS)
def test_none_hash_pythonhashseed_wins(monkeypatch, hash_fn):
    monkeypatch.setenv("PYTHONHASHSEED", "42")
    assert resolve_none_hash_seed() == "42"
    assert none_hash(hash_fn) == hash_fn("42") != hash_fn("vllm-none-hash")
    monkeypatch.setenv("PYTHONHASHSEED", "")  # set but empty still wins, as in vLLM
    assert none_hash(hash_fn) == hash_fn("")


def test_none_hash_explicit_seed_and_errors(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "42")
    assert none_hash(sha256, seed="pinned") == sha256("pinned")
    with pytest.raises(UsageError, match="seed must be a str"):
        none_hash(sha256, seed=b"x")
    with pytest.raises(UsageError, match="callable"):
        none_hash("sha256")


def test_none_hash_refuses_random_seeded_hashes(monkeypatch):
    def xxhash(obj):  # vLLM would give it a random per-process seed
        return sha256(obj)

    with pytest.raises(UsageError, match="PYTHONHASHSEED"):
        none_hash(xxhash)
    assert none_hash(xxhash, seed="s") == sha256("s")
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    assert none_hash(xxhash) == sha256("7")


# --------------------------------------------------------------------------- chain


@pytest.mark.parametrize("hash_fn", HASH_FNS)
def test_hash_block_tokens(hash_fn):
    none = none_hash(hash_fn)
    parent = b"\x07" * 32
    assert hash_block_tokens(hash_fn, none, parent, [1, 2], None) == hash_fn((parent, (1, 2), None))
    extra = (("cache_salt", "s"),)
    assert hash_block_tokens(hash_fn, none, parent, (1, 2), extra) == hash_fn(
        (parent, (1, 2), extra)
    )
    # No parent (None or empty) means NONE_HASH.
    first = hash_fn((none, (1, 2), None))
    assert hash_block_tokens(hash_fn, none, None, [1, 2]) == first
    assert hash_block_tokens(hash_fn, none, b"", [1, 2]) == first


@pytest.mark.parametrize("hash_fn", HASH_FNS)
def test_request_hashes_are_the_chain(hash_fn):
    tokens = list(range(100, 123))
    req = make_request(tokens, hbs=5, hash_fn=hash_fn)
    none = none_hash(hash_fn)
    expected, parent = [], None
    for start in range(0, 20, 5):
        parent = hash_block_tokens(hash_fn, none, parent, tokens[start : start + 5])
        expected.append(parent)
    assert req.block_hashes == expected
    assert all(len(h) == 32 for h in req.block_hashes)


@settings(max_examples=80, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**31), max_size=60),
    hbs=st.integers(1, 9),
    chunks=st.lists(st.integers(0, 7), max_size=12),
    hash_fn=st.sampled_from(HASH_FNS),
    salt=st.sampled_from([None, "", "t1"]),
)
def test_incremental_hashing_equals_one_shot(tokens, hbs, chunks, hash_fn, salt):
    """Hashes only grow, and appending tokens in any chunks gives the one-shot result."""
    split = len(tokens) // 2
    req = make_request(tokens[:split], hbs, hash_fn, cache_salt=salt)
    rest = tokens[split:]
    for size in chunks:
        before = list(req.block_hashes)
        piece, rest = rest[:size], rest[size:]
        req.append_output_token_ids(piece[0] if size == 1 and piece else piece)
        assert req.block_hashes[: len(before)] == before
    req.append_output_token_ids(rest)
    assert req.block_hashes == make_request(tokens, hbs, hash_fn, cache_salt=salt).block_hashes
    assert len(req.block_hashes) == len(tokens) // hbs


@pytest.mark.parametrize("hash_fn", HASH_FNS)
def test_a_token_changes_its_block_and_every_later_one(hash_fn):
    tokens = list(range(40))
    base = make_request(tokens, 4, hash_fn).block_hashes
    for pos in (0, 13, 39):
        changed = tokens.copy()
        changed[pos] += 1
        other = make_request(changed, 4, hash_fn).block_hashes
        b = pos // 4
        assert other[:b] == base[:b]
        assert all(x != y for x, y in zip(other[b:], base[b:], strict=True))


# --------------------------------------------------------------------------- extra keys


def test_cache_salt_only_on_the_block_at_token_0():
    req = make_request(list(range(12)), hbs=4, cache_salt="tenant")
    keys = [generate_block_hash_extra_keys(req, s, s + 4, 0)[0] for s in (0, 4, 8)]
    assert keys == [(("cache_salt", "tenant"),), None, None]
    plain = make_request(list(range(12)), hbs=4)
    # The salt isolates every block through the chain, although only block 0 carries it.
    assert all(a != b for a, b in zip(req.block_hashes, plain.block_hashes, strict=True))
    # An empty salt is no salt.
    assert make_request(list(range(12)), hbs=4, cache_salt="").block_hashes == plain.block_hashes


@pytest.mark.parametrize("hash_fn", HASH_FNS)
def test_different_salts_differ_same_salts_agree(hash_fn):
    tokens = list(range(16))
    a = make_request(tokens, 4, hash_fn, cache_salt="a").block_hashes
    b = make_request(tokens, 4, hash_fn, cache_salt="b").block_hashes
    a2 = make_request(tokens, 4, hash_fn, cache_salt="a").block_hashes
    assert a == a2
    assert all(x != y for x, y in zip(a, b, strict=True))


def test_extra_key_order_lora_mm_salt_embeds():
    embeds = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    lora = LoRARequest("ad", 1, "/loras/ad")
    req = make_request(
        list(range(8)),
        hbs=4,
        lora_request=lora,
        mm_features=[mm("img", 1, 2)],
        cache_salt="s",
        prompt_embeds=embeds,
    )
    keys, next_idx = generate_block_hash_extra_keys(req, 0, 4, 0)
    digest = hashlib.sha256(embeds[0:4].tobytes()).digest()
    assert keys == (
        ("lora", "ad", "/loras/ad"),
        ("mm", "img", 1),
        ("cache_salt", "s"),
        ("prompt_embeds", digest),
    )
    assert next_idx == 1
    keys2, _ = generate_block_hash_extra_keys(req, 4, 8, next_idx)
    assert keys2 == (
        ("lora", "ad", "/loras/ad"),
        ("prompt_embeds", hashlib.sha256(embeds[4:8].tobytes()).digest()),
    )
    assert to_event_extra_keys([keys, keys2, None]) == [
        ("ad", ("img", 1), "s", digest),
        ("ad", keys2[1][1]),
        None,
    ]
    assert need_extra_keys(req)
    assert not need_extra_keys(make_request([1, 2], cache_salt=""))


def test_lora_path_enters_the_hash():
    a = make_request(list(range(8)), lora_request=LoRARequest("ad", 1, "/p1")).block_hashes
    b = make_request(list(range(8)), lora_request=LoRARequest("ad", 1, "/p2")).block_hashes
    c = make_request(list(range(8)), lora_request=LoRARequest("ad", 2, "/p1")).block_hashes
    assert a != b
    assert a == c  # the adapter id is not hashed (vLLM 0.33.0 hashes name and path)


def test_mm_keys_offsets_and_scan_index():
    # Items: A at [2, 8), B at [8, 9), C at [13, 15).
    feats = [mm("A", 2, 6), mm("B", 8, 1), mm("C", 13, 2)]
    req = make_request(list(range(16)), hbs=4, mm_features=feats)
    got, idx = [], 0
    for start in range(0, 16, 4):
        keys, idx = generate_block_hash_extra_keys(req, start, start + 4, idx)
        got.append((keys, idx))
    assert got == [
        ((("mm", "A", 2),), 0),  # A runs past the block
        ((("mm", "A", -2),), 1),  # A started 2 tokens before this block and ends at 8
        ((("mm", "B", 0),), 2),  # B ends inside; C starts later
        ((("mm", "C", 1),), 3),  # C ends inside
    ]
    # -1 means "the last item"; an index beyond the items is refused.
    assert generate_block_hash_extra_keys(req, 12, 16, -1) == ((("mm", "C", 1),), 3)
    with pytest.raises(UsageError, match="out of range"):
        generate_block_hash_extra_keys(req, 12, 16, -4)
    # Past the last item: no keys, index unchanged (even a negative one).
    assert generate_block_hash_extra_keys(req, 16, 20, -1) == (None, -1)
    # The hasher resumes the scan for blocks added later.
    grown = make_request(list(range(9)), hbs=4, mm_features=feats)
    grown.append_output_token_ids(list(range(9, 16)))
    assert grown.block_hashes == req.block_hashes


def test_mm_identifier_none_is_refused():
    req = Request("r", list(range(8)), mm_features=[mm(None, 0, 2)])
    with pytest.raises(UsageError, match="identifier is None"):
        generate_block_hash_extra_keys(req, 0, 4, 0)


def test_same_item_at_other_offset_hashes_differently():
    a = make_request([9] * 8, mm_features=[mm("img", 0, 3)]).block_hashes
    b = make_request([9] * 8, mm_features=[mm("img", 1, 3)]).block_hashes
    c = make_request([9] * 8, mm_features=[mm("other", 0, 3)]).block_hashes
    assert len({a[0], b[0], c[0]}) == 3


def test_prompt_embeds_digest_is_memoised_and_layout_independent():
    embeds = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float16)
    req = make_request(None, hbs=4, prompt_embeds=embeds)
    assert list(req.all_token_ids) == [0] * 8  # embeds-only prompts read as zeros
    assert sorted(req._prompt_embeds_per_block_hashes) == [(0, 4), (4, 8)]
    fortran = np.asfortranarray(embeds)  # row slices are not C-contiguous
    other = make_request(None, hbs=4, prompt_embeds=fortran)
    assert other.block_hashes == req.block_hashes
    changed = embeds.copy()
    changed[5, 0] += 1
    assert make_request(None, hbs=4, prompt_embeds=changed).block_hashes[0] == req.block_hashes[0]
    assert make_request(None, hbs=4, prompt_embeds=changed).block_hashes[1] != req.block_hashes[1]
    # Decode blocks past the prompt still carry a (empty-slice) prompt_embeds key.
    req.append_output_token_ids([1, 2, 3, 4])
    keys, _ = generate_block_hash_extra_keys(req, 8, 12, 0)
    assert keys == (("prompt_embeds", hashlib.sha256(b"").digest()),)


def test_prompt_embeds_torch_matches_numpy():
    torch = pytest.importorskip("torch")
    t = torch.randn(8, 5)
    a = make_request(list(range(8)), prompt_embeds=t).block_hashes
    b = make_request(list(range(8)), prompt_embeds=t.numpy().copy()).block_hashes
    assert a == b
    bf = torch.randn(8, 5, dtype=torch.bfloat16)  # no numpy dtype: hashed via a uint8 view
    raw = bf.view(torch.uint8).numpy()
    assert (
        make_request(list(range(8)), prompt_embeds=bf).block_hashes
        == make_request(list(range(8)), prompt_embeds=raw).block_hashes
    )


def test_to_event_extra_keys():
    assert to_event_extra_keys(None) is None
    assert to_event_extra_keys([]) is None
    assert to_event_extra_keys([None, None]) == [None, None]
    keys = (("lora", "n", "/p"), ("mm", "id", 3), ("mm", "id2", -1), ("cache_salt", "s"))
    assert to_event_extra_keys(iter([keys])) == [("n", ("id", 3), ("id2", -1), "s")]


# --------------------------------------------------------------------------- hasher


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "16", None])
def test_hasher_rejects_bad_block_size(bad):
    with pytest.raises(UsageError, match="hash_block_size must be a positive int"):
        RequestBlockHasher(bad, sha256, none_hash(sha256))


def test_hasher_rejects_bad_arguments():
    with pytest.raises(UsageError, match="hash_fn must be callable"):
        RequestBlockHasher(4, "sha256", b"x" * 32)
    for bad in (None, b"", "x" * 32, bytearray(32)):
        with pytest.raises(UsageError, match="none_hash must be non-empty bytes"):
            RequestBlockHasher(4, sha256, bad)
    with pytest.raises(UsageError, match="num_hash_lookahead_tokens"):
        RequestBlockHasher(4, sha256, b"x" * 32, -1)
    assert "hash_block_size=4" in repr(RequestBlockHasher(4, sha256, b"x" * 32))


def test_hasher_uses_the_given_none_hash():
    a = RequestBlockHasher(4, sha256, b"a" * 32)
    b = RequestBlockHasher(4, sha256, b"b" * 32)
    ra = Request("a", list(range(8)), block_hasher=a)
    rb = Request("b", list(range(8)), block_hasher=b)
    assert ra.block_hashes[0] == sha256((b"a" * 32, (0, 1, 2, 3), None))
    assert all(x != y for x, y in zip(ra.block_hashes, rb.block_hashes, strict=True))


def test_fast_path_equals_general_path():
    """A request without extra keys takes a shortcut; forcing the general path (a falsy but
    present lora_request is not a LoRA) must not change the hashes."""

    class Falsy:
        def __bool__(self):
            return False

    plain = make_request(list(range(50)), hbs=3)
    general = make_request(list(range(50)), hbs=3, prompt_embeds=None, lora_request=Falsy())
    assert plain.block_hashes == general.block_hashes


def test_lookahead_hashes_wait_for_the_next_tokens():
    none = none_hash(sha256)
    hasher = get_request_block_hasher(4, sha256, none, num_hash_lookahead_tokens=2)
    req = Request("r", list(range(5)), block_hasher=hasher)
    assert req.block_hashes == []  # block 0 is full but its 2 lookahead tokens are not there
    req.append_output_token_ids(5)
    assert req.block_hashes == [sha256((none, (0, 1, 2, 3), (None, 4, 5)))]
    one = RequestBlockHasher(4, sha256, none, 1)
    r1 = Request("r", list(range(5)), block_hasher=one, cache_salt="s")
    assert r1.block_hashes == [sha256((none, (0, 1, 2, 3), ((("cache_salt", "s"),), 4)))]
    feats = [mm("A", 3, 3)]
    r2 = Request("r", list(range(12)), mm_features=feats)
    # The item reaches past the block: the index steps back so the next block sees it.
    assert generate_lookahead_block_hash_extra_keys(r2, 0, 4, 6, 0) == ((("mm", "A", 3),), 0)


def test_block_hash_list_with_block_size():
    fine = [bytes([i]) * 32 for i in range(7)]
    view = BlockHashListWithBlockSize(fine, 4, 8)
    assert len(view) == 3
    assert list(view) == [fine[1], fine[3], fine[5]] == view[:]
    assert view[0] == fine[1] and view[2] == fine[5]
    assert view[1:] == [fine[3], fine[5]]
    with pytest.raises(TypeError):
        view["0"]
    with pytest.raises(UsageError, match="not a multiple"):
        BlockHashListWithBlockSize(fine, 4, 6)
    with pytest.raises(UsageError, match="target_block_size"):
        BlockHashListWithBlockSize(fine, 4, 0)


# --------------------------------------------------------------------------- Request


def test_request_basics():
    req = make_request([1, 2, 3, 4, 5], hbs=2, session_id="sess", cache_salt="s")
    assert req.num_tokens == 5 and req.num_prompt_tokens == 5
    assert len(req.block_hashes) == 2
    req.append_output_token_ids(6)
    req.append_output_token_ids((7, 8))
    assert list(req.output_token_ids) == [6, 7, 8] and req.num_output_tokens == 3
    assert req.all_token_ids[4:] == [5, 6, 7, 8]
    assert isinstance(req.all_token_ids[4:], list)
    assert len(req.block_hashes) == 4
    assert req.session_id == "sess" and req.cache_salt == "s" and req.lora_request is None
    assert req.mm_features == []
    assert "num_block_hashes=4" in repr(req)
    # Without a hasher no hashes are computed.
    assert Request("x", [1, 2, 3]).block_hashes == []


def test_request_token_views_are_read_only():
    req = Request("x", [1, 2, 3])
    view = req.all_token_ids
    assert isinstance(view, ConstantList)
    for op in (
        lambda: view.append(1),
        lambda: view.extend([1]),
        lambda: view.pop(),
        lambda: view.clear(),
        lambda: view.__setitem__(0, 9),
        lambda: view.__delitem__(0),
    ):
        with pytest.raises(TypeError):
            op()
    assert view == [1, 2, 3] and 2 in view and view.index(3) == 2 and view.copy() == [1, 2, 3]


def test_request_validation():
    with pytest.raises(UsageError, match="Neither prompt_token_ids nor prompt_embeds"):
        Request("x", None)
    with pytest.raises(UsageError, match="different lengths"):
        Request("x", [1, 2], prompt_embeds=np.zeros((3, 2), np.float32))
    with pytest.raises(UsageError, match="prompt_is_token_ids"):
        Request("x", [1, 2], prompt_is_token_ids=[True])
    with pytest.raises(UsageError, match="block_hasher must be callable"):
        Request("x", [1], block_hasher=16)
    with pytest.raises(UsageError, match="id must be > 0"):
        LoRARequest("a", 0, "/p")
    with pytest.raises(UsageError, match="lora_path"):
        LoRARequest("a", 1)


def test_request_mixed_prompt_zeroes_embedded_positions():
    req = Request(
        "x",
        [5, 6, 7],
        prompt_embeds=np.zeros((3, 2), np.float32),
        prompt_is_token_ids=[True, False, True],
    )
    assert list(req.all_token_ids) == [5, 0, 7]
    assert req.prompt_token_ids == [5, 6, 7]


def test_lora_request_fields():
    lora = LoRARequest("name", 3, "/path")
    assert (lora.adapter_id, lora.name, lora.path) == (3, "name", "/path")


def test_import_does_not_import_torch():
    code = (
        "import sys, shmkv, shmkv.hashing, shmkv.core.request; "
        "assert 'torch' not in sys.modules, 'torch imported'; "
        "assert 'cbor2' not in sys.modules, 'cbor2 imported'"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(ROOT)
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env=env, timeout=60)
