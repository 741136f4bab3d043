"""``SharedHostStorage``: SGLang's HiCache L3 backend over one node-wide shmkv page store.

SGLang 0.5.23 loads it with its own flags, nothing patched::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "shmkv", "module_path":
        "shmkv.sglang", "class_name": "SharedHostStorage", "interface_v1": 1,
        "shmkv_pool": "node0", "bytes": 68719476736}'

``StorageBackendFactory`` builds it with ``(storage_config, kwargs)``; the controller then
calls ``register_mem_pool_host``, which opens the store (pool + region, store.py) and
checks this instance's identity against the store's (identity.py). A page's key is a
digest of SGLang's page hash and the rank part owning it (every TP rank its own shard; with
MLA one shard per DCP rank, written by the first rank of each group only).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from shmkv.errors import UsageError
from shmkv.sglang import identity as ident
from shmkv.sglang.pages import page_bytes_of, page_view
from shmkv.sglang.store import PageStore

_CONFIG_FIELDS = ("tp_rank", "tp_size", "pp_rank", "pp_size", "attn_cp_rank", "attn_cp_size",
                  "is_mla_model", "model_name")


class SharedHostStorage(HiCacheStorage):
    """A HiCache L3 storage backend whose pages every SGLang instance on the node shares.

    Args:
        storage_config: SGLang's ``HiCacheStorageConfig``; its ``extra_config`` names the
            pool (``shmkv_pool``) and the store's page bytes (``bytes``).
        kwargs: what the factory passes besides (unused).

    Raises:
        UsageError: an unknown extra_config key, a bad value, a config that is not SGLang's.
    """

    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        missing = [f for f in _CONFIG_FIELDS if not hasattr(storage_config, f)]
        if missing:
            raise UsageError(f"storage_config must be SGLang's HiCacheStorageConfig; "
                             f"{type(storage_config).__name__} lacks {missing}")
        if getattr(storage_config, "should_split_heads", False):
            raise UsageError("storage_config.should_split_heads (the page_head layout with "
                             "tp_lcm_size) is not supported by the shmkv SGLang store")
        self.settings = ident.parse_extra_config(storage_config.extra_config)
        self.config = storage_config
        c = storage_config
        dcp = f"dcp{getattr(c, 'dcp_rank', 0)}/{getattr(c, 'dcp_size', 1)}"
        shard = f"pp{c.pp_rank}/{c.pp_size} cp{c.attn_cp_rank}/{c.attn_cp_size} {dcp}"
        self._suffix = (shard if c.is_mla_model else f"tp{c.tp_rank}/{c.tp_size} {shard}").encode()
        self.is_writer = bool(getattr(c, "is_storage_writer", not c.is_mla_model or c.tp_rank == 0))
        self.store: PageStore | None = None
        self.mem_pool_host = None
        self.num_get_pages = self.num_hit_pages = self.num_set_pages = 0
        self.num_stored_pages = self.num_skipped_pages = 0

    # ------------------------------------------------------------------ set-up

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Opens the node-wide store for this host pool's pages and checks the identity.

        Raises:
            UsageError: an unsupported layout or buffer; a second, different host pool.
            LayoutMismatchError: the store belongs to instances of another identity (every
                differing field named).
        """
        if self.store is not None:
            if mem_pool_host is self.mem_pool_host:
                return
            raise UsageError("register_mem_pool_host(): a host pool is registered already")
        view = page_view(mem_pool_host, bool(self.config.is_mla_model))
        page_bytes = page_bytes_of(view)
        identity = ident.store_identity(
            self.config, int(mem_pool_host.page_size), str(view.dtype), mem_pool_host.layout,
            page_bytes, self.settings["bytes"], ident.current_server_args())
        self.store = PageStore(self.settings["pool"], self.settings["bytes"], page_bytes,
                               identity, self.settings["max_processes"])
        self.mem_pool_host = mem_pool_host
        self._view = view
        self._page_size = int(mem_pool_host.page_size)
        region = torch.from_numpy(self.store.region.pages)
        self._slots = region.view(view.dtype).view(self.store.num_pages, *view.shape[1:])
        self._host_np = _np_view(view)  # the copies are numpy's (store.copy_runs)
        self._slots_np = _np_view(self._slots)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        raise UsageError(
            f"the shmkv SGLang store keeps KV pages only; hybrid pools ({host_pool_name}: "
            "Mamba/SWA/DSA sidecars, the v2 calls) are not supported: use another "
            "--hicache-storage-backend for hybrid models")

    def batch_exists_v2(self, keys, pool_transfers=None, extra_info=None):
        raise UsageError("batch_exists_v2(): hybrid pools are not supported by the shmkv store")

    def batch_get_v2(self, transfers, extra_info=None):
        raise UsageError("batch_get_v2(): hybrid pools are not supported by the shmkv store")

    def batch_set_v2(self, transfers, extra_info=None):
        raise UsageError("batch_set_v2(): hybrid pools are not supported by the shmkv store")

    # ------------------------------------------------------------------ helpers

    def _ready(self, call: str) -> PageStore:
        if self.store is None:
            raise UsageError(f"{call}(): call register_mem_pool_host() first (SGLang does, "
                             "right after creating the backend)")
        return self.store

    def _hashes(self, call: str, keys: Any) -> list[bytes]:
        if isinstance(keys, (str, bytes)) or not isinstance(keys, (list, tuple)):
            raise UsageError(f"{call}(): keys must be a list of str, got {type(keys).__name__}")
        out = []
        for k in keys:
            if not isinstance(k, str) or not k:
                raise UsageError(f"{call}(): every key must be a non-empty str, got {k!r}")
            out.append(hashlib.sha256(k.encode() + b"\0" + self._suffix).digest())
        return out

    def _host_pages(self, call: str, num_keys: int, host_indices: Any) -> list[int]:
        ps = self._page_size
        if not isinstance(host_indices, torch.Tensor) or host_indices.dim() != 1 or (
                host_indices.dtype not in (torch.int32, torch.int64)):
            raise UsageError(f"{call}(): host_indices must be a 1-d int tensor, got "
                             f"{getattr(host_indices, 'shape', type(host_indices).__name__)}")
        if host_indices.numel() != num_keys * ps:
            raise UsageError(f"{call}(): host_indices has {host_indices.numel()} entries; "
                             f"{num_keys} keys of page {ps} need {num_keys * ps}")
        if num_keys == 0:
            return []
        idx = host_indices.cpu().numpy().astype(np.int64, copy=False).reshape(num_keys, ps)
        first = idx[:, 0]
        limit = self._view.shape[0] * ps
        if (first % ps).any() or (idx != first[:, None] + np.arange(ps)).any() \
                or int(first.min()) < 0 or int(idx.max()) >= limit:
            raise UsageError(f"{call}(): host_indices must be whole pages of {ps} consecutive "
                             f"tokens, page-aligned, in [0, {limit})")
        return (first // ps).tolist()

    def _flat(self, call: str, name: str, tensor: Any) -> torch.Tensor:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu" or (
                tensor.numel() * tensor.element_size() != self.store.page_bytes):
            raise UsageError(f"{call}(): {name} must be a CPU tensor of one page "
                             f"({self.store.page_bytes} bytes), got "
                             f"{getattr(tensor, 'shape', type(tensor).__name__)}")
        return tensor

    # ------------------------------------------------------------------ zero-copy (v1)

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        """Copies each stored page of ``keys`` into the host pool at ``host_indices`` (one
        copy per run of pages consecutive in both); True per page copied."""
        store = self._ready("batch_get_v1")
        hashes = self._hashes("batch_get_v1", keys)
        pages = self._host_pages("batch_get_v1", len(keys), host_indices)
        if len(set(pages)) != len(pages):
            twice = next(p for p in pages if pages.count(p) > 1)
            raise UsageError(f"batch_get_v1(): host_indices name host page {twice} twice: each "
                             "page is copied into one host page of its own")
        got = store.load(hashes, self._host_np, pages, self._slots_np)
        self.num_get_pages += len(keys)
        self.num_hit_pages += sum(got)
        return got

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        """Copies each page of ``keys`` not yet stored (nor being stored by another
        instance) from the host pool into the store; False for pages that found no room."""
        store = self._ready("batch_set_v1")
        hashes = self._hashes("batch_set_v1", keys)
        pages = self._host_pages("batch_set_v1", len(keys), host_indices)
        if not self.is_writer:
            return [True] * len(keys)
        stored, failed = store.save(hashes, self._host_np, pages, self._slots_np)
        self._count_set(len(keys), stored)
        bad = set(failed)
        return [i not in bad for i in range(len(keys))]

    def _count_set(self, num_keys: int, num_stored: int) -> None:
        self.num_set_pages += num_keys
        self.num_stored_pages += num_stored
        self.num_skipped_pages += num_keys - num_stored

    # ------------------------------------------------------------------ generic calls

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None):
        """The stored page of ``key`` copied into ``target_location`` (a new flat tensor if
        None), or None if it is not stored."""
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None):
        store = self._ready("batch_get")
        hashes = self._hashes("batch_get", keys)
        if target_locations is None:
            targets = [torch.empty(self._view[0].numel(), dtype=self._view.dtype) for _ in keys]
        else:
            if not isinstance(target_locations, (list, tuple)) or len(
                    target_locations) != len(keys):
                raise UsageError(f"batch_get(): target_locations must be a list of "
                                 f"{len(keys)} tensors, got {type(target_locations).__name__}")
            targets = [self._flat("batch_get", "target_location", t) for t in target_locations]
            for t in targets:  # each is filled in place, as one run of bytes
                if not t.is_contiguous():
                    raise UsageError(
                        f"batch_get(): target_location must be a contiguous tensor (a page is "
                        f"copied into it in place), got strides {tuple(t.stride())}")
        blocks = store.pin(hashes)
        held = [b for b in blocks if b is not None]
        try:
            out = []
            for b, t in zip(blocks, targets, strict=True):
                if b is None:
                    out.append(None)
                    continue
                np.copyto(_np_view(t.view(-1).view(torch.uint8)),
                          self._slots_np[b.block_id - 1].reshape(-1).view(np.uint8))
                out.append(t)
        finally:
            store.unpin(held)
        self.num_get_pages += len(keys)
        self.num_hit_pages += len(held)
        return out

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        store = self._ready("batch_set")
        hashes = self._hashes("batch_set", keys)
        if not isinstance(values, (list, tuple)) or len(values) != len(keys):
            raise UsageError(f"batch_set(): values must be a list of {len(keys)} tensors, got "
                             f"{type(values).__name__}")
        values = [self._flat("batch_set", "value", v) for v in values]
        if not self.is_writer:
            return True
        todo, blocks, failed = store.begin_store(hashes)
        ok = False
        try:
            for i, b in zip(todo, blocks, strict=True):
                np.copyto(self._slots_np[b.block_id - 1].reshape(-1).view(np.uint8),
                          _np_view(values[i].contiguous().view(-1).view(torch.uint8)))
            ok = True
        finally:
            store.finish_store([hashes[i] for i in todo], blocks, ok)
        self._count_set(len(keys), len(blocks))
        return not failed

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many leading pages of ``keys`` are stored completely."""
        return self._ready("batch_exists").prefix(self._hashes("batch_exists", keys))

    def clear(self) -> bool:
        return self._ready("clear").clear()

    def get_stats(self):
        return None

    def counters(self) -> dict[str, int]:
        """This instance's page counts: asked, hits, offered for storing, stored, skipped
        (stored already, or being stored by another instance)."""
        return {"get_pages": self.num_get_pages, "hit_pages": self.num_hit_pages,
                "set_pages": self.num_set_pages, "stored_pages": self.num_stored_pages,
                "skipped_pages": self.num_skipped_pages}

    def close(self) -> None:
        if self.store is not None:
            self._slots = self._slots_np = self._host_np = None
            self.store.close()
            self.store = None


_UINT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _np_view(t: torch.Tensor) -> np.ndarray:
    """A numpy view (no copy) of a CPU tensor's bytes, as unsigned ints of its element size
    (numpy has no bfloat16/fp8)."""
    return t.view(_UINT[t.element_size()]).numpy()
