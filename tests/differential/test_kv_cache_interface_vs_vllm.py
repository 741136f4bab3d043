"""Differential tests: shmkv's specs against vLLM 0.33.0's, field for field and byte for byte."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from shmkv.core import kv_cache_interface as shm

torch = pytest.importorskip("torch")
vllm = pytest.importorskip("vllm.v1.kv_cache_interface")

pytestmark = pytest.mark.differential

SPEC_NAMES = [
    "KVCacheSpec", "AttentionSpec", "FullAttentionSpec", "MLAAttentionSpec", "RSWASpec",
    "SlidingWindowSpec", "ChunkedLocalAttentionSpec", "MambaSpec", "EncoderOnlyAttentionSpec",
    "CrossAttentionSpec", "SinkFullAttentionSpec", "KVCacheTensor", "KVCacheGroupSpec",
    "KVCacheConfig",
]


def _comparable(value):
    if isinstance(value, dataclasses._MISSING_TYPE):
        return "MISSING"
    if hasattr(value, "value"):  # enums
        return value.value if not isinstance(value.value, str) else value.value.lower()
    return value


# Fields shmkv has as vLLM 0.34.0 does, which an older vLLM lacks; their defaults keep the
# older behaviour, so they are left out of the comparison with an older release.
NEWER_FIELDS = {"kv_head_major_slots", "state_alignment", "needs_kv_cache_zeroing"}


@pytest.mark.parametrize("name", SPEC_NAMES)
def test_same_fields_defaults_and_kw_only(name):
    """Every class has vLLM's fields, in order, with the same defaults and kw_only flags
    (and init flags: a field vLLM sets itself is not a constructor argument in shmkv)."""
    theirs = {f.name: f for f in dataclasses.fields(getattr(vllm, name))}
    ours = {f.name: f for f in dataclasses.fields(getattr(shm, name))
            if f.name in theirs or f.name not in NEWER_FIELDS}
    assert list(ours) == list(theirs)
    for field_name, f in theirs.items():
        o = ours[field_name]
        assert o.kw_only == f.kw_only, field_name
        assert o.compare == f.compare, field_name
        assert o.init == f.init, field_name
        if field_name == "mamba_type":
            assert o.default.lower() == f.default.name.lower()
            continue
        assert _comparable(o.default) == _comparable(f.default), field_name


def _pair(name, **kw):
    ours_kw = {k: (str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else v)
               for k, v in kw.items()}
    if "dtypes" in kw:
        ours_kw["dtypes"] = tuple(str(d).removeprefix("torch.") for d in kw["dtypes"])
    return getattr(shm, name)(**ours_kw), getattr(vllm, name)(**kw)


CASES = [
    ("FullAttentionSpec", {"block_size": 16, "num_kv_heads": 8, "head_size": 128,
                           "dtype": torch.float16}),
    ("FullAttentionSpec", {"block_size": 32, "num_kv_heads": 2, "head_size": 64,
                           "head_size_v": 32, "dtype": torch.float32}),
    ("FullAttentionSpec", {"block_size": 16, "num_kv_heads": 2, "head_size": 64,
                           "dtype": torch.bfloat16, "page_size_padded": 9000}),
    ("MLAAttentionSpec", {"block_size": 64, "num_kv_heads": 1, "head_size": 576,
                          "dtype": torch.bfloat16}),
    ("MLAAttentionSpec", {"block_size": 1, "num_kv_heads": 1, "head_size": 3,
                          "dtype": torch.uint8, "alignment": 8}),
    ("SlidingWindowSpec", {"block_size": 16, "num_kv_heads": 4, "head_size": 64,
                           "dtype": torch.float16, "sliding_window": 128}),
    ("SlidingWindowSpec", {"block_size": 16, "num_kv_heads": 4, "head_size": 64,
                           "dtype": torch.float16, "sliding_window": 4096,
                           "extra_retained_tokens": 3}),
    ("ChunkedLocalAttentionSpec", {"block_size": 16, "num_kv_heads": 4, "head_size": 64,
                                   "dtype": torch.float16, "attention_chunk_size": 64}),
    ("RSWASpec", {"block_size": 16, "num_kv_heads": 4, "head_size": 64, "dtype": torch.float16,
                  "rswa_window": 256}),
    ("CrossAttentionSpec", {"block_size": 16, "num_kv_heads": 4, "head_size": 64,
                            "dtype": torch.float16}),
    ("SinkFullAttentionSpec", {"block_size": 16, "num_kv_heads": 4, "head_size": 64,
                               "dtype": torch.float16, "sink_len": 32}),
    *([("FullAttentionSpec", {"block_size": 16, "num_kv_heads": 2, "head_size": 64,
                              "dtype": torch.float16, "num_head_slots": 4,
                              "kv_head_major_slots": True})]
      if "kv_head_major_slots" in vllm.AttentionSpec.__dataclass_fields__ else []),
    *([("MambaSpec", {"block_size": 16, "shapes": ((3, 5), (7,)),
                      "dtypes": (torch.float32, torch.float16), "state_alignment": 64})]
      if "state_alignment" in vllm.MambaSpec.__dataclass_fields__ else []),
    ("MambaSpec", {"block_size": 16, "shapes": ((4, 8), (2, 3)),
                   "dtypes": (torch.float32, torch.float16), "num_speculative_blocks": 2}),
    ("MambaSpec", {"block_size": 16, "shapes": ((4, 8),), "dtypes": (torch.float32,),
                   "page_size_padded": 1000, "num_prefill_checkpoint_blocks": 1}),
]


@pytest.mark.parametrize("mode", ["none", "align"])
@pytest.mark.parametrize(("name", "kw"), CASES, ids=[f"{n}-{i}" for i, (n, _) in
                                                     enumerate(CASES)])
def test_same_sizes(name, kw, mode):
    """page_size_bytes, max_memory_usage_bytes and max_num_blocks_per_req agree."""
    ours, theirs = _pair(name, **kw)
    assert ours.page_size_bytes == theirs.page_size_bytes
    for dcp, max_len, in_flight in ((1, 1000, 256), (1, 64, 8192), (2, 4097, 512)):
        if dcp > 1 and name == "SlidingWindowSpec":
            continue
        cfg = SimpleNamespace(
            model_config=SimpleNamespace(max_model_len=max_len),
            parallel_config=SimpleNamespace(decode_context_parallel_size=dcp),
            max_in_flight_tokens=in_flight,
            cache_config=SimpleNamespace(mamba_cache_mode=mode),
            scheduler_config=SimpleNamespace(max_num_encoder_input_tokens=1500),
        )
        assert ours.max_memory_usage_bytes(cfg) == theirs.max_memory_usage_bytes(cfg)
        assert ours.max_num_blocks_per_req(cfg, max_len) == theirs.max_num_blocks_per_req(
            cfg, max_len)
    assert shm.get_kv_cache_spec_kind(ours).value == vllm.get_kv_cache_spec_kind(theirs).value
    assert (shm.get_kv_cache_spec_sliding_window(ours)
            == vllm.get_kv_cache_spec_sliding_window(theirs))


MERGEABLE = [(n, kw) for n, kw in CASES if n != "MambaSpec"]


@pytest.mark.parametrize(("name", "kw"), MERGEABLE, ids=[n for n, _ in MERGEABLE])
def test_same_merge(name, kw):
    """Merging two equal layers gives the same spec in both libraries."""
    a, b = _pair(name, **kw)
    merged_ours = type(a).merge([a, a])
    merged_theirs = type(b).merge([b, b])
    for f in dataclasses.fields(merged_theirs):
        if f.name == "dtype":
            continue
        assert _comparable(getattr(merged_ours, f.name)) == _comparable(
            getattr(merged_theirs, f.name)), f.name


@pytest.mark.skipif("kv_head_major_slots" not in vllm.AttentionSpec.__dataclass_fields__,
                    reason="vLLM 0.34's spec fields")
def test_newer_spec_fields_match_vllm():
    """vLLM 0.34's spec changes: a Mamba state is padded to ``state_alignment`` (the page
    grows), a padded page must be a multiple of it, a HiSparse hot block's stride is a whole
    number of pages, and
    ``needs_kv_cache_zeroing`` is a field set at construction."""
    ours, theirs = _pair("MambaSpec", block_size=16, shapes=((3, 5),), dtypes=(torch.float32,),
                         state_alignment=64)
    assert ours.page_size_bytes == theirs.page_size_bytes == 64
    for lib in (shm, vllm):
        with pytest.raises(AssertionError, match="aligned to state_alignment"):
            lib.MambaSpec(block_size=16, shapes=((3, 5),), dtypes=(
                torch.float32 if lib is vllm else "float32",), state_alignment=64,
                page_size_padded=100)
    hot = {"block_size": 16, "page_size": 96, "blocks_per_request": 4,
           "block_stride_alignment": 256}
    assert (shm.HiSparseHotSpec(**hot).get_block_stride_alignment()
            == vllm.HiSparseHotSpec(**hot).get_block_stride_alignment() == 768)
    for lib, spec in ((shm, ours), (vllm, theirs)):
        group = lib.KVCacheGroupSpec(["m"], spec)
        config = lib.KVCacheConfig(10, [], [group])
        assert config.needs_kv_cache_zeroing is True
        assert "needs_kv_cache_zeroing" in {f.name for f in dataclasses.fields(config)}
