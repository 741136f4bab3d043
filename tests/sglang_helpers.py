"""What the SGLang backend's tests share: SGLang's own config built as its controller does,
and the ``dynamic`` extra_config exactly as the command line passes it. The host KV buffers
of SGLang's host-pool shapes are in ``tests/sglang_host.py`` (no SGLang import there).
"""

from __future__ import annotations

import json

import pytest

sgl_storage = pytest.importorskip("sglang.srt.mem_cache.hicache_storage")
sgl_factory = pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory")

from tests.sglang_host import HostBuffer, page_indices, remove_store  # noqa: E402

CLI_EXTRA = ('{"backend_name": "shmkv", "module_path": "shmkv.sglang", "class_name": '
             '"SharedHostStorage", "interface_v1": 1, "shmkv_pool": "%s", "bytes": %d}')


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


__all__ = ["CLI_EXTRA", "HostBuffer", "make_backend", "make_config", "page_indices",
           "remove_store", "sgl_factory", "sgl_storage"]
