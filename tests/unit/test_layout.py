"""The layout table: sizes, alignment, and the docstring that must not drift from the code."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest

from shmkv.pool import layout as L
from shmkv.pool.layout import REGIONS, Layout, PoolConfig


def test_block_row_is_64_bytes_and_fields_are_where_the_fast_paths_read_them():
    """A block row fits the 64-byte budget and the flat-view field indices match the dtype."""
    assert L.BLOCK_DTYPE.itemsize == 64
    assert L.BLOCK_DTYPE.fields["prev"][0] == np.dtype("<i4")
    assert L.BLOCK_DTYPE.fields["next"][0] == np.dtype("<i4")
    row = np.zeros(1, L.BLOCK_DTYPE)
    flat32 = row.view("<i4")
    for field, index in [("ref_cnt", L.F_REF), ("prev", L.F_PREV), ("next", L.F_NEXT),
                         ("index_next", L.F_INDEX_NEXT), ("hash_num_tokens", L.F_HASH_TOKENS)]:
        row[field] = 1234
        assert flat32[index] == 1234, field
        row[field] = 0
    row["queue_key"] = -(1 << 40)
    assert row.view("<i8")[L.F_QUEUE_KEY] == -(1 << 40)


@pytest.mark.parametrize("num_blocks", [1, 11, 1000, 1 << 20])
def test_regions_are_aligned_and_disjoint(num_blocks):
    """Every region starts on a 64-byte boundary and none overlaps the next."""
    lay = Layout.from_config(PoolConfig(num_blocks=num_blocks, hash_block_size=16))
    end = 0
    for name, offset, nbytes, _ in lay.describe():
        assert offset % L.ALIGN_BYTES == 0, name
        assert offset >= end, name
        end = offset + nbytes
    assert lay.total_bytes >= end and lay.total_bytes % L.ALIGN_BYTES == 0
    assert lay.free_head == num_blocks and lay.free_tail == num_blocks + 1
    buckets = lay.config.num_index_buckets
    assert buckets >= 2 * num_blocks and buckets & (buckets - 1) == 0


def test_budget_is_at_most_64_bytes_per_block_plus_index_ledger_and_journal():
    """Metadata stays within 64 B per block plus the 4-byte index buckets (<= 4 per block)
    plus the ledger (4 B per block per process slot) plus the undo journal (16 B per entry,
    at most 32 MiB by default)."""
    n = 1 << 20
    cfg = PoolConfig(num_blocks=n, hash_block_size=16, max_processes=8)
    lay = Layout.from_config(cfg)
    ledger = 4 * n * cfg.max_processes
    assert cfg.journal_entries == L.default_journal_entries(n) == 1 << 21
    journal = 16 * cfg.journal_entries
    assert lay.total_bytes <= n * 64 + cfg.num_index_buckets * 4 + ledger + journal + 8192


def test_docstring_names_every_region_and_field():
    """The module docstring renders the table in code: every region and field appears."""
    doc = L.__doc__
    for region in REGIONS:
        assert f"`{region.name}`" in doc, region.name
    for dtype in (L.HEADER_DTYPE, L.BLOCK_DTYPE):
        for field in dtype.names:
            assert f"`{field}`" in doc, field
    assert f"- v{L.LAYOUT_VERSION}:" in doc


def test_magic_bytes_are_all_different():
    """The magic has 8 distinct bytes, so a byte-swapped read can never match it."""
    raw = L.MAGIC.to_bytes(8, "little")
    assert len(set(raw)) == 8
    assert int.from_bytes(raw, "big") != L.MAGIC


def test_segment_name_carries_the_layout_version():
    """Segment names are /shmkv-<name>-v<LAYOUT_VERSION>."""
    assert L.segment_name("pool.a_1") == f"/shmkv-pool.a_1-v{L.LAYOUT_VERSION}"


def test_segment_is_created_with_mode_0600(make_pool):
    """The segment file is readable and writable by its owner only."""
    pool = make_pool(4)
    mode = stat.S_IMODE(os.stat(f"/dev/shm{pool._segment.shm_name}").st_mode)
    assert mode & 0o077 == 0 and mode & 0o600 == 0o600


def test_header_echoes_the_config(make_pool):
    """The header records every config value, the creator pid and state READY."""
    pool = make_pool(13, hash_block_size=32, enable_caching=False, enable_kv_cache_events=True,
                      medium="CPU")
    hdr = pool.layout.view(pool._segment.buf, "header")[0]
    assert int(hdr["magic"]) == L.MAGIC
    assert int(hdr["layout_version"]) == L.LAYOUT_VERSION
    assert int(hdr["format_flags"]) == L.FLAG_KV_EVENTS
    assert int(hdr["num_blocks"]) == 13 and int(hdr["hash_block_size"]) == 32
    assert int(hdr["creator_pid"]) == os.getpid()
    assert int(hdr["state"]) == L.STATE_READY
    assert bytes(hdr["medium"]) == b"CPU"
    assert int(hdr["total_bytes"]) == pool.layout.total_bytes == len(pool._segment.buf)
