"""The tiny model's configuration and the KV-cache config that matches it, without torch
(a scheduler process needs these, not the model). ``shmkv.serve.model`` re-exports both."""

from __future__ import annotations

from dataclasses import dataclass, field

from shmkv.core.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from shmkv.errors import UsageError


@dataclass(frozen=True)
class TinyModelConfig:
    vocab_size: int = 97
    num_layers: int = 3
    num_heads: int = 4
    num_kv_heads: int = 2
    head_size: int = 16
    hidden_size: int = 64
    intermediate_size: int = 128
    # One entry per layer: None (full attention) or a window in tokens.
    sliding_window: tuple[int | None, ...] = field(default=(None, 8, None))
    rope_theta: float = 10000.0
    seed: int = 0

    def __post_init__(self) -> None:
        if len(self.sliding_window) != self.num_layers:
            raise UsageError(
                f"sliding_window has {len(self.sliding_window)} entries for "
                f"{self.num_layers} layers")
        if self.num_heads % self.num_kv_heads:
            raise UsageError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads "
                f"{self.num_kv_heads}")
        for w in self.sliding_window:
            if w is not None and (not isinstance(w, int) or w <= 0):
                raise UsageError(f"a sliding window must be a positive int or None, got {w!r}")

    def group_windows(self) -> list[int | None]:
        """The KV-cache groups' windows, in group order: full attention first (if any
        layer has it), then each distinct window in increasing size."""
        windows = sorted({w for w in self.sliding_window if w is not None})
        return ([None] if None in self.sliding_window else []) + windows

    def layer_groups(self) -> list[int]:
        """The KV-cache group of every layer."""
        windows = self.group_windows()
        return [windows.index(w) for w in self.sliding_window]


def make_kv_cache_config(config: TinyModelConfig, num_blocks: int,
                         block_size: int) -> KVCacheConfig:
    """The shmkv ``KVCacheConfig`` that matches the model: one group per window (full
    attention is the group with window None), layers named ``layers.<i>``."""
    groups = []
    layer_groups = config.layer_groups()
    for g, w in enumerate(config.group_windows()):
        names = [f"layers.{i}" for i, lg in enumerate(layer_groups) if lg == g]
        common = {"block_size": block_size, "num_kv_heads": config.num_kv_heads,
                      "head_size": config.head_size, "dtype": "float32"}
        spec = (FullAttentionSpec(**common) if w is None
                else SlidingWindowSpec(**common, sliding_window=w))
        groups.append(KVCacheGroupSpec(names, spec))
    return KVCacheConfig(num_blocks, [], groups)
