"""A tiny decoder-only transformer whose attention reads and writes K/V through block tables.

Random weights from a fixed seed (no download), made on the CPU and then moved to the run's
device and dtype (float32 on the CPU by default; ``--model small`` is the same class at a
Llama-like size, ``shmkv/serve/small_model.py``). Two forward passes:
- ``forward_paged``: a batch of requests, each scheduling some new tokens at some start
  position; every layer writes the new tokens' K/V into the ``KVStore`` at their slots
  (``slot_mappings[group]``) and attends over K/V gathered from the store through the
  request's row of its group's block table. Paged attention written plainly in torch.
- ``forward_reference``: one sequence, no cache, a causal (and windowed) mask.

``reference_generate`` decodes greedily with the reference; a serving loop that decodes with
``forward_paged`` must produce the same tokens.

A layer with ``sliding_window = w`` lets the query at position ``p`` see keys ``p - w + 1 ..
p`` (vLLM's window, ``SlidingWindowSpec.num_retained_tokens = w - 1``); its K/V live in
the sliding-window KV-cache group, whose blocks wholly before the window may be the null
block. ``forward_paged`` gathers only positions inside the window, and refuses (raises)
to read a null block: block 0 is never a real block.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from shmkv.errors import UsageError
from shmkv.pool.layout import NULL_BLOCK_ID
from shmkv.serve.config import TinyModelConfig, make_kv_cache_config

__all__ = ["TinyModelConfig", "TinyTransformer", "make_kv_cache_config"]


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (the half-split variant) of ``x`` ``[T, heads, head_size]``."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / (theta ** (torch.arange(half, dtype=torch.float32, device=x.device)
                                / half))
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()  # the statistics in float32 whatever the model's dtype
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


class _Layer(nn.Module):
    def __init__(self, c: TinyModelConfig) -> None:
        super().__init__()
        self.q = nn.Linear(c.hidden_size, c.num_heads * c.head_size, bias=False)
        self.k = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_size, bias=False)
        self.v = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_size, bias=False)
        self.o = nn.Linear(c.num_heads * c.head_size, c.hidden_size, bias=False)
        self.gate_up = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.down = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)
        self.norm1 = nn.Parameter(torch.ones(c.hidden_size))
        self.norm2 = nn.Parameter(torch.ones(c.hidden_size))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
            k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Attention of queries ``[Tq, H, D]`` over keys/values ``[Tk, Hkv, D]`` with a causal
    (and window) mask from the positions (``scaled_dot_product_attention`` with a boolean
    mask, on whatever device the tensors are). Returns ``[Tq, H * D]``."""
    reps = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(reps, dim=1)
    v = v.repeat_interleave(reps, dim=1)
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        allowed &= k_pos[None, :] > q_pos[:, None] - window
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=allowed[None],
        scale=1.0 / math.sqrt(q.shape[-1]))
    return out.transpose(0, 1).reshape(q.shape[0], -1)


class TinyTransformer(nn.Module):
    """The tiny model; ``TinyTransformer(config)`` is deterministic in ``config.seed``: the
    weights are drawn on the CPU, then moved to ``device`` in ``dtype`` (float32, cpu by
    default), so every process and device starts from the same numbers."""

    def __init__(self, config: TinyModelConfig, device: object = "cpu",
                 dtype: object = None) -> None:
        super().__init__()
        self.config = config
        gen_state = torch.random.get_rng_state()
        torch.manual_seed(config.seed)
        try:
            self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
            self.layers = nn.ModuleList(_Layer(config) for _ in range(config.num_layers))
            self.final_norm = nn.Parameter(torch.ones(config.hidden_size))
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            with torch.no_grad():
                self.lm_head.weight.mul_(4.0)  # spread the logits: no near-ties in argmax
        finally:
            torch.random.set_rng_state(gen_state)
        self.layer_groups = config.layer_groups()
        self.requires_grad_(False)
        self.eval()
        self.to(device=torch.device(device), dtype=dtype or torch.float32)

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def _qkv(self, layer: _Layer, h: torch.Tensor, positions: torch.Tensor):
        c = self.config
        x = _rms_norm(h, layer.norm1)
        q = layer.q(x).view(-1, c.num_heads, c.head_size)
        k = layer.k(x).view(-1, c.num_kv_heads, c.head_size)
        v = layer.v(x).view(-1, c.num_kv_heads, c.head_size)
        return _rope(q, positions, c.rope_theta), _rope(k, positions, c.rope_theta), v

    def _mlp(self, layer: _Layer, h: torch.Tensor) -> torch.Tensor:
        gate, up = layer.gate_up(_rms_norm(h, layer.norm2)).chunk(2, dim=-1)
        return h + layer.down(torch.nn.functional.silu(gate) * up)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(_rms_norm(h, self.final_norm)).float()

    # ------------------------------------------------------------------ no cache

    @torch.no_grad()
    def forward_reference(self, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Logits ``[T, vocab]`` (float32) of one sequence, computed afresh (no cache)."""
        ids = torch.as_tensor(token_ids, dtype=torch.int64).to(self.device)
        positions = torch.arange(ids.numel(), device=self.device)
        h = self.embed(ids)
        for layer, window in zip(self.layers, self.config.sliding_window, strict=True):
            q, k, v = self._qkv(layer, h, positions)
            h = h + layer.o(_attend(q, k, v, positions, positions, window))
            h = self._mlp(layer, h)
        return self._logits(h)

    def reference_generate(self, prompt_token_ids: Sequence[int],
                           max_new_tokens: int) -> list[int]:
        """Greedy continuation of the prompt, each token computed from scratch."""
        tokens = list(prompt_token_ids)
        out = []
        for _ in range(max_new_tokens):
            nxt = int(self.forward_reference(tokens)[-1].argmax())
            out.append(nxt)
            tokens.append(nxt)
        return out

    # ------------------------------------------------------------------ paged

    @torch.no_grad()
    def forward_paged(self, token_ids: torch.Tensor, positions: torch.Tensor,
                      query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                      block_tables: Sequence[torch.Tensor],
                      slot_mappings: Sequence[torch.Tensor], kv_store) -> torch.Tensor:
        """Logits ``[num_reqs, vocab]`` at each request's last scheduled token.

        Args:
            token_ids, positions: ``[T]``, the scheduled tokens, request-major.
            query_start_loc: ``[num_reqs + 1]``: request ``r``'s tokens are
                ``query_start_loc[r] : query_start_loc[r + 1]``, consecutive positions.
            seq_lens: ``[num_reqs]``: tokens of each request once this step's are in.
            block_tables: per KV-cache group, int32 ``[num_reqs, width]``.
            slot_mappings: per group, int64 ``[T]`` (``compute_slot_mapping``).
            kv_store: anything with ``key_cache[l]``, ``value_cache[l]`` (on the model's
                device, in its dtype) and ``block_size``: the ``KVStore``, or a placement's
                view (``shmkv/serve/placement.py``).

        The index arithmetic runs on the CPU (the tables are a CPU snapshot); the indices
        then move to the model's device once per step.

        Raises:
            UsageError: a gathered block is the null block (a read outside the window).
        """
        c = self.config
        num_reqs = seq_lens.numel()
        dev = self.device
        positions = positions.cpu()
        h = self.embed(token_ids.to(dev))
        qsl = query_start_loc.tolist()
        lens = seq_lens.tolist()
        # Per group and request: key positions to read and their slots (shared by layers).
        gathers: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        windows = c.group_windows()
        for g, (table, window) in enumerate(zip(block_tables, windows, strict=True)):
            bs = kv_store.block_size
            per_req = []
            for r in range(num_reqs):
                first_q = int(positions[qsl[r]]) if qsl[r + 1] > qsl[r] else lens[r]
                lo = 0 if window is None else max(0, first_q - window + 1)
                k_pos = torch.arange(lo, lens[r])
                block_ids = table[r].index_select(0, k_pos // bs).to(torch.int64)
                if bool((block_ids == NULL_BLOCK_ID).any()):
                    raise UsageError(
                        f"request {r}, group {g}: positions {lo}..{lens[r] - 1} reach the null "
                        f"block (row {table[r].tolist()})")
                per_req.append((k_pos.to(dev), (block_ids * bs + k_pos % bs).to(dev)))
            gathers.append(per_req)
        slot_mappings = [s.to(dev) for s in slot_mappings]
        positions = positions.to(dev)
        for i, layer in enumerate(self.layers):
            g = self.layer_groups[i]
            window = c.sliding_window[i]
            q, k, v = self._qkv(layer, h, positions)
            kc = kv_store.key_cache[i].view(-1, c.num_kv_heads, c.head_size)
            vc = kv_store.value_cache[i].view(-1, c.num_kv_heads, c.head_size)
            kc.index_copy_(0, slot_mappings[g], k)
            vc.index_copy_(0, slot_mappings[g], v)
            outs = []
            for r in range(num_reqs):
                a, b = qsl[r], qsl[r + 1]
                k_pos, slots = gathers[g][r]
                outs.append(_attend(q[a:b], kc.index_select(0, slots),
                                    vc.index_select(0, slots), positions[a:b], k_pos, window))
            h = h + layer.o(torch.cat(outs))
            h = self._mlp(layer, h)
        last = (query_start_loc[1:] - 1).to(dev)
        return self._logits(h.index_select(0, last))
