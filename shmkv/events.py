"""KV-cache events in vLLM 0.33.0's wire format, as msgspec Structs.

Class names, field names, field order, defaults and struct options follow
``vllm.distributed.kv_events``, so a consumer that decodes vLLM's ``KVEventBatch`` decodes
shmkv's, and the other way round: events are tagged maps (``"type"`` = class name) with
default-valued fields omitted; a batch is the array ``[ts, events, data_parallel_rank?]``.

- ``BlockStored``: one per ``cache_full_blocks`` call, for the blocks it cached (hashes
  without the group id), with the logical parent hash and the tokens they cover.
- ``BlockRemoved``: one per key evicted from the prefix cache.
- ``AllBlocksCleared``: a successful ``reset_prefix_cache``.

Hashes in events are integers (the low 64 bits of the digest) unless
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``, exactly as in vLLM 0.33.0.
"""

from __future__ import annotations

import os
from typing import Any, Union

import msgspec

from shmkv.errors import ProtocolError

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"

ExternalBlockHash = Union[bytes, int]  # noqa: UP007  (msgspec needs a runtime union on 3.10)


INT_BLOCK_HASHES_ENV = "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"
_LOW_64_BITS = (1 << 64) - 1


def use_int_block_hashes() -> bool:
    """Whether events carry hashes as integers (vLLM's default) rather than 32 bytes.

    Read from vLLM's own variable, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` (default "1"), at
    each event, as vLLM reads it, so one setting governs both.
    """
    return bool(int(os.getenv(INT_BLOCK_HASHES_ENV, "1")))


def external_block_hash(block_hash: bytes, as_int: bool) -> ExternalBlockHash:
    """The form of a hash published in events: the low 64 bits of the digest read as a
    big-endian integer, or the digest itself."""
    return int.from_bytes(block_hash, "big") & _LOW_64_BITS if as_int else block_hash


def short_hash(block_hash: bytes | int) -> str:
    """A block hash as the commands print it (``shmkv events``, ``shmkv inspect --keys``):
    16 hex digits of its low 64 bits, which is the integer form events carry by default
    (:func:`external_block_hash`), so a digest and its integer form print the same."""
    if isinstance(block_hash, int):
        return f"{block_hash & _LOW_64_BITS:016x}"
    return f"{external_block_hash(bytes(block_hash), True):016x}"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A batch of events: ``[ts, events, data_parallel_rank]``."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the KV-cache events; tagged with the class name under ``"type"``."""


class BlockStored(KVCacheEvent):
    """Blocks entered the prefix cache."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None  # deprecated in vLLM, kept for its wire format
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks left the prefix cache (one event per evicted key)."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """The whole prefix cache was reset."""


class KVEventBatch(EventBatch):
    """An ``EventBatch`` whose events are KV-cache events."""

    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


_encoder = msgspec.msgpack.Encoder()
_batch_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    """msgpack bytes of a batch, as vLLM publishes them."""
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decodes a batch encoded by shmkv or by vLLM.

    Raises:
        ProtocolError: the bytes are not a KV-event batch.
    """
    try:
        return _batch_decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"not a KV-event batch ({len(payload)} bytes): {exc}") from exc
