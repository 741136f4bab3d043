"""What the SGLang backend's tests share: SGLang's own config built as its controller does,
the ``dynamic`` extra_config exactly as the command line passes it, and host KV buffers of
SGLang's host-pool shapes.

SGLang's host pool classes (``MHATokenToKVPoolHost``...) need a device KV pool and import
``sglang.srt.configs``, which imports torchvision: no CPU torchvision 0.28 wheel is installable
beside torch 2.13.0+cpu here, so :class:`HostBuffer` holds a real tensor of exactly the shape
their ``init_kv_buffer`` allocates (mha.py, mla.py) and the attributes the backend reads.
"""

from __future__ import annotations

import json

import pytest

sgl_storage = pytest.importorskip("sglang.srt.mem_cache.hicache_storage")
sgl_factory = pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory")

import torch  # noqa: E402

from shmkv import BlockPool  # noqa: E402
from shmkv.pool.siblings import unlink_pool_siblings  # noqa: E402

CLI_EXTRA = ('{"backend_name": "shmkv", "module_path": "shmkv.sglang", "class_name": '
             '"SharedHostStorage", "interface_v1": 1, "shmkv_pool": "%s", "bytes": %d}')


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


def make_config(pool: str, store_bytes: int = 1 << 20, *, tp_rank: int = 0, tp_size: int = 1,
                mla: bool = False, model: str = "org/model", extra: dict | None = None):
    """SGLang's HiCacheStorageConfig with the extra_config parsed from the CLI's JSON."""
    extra_config = json.loads(CLI_EXTRA % (pool, store_bytes))
    extra_config.update(extra or {})
    return sgl_storage.HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
        attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=False,
        is_page_first_layout=False, model_name=model, extra_config=extra_config)


def make_backend(pool: str, host: HostBuffer | None = None, **kwargs):
    """The backend as SGLang makes it: the factory's ``dynamic`` path, then registration."""
    backend = sgl_factory.StorageBackendFactory.create_backend(
        "dynamic", make_config(pool, **kwargs), None)
    if host is not None:
        backend.register_mem_pool_host(host)
    return backend


def page_indices(pages: list[int], page_size: int) -> torch.Tensor:
    """SGLang's host_indices for whole host pages: page_size consecutive tokens each."""
    return torch.cat([torch.arange(p * page_size, (p + 1) * page_size) for p in pages]) \
        if pages else torch.empty(0, dtype=torch.int64)


def remove_store(pool: str) -> None:
    BlockPool.unlink(pool)
    unlink_pool_siblings(pool)
