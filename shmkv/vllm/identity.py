"""One identity per offload tier: replicas whose KV bytes could differ never share one.

The first replica records its identity in the tier table; every later one must match it
field for field, or is refused at start with every differing field named, both values, and
how to start afresh. The fields are what decides the bytes of a chunk and who writes them:

- the model: its hub id, or for a local directory a digest of its config and weight files
  (``shmkv/model_files.py`` says what it reads), the revision, ``hf_overrides``, the
  weights' quantization and dtype. A local directory's path is recorded and shown in a
  refusal, never compared (``SHOWN_FIELDS``): the same weights copied or mounted at another
  path share the tier;
- the KV format: the KV cache dtype, the layer names of every KV group, the GPU block size,
  tokens per hash and blocks per chunk, the bytes of a chunk and of a worker's slot in it,
  the KV layout;
- the parallel layout: TP, PP, DCP and PCP sizes, the world size, and the rank that writes
  each slot of a chunk;
- the block hash: vLLM's algorithm and the seed of its NONE_HASH (a digest, never the
  seed), since a key names bytes only if every replica hashes prompts alike;
- the platform, and vLLM's release (its offloading code differs between releases).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from shmkv.errors import LayoutMismatchError, UsageError
from shmkv.model_files import differing_fields, shown_note, weights_fields
from shmkv.vllm.compat import VLLM_RELEASE, VLLM_RELEASE_VERSION
from shmkv.vllm.tier import IDENTITY_MAX, TierTable

# Non-cryptographic hashes of vLLM's prefix cache: their NONE_HASH seed is random per
# process unless PYTHONHASHSEED is set (vllm.v1.core.kv_cache_utils.resolve_none_hash_seed).
NON_CRYPTO_HASH_ALGOS = ("xxhash", "xxhash_cbor")


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _overrides(value: Any) -> str:
    if callable(value):
        return f"callable {getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', '?')}"
    return json.dumps(value, sort_keys=True, default=str)


def hash_seed_identity(algo: str) -> str:
    """What names the NONE_HASH seed of ``algo`` (a digest of PYTHONHASHSEED, or vLLM's
    fixed default).

    Raises:
        UsageError: a non-cryptographic hash with no PYTHONHASHSEED: its seed is random per
            process, so replicas never agree on a key.
    """
    seed = os.environ.get("PYTHONHASHSEED")
    if seed is not None:
        return f"PYTHONHASHSEED digest {_digest(seed.encode())}"
    if algo in NON_CRYPTO_HASH_ALGOS:
        raise UsageError(
            f"prefix_caching_hash_algo {algo!r} seeds its block hashes at random in every "
            "process unless PYTHONHASHSEED is set, so replicas could never share the offload "
            "tier: set the same PYTHONHASHSEED in every replica, or use sha256"
        )
    return "vLLM's fixed default"


def platform_name(platform: Any) -> str:
    """vLLM's platform, by its class and device type."""
    return f"{type(platform).__name__} ({platform.device_type or 'no device'})"


def config_identity(vllm_config: Any) -> dict[str, Any]:
    """The fields of a replica's identity that vLLM's config decides before its KV cache is
    sized (the model, weights, dtype, block size, parallel layout, block hash, platform and
    release): what :func:`replica_identity` holds less the KV geometry of the spec.

    Raises:
        UsageError: a hash algorithm whose seed replicas cannot share.
    """
    from vllm.platforms import current_platform

    model, cache, par = vllm_config.model_config, vllm_config.cache_config, \
        vllm_config.parallel_config
    return {
        **weights_fields(model.model, "model"),
        "revision": model.revision,
        "hf_overrides": _overrides(model.hf_overrides),
        "quantization": model.quantization,
        "model_dtype": str(model.dtype).removeprefix("torch."),
        "block_size": cache.block_size,
        "tensor_parallel_size": par.tensor_parallel_size,
        "pipeline_parallel_size": par.pipeline_parallel_size,
        "decode_context_parallel_size": par.decode_context_parallel_size,
        "prefill_context_parallel_size": par.prefill_context_parallel_size,
        "world_size": par.world_size,
        "hash_algorithm": cache.prefix_caching_hash_algo,
        "hash_seed": hash_seed_identity(cache.prefix_caching_hash_algo),
        "platform": platform_name(current_platform),
        "vllm_release": ".".join(map(str, VLLM_RELEASE)),
        "vllm_version": VLLM_RELEASE_VERSION,
    }


def replica_identity(spec: Any, vllm_config: Any) -> dict[str, Any]:
    """The identity of the replica ``spec`` belongs to (the fields of the module
    docstring), from vLLM's whole config: :func:`config_identity` and the spec's KV
    geometry.

    Raises:
        UsageError: a hash algorithm whose seed replicas cannot share.
    """
    cfg = spec.config
    layers = [list(g.layer_names) for g in cfg.groups]
    return {
        **config_identity(vllm_config),
        "kv_cache_dtype": cfg.model.dtype,
        "kv_layers": _digest(json.dumps(layers).encode()),
        "num_kv_layers": sum(len(g) for g in layers),
        "tokens_per_block": list(spec.tokens_per_block),
        "tokens_per_hash": spec.tokens_per_hash,
        "blocks_per_chunk": spec.blocks_per_chunk,
        "kv_bytes_per_chunk": spec.kv_bytes_per_chunk,
        "cpu_page_size_per_worker": spec.cpu_page_size_per_worker,
        "num_chunks": spec.num_chunks,
        "kv_cache_layout": cfg.kv_cache_layout,
        "canonical_layout": cfg.canonical_layout,
        "slot_writers": ("rank 0 writes the one slot (replicated layout)"
                         if spec.replicated_layout else "worker rank r writes slot r"),
    }


def check_identity(tier: TierTable, pool: str, identity: dict[str, Any], *,
                   record: bool = True, partial: bool = False) -> None:
    """Records ``identity`` as the tier's (if none is and ``record``), or checks that it
    equals the tier's but for the fields only shown (``SHOWN_FIELDS``); caller holds the
    pool lock. ``partial``: ``identity`` holds some of the fields
    (:func:`config_identity`), and only those are compared.

    Raises:
        LayoutMismatchError: fields differ (each named, with both values, then the shown
            ones, and the way to start afresh), or the identity does not fit the table.
    """
    blob = json.dumps(identity, sort_keys=True).encode()
    if len(blob) > IDENTITY_MAX:
        raise LayoutMismatchError(
            f"replica identity of {len(blob)} bytes does not fit the tier table "
            f"({IDENTITY_MAX} bytes); shorten the model path"
        )
    recorded = tier.read_identity()
    if not recorded:
        if record:
            tier.write_identity(blob)
        return
    theirs = json.loads(recorded)
    names = list(identity)
    if not partial:
        names += [name for name in theirs if name not in identity]
    named = differing_fields(theirs, identity, names)
    if named:
        fields = "; ".join(f"{name}: this replica {identity.get(name)!r}, the tier "
                           f"{theirs.get(name)!r}" for name in named) + shown_note(named)
        raise LayoutMismatchError(
            f"pool {pool!r}: this replica differs from the replicas sharing the offload tier "
            f"({fields}). Replicas of one tier must run the same model, weights, parallel "
            "layout, KV format, chunk size and block hashing. To start the tier afresh, stop "
            f"every replica using it and run `shmkv unlink {pool}`; or give this replica "
            "another shmkv_pool"
        )
