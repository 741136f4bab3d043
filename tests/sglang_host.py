"""SGLang's host KV buffers and host indices, without importing SGLang: what the store's
own tests (``shmkv.sglang.store``, which needs no SGLang) and the backend's tests share.

SGLang's host pool classes (``MHATokenToKVPoolHost``...) need a device KV pool and import
``sglang.srt.configs``, which imports torchvision: no CPU torchvision 0.28 wheel is installable
beside torch 2.13.0+cpu here, so :class:`HostBuffer` holds a real tensor of exactly the shape
their ``init_kv_buffer`` allocates (mha.py, mla.py) and the attributes the backend reads.
"""

from __future__ import annotations

import torch

from shmkv import BlockPool
from shmkv.pool.siblings import unlink_pool_siblings


class HostBuffer:
    """SGLang's host KV buffer for one layout: ``kv_buffer`` in its host pool's shape."""

    def __init__(self, layout: str, *, mla: bool = False, page_size: int = 4,
                 num_pages: int = 16, layers: int = 2, heads: int = 2, dim: int = 8,
                 dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> None:
        self.layout, self.page_size, self.dtype = layout, page_size, dtype
        size = page_size * num_pages
        if mla:
            dims = {"layer_first": (layers, size, 1, dim), "page_first": (size, layers, 1, dim),
                    "page_first_direct": (num_pages, layers, page_size, 1, dim)}[layout]
        else:
            dims = {"layer_first": (2, layers, size, heads, dim),
                    "page_first": (2, size, layers, heads, dim),
                    "page_first_direct": (2, num_pages, layers, page_size, heads, dim)}[layout]
        gen = torch.Generator().manual_seed(seed)
        self.kv_buffer = torch.randn(dims, generator=gen).to(dtype)
        self.mla = mla

    def data_page(self, index: int) -> torch.Tensor:
        """The flat page at token ``index``, sliced as SGLang's ``get_data_page`` does."""
        ps, b = self.page_size, self.kv_buffer
        if self.layout == "page_first_direct":
            p = index // ps
            return (b[p:p + 1] if self.mla else b[:, p:p + 1]).flatten()
        if self.layout == "layer_first":
            return (b[:, index:index + ps] if self.mla else b[:, :, index:index + ps]).flatten()
        return (b[index:index + ps] if self.mla else b[:, index:index + ps]).flatten()


def page_indices(pages: list[int], page_size: int) -> torch.Tensor:
    """SGLang's host_indices for whole host pages: page_size consecutive tokens each."""
    return torch.cat([torch.arange(p * page_size, (p + 1) * page_size) for p in pages]) \
        if pages else torch.empty(0, dtype=torch.int64)


def remove_store(pool: str) -> None:
    BlockPool.unlink(pool)
    unlink_pool_siblings(pool)
