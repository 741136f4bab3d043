"""Slot mapping and a batch's token indices: what a rank computes from block tables.

``compute_slot_mapping`` turns block-table rows and token positions into KV slots (vLLM's
formula); ``batch_token_indices`` lists a batch's tokens request-major. Both run in numpy
on the CPU (a decode batch is a few hundred tokens, where each torch call's fixed cost would
dominate), in one C pass when the kernel is built (``docs/kernels.md``; the numpy code is
the reference and the fallback), and in torch for a table on a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from shmkv.errors import UsageError
from shmkv.ranks._common import LazyTorch

# The C kernel's one-pass helpers (None without it); numpy below is the reference and the
# fallback. ``SharedBlockTables`` calls them through this module, so a test that sets them to
# None runs the numpy path everywhere.
try:
    from shmkv.pool._ckernel import slot_mappings as c_slot_mappings
    from shmkv.pool._ckernel import token_indices as c_token_indices
except ImportError:  # pure-Python install
    c_slot_mappings = c_token_indices = None

torch = LazyTorch(globals())

PAD_SLOT_ID = -1  # vLLM's PAD_ID for slots of padding tokens


def as_int64(x: Sequence[int] | np.ndarray | torch.Tensor) -> torch.Tensor:
    """A 1-d int64 tensor; lists go through numpy (several times cheaper than torch's own
    list conversion)."""
    if isinstance(x, torch.Tensor):
        return x.reshape(-1).to(torch.int64)
    return torch.from_numpy(np.asarray(x, dtype=np.int64).reshape(-1))


def as_numpy_int64(x: Sequence[int] | np.ndarray | torch.Tensor) -> np.ndarray:
    """A 1-d int64 array; a CPU tensor is read in place (no copy if already int64)."""
    if isinstance(x, torch.Tensor):
        return x.reshape(-1).to(torch.int64).numpy()
    return np.asarray(x, dtype=np.int64).reshape(-1)


def c_operand(x: object) -> object:
    """``x`` as the C helpers take it (a list, a tuple, a 1-d ndarray; a CPU int64 tensor as
    its numpy view), or None: the numpy path then takes it. The helpers refuse anything
    else they cannot read exactly as numpy would (a float, a 2-d or strided array...)."""
    kind = type(x)
    if kind is list or kind is tuple:
        return x
    if kind is np.ndarray:
        return x if x.ndim == 1 else None
    if isinstance(x, torch.Tensor) and x.dtype == torch.int64 and x.device.type == "cpu":
        return x.numpy() if x.dim() == 1 else None
    return None


def compute_slot_mapping(block_table: torch.Tensor, req_indices: torch.Tensor,
                         positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Slots of a batch's tokens: ``block_table[req, pos // bs] * bs + pos % bs`` (int64).

    ``block_table`` is int32 ``[num_rows, width]`` (a snapshot's gathered rows, or the shared
    table itself); token ``t`` belongs to row ``req_indices[t]`` at position
    ``positions[t]``. Vectorised, no Python loop. Like vLLM, the block number comes from the
    position, not from the token's index. A padding token (``req_indices[t] < 0``) gets
    ``PAD_SLOT_ID``. A table on the CPU is computed in numpy, as vLLM's worker does (a
    decode batch is a few hundred tokens, where each torch call's fixed cost would
    dominate); one on a GPU in torch, on its device.

    Raises:
        UsageError: a position past the table's width or a row out of range.
    """
    if block_table.device.type != "cpu":
        return _slot_mapping_on_device(block_table, req_indices, positions, block_size)
    req = as_numpy_int64(req_indices)
    pos = as_numpy_int64(positions)
    if pos.size == 0:
        return torch.empty(0, dtype=torch.int64)
    check_slot_inputs(int(pos.min()), int(pos.max()), int(req.max()), block_table.shape,
                       block_size)
    pad = req < 0 if int(req.min()) < 0 else None
    slots = slots_np(block_table.numpy(), np.maximum(req, 0) if pad is not None else req,
                      pos, block_size)
    if pad is not None:
        slots[pad] = PAD_SLOT_ID
    return torch.from_numpy(slots)


def slots_np(table: np.ndarray, rows: np.ndarray, pos: np.ndarray, block_size: int
              ) -> np.ndarray:
    """The slot formula on checked inputs (rows and positions in range)."""
    flat = rows * table.shape[1]
    flat += pos // block_size
    slots = table.reshape(-1).take(flat).astype(np.int64)
    slots *= block_size
    slots += pos % block_size
    return slots


def check_slot_inputs(pos_lo: int, pos_hi: int, req_hi: int, table_shape, block_size: int
                       ) -> None:
    rows, width = table_shape
    if pos_lo < 0 or pos_hi >= width * block_size:
        raise UsageError(
            f"positions must lie in [0, {width * block_size}) for a table {width} blocks "
            f"wide of block size {block_size}; found {pos_lo}..{pos_hi}")
    if req_hi >= rows:
        raise UsageError(f"row index {req_hi} out of range for a table of {rows} rows")


def _slot_mapping_on_device(block_table: torch.Tensor, req_indices: torch.Tensor,
                            positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """``compute_slot_mapping`` in torch, on the table's device."""
    device = block_table.device
    width = block_table.shape[1]
    req_indices = as_int64(req_indices).to(device)
    positions = as_int64(positions).to(device)
    if positions.numel() == 0:
        return torch.empty(0, dtype=torch.int64, device=device)
    lo, hi = (int(x) for x in torch.aminmax(positions))
    req_lo, req_hi = (int(x) for x in torch.aminmax(req_indices))
    check_slot_inputs(lo, hi, req_hi, block_table.shape, block_size)
    pad = req_indices < 0 if req_lo < 0 else None
    rows = req_indices.clamp(min=0) if pad is not None else req_indices
    flat = rows * width
    flat += torch.div(positions, block_size, rounding_mode="floor")
    slots = block_table.reshape(-1).index_select(0, flat).to(torch.int64)
    slots *= block_size
    slots += torch.remainder(positions, block_size)
    return slots if pad is None else slots.masked_fill_(pad, PAD_SLOT_ID)


def batch_token_indices(num_scheduled_tokens: Sequence[int] | torch.Tensor,
                        start_positions: Sequence[int] | torch.Tensor,
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(req_indices, positions)`` of a batch whose request ``i`` schedules
    ``num_scheduled_tokens[i]`` tokens starting at position ``start_positions[i]``: one
    entry per token, request-major (vLLM's ``query_start_loc`` order). Works for prefill
    (many tokens per request) and decode (one) alike. One C pass when the kernel is built
    (the same answers; anything it does not take goes the numpy way, which says what is
    wrong)."""
    counts_c, starts_c = c_operand(num_scheduled_tokens), c_operand(start_positions)
    if c_token_indices is not None and counts_c is not None and starts_c is not None:
        size = len(counts_c)  # the decode case: one token per request
        req, pos = np.empty(size, np.int64), np.empty(size, np.int64)
        total = c_token_indices(counts_c, starts_c, req, pos)
        if total > size:  # prefill: sized now, written now (unless a thread changed the lists)
            req, pos = np.empty(total, np.int64), np.empty(total, np.int64)
            if c_token_indices(counts_c, starts_c, req, pos) != total:
                total = -1
        if total >= 0:
            return torch.from_numpy(req[:total]), torch.from_numpy(pos[:total])
    counts = np.asarray(num_scheduled_tokens, dtype=np.int64)
    starts = np.asarray(start_positions, dtype=np.int64)
    if counts.shape != starts.shape or counts.ndim != 1:
        raise UsageError(
            f"num_scheduled_tokens and start_positions must be 1-d of one length, got "
            f"{tuple(counts.shape)} and {tuple(starts.shape)}")
    if not counts.size:
        return torch.from_numpy(counts), torch.from_numpy(starts)
    lo = int(counts.min())
    if lo < 0 or int(starts.min()) < 0:
        raise UsageError("token counts and start positions must be >= 0")
    if lo == 1 and int(counts.max()) == 1:  # decode
        return torch.arange(counts.size), torch.from_numpy(starts)
    # numpy for the bookkeeping (vLLM's worker does the same): cheaper per call than torch.
    req_indices = np.repeat(np.arange(counts.size), counts)
    offsets = np.arange(req_indices.size) - np.repeat(np.cumsum(counts) - counts, counts)
    return torch.from_numpy(req_indices), torch.from_numpy(starts[req_indices] + offsets)
