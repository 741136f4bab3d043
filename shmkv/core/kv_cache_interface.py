"""KV-cache specs and configs with vLLM 0.33.0's names, fields and defaults
(``vllm/v1/kv_cache_interface.py``), for the single-type managers and coordinators.

Each spec is a frozen dataclass describing the cache of one layer; ``block_size`` is in tokens.
A KV-cache group (``KVCacheGroupSpec``) is a set of layers with one spec and one block table;
``KVCacheConfig`` lists the groups that share the one block pool.

NOTE: vLLM types ``dtype`` as ``torch.dtype``. shmkv does not import torch (it is optional), so
a dtype here may be a ``torch.dtype``, a numpy dtype, or a name such as ``"float16"`` /
``"torch.bfloat16"``; only its size in bytes is ever used (:func:`get_dtype_size`). Equal
specs must use the same form, as equality compares the field as given.

Methods that take vLLM's ``vllm_config`` read it duck-typed, by the attribute paths vLLM uses
(``model_config.max_model_len``, ``parallel_config.decode_context_parallel_size``,
``max_in_flight_tokens``, ``cache_config.mamba_cache_mode``,
``scheduler_config.max_num_encoder_input_tokens``), so a vLLM ``VllmConfig`` or any stand-in
works.

Left out (0.33.0 has them; nothing in shmkv uses them yet): ``SlidingWindowMLASpec``,
``HiddenStateCacheSpec``, ``UniformTypeKVCacheSpecs``, the tensor-view helpers, and
``MultipleOf`` block-stride alignment (an int alignment is kept).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields, replace
from enum import IntEnum, StrEnum
from fractions import Fraction
from math import lcm, prod
from typing import Any, TypeVar

__all__ = [
    "AttentionSpec",
    "ChunkedLocalAttentionSpec",
    "CircularBufferSpec",
    "CrossAttentionSpec",
    "EncoderOnlyAttentionSpec",
    "FullAttentionSpec",
    "HiSparseHotSpec",
    "HiSparseResidentSpec",
    "KVCacheConfig",
    "KVCacheGroupRole",
    "KVCacheGroupSpec",
    "KVCacheSpec",
    "KVCacheSpecKind",
    "KVCacheTensor",
    "KVQuantMode",
    "MLAAttentionSpec",
    "MambaSpec",
    "RSWASpec",
    "SinkFullAttentionSpec",
    "SlidingWindowSpec",
    "cdiv",
    "get_dtype_size",
    "get_kv_cache_spec_kind",
    "get_kv_cache_spec_sliding_window",
    "get_mamba_prefill_checkpoint_position",
    "is_mamba_prefill_checkpoint_valid",
]

_SpecT = TypeVar("_SpecT", bound="KVCacheSpec")


def cdiv(a: int, b: int) -> int:
    """Ceiling division of ints (vLLM's ``cdiv``)."""
    return -(a // -b)


# Byte sizes of the dtype names torch, numpy and vLLM's cache configs use.
_DTYPE_SIZES = {
    "float16": 2, "half": 2, "bfloat16": 2, "float32": 4, "float": 4, "float64": 8,
    "double": 8, "int8": 1, "uint8": 1, "int16": 2, "short": 2, "int32": 4, "int": 4,
    "int64": 8, "long": 8, "bool": 1, "float8_e4m3fn": 1, "float8_e4m3fnuz": 1,
    "float8_e5m2": 1, "float8_e5m2fnuz": 1, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1,
}


def get_dtype_size(dtype: Any) -> int:
    """Bytes per element of ``dtype``: a torch or numpy dtype (its ``itemsize``) or a name.

    Raises:
        ValueError: a name that is not a known dtype.
    """
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        try:
            return _DTYPE_SIZES[name]
        except KeyError:
            raise ValueError(f"unknown dtype name {dtype!r}") from None
    itemsize = getattr(dtype, "itemsize", None)
    if isinstance(itemsize, int):
        return itemsize
    return get_dtype_size(str(dtype))


class KVQuantMode(IntEnum):
    """KV-cache quantization mode (vLLM's values). Carried on attention specs; the page
    size does not depend on it."""

    NONE = 0
    FP8_PER_TENSOR = 1
    INT8_PER_TOKEN_HEAD = 2
    FP8_PER_TOKEN_HEAD = 3
    INT4_PER_TOKEN_HEAD = 4
    NVFP4 = 5
    TURBOQUANT_K8V4 = 6
    TURBOQUANT_4BIT_NC = 7
    TURBOQUANT_K3V4_NC = 8
    TURBOQUANT_3BIT_NC = 9
    NVFP4_DS_MLA = 10
    ULTRAQUANT_4BIT = 11
    OCTAVE_K3V4 = 12
    OCTAVE_K3V3 = 13
    OCTAVE_K3V3_COMPACT = 14


class KVCacheSpecKind(StrEnum):
    """The kind of a spec, as published in KV-event metadata."""

    FULL_ATTENTION = "full_attention"
    MLA_ATTENTION = "mla_attention"
    SLIDING_WINDOW = "sliding_window"
    SLIDING_WINDOW_MLA = "sliding_window_mla"
    MAMBA = "mamba"
    CHUNKED_LOCAL_ATTENTION = "chunked_local_attention"
    SINK_FULL_ATTENTION = "sink_full_attention"
    ENCODER_ONLY_ATTENTION = "encoder_only_attention"
    CROSS_ATTENTION = "cross_attention"
    UNKNOWN = "unknown"


# --------------------------------------------------------------------------- specs


@dataclass(frozen=True)
class KVCacheSpec:
    """The KV-cache format of one layer (abstract: subclasses give the page size)."""

    block_size: int
    dcp_sharded: bool = field(default=False, kw_only=True)
    block_stride_alignment: int | None = field(default=None, kw_only=True)
    # Draft-model layers compare equal to target ones, so grouping ignores the flag.
    is_draft: bool = field(default=False, kw_only=True, compare=False)

    def __post_init__(self) -> None:
        alignment = self.block_stride_alignment
        if isinstance(alignment, int) and alignment <= 0:
            raise ValueError("block_stride_alignment must be positive")

    def get_block_stride_alignment(self) -> int:
        """Bytes the stride between physical blocks must be a multiple of (1: any)."""
        return self.block_stride_alignment or 1

    @property
    def prefix_cacheable(self) -> bool:
        """Whether the group takes part in prefix caching."""
        return True

    @property
    def prefix_replay_tokens(self) -> int:
        return 0

    @property
    def num_heads(self) -> int:
        raise NotImplementedError

    @property
    def tokens_per_state(self) -> int | Fraction:
        raise NotImplementedError

    @property
    def state_content_size_bytes(self) -> int:
        raise NotImplementedError

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block (``block_size`` tokens) of this layer."""
        raise NotImplementedError

    @property
    def num_states(self) -> int:
        return self.get_num_kernel_states(self.block_size)

    def get_num_kernel_states(self, kernel_block_size: int) -> int:
        if self.tokens_per_state > 0:
            return int(kernel_block_size // self.tokens_per_state)
        return 1

    @property
    def block_table_token_alignment(self) -> int | None:
        return 128

    def max_memory_usage_bytes(self, vllm_config: Any) -> int:
        """The most memory one request can hold in this layer, in bytes."""
        raise NotImplementedError

    def max_num_blocks_per_req(self, vllm_config: Any, max_len: int) -> int:
        """Block-table row length this group needs for sequences of ``max_len`` tokens."""
        return cdiv(max_len, self.block_size)

    def copy_with_new_block_size(self: _SpecT, block_size: int) -> _SpecT:
        """This spec with another ``block_size``."""
        return replace(self, block_size=block_size)

    @classmethod
    def merge(cls: type[_SpecT], specs: list[_SpecT]) -> _SpecT:
        """One spec for a group of layers; they must all be equal.

        Raises:
            AssertionError: two layers differ (vLLM raises the same).
        """
        if any(spec != specs[0] for spec in specs[1:]):
            raise AssertionError("All layers in the same KV cache group must be the same.")
        return copy.deepcopy(specs[0])

    @property
    def has_layer_views(self) -> bool:
        return True

    @property
    def uses_slot_mapping(self) -> bool:
        return True


@dataclass(frozen=True, kw_only=True)
class HiSparseHotSpec(KVCacheSpec):
    """HiSparse's hot region: ``blocks_per_request`` blocks a request holds while it reads
    host-backed history (``shmkv/core/hisparse.py``). Never prefix-cached."""

    page_size: int
    blocks_per_request: int

    @property
    def prefix_cacheable(self) -> bool:
        return False

    @property
    def page_size_bytes(self) -> int:
        return self.page_size

    def get_block_stride_alignment(self) -> int:
        """A hot block's stride is a whole number of its pages, and of the alignment asked
        for."""
        return lcm(self.page_size, super().get_block_stride_alignment())

    @property
    def block_table_token_alignment(self) -> int | None:
        return None

    def max_memory_usage_bytes(self, vllm_config: Any) -> int:
        return self.blocks_per_request * self.page_size

    def max_num_blocks_per_req(self, vllm_config: Any, max_len: int) -> int:
        return self.blocks_per_request

    @property
    def has_layer_views(self) -> bool:
        return False

    @property
    def uses_slot_mapping(self) -> bool:
        return False


@dataclass(frozen=True, kw_only=True)
class HiSparseResidentSpec(KVCacheSpec):
    """GPU copies of host-backed HiSparse pages, which the pool may take back once the host
    copy is durable (``shmkv/core/hisparse.py``). Never prefix-cached."""

    page_size: int

    @property
    def prefix_cacheable(self) -> bool:
        return False

    @property
    def page_size_bytes(self) -> int:
        return self.page_size

    def max_admission_blocks_per_request(self, max_in_flight_tokens: int,
                                         max_model_len: int) -> int:
        """Admission reserves only the in-flight window: older pages move to the host."""
        return cdiv(min(max_in_flight_tokens, max_model_len), self.block_size)

    def max_memory_usage_bytes(self, vllm_config: Any) -> int:
        return self.max_admission_blocks_per_request(
            max_in_flight_tokens=vllm_config.max_in_flight_tokens,
            max_model_len=vllm_config.model_config.max_model_len,
        ) * self.page_size

    @property
    def has_layer_views(self) -> bool:
        return False


@dataclass(frozen=True, kw_only=True)
class AttentionSpec(KVCacheSpec):
    """An attention layer: K and V per token and head.

    ``page_size_bytes`` = heads x states x (head_size + head_size_v) x dtype bytes, or
    ``page_size_padded`` when set (which must not be smaller).
    """

    dcp_sharded: bool = True
    max_tp_shards: int | None = None
    num_kv_heads: int
    head_size: int
    dtype: Any
    head_size_v: int = None  # type: ignore[assignment]  # defaults to head_size
    kv_quant_mode: KVQuantMode = KVQuantMode.NONE
    page_size_padded: int | None = None
    num_head_slots: int | None = None
    state_content_bytes: int | None = None
    # The page's head slots are grouped by KV head (each head one contiguous run of bytes).
    kv_head_major_slots: bool = False
    tokens_per_state: int | Fraction = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.head_size_v is None:
            object.__setattr__(self, "head_size_v", self.head_size)

    @property
    def num_heads(self) -> int:  # type: ignore[override]
        return self.num_kv_heads if self.num_head_slots is None else self.num_head_slots

    @property
    def state_content_size_bytes(self) -> int:
        if self.state_content_bytes is not None:
            return self.state_content_bytes
        return (self.head_size + self.head_size_v) * get_dtype_size(self.dtype)

    @property
    def unpadded_page_size_bytes(self) -> int:
        return self.num_heads * self.num_states * self.state_content_size_bytes

    @property
    def real_page_size_bytes(self) -> int:
        return self.unpadded_page_size_bytes

    @property
    def page_size_bytes(self) -> int:
        unpadded = self.unpadded_page_size_bytes
        if self.page_size_padded is None:
            return unpadded
        assert self.page_size_padded >= unpadded
        return self.page_size_padded

    def max_num_blocks_per_req(self, vllm_config: Any, max_len: int) -> int:
        shards = (
            vllm_config.parallel_config.decode_context_parallel_size if self.dcp_sharded else 1
        )
        return cdiv(max_len, self.block_size * shards)


def _attention_fields_agree(specs: list, merged: AttentionSpec) -> None:
    for spec in specs:
        for f in fields(AttentionSpec):
            if f.compare:
                assert getattr(spec, f.name) == getattr(merged, f.name), (
                    "All attention layers in the same KV cache group must have the same "
                    "attention spec."
                )


def _one_window(sizes: set[int]) -> int | None:
    if len(sizes) > 1:
        raise ValueError(
            "All attention layers in the same KV cache group must have the same window size."
        )
    return next(iter(sizes), None)


def _base_attention_kwargs(spec: AttentionSpec) -> dict[str, Any]:
    return {
        "block_size": spec.block_size,
        "block_stride_alignment": spec.block_stride_alignment,
        "num_kv_heads": spec.num_kv_heads,
        "head_size": spec.head_size,
        "dtype": spec.dtype,
        "kv_quant_mode": spec.kv_quant_mode,
        "dcp_sharded": spec.dcp_sharded,
        "max_tp_shards": spec.max_tp_shards,
        "page_size_padded": spec.page_size_padded,
        "num_head_slots": spec.num_head_slots,
        "state_content_bytes": spec.state_content_bytes,
        "kv_head_major_slots": spec.kv_head_major_slots,
    }


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """Full attention: every token's KV is kept for the request's life.

    With the hybrid allocator off, sliding-window and chunked-local layers are managed as
    full attention and record their window here (``sliding_window`` /
    ``attention_chunk_size``).
    """

    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    non_causal: bool = False

    def max_memory_usage_bytes(self, vllm_config: Any) -> int:
        max_model_len = vllm_config.model_config.max_model_len
        dcp = vllm_config.parallel_config.decode_context_parallel_size
        if self.dcp_sharded and dcp > 1:
            max_model_len = cdiv(max_model_len, dcp)
        return cdiv(max_model_len, self.block_size) * self.page_size_bytes

    @classmethod
    def merge_window_sizes(cls, window_sizes: set[int]) -> int | None:
        """The one window of a group, None if no layer has one.

        Raises:
            ValueError: layers with different windows.
        """
        return _one_window(set(window_sizes))

    @classmethod
    def merge(cls, specs: list) -> Any:
        """One spec for the group: the shared attention fields, the union of the windows,
        non-causal if any layer is.

        Raises:
            ValueError: different window sizes. AssertionError: different attention fields,
                an MLA spec, or both a sliding window and a chunk size.
        """
        assert all(isinstance(s, FullAttentionSpec) for s in specs), (
            "All attention layers in the same KV cache group must be FullAttentionSpec."
        )
        assert not any(isinstance(s, MLAAttentionSpec) for s in specs), (
            "MLAAttentionSpec should be merged in MLAAttentionSpec.merge"
        )
        first = specs[0]
        merged = cls(
            **_base_attention_kwargs(first),
            head_size_v=first.head_size_v,
            tokens_per_state=first.tokens_per_state,
            sliding_window=_one_window({s.sliding_window for s in specs} - {None}),
            attention_chunk_size=_one_window({s.attention_chunk_size for s in specs} - {None}),
            non_causal=any(s.non_causal for s in specs),
        )
        _attention_fields_agree(specs, merged)
        assert merged.sliding_window is None or merged.attention_chunk_size is None, (
            "Model with both sliding window layers and chunked local attention layers is "
            "not supported."
        )
        return merged


@dataclass(frozen=True, kw_only=True)
class MLAAttentionSpec(FullAttentionSpec):
    """Multi-head latent attention: one latent vector per token, no separate V
    (``head_size_v`` is 0). ``alignment``, when set, pads the page up to a multiple of it."""

    cache_dtype_str: str | None = None
    topk_buffer_width: int | None = None
    alignment: int | None = None
    model_version: str | None = None
    cache_role: str = "sparse"
    is_index_group_leader: bool = False
    non_causal_multi_token_decode: bool = False
    head_size_v: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.alignment is not None:
            real = self.real_page_size_bytes
            padded = cdiv(real, self.alignment) * self.alignment
            if padded != real:
                object.__setattr__(self, "page_size_padded", padded)

    @classmethod
    def merge(cls, specs: list) -> Any:
        """One spec for an MLA group; the MLA-only fields must agree.

        Raises:
            AssertionError: layers that differ.
        """
        assert all(isinstance(s, MLAAttentionSpec) for s in specs), (
            "All attention layers in the same KV cache group must be MLAAttentionSpec."
        )
        shared = ("cache_dtype_str", "topk_buffer_width", "tokens_per_state", "model_version",
                  "cache_role", "is_index_group_leader", "block_stride_alignment")
        for name in shared:
            assert len({getattr(s, name) for s in specs}) == 1, (
                "All attention layers in the same KV cache group must use the same "
                f"{name}."
            )
        first = specs[0]
        kwargs = _base_attention_kwargs(first)
        merged = cls(
            **kwargs,
            cache_dtype_str=first.cache_dtype_str,
            topk_buffer_width=first.topk_buffer_width,
            tokens_per_state=first.tokens_per_state,
            model_version=first.model_version,
            cache_role=first.cache_role,
            is_index_group_leader=first.is_index_group_leader,
            non_causal_multi_token_decode=any(s.non_causal_multi_token_decode for s in specs),
        )
        _attention_fields_agree(specs, merged)
        return merged


@dataclass(frozen=True, kw_only=True)
class RSWASpec(FullAttentionSpec):
    """Reference sliding window attention: the prompt stays visible; of the generated
    tokens only the last ``rswa_window`` are kept."""

    rswa_window: int

    @classmethod
    def merge(cls, specs: list) -> Any:
        assert all(isinstance(s, RSWASpec) for s in specs), (
            "All attention layers in the same KV cache group must be RSWASpec."
        )
        windows = {s.rswa_window for s in specs}
        assert len(windows) == 1, f"All R-SWA layers must share the same rswa_window, got {windows}"
        base = FullAttentionSpec.merge(specs)
        kwargs = {f.name: getattr(base, f.name) for f in fields(FullAttentionSpec) if f.init}
        return cls(**kwargs, rswa_window=windows.pop())


@dataclass(frozen=True, kw_only=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    """Chunked local attention: a token attends only to its own ``attention_chunk_size``
    chunk."""

    attention_chunk_size: int

    def max_admission_blocks_per_request(
        self, max_in_flight_tokens: int, max_model_len: int
    ) -> int:
        """Blocks one request can hold at most: a chunk plus the tokens in flight."""
        num_tokens = min(self.attention_chunk_size + max_in_flight_tokens, max_model_len)
        return cdiv(num_tokens, self.block_size)

    def max_memory_usage_bytes(self, vllm_config: Any) -> int:
        return self.max_admission_blocks_per_request(
            vllm_config.max_in_flight_tokens, vllm_config.model_config.max_model_len
        ) * self.page_size_bytes


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    """Sliding window attention over the last ``sliding_window`` tokens;
    ``extra_retained_tokens`` more are kept (not attended) for multi-token spec decoding."""

    sliding_window: int
    extra_retained_tokens: int = 0

    @property
    def num_retained_tokens(self) -> int:
        """Tokens below a request's first scheduled position that must stay readable."""
        return self.sliding_window - 1 + self.extra_retained_tokens

    def max_admission_blocks_per_request(
        self, max_in_flight_tokens: int, max_model_len: int
    ) -> int:
        """Blocks one request can hold at most: the window, the extra retained tokens and
        the tokens in flight, plus one because the window may start inside a block."""
        num_tokens = min(self.num_retained_tokens + max_in_flight_tokens, max_model_len)
        return cdiv(num_tokens, self.block_size) + 1

    def max_memory_usage_bytes(self, vllm_config: Any) -> int:
        assert (
            not self.dcp_sharded
            or vllm_config.parallel_config.decode_context_parallel_size == 1
        ), "DCP not support sliding window."
        return self.max_admission_blocks_per_request(
            vllm_config.max_in_flight_tokens, vllm_config.model_config.max_model_len
        ) * self.page_size_bytes


@dataclass(frozen=True)
class MambaSpec(KVCacheSpec):
    """A Mamba (state-space) layer: one state per block, of ``shapes`` x ``dtypes``.

    ``mamba_cache_mode``: ``"none"`` keeps only the running state, ``"all"`` a state per
    block, ``"align"`` the states at block boundaries for prefix caching.
    """

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[Any, ...]
    state_alignment: int = 1  # bytes: each state starts at a multiple of it in the page
    page_size_padded: int | None = None
    mamba_type: str = "MAMBA2"
    mamba_cache_mode: str = "none"
    num_speculative_blocks: int = 0
    num_prefill_checkpoint_blocks: int = 0
    prefill_checkpoint_alignment: int | None = None
    num_heads: int = 1  # type: ignore[assignment]
    tokens_per_state: int = -1  # type: ignore[assignment]
    tp_replicated: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.page_size_padded is not None:
            assert self.page_size_padded % self.state_alignment == 0, (
                "page_size_padded must be aligned to state_alignment"
            )

    @property
    def state_content_size_bytes(self) -> int:
        align = self.state_alignment
        return sum(cdiv(prod(shape) * get_dtype_size(dtype), align) * align
                   for shape, dtype in zip(self.shapes, self.dtypes, strict=False))

    @property
    def real_page_size_bytes(self) -> int:
        return self.state_content_size_bytes

    @property
    def page_size_bytes(self) -> int:
        size = self.state_content_size_bytes
        if self.page_size_padded is None:
            return size
        assert self.page_size_padded >= size
        return self.page_size_padded

    @property
    def block_table_token_alignment(self) -> int | None:
        return None

    def max_memory_usage_bytes(self, vllm_config: Any) -> int:
        if vllm_config.cache_config.mamba_cache_mode == "align":
            num_pages = 2 + self.num_speculative_blocks + self.num_prefill_checkpoint_blocks
        else:
            num_pages = 1 + self.num_speculative_blocks
        return num_pages * self.page_size_bytes

    def max_num_blocks_per_req(self, vllm_config: Any, max_len: int) -> int:
        if vllm_config.cache_config.mamba_cache_mode == "align":
            # Rows are indexed by position over the whole sequence; old states are nulled.
            return cdiv(max_len, self.block_size) + self.num_speculative_blocks
        return cdiv(self.max_memory_usage_bytes(vllm_config), self.page_size_bytes)


def get_mamba_prefill_checkpoint_position(
    num_tokens: int, hash_block_size: int, drop_eagle_block: bool,
    num_hash_lookahead_tokens: int = 0,
) -> int:
    """The last hash boundary of a prefill whose Mamba state can be reused: at least one
    token (or the hash lookahead) is left to recompute, one hash unit fewer with EAGLE."""
    limit = num_tokens if drop_eagle_block else num_tokens - max(1, num_hash_lookahead_tokens)
    position = limit // hash_block_size * hash_block_size
    if drop_eagle_block:
        position -= hash_block_size
    return max(position, 0)


def is_mamba_prefill_checkpoint_valid(
    query_start: int, query_end: int, checkpoint_position: int, hash_block_size: int,
    mamba_block_size: int, checkpoint_alignment: int | None,
) -> bool:
    """Whether a prefill chunk ``[query_start, query_end)`` can export the Mamba state at
    ``checkpoint_position``, strictly inside it, into a block of its own: the chunk starts
    on a hash boundary, covers at least one hash unit before the checkpoint, reaches past
    the block of its initial state, and the checkpoint lies a multiple of the backend's
    ``checkpoint_alignment`` after the start (None: the backend exports none)."""
    if checkpoint_alignment is None:
        return False
    assert checkpoint_alignment > 0
    initial_state_block = (query_start - 1) // mamba_block_size
    checkpoint_block = cdiv(query_end, mamba_block_size) - 2
    return (
        query_start % hash_block_size == 0
        and checkpoint_block > initial_state_block
        and query_start + hash_block_size <= checkpoint_position
        and query_start < checkpoint_position < query_end
        and (checkpoint_position - query_start) % checkpoint_alignment == 0
    )


@dataclass(frozen=True)
class EncoderOnlyAttentionSpec(AttentionSpec):
    """Encoder-only attention: no KV cache is kept."""

    def max_memory_usage_bytes(self, vllm_config: Any) -> int:
        return 0


@dataclass(frozen=True)
class CrossAttentionSpec(AttentionSpec):
    """Cross attention of an encoder-decoder model: the encoder's KV, allocated once per
    request and never shared."""

    def max_memory_usage_bytes(self, vllm_config: Any) -> int:
        max_encoder_len = vllm_config.scheduler_config.max_num_encoder_input_tokens
        return cdiv(max_encoder_len, self.block_size) * self.page_size_bytes


@dataclass(frozen=True, kw_only=True)
class CircularBufferSpec(AttentionSpec):
    """One block per request, for the request's whole lifetime: a ring of ``block_size``
    rows holding the raw keys of the token group still being compressed (vLLM 0.33.0's).
    Never prefix cached; no slot mapping (the ring is indexed by position modulo its size).
    """

    @property
    def block_table_token_alignment(self) -> int | None:
        return None

    def max_memory_usage_bytes(self, vllm_config: Any) -> int:
        return self.page_size_bytes

    def max_num_blocks_per_req(self, vllm_config: Any, max_len: int) -> int:
        return 1

    def is_uniform_with_collection(self, kv_cache_specs: dict[str, KVCacheSpec]) -> bool:
        return all(isinstance(spec, CircularBufferSpec) for spec in kv_cache_specs.values())

    @property
    def prefix_cacheable(self) -> bool:
        return False

    @property
    def uses_slot_mapping(self) -> bool:
        return False


@dataclass(frozen=True)
class SinkFullAttentionSpec(FullAttentionSpec):
    """Full attention with ``sink_len`` attention-sink tokens (a positive multiple of the
    block size)."""

    sink_len: int | None = None

    @classmethod
    def merge(cls, specs: list) -> Any:
        assert all(isinstance(s, FullAttentionSpec) for s in specs), (
            "All attention layers in the same KV cache group must be FullAttentionSpec."
        )
        assert not any(isinstance(s, MLAAttentionSpec) for s in specs), (
            "MLAAttentionSpec should be merged in MLAAttentionSpec.merge"
        )
        first = specs[0]
        # As vLLM: tokens_per_state is not carried over (it keeps its default).
        merged = cls(
            **_base_attention_kwargs(first),
            head_size_v=first.head_size_v,
            sink_len=first.sink_len,
            sliding_window=_one_window({s.sliding_window for s in specs} - {None}),
            attention_chunk_size=_one_window({s.attention_chunk_size for s in specs} - {None}),
            non_causal=any(s.non_causal for s in specs),
        )
        _attention_fields_agree(specs, merged)
        assert merged.sliding_window is None or merged.attention_chunk_size is None, (
            "Model with both sliding window layers and chunked local attention layers is "
            "not supported."
        )
        return merged


def get_kv_cache_spec_kind(kv_cache_spec: KVCacheSpec) -> KVCacheSpecKind:
    """The event-metadata kind of a spec; subclasses are tested before their bases."""
    for spec_type, kind in (
        (MLAAttentionSpec, KVCacheSpecKind.MLA_ATTENTION),
        (SinkFullAttentionSpec, KVCacheSpecKind.SINK_FULL_ATTENTION),
        (FullAttentionSpec, KVCacheSpecKind.FULL_ATTENTION),
        (ChunkedLocalAttentionSpec, KVCacheSpecKind.CHUNKED_LOCAL_ATTENTION),
        (SlidingWindowSpec, KVCacheSpecKind.SLIDING_WINDOW),
        (MambaSpec, KVCacheSpecKind.MAMBA),
        (EncoderOnlyAttentionSpec, KVCacheSpecKind.ENCODER_ONLY_ATTENTION),
        (CrossAttentionSpec, KVCacheSpecKind.CROSS_ATTENTION),
    ):
        if isinstance(kv_cache_spec, spec_type):
            return kind
    return KVCacheSpecKind.UNKNOWN


def get_kv_cache_spec_sliding_window(kv_cache_spec: KVCacheSpec) -> int | None:
    """The window of a sliding-window spec, else None."""
    if isinstance(kv_cache_spec, SlidingWindowSpec):
        return kv_cache_spec.sliding_window
    return None


# --------------------------------------------------------------------------- configs


@dataclass
class KVCacheTensor:
    """Where a set of same-shaped layers lives in one backing allocation: layer ``l``'s page
    of block ``b`` starts at ``offset + l * layer_stride + b * block_stride`` bytes into an
    allocation of ``size`` bytes."""

    size: int
    layers: list[str]
    layer_stride: int
    block_stride: int
    offset: int = 0
    host_resident: bool = False


class KVCacheGroupRole(StrEnum):
    DEFAULT = "default"
    HISPARSE_SOURCE = "hisparse_source"
    HISPARSE_INDEXER = "hisparse_indexer"


@dataclass
class KVCacheGroupSpec:
    """Layers that share one spec and one block table (one manager)."""

    layer_names: list[str]
    kv_cache_spec: KVCacheSpec
    is_eagle_group: bool = False
    host_resident: bool = False
    enable_kv_transfer: bool = True
    role: KVCacheGroupRole = KVCacheGroupRole.DEFAULT


@dataclass
class KVCacheConfig:
    """The KV-cache configuration of a model: the pool size, the tensors and the groups
    (one group per distinct spec; all groups share the one block pool)."""

    num_blocks: int
    kv_cache_tensors: list[KVCacheTensor]
    kv_cache_groups: list[KVCacheGroupSpec]
    prefix_cache_retention_interval: int | None = None
    kv_cache_layout: str | None = None
    hash_block_size: int | None = None
    cache_hit_alignment_tokens: int | None = None
    hisparse_host_num_blocks: int | None = None
    hisparse_host_block_stride: int | None = None
    hisparse_shared_host_pool: bool = False
    kv_tp_replicas: int = 1
    # New blocks must be zeroed: Mamba state is read before it is written, and a block
    # reused under another precision could decode stale bytes. Set from the groups at
    # construction.
    needs_kv_cache_zeroing: bool = field(init=False)

    def __post_init__(self) -> None:
        self.needs_kv_cache_zeroing = (self.has_mamba_layers
                                       or self.has_mixed_precision_kv_cache)

    @property
    def transfer_group_ids(self) -> tuple[int, ...]:
        """Groups that take part in external KV transfer."""
        return tuple(i for i, g in enumerate(self.kv_cache_groups) if g.enable_kv_transfer)

    @property
    def prefix_cacheable_group_ids(self) -> tuple[int, ...]:
        return tuple(i for i in self.transfer_group_ids
                     if self.kv_cache_groups[i].kv_cache_spec.prefix_cacheable)

    @property
    def host_group_ids(self) -> tuple[int, ...]:
        return tuple(i for i, g in enumerate(self.kv_cache_groups) if g.host_resident)

    @property
    def has_mamba_layers(self) -> bool:
        return any(isinstance(g.kv_cache_spec, MambaSpec) for g in self.kv_cache_groups)

    @property
    def has_mixed_precision_kv_cache(self) -> bool:
        """Whether device attention groups use more than one (dtype, quant mode)."""
        precisions = {
            (str(g.kv_cache_spec.dtype).removeprefix("torch."), g.kv_cache_spec.kv_quant_mode)
            for g in self.kv_cache_groups
            if not g.host_resident and isinstance(g.kv_cache_spec, AttentionSpec)
        }
        return len(precisions) > 1

