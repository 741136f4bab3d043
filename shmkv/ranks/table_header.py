"""The block-table segment's header and name (the layout is drawn in ``shmkv/ranks/tables.py``'s
docstring): what the tables' writer and readers both index."""

from __future__ import annotations

import numpy as np

from shmkv.pool import layout as L

BT_LAYOUT_VERSION = L.BT_LAYOUT_VERSION
BT_MAGIC = L.BT_MAGIC  # bytes all different, like the pool's MAGIC
MAX_KV_CACHE_GROUPS = 8

BT_HEADER_DTYPE = np.dtype([
    ("magic", "<u8"), ("layout_version", "<u4"), ("header_bytes", "<u4"),
    ("total_bytes", "<u8"), ("num_groups", "<u4"), ("max_num_reqs", "<u4"),
    ("max_model_len", "<u4"), ("creator_pid", "<u4"), ("seq", "<u8"), ("step", "<i8"),
    ("block_sizes", "<u4", (MAX_KV_CACHE_GROUPS,)),
    ("max_num_blocks_per_req", "<u4", (MAX_KV_CACHE_GROUPS,)),
    ("_pad", "V", 256 - 56 - 8 * MAX_KV_CACHE_GROUPS),
])
assert BT_HEADER_DTYPE.itemsize == 256
SEQ_WORD = BT_HEADER_DTYPE.fields["seq"][1] // 8
STEP_WORD = BT_HEADER_DTYPE.fields["step"][1] // 8


def block_tables_segment_name(name: str) -> str:
    return L.sibling_segment_name("bt", name, BT_LAYOUT_VERSION)
