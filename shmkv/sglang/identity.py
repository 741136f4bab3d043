"""One identity per node-wide store, and the extra_config SGLang hands the backend.

Every instance sharing a store must produce the same bytes for the same page key: the same
model, parallel layout (TP/PP/attention-CP/DCP sizes, which ranks write: with MLA only the
first rank of each DCP group, as SGLang's ``is_storage_writer``), tokens per page, KV dtype,
host-pool layout and page bytes, and the weights themselves: SGLang fills the storage
config's ``model_name`` with ``--served-model-name``, which two instances serving different
weights (base and instruct, another quantization) may share, so the identity also holds what
the process's SGLang server args say of the weights (the hub id, or a digest of a local
model directory's config and weight files; revision, quantization, dtype:
``shmkv/model_files.py`` says what the digest cannot see). A local directory's path is
recorded and shown in a refusal, never compared (``SHOWN_FIELDS``): the same weights at
another path share the store. The first instance records its identity in the store's
region (region.py); a later one that differs is refused at start, every differing field
named with both values.
"""

from __future__ import annotations

import json
from typing import Any

from shmkv.errors import LayoutMismatchError, UsageError
from shmkv.model_files import differing_fields, shown_note, weights_fields

# What StorageBackendFactory's ``dynamic`` config and SGLang's controller put there.
SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size",
               "prefetch_threshold", "prefetch_timeout_base")
SHMKV_KEYS = ("shmkv_pool", "bytes", "max_processes")
DEFAULT_MAX_PROCESSES = 64


def parse_extra_config(extra: Any) -> dict[str, Any]:
    """The store's settings from SGLang's extra_config: ``shmkv_pool`` (the pool's name,
    required), ``bytes`` (the store's page bytes, required, > 0), ``max_processes``.

    Raises:
        UsageError: not a dict, an unknown key, a missing or bad value (all named).
    """
    if not isinstance(extra, dict):
        raise UsageError(
            f"extra_config must be a dict (--hicache-storage-backend-extra-config JSON), got "
            f"{type(extra).__name__}")
    unknown = sorted(k for k in extra if k not in SGLANG_KEYS + SHMKV_KEYS)
    if unknown:
        raise UsageError(
            f"extra_config: unknown key(s) {unknown}; shmkv takes {list(SHMKV_KEYS)} besides "
            f"SGLang's {list(SGLANG_KEYS)}")
    pool = extra.get("shmkv_pool")
    if not isinstance(pool, str) or not pool:
        raise UsageError(f"extra_config: shmkv_pool must be a pool name (str), got {pool!r}")
    size = extra.get("bytes")
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise UsageError(f"extra_config: bytes must be an int > 0, got {size!r}")
    procs = extra.get("max_processes", DEFAULT_MAX_PROCESSES)
    if isinstance(procs, bool) or not isinstance(procs, int) or not 1 <= procs <= 1024:
        raise UsageError(f"extra_config: max_processes must be an int in [1, 1024], got {procs!r}")
    return {"pool": pool, "bytes": size, "max_processes": procs}


def current_server_args() -> Any:
    """The SGLang server args this process runs with (the scheduler's: SGLang's runtime
    context), or None outside an SGLang server."""
    try:
        from sglang.srt.runtime_context import get_server_args

        return get_server_args()
    except Exception:  # noqa: BLE001 (not in a server, or another SGLang: no args to read)
        return None


def weights_identity(server_args: Any) -> dict[str, Any]:
    """What the process can see of its weights, from SGLang's server args
    (``weights_fields`` of its model path); fields that say so when there are none (a
    backend used outside an SGLang server)."""
    if server_args is None:
        unknown = "unknown: no SGLang server args in this process"
        return {"model_path": unknown, "model_files": unknown}
    path = getattr(server_args, "model_path", None)
    return {
        **(weights_fields(str(path), "model_path") if path else
           {"model_path": str(path), "model_files": ""}),
        "revision": str(getattr(server_args, "revision", None)),
        "quantization": str(getattr(server_args, "quantization", None)),
        "model_dtype": str(getattr(server_args, "dtype", None)),
    }


def store_identity(config: Any, page_size: int, dtype: str, layout: str,
                   page_bytes: int, store_bytes: int,
                   server_args: Any = None) -> dict[str, Any]:
    """The fields that decide a page's bytes (``config``: SGLang's HiCacheStorageConfig;
    ``server_args``: SGLang's, for the weights: ``weights_identity``)."""
    return {
        **weights_identity(server_args),
        "model": config.model_name or "",
        "tp_size": int(config.tp_size),
        "pp_size": int(config.pp_size),
        "attn_cp_size": int(config.attn_cp_size),
        "dcp_size": int(getattr(config, "dcp_size", 1)),
        "mla_writer": "first rank of each DCP group" if config.is_mla_model else "every rank",
        "page_size": int(page_size),
        "kv_dtype": dtype,
        "layout": layout,
        "page_bytes": int(page_bytes),
        "bytes": int(store_bytes),
    }


def encode(identity: dict[str, Any]) -> bytes:
    return json.dumps(identity, sort_keys=True).encode()


def compare(found: bytes, mine: dict[str, Any], store: str) -> None:
    """Refuses an instance whose identity differs from the one the store recorded, but
    for the fields only shown (``SHOWN_FIELDS``).

    Raises:
        LayoutMismatchError: naming every differing field, the store's value and this
            instance's, then the shown ones.
    """
    recorded = json.loads(found.decode()) if found else {}
    named = differing_fields(recorded, mine, sorted(set(recorded) | set(mine)))
    if named:
        fields = "; field ".join(f"{k}: the store has {recorded.get(k)!r}, this instance "
                                 f"{mine.get(k)!r}" for k in named) + shown_note(named)
        raise LayoutMismatchError(
            f"SGLang store {store!r} belongs to instances of another identity; field "
            + fields
            + f". Every instance sharing it must match; to start afresh, stop them all and "
              f"run `shmkv unlink {store}`")
