"""Differential tests: shmkv.hashing against vLLM 0.33.0's own hashing code.

Seeded random requests (with and without cache_salt, LoRA, multimodal items and prompt
embeddings, several hash block sizes, grown by random output chunks) are built twice: as vLLM
``Request`` objects hashed by vLLM's ``get_request_block_hasher``, and as
``shmkv.core.request.Request`` objects hashed by shmkv's ``RequestBlockHasher``. Both hash
functions (sha256, sha256_cbor), with PYTHONHASHSEED unset and set, must give the same
NONE_HASH, the same block hashes after every append, the same extra keys for every block
and window, and the same event extra keys.
"""

from __future__ import annotations

import random
import string

import pytest

from shmkv import hashing as shm
from shmkv.core import request as shm_request
from shmkv.errors import UsageError

vllm_kv_cache_utils = pytest.importorskip("vllm.v1.core.kv_cache_utils")
vllm_hashing = pytest.importorskip("vllm.utils.hashing")
vllm_request = pytest.importorskip("vllm.v1.request")
vllm_mm_inputs = pytest.importorskip("vllm.multimodal.inputs")
vllm_lora_request = pytest.importorskip("vllm.lora.request")
vllm_sampling = pytest.importorskip("vllm.sampling_params")
torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")

pytestmark = pytest.mark.differential

HASH_FNS = [
    pytest.param(vllm_hashing.sha256, shm.sha256, id="sha256"),
    pytest.param(vllm_hashing.sha256_cbor, shm.sha256_cbor, id="sha256_cbor"),
]
SEEDS = [pytest.param(None, id="no-PYTHONHASHSEED"), pytest.param("12345", id="PYTHONHASHSEED")]


@pytest.fixture(autouse=True)
def _restore_vllm_none_hash():
    """init_none_hash sets module globals; leave them as other modules found them."""
    saved = {k: getattr(vllm_kv_cache_utils, k, None) for k in ("NONE_HASH", "_NONE_HASH_SEED")}
    yield
    for key, value in saved.items():
        if value is not None:
            setattr(vllm_kv_cache_utils, key, value)


def _set_seed(monkeypatch, seed: str | None) -> None:
    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)


# --------------------------------------------------------------------------- request twins

# vLLM 0.34 keeps a request's token ids as int32 (an id >= 2**31 raises OverflowError), so
# the large ids the hashing must carry are drawn below 2**31 there.
try:
    import vllm.v1.token_buffer  # noqa: F401

    BIG_TOKEN = 2**31
except ImportError:
    BIG_TOKEN = 2**40


class Twin:
    """One random request as a vLLM Request and as a shmkv Request."""

    def __init__(self, rng: random.Random, idx: int, hbs: int, vllm_hasher, shm_hasher):
        n = rng.choice([0, 1, hbs - 1, hbs, hbs + 1, rng.randrange(0, 8 * hbs + 3)])
        big = rng.random() < 0.1
        tokens = [rng.randrange(0, BIG_TOKEN if big else 50_000) for _ in range(n)]
        salt = rng.choice([None, None, "", "tenant-" + str(rng.randrange(5)), "sälz-✓"])
        lora = None
        shm_lora = None
        if rng.random() < 0.3:
            lid = rng.randrange(1, 4)
            name, path = f"adapter-{lid}", f"/loras/{lid}"
            lora = vllm_lora_request.LoRARequest(name, lid, path)
            shm_lora = shm_request.LoRARequest(name, lid, path) if rng.random() < 0.5 else lora
        vllm_mm, shm_mm = self._mm_features(rng, n)
        embeds = shm_embeds = None
        if n and rng.random() < 0.25:
            dtype = rng.choice([torch.float32, torch.float16, torch.bfloat16])
            embeds = torch.randn(n, rng.choice([1, 3, 8]), dtype=dtype, generator=None)
            shm_embeds = embeds
            if dtype != torch.bfloat16 and rng.random() < 0.5:
                shm_embeds = embeds.numpy().copy()  # same raw bytes, no torch on shmkv's side
        prompt = tokens if (embeds is None or rng.random() < 0.7) else None
        self.label = (
            f"req {idx}: n={n} hbs={hbs} salt={salt!r} lora={lora is not None} "
            f"mm={len(vllm_mm)} embeds={None if embeds is None else embeds.dtype} "
            f"prompt={'ids' if prompt is not None else 'None'}"
        )
        self.vllm = vllm_request.Request(
            request_id=str(idx),
            prompt_token_ids=None if prompt is None else list(prompt),
            sampling_params=vllm_sampling.SamplingParams(max_tokens=64),
            pooling_params=None,
            prompt_embeds=embeds,
            mm_features=vllm_mm or None,
            lora_request=lora,
            cache_salt=salt,
            block_hasher=vllm_hasher,
            session_id=f"s{idx}",
        )
        self.shm = shm_request.Request(
            str(idx),
            None if prompt is None else list(prompt),
            block_hasher=shm_hasher,
            cache_salt=salt,
            lora_request=shm_lora,
            mm_features=shm_mm or None,
            prompt_embeds=shm_embeds,
            session_id=f"s{idx}",
        )

    @staticmethod
    def _mm_features(rng: random.Random, n: int):
        """Sorted, non-overlapping placeholder ranges; identifiers sometimes repeat."""
        if n == 0 or rng.random() < 0.6:
            return [], []
        idents = [f"img-{rng.randrange(3)}" for _ in range(3)]
        vllm_feats, shm_feats = [], []
        pos = rng.randrange(0, 4)
        while pos < n + 4 and len(vllm_feats) < 6:
            length = rng.randrange(1, 12)
            ident = rng.choice(idents)
            vllm_feats.append(
                vllm_mm_inputs.MultiModalFeatureSpec(
                    data=None,
                    modality="image",
                    identifier=ident,
                    mm_position=vllm_mm_inputs.PlaceholderRange(offset=pos, length=length),
                )
            )
            shm_feats.append(
                shm_request.MultiModalFeatureSpec(
                    None, "image", ident, shm_request.PlaceholderRange(pos, length)
                )
            )
            pos += length + rng.randrange(0, 6)
        return vllm_feats, shm_feats

    def append(self, ids) -> None:
        self.vllm.append_output_token_ids(ids)
        self.shm.append_output_token_ids(ids)


def _check_extra_keys(twin: Twin, hbs: int, rng: random.Random) -> None:
    """Extra keys per block (with the mm index carried along, as the hasher and vLLM's
    cache_full_blocks do), for random windows, and as event keys."""
    num_blocks = twin.vllm.num_tokens // hbs
    for bs in {hbs, 2 * hbs}:
        vllm_idx = shm_idx = 0
        vllm_list, shm_list = [], []
        for i in range(twin.vllm.num_tokens // bs):
            v, vllm_idx = vllm_kv_cache_utils.generate_block_hash_extra_keys(
                twin.vllm, i * bs, (i + 1) * bs, vllm_idx
            )
            s, shm_idx = shm.generate_block_hash_extra_keys(twin.shm, i * bs, (i + 1) * bs, shm_idx)
            assert (s, shm_idx) == (v, vllm_idx), f"{twin.label}: block {i} at {bs}"
            vllm_list.append(v)
            shm_list.append(s)
        assert shm.to_event_extra_keys(shm_list) == vllm_kv_cache_utils.to_event_extra_keys(
            vllm_list
        ), twin.label
    n_mm = len(twin.vllm.mm_features)
    for _ in range(6):
        start = rng.randrange(0, max(1, twin.vllm.num_tokens))
        end = start + rng.randrange(1, 3 * hbs)
        mm_idx = rng.randrange(-n_mm, n_mm + 1) if n_mm else rng.choice([0, -1])
        try:
            expected = vllm_kv_cache_utils.generate_block_hash_extra_keys(
                twin.vllm, start, end, mm_idx
            )
        except AssertionError:
            with pytest.raises(UsageError):
                shm.generate_block_hash_extra_keys(twin.shm, start, end, mm_idx)
            continue
        assert shm.generate_block_hash_extra_keys(twin.shm, start, end, mm_idx) == expected, (
            f"{twin.label}: window [{start}, {end}) from mm {mm_idx}"
        )
    assert num_blocks == len(twin.shm.block_hashes)


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("vllm_fn, shm_fn", HASH_FNS)
def test_none_hash_matches(monkeypatch, vllm_fn, shm_fn, seed):
    _set_seed(monkeypatch, seed)
    vllm_kv_cache_utils.init_none_hash(vllm_fn)
    assert shm.resolve_none_hash_seed() == vllm_kv_cache_utils.resolve_none_hash_seed(vllm_fn)
    assert shm.none_hash(shm_fn) == vllm_kv_cache_utils.NONE_HASH
    assert len(shm.none_hash(shm_fn)) == 32


def test_hash_fn_by_name_matches():
    for name in ("sha256", "sha256_cbor"):
        obj = (b"\x01" * 32, (1, 2, 2**70, -5), (("lora", "a", "/p"), ("mm", "x", -3)))
        assert shm.get_hash_fn_by_name(name)(obj) == vllm_hashing.get_hash_fn_by_name(name)(obj)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("vllm_fn, shm_fn", HASH_FNS)
def test_block_hashes_and_extra_keys_match(monkeypatch, vllm_fn, shm_fn, seed):
    _set_seed(monkeypatch, seed)
    vllm_kv_cache_utils.init_none_hash(vllm_fn)
    none = shm.none_hash(shm_fn)
    rng = random.Random(f"hashing-{shm_fn.__name__}-{seed}")
    torch.manual_seed(rng.randrange(2**31))
    checked_blocks = 0
    seen: dict[str, int] = dict.fromkeys(("lora", "mm", "cache_salt", "prompt_embeds"), 0)
    for hbs in (1, 4, 16):
        vllm_hasher = vllm_kv_cache_utils.get_request_block_hasher(hbs, vllm_fn)
        shm_hasher = shm.RequestBlockHasher(hbs, shm_fn, none)
        for idx in range(150 if hbs > 1 else 60):
            twin = Twin(rng, idx, hbs, vllm_hasher, shm_hasher)
            assert twin.shm.block_hashes == twin.vllm.block_hashes, twin.label
            assert list(twin.shm.all_token_ids) == list(twin.vllm.all_token_ids), twin.label
            for _ in range(rng.randrange(0, 4)):
                chunk = [rng.randrange(50_000) for _ in range(rng.randrange(0, 2 * hbs + 2))]
                twin.append(chunk[0] if len(chunk) == 1 and rng.random() < 0.5 else chunk)
                assert twin.shm.block_hashes == twin.vllm.block_hashes, twin.label
            _check_extra_keys(twin, hbs, rng)
            checked_blocks += len(twin.shm.block_hashes)
            for i in range(len(twin.shm.block_hashes)):
                keys, _ = shm.generate_block_hash_extra_keys(twin.shm, i * hbs, (i + 1) * hbs, 0)
                for key in keys or ():
                    seen[key[0]] += 1
            # The coarse view at 2x and 4x the hash block size.
            for k in (2, 4):
                ours = shm.BlockHashListWithBlockSize(twin.shm.block_hashes, hbs, k * hbs)
                theirs = vllm_kv_cache_utils.BlockHashListWithBlockSize(
                    twin.vllm.block_hashes, hbs, k * hbs
                )
                assert len(ours) == len(theirs)
                assert list(ours) == list(theirs) == ours[:] == theirs[:]
                assert ours[1::2] == theirs[1::2]
    assert checked_blocks > 800
    assert min(seen.values()) > 50, seen  # every kind of extra key was exercised


@pytest.mark.parametrize("vllm_fn, shm_fn", HASH_FNS)
def test_lookahead_hashes_match(monkeypatch, vllm_fn, shm_fn):
    """Speculative-decoding lookahead (each hash also covers the next L tokens)."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    vllm_kv_cache_utils.init_none_hash(vllm_fn)
    none = shm.none_hash(shm_fn)
    rng = random.Random(f"lookahead-{shm_fn.__name__}")
    for lookahead in (1, 3):
        for hbs in (2, 8):
            vllm_hasher = vllm_kv_cache_utils.get_request_block_hasher(hbs, vllm_fn, lookahead)
            shm_hasher = shm.get_request_block_hasher(hbs, shm_fn, none, lookahead)
            for idx in range(25):
                twin = Twin(rng, idx, hbs, vllm_hasher, shm_hasher)
                assert twin.shm.block_hashes == twin.vllm.block_hashes, twin.label
                for _ in range(3):
                    twin.append([rng.randrange(1000) for _ in range(rng.randrange(0, hbs + 2))])
                    assert twin.shm.block_hashes == twin.vllm.block_hashes, twin.label
                mm_idx = 0  # carried from block to block, as vLLM's cache_full_blocks does
                for start in range(0, twin.vllm.num_tokens, hbs):
                    end = start + hbs
                    args = (start, end, end + lookahead)
                    expected = vllm_kv_cache_utils.generate_lookahead_block_hash_extra_keys(
                        twin.vllm, *args, mm_idx
                    )
                    got = shm.generate_lookahead_block_hash_extra_keys(twin.shm, *args, mm_idx)
                    assert got == expected, f"{twin.label}: block at {start}"
                    mm_idx = got[1]


def test_hash_block_tokens_matches(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    rng = random.Random("hash_block_tokens")
    for vllm_fn, shm_fn in ((p.values[0], p.values[1]) for p in HASH_FNS):
        vllm_kv_cache_utils.init_none_hash(vllm_fn)
        none = shm.none_hash(shm_fn)
        for _ in range(200):
            parent = rng.choice([None, b"", rng.randbytes(32)])
            tokens = [rng.randrange(-(2**70), 2**70) for _ in range(rng.randrange(0, 20))]
            extra = rng.choice(
                [
                    None,
                    (("cache_salt", "".join(rng.choices(string.printable, k=5))),),
                    (("lora", "a", "/a"), ("mm", "id", rng.randrange(-9, 9))),
                    (("prompt_embeds", rng.randbytes(32)),),
                ]
            )
            assert shm.hash_block_tokens(
                shm_fn, none, parent, tokens, extra
            ) == vllm_kv_cache_utils.hash_block_tokens(vllm_fn, parent, tokens, extra)


def test_shm_request_works_with_vllm_hasher(monkeypatch):
    """vLLM's hasher accepts shmkv's Request and vice versa (duck typing both ways)."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    vllm_kv_cache_utils.init_none_hash(vllm_hashing.sha256)
    vllm_hasher = vllm_kv_cache_utils.get_request_block_hasher(4, vllm_hashing.sha256)
    shm_hasher = shm.RequestBlockHasher(4, shm.sha256, shm.none_hash(shm.sha256))
    tokens = list(range(37))
    a = shm_request.Request("a", tokens, block_hasher=vllm_hasher, cache_salt="x")
    b = shm_request.Request("b", tokens, block_hasher=shm_hasher, cache_salt="x")
    c = vllm_request.Request(
        "c",
        tokens,
        vllm_sampling.SamplingParams(max_tokens=4),
        None,
        cache_salt="x",
        block_hasher=shm_hasher,
    )
    assert a.block_hashes == b.block_hashes == c.block_hashes
    assert len(a.block_hashes) == 9
