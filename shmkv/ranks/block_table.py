"""The names ``shmkv.ranks.block_table`` has always offered, from the modules that hold them.

- ``shmkv/ranks/tables.py``: ``SharedBlockTables``, ``BlockTableSnapshot`` and the block-table
  segment's layout (its docstring);
- ``shmkv/ranks/slot_mapping.py``: ``compute_slot_mapping``, ``batch_token_indices``;
- ``shmkv/ranks/kv_store.py``: ``KVStore`` and the KV store segment's layout (its docstring);
- ``shmkv/ranks/cuda_ipc.py``: ``export_device_tensor``, ``open_device_tensor``.

Like them, it imports torch on first use only.
"""

from __future__ import annotations

from shmkv.ranks._common import MAX_BLOCK_ID
from shmkv.ranks.cuda_ipc import export_device_tensor, open_device_tensor
from shmkv.ranks.kv_store import (
    KV_HEADER_BYTES,
    KV_HEADER_DTYPE,
    KV_LAYOUT_VERSION,
    KV_MAGIC,
    KVStore,
    kv_store_segment_name,
)
from shmkv.ranks.slot_mapping import PAD_SLOT_ID, batch_token_indices, compute_slot_mapping
from shmkv.ranks.tables import (
    BT_HEADER_DTYPE,
    BT_LAYOUT_VERSION,
    BT_MAGIC,
    DEFAULT_READ_TIMEOUT_S,
    MAX_KV_CACHE_GROUPS,
    BlockTableSnapshot,
    SharedBlockTables,
    block_tables_segment_name,
)

__all__ = [
    "BT_HEADER_DTYPE", "BT_LAYOUT_VERSION", "BT_MAGIC", "DEFAULT_READ_TIMEOUT_S",
    "KV_HEADER_BYTES", "KV_HEADER_DTYPE", "KV_LAYOUT_VERSION", "KV_MAGIC", "MAX_BLOCK_ID",
    "MAX_KV_CACHE_GROUPS", "PAD_SLOT_ID", "BlockTableSnapshot", "KVStore", "SharedBlockTables",
    "batch_token_indices", "block_tables_segment_name", "compute_slot_mapping",
    "export_device_tensor", "kv_store_segment_name", "open_device_tensor",
]
