"""Specs and configs (shmkv.core.kv_cache_interface): page sizes, memory bounds, merges, kinds."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from shmkv.core.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpecKind,
    MambaSpec,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
    get_dtype_size,
    get_kv_cache_spec_kind,
)


def make_config(max_model_len=1024, dcp=1, in_flight=256, mamba_mode="none", enc=1500):
    return SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=max_model_len),
        parallel_config=SimpleNamespace(decode_context_parallel_size=dcp),
        max_in_flight_tokens=in_flight,
        cache_config=SimpleNamespace(mamba_cache_mode=mamba_mode),
        scheduler_config=SimpleNamespace(max_num_encoder_input_tokens=enc),
    )


def full(**kw):
    kw = {"block_size": 16, "num_kv_heads": 8, "head_size": 128, "dtype": "float16"} | kw
    return FullAttentionSpec(**kw)


def test_dtype_sizes_by_name_and_itemsize():
    """A dtype is a name (with or without ``torch.``) or anything with an int itemsize."""
    assert get_dtype_size("float16") == 2
    assert get_dtype_size("torch.bfloat16") == 2
    assert get_dtype_size(SimpleNamespace(itemsize=4)) == 4
    with pytest.raises(ValueError, match="unknown dtype"):
        get_dtype_size("float13")


def test_attention_page_size():
    """K and V: 16 tokens x 8 heads x (128 + 128) x 2 bytes; padding replaces it."""
    assert full().page_size_bytes == 16 * 8 * 256 * 2
    assert full(head_size_v=64).page_size_bytes == 16 * 8 * 192 * 2
    assert full(page_size_padded=70000).page_size_bytes == 70000
    assert full().max_memory_usage_bytes(make_config()) == 64 * 65536
    assert full().max_memory_usage_bytes(make_config(dcp=2)) == 32 * 65536


def test_mla_single_latent_and_alignment_padding():
    """MLA stores one latent per token (no V); an alignment pads the page up."""
    spec = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype="bfloat16")
    assert spec.head_size_v == 0 and spec.page_size_bytes == 16 * 576 * 2
    padded = MLAAttentionSpec(block_size=1, num_kv_heads=1, head_size=3, dtype="uint8",
                              alignment=8)
    assert padded.page_size_bytes == 8


def test_window_specs_admission_caps():
    """SWA holds W-1 + in-flight tokens plus one block; chunked-local a chunk + in-flight."""
    swa = SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=8, dtype="float16",
                            sliding_window=128)
    assert swa.max_admission_blocks_per_request(256, 1024) == -(-(127 + 256) // 16) + 1
    assert swa.max_admission_blocks_per_request(4096, 1024) == 64 + 1
    chunked = ChunkedLocalAttentionSpec(block_size=16, num_kv_heads=1, head_size=8,
                                        dtype="float16", attention_chunk_size=64)
    assert chunked.max_admission_blocks_per_request(256, 1024) == 20
    assert chunked.max_memory_usage_bytes(make_config()) == 20 * chunked.page_size_bytes


def test_mamba_page_and_modes():
    """A Mamba page is the sum of its state tensors; align mode keeps two states."""
    spec = MambaSpec(16, ((4, 8), (2,)), ("float32", "float16"), num_speculative_blocks=1)
    assert spec.page_size_bytes == 4 * 8 * 4 + 2 * 2
    assert spec.max_memory_usage_bytes(make_config()) == 2 * 132
    assert spec.max_memory_usage_bytes(make_config(mamba_mode="align")) == 3 * 132
    assert spec.max_num_blocks_per_req(make_config(mamba_mode="align"), 100) == 7 + 1


def test_merge_rules():
    """Equal layers merge; different windows are a ValueError; window + chunk asserts."""
    assert FullAttentionSpec.merge([full(), full()]) == full()
    assert FullAttentionSpec.merge([full(), full(sliding_window=8)]).sliding_window == 8
    with pytest.raises(ValueError, match="same window size"):
        FullAttentionSpec.merge([full(sliding_window=4), full(sliding_window=8)])
    with pytest.raises(AssertionError):
        FullAttentionSpec.merge([full(sliding_window=4), full(attention_chunk_size=8)])
    with pytest.raises(AssertionError):
        FullAttentionSpec.merge([full(), full(num_kv_heads=4)])


def test_kinds_and_config_properties():
    """Kinds name the most specific spec; Mamba groups need zeroing."""
    sink = SinkFullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype="float16",
                                 sink_len=16)
    cross = CrossAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype="float16")
    mamba = MambaSpec(16, ((4,),), ("float32",))
    assert get_kv_cache_spec_kind(sink) is KVCacheSpecKind.SINK_FULL_ATTENTION
    assert get_kv_cache_spec_kind(full()) is KVCacheSpecKind.FULL_ATTENTION
    assert get_kv_cache_spec_kind(cross) is KVCacheSpecKind.CROSS_ATTENTION
    assert get_kv_cache_spec_kind(mamba) is KVCacheSpecKind.MAMBA
    cfg = KVCacheConfig(10, [], [KVCacheGroupSpec(["a"], full()), KVCacheGroupSpec(["m"], mamba)])
    assert cfg.has_mamba_layers and cfg.needs_kv_cache_zeroing
    assert cfg.prefix_cacheable_group_ids == (0, 1)
    assert not KVCacheConfig(10, [], [KVCacheGroupSpec(["a"], full())]).needs_kv_cache_zeroing
    assert "needs_kv_cache_zeroing" in {f.name for f in dataclasses.fields(cfg)}
    assert str(KVCacheSpecKind.MAMBA) == "mamba"  # a StrEnum, as vLLM 0.34's


def test_mamba_state_alignment_pads_each_state():
    """Each Mamba state is padded to ``state_alignment`` bytes (60 + 14 bytes at 64: 128);
    a padded page must be a multiple of it; the default (1) changes nothing."""
    spec = MambaSpec(16, ((3, 5), (7,)), ("float32", "float16"), state_alignment=64)
    assert spec.page_size_bytes == 128
    assert MambaSpec(16, ((3, 5), (7,)), ("float32", "float16")).page_size_bytes == 74
    with pytest.raises(AssertionError, match="aligned to state_alignment"):
        MambaSpec(16, ((3, 5),), ("float32",), state_alignment=64, page_size_padded=100)
    merged = FullAttentionSpec.merge([full(), full()])
    assert merged.kv_head_major_slots is False
    heads = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype="float16",
                              kv_head_major_slots=True)
    assert FullAttentionSpec.merge([heads, heads]).kv_head_major_slots is True


def test_import_does_not_load_torch():
    """Importing shmkv and its specs never imports torch (an optional dependency)."""
    import subprocess
    import sys

    code = ("import sys, shmkv, shmkv.core.kv_cache_interface, "
            "shmkv.core.single_type_kv_cache_manager; assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
