"""Page views of SGLang's host KV pool, and the runs a batch of pages copies in.

A stored page's bytes are the host pool's flat data page (SGLang's ``get_data_page(index,
flat=True)``), so the zero-copy (v1) and the generic (``get``/``set``) paths agree byte for
byte. :func:`page_view` returns a strided view ``[num_host_pages, *page_shape]`` of the
pool's ``kv_buffer`` whose row ``p`` is host page ``p`` in that order:

    layout               MHA kv_buffer                     page row
    layer_first          [2, layers, tokens, heads, dim]   [2, layers, page, heads, dim]
    page_first           [2, tokens, layers, heads, dim]   [2, page, layers, heads, dim]
    page_first_direct    [2, pages, layers, page, h, d]    [2, layers, page, heads, dim]
    (MLA)                the same without the leading 2 and with heads = 1
"""

from __future__ import annotations

from typing import Any

import torch

from shmkv.errors import UsageError

LAYOUTS = ("layer_first", "page_first", "page_first_direct")


def page_view(host_pool: Any, is_mla: bool) -> torch.Tensor:
    """``[num_host_pages, *page_shape]`` view of ``host_pool.kv_buffer`` (no copy).

    Raises:
        UsageError: a layout other than LAYOUTS, or a buffer whose shape does not fit it.
    """
    layout = getattr(host_pool, "layout", None)
    if layout not in LAYOUTS:
        raise UsageError(
            f"host pool layout {layout!r} is not supported by the shmkv SGLang store; use "
            f"--hicache-mem-layout one of {list(LAYOUTS)}")
    buf = host_pool.kv_buffer
    ps = int(host_pool.page_size)
    want = 4 if is_mla else 5
    if layout == "page_first_direct":
        want += 1
    if not isinstance(buf, torch.Tensor) or buf.dim() != want:
        raise UsageError(
            f"host pool kv_buffer for layout {layout!r} ({'MLA' if is_mla else 'MHA'}) must be "
            f"a {want}-d tensor, got {getattr(buf, 'shape', type(buf).__name__)}")
    if is_mla:
        buf = buf.unsqueeze(0)  # one "K/V" plane: the same formulas as MHA, then squeezed
    if layout == "layer_first":
        two, layers, tokens, heads, dim = buf.shape
        v = buf.view(two, layers, tokens // ps, ps, heads, dim).permute(2, 0, 1, 3, 4, 5)
    elif layout == "page_first":
        two, tokens, layers, heads, dim = buf.shape
        v = buf.view(two, tokens // ps, ps, layers, heads, dim).permute(1, 0, 2, 3, 4, 5)
    else:
        v = buf.permute(1, 0, 2, 3, 4, 5)
    if layout != "page_first_direct" and tokens % ps:
        raise UsageError(f"host pool holds {tokens} tokens, not a multiple of page {ps}")
    return v.squeeze(1) if is_mla else v


def page_bytes_of(view: torch.Tensor) -> int:
    return int(view[0].numel()) * view.element_size()
