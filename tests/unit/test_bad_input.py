"""Bad input gets a clear error and changes nothing.

For every public entry point of BlockPool: each kind of bad argument raises the documented
error with a message that says what is wrong, and a rejected mutating call leaves the segment
byte-for-byte unchanged and records no event.
"""

from __future__ import annotations

import mmap
import os
import re
from contextlib import contextmanager

import numpy as np
import posix_ipc
import pytest

from shmkv import (
    LAYOUT_VERSION,
    BlockPool,
    LayoutMismatchError,
    OutOfBlocksError,
    PoolClosedError,
    SegmentError,
    SegmentExistsError,
    SegmentNotFoundError,
    ShmKVError,
    UsageError,
)
from shmkv.pool import layout as L
from tests.conftest import unique_pool_name
from tests.helpers import make_request, segment_image

# ----------------------------------------------------------------------------- fixtures


def _our_segments() -> set[str]:
    """Segments in /dev/shm named after a pool of this test process."""
    return {f for f in os.listdir("/dev/shm") if f.startswith(f"shmkv-t-{os.getpid()}-")}


@pytest.fixture(autouse=True)
def nothing_left_in_dev_shm():
    """Every test of this module leaves /dev/shm as it found it (torn down last)."""
    before = _our_segments()
    yield
    assert _our_segments() - before == set()


@pytest.fixture
def raw_segment():
    """Factory for raw (non-shmkv) POSIX segments under a pool's name; unlinked at teardown."""
    made: list[str] = []

    def factory(content: bytes, size: int | None = None) -> str:
        name = unique_pool_name()
        shm_name = L.segment_name(name)
        size = len(content) if size is None else size
        shm = posix_ipc.SharedMemory(shm_name, posix_ipc.O_CREX, mode=0o600, size=size)
        made.append(shm_name)
        try:
            if size:
                with mmap.mmap(shm.fd, size) as m:
                    m[: len(content)] = content
        finally:
            shm.close_fd()
        return name

    yield factory
    for shm_name in made:
        try:
            posix_ipc.unlink_shared_memory(shm_name)
        except posix_ipc.ExistentialError:
            pass


def read_segment(name: str) -> bytes:
    """The bytes of a segment, read through a fresh mapping."""
    shm = posix_ipc.SharedMemory(L.segment_name(name))
    try:
        if shm.size == 0:
            return b""
        with mmap.mmap(shm.fd, shm.size) as m:
            return bytes(m)
    finally:
        shm.close_fd()


@pytest.fixture
def pool(make_pool) -> BlockPool:
    """An 11-block pool with events on, in a realistic state (see ``populate``)."""
    return populate(make_pool(11, enable_kv_cache_events=True))


def populate(pool: BlockPool) -> BlockPool:
    """Leaves blocks 1-3 held and cached, 4 held uncached, 5-6 free and cached, the rest free.

    Pending events are left in the queue on purpose; ``rejected`` checks they survive.
    """
    req = make_request(96)  # 6 full blocks
    held = pool.get_new_blocks(4)
    pool.cache_full_blocks(req, held, 0, 3, 16, 0)
    freed = pool.get_new_blocks(2)
    pool.cache_full_blocks(make_request(32, first_token=500), freed, 0, 2, 16, 0)
    pool.free_blocks(reversed(freed))
    pool.check_invariants()
    return pool


def first_diff(before: bytes, after: bytes) -> str:
    if len(before) != len(after):
        return f"size {len(before)} -> {len(after)}"
    diff = np.flatnonzero(np.frombuffer(before, np.uint8) != np.frombuffer(after, np.uint8))
    return f"{len(diff)} byte(s) differ, first at offset {int(diff[0])}" if len(diff) else ""


@contextmanager
def rejected(pool: BlockPool, exc_type=UsageError, match: str | None = None):
    """Expects ``exc_type``; afterwards the segment and the pending events are unchanged."""
    before = segment_image(pool)
    pending = list(pool._event_queue)
    with pytest.raises(exc_type, match=match) as info:
        yield info
    after = segment_image(pool)
    assert after == before, f"rejected call changed the segment: {first_diff(before, after)}"
    assert pool.take_events() == pending, "rejected call changed the event queue"
    pool.check_invariants()


def held(pool: BlockPool) -> list:
    return [b for b in pool.blocks[1:] if b.ref_cnt > 0]


# ----------------------------------------------------------------------------- create


@pytest.mark.parametrize("num_gpu_blocks", [0, -1, "10", True, 10.0, None])
def test_create_rejects_bad_num_gpu_blocks(pool_name, num_gpu_blocks):
    """create() with num_gpu_blocks that is not a positive int raises UsageError, no segment."""
    with pytest.raises(UsageError, match="num_gpu_blocks") as info:
        BlockPool.create(pool_name, num_gpu_blocks)
    assert isinstance(info.value, ValueError)
    assert repr(num_gpu_blocks) in str(info.value) or str(num_gpu_blocks) in str(info.value)
    assert not os.path.exists(f"/dev/shm{L.segment_name(pool_name)}")


@pytest.mark.parametrize("hash_block_size", [0, -16, "16", True])
def test_create_rejects_bad_hash_block_size(pool_name, hash_block_size):
    """create() with a hash_block_size that is not a positive int raises UsageError."""
    with pytest.raises(UsageError, match="hash_block_size"):
        BlockPool.create(pool_name, 8, hash_block_size=hash_block_size)
    assert not os.path.exists(f"/dev/shm{L.segment_name(pool_name)}")


BAD_NAMES = {
    "slash": ("a/b", "contains '/'"),
    "leading_slash": ("/abc", "contains '/'"),
    "empty": ("", "empty"),
    "too_long": ("x" * (L.MAX_POOL_NAME_CHARS + 1), f"at most {L.MAX_POOL_NAME_CHARS}"),
    "space": ("a b", "letters, digits"),
    "leading_dot": (".hidden", "start with a letter or digit"),
    "not_str": (42, "must be a str"),
}


@pytest.mark.parametrize("case", BAD_NAMES)
def test_create_rejects_bad_name(case):
    """create() with a bad pool name raises UsageError (a ValueError) saying why."""
    name, why = BAD_NAMES[case]
    before = set(os.listdir("/dev/shm"))
    with pytest.raises(UsageError, match=re.escape(why)) as info:
        BlockPool.create(name, 8)
    assert isinstance(info.value, ValueError)
    assert set(os.listdir("/dev/shm")) - before == set()


def test_create_name_at_length_limit_works():
    """A name of exactly MAX_POOL_NAME_CHARS characters is accepted (boundary)."""
    name = unique_pool_name().ljust(L.MAX_POOL_NAME_CHARS, "x")
    with BlockPool.create(name, 4) as pool:
        assert pool.pool_name == name


def test_create_over_existing_segment(pool):
    """create() under the name of a live pool raises SegmentExistsError; that pool is untouched."""
    with rejected(pool, SegmentExistsError, match="already exists"):
        BlockPool.create(pool.pool_name, 11)
    assert len(held(pool)) == 4


def test_create_over_foreign_segment(raw_segment):
    """create() over a foreign segment of the same name raises SegmentExistsError, no write."""
    name = raw_segment(b"\xab" * 4096)
    with pytest.raises(SegmentExistsError):
        BlockPool.create(name, 8)
    assert read_segment(name) == b"\xab" * 4096


# ----------------------------------------------------------------------------- attach


def test_attach_missing_segment(pool_name):
    """attach() to a name without a segment raises SegmentNotFoundError naming it."""
    with pytest.raises(SegmentNotFoundError, match=re.escape(L.segment_name(pool_name))):
        BlockPool.attach(pool_name)


@pytest.mark.parametrize("case", ["slash", "empty", "too_long"])
def test_attach_bad_name(case):
    """attach() with a bad pool name raises UsageError before touching /dev/shm."""
    name, why = BAD_NAMES[case]
    with pytest.raises(UsageError, match=re.escape(why)):
        BlockPool.attach(name)


def test_attach_garbage_segment(raw_segment):
    """attach() to a segment full of garbage raises LayoutMismatchError naming magic."""
    garbage = bytes((i * 37 + 11) % 256 for i in range(8192))
    name = raw_segment(garbage)
    with pytest.raises(LayoutMismatchError, match="magic") as info:
        BlockPool.attach(name)
    assert "not a shmkv segment" in str(info.value)
    assert read_segment(name) == garbage


def test_attach_zero_filled_segment(raw_segment):
    """attach() to a zero-filled segment (right size, no header) raises on magic."""
    name = raw_segment(bytes(8192))
    with pytest.raises(LayoutMismatchError, match="magic"):
        BlockPool.attach(name)


def test_attach_empty_segment(raw_segment):
    """attach() to an empty (0-byte) segment raises LayoutMismatchError saying so."""
    name = raw_segment(b"", size=0)
    with pytest.raises(LayoutMismatchError, match=r"empty \(0 bytes\)"):
        BlockPool.attach(name)


def test_attach_segment_smaller_than_header(raw_segment):
    """attach() to a segment smaller than a header raises LayoutMismatchError with the size."""
    name = raw_segment(b"\x01" * 100)
    with pytest.raises(LayoutMismatchError, match=r"is 100 bytes, smaller than a shmkv header"):
        BlockPool.attach(name)


def test_attach_truncated_pool(pool, raw_segment):
    """attach() to a copy of a real pool cut short raises LayoutMismatchError with both sizes."""
    image = segment_image(pool)
    name = raw_segment(image[: len(image) // 2])
    with pytest.raises(LayoutMismatchError, match=rf"is {len(image) // 2} bytes but its header "
                       rf"describes {len(image)}"):
        BlockPool.attach(name)


def test_attach_other_layout_version(pool):
    """attach() to a segment of another layout version names layout_version, expected vs found."""
    hdr = pool._layout.view(pool._segment.buf, "header")
    hdr["layout_version"] = LAYOUT_VERSION + 1
    patched = segment_image(pool)
    with pytest.raises(LayoutMismatchError, match="layout_version") as info:
        BlockPool.attach(pool.pool_name)
    msg = str(info.value)
    assert f"is {LAYOUT_VERSION + 1}" in msg and f"expected {LAYOUT_VERSION}" in msg
    assert segment_image(pool) == patched


def test_attach_mismatching_config_lists_every_field(pool):
    """attach() with expected config values that differ lists every differing field."""
    before = segment_image(pool)
    with pytest.raises(LayoutMismatchError) as info:
        BlockPool.attach(pool.pool_name, num_gpu_blocks=12, hash_block_size=32,
                         enable_kv_cache_events=False)
    msg = str(info.value)
    assert "num_blocks: expected 12, found 11" in msg
    assert "hash_block_size: expected 32, found 16" in msg
    assert "enable_kv_cache_events: expected False, found True" in msg
    assert "enable_caching" not in msg  # not given, so not compared
    assert segment_image(pool) == before


def test_attach_matching_config_works(pool):
    """attach() with the right expected config succeeds and sees the same pool (control)."""
    other = BlockPool.attach(pool.pool_name, num_gpu_blocks=11, hash_block_size=16,
                             enable_caching=True, enable_kv_cache_events=True)
    try:
        assert other.get_num_free_blocks() == pool.get_num_free_blocks()
    finally:
        other.close()


def test_attach_initializing_segment(pool):
    """attach() to a segment whose creator never finished raises SegmentError (INITIALIZING)."""
    pool._layout.view(pool._segment.buf, "header")["state"] = L.STATE_INITIALIZING
    with pytest.raises(SegmentError, match="INITIALIZING") as info:
        BlockPool.attach(pool.pool_name)
    assert not isinstance(info.value, LayoutMismatchError)


# ----------------------------------------------------------------------------- get_new_blocks


@pytest.mark.parametrize("extra", [1, 100])
def test_get_new_blocks_too_many(pool, extra):
    """Asking for more blocks than are free raises vLLM's exact ValueError; nothing changes."""
    n = pool.get_num_free_blocks() + extra
    with rejected(pool, OutOfBlocksError) as info:
        pool.get_new_blocks(n)
    assert str(info.value) == f"Cannot get {n} free blocks from the pool"
    assert isinstance(info.value, ValueError) and isinstance(info.value, ShmKVError)


def test_get_new_blocks_exactly_all_free_works(pool):
    """Asking for exactly the free count succeeds (the boundary of the error above)."""
    n = pool.get_num_free_blocks()
    assert len(pool.get_new_blocks(n)) == n
    assert pool.get_num_free_blocks() == 0
    with rejected(pool, OutOfBlocksError, match="^Cannot get 1 free blocks from the pool$"):
        pool.get_new_blocks(1)


@pytest.mark.parametrize("count", [-1, -100, np.int64(-2)])
def test_get_new_blocks_negative(pool, count):
    """A negative count raises UsageError naming the call and the count; nothing changes."""
    with rejected(pool, UsageError, match=r"^get_new_blocks\(\): num_blocks must be >= 0, got "):
        pool.get_new_blocks(count)


@pytest.mark.parametrize("method", ["get_new_blocks", "has_free_blocks"])
@pytest.mark.parametrize("count", ["2", 2.0, 1.5, None, [2], True])
def test_block_count_non_int(pool, method, count):
    """A count that is not an int raises UsageError naming the call; nothing changes."""
    with rejected(pool, UsageError, match=rf"^{method}\(\): num_blocks must be an int"):
        getattr(pool, method)(count)


def test_has_free_blocks_counts(pool):
    """With nobody dead, has_free_blocks is the free count's answer (numpy ints too)."""
    n = pool.get_num_free_blocks()
    assert pool.has_free_blocks(n) and pool.has_free_blocks(np.int32(0))
    assert not pool.has_free_blocks(n + 1)
    # vLLM's managers can ask for fewer than none (Mamba "align" with draft tokens): fits.
    assert pool.has_free_blocks(-1) and pool.has_free_blocks(np.int64(-3))
    pool.check_invariants()


# ----------------------------------------------------------------------------- free_blocks


def test_free_blocks_double_free(pool):
    """Freeing a block that is already free raises UsageError saying so; nothing changes."""
    free_handle = pool.blocks[pool.get_free_block_ids()[0]]
    with rejected(pool, match=r"ref_cnt 0 but is freed 1 time\(s\) \(it is already free\)"):
        pool.free_blocks([*held(pool), free_handle])  # the held ones are not freed either


def test_free_blocks_double_free_bulk_path(make_pool):
    """The same double free through the bulk (numpy) path, 24+ blocks, changes nothing."""
    pool = make_pool(40, enable_kv_cache_events=True)
    blocks = pool.get_new_blocks(30)
    pool.free_blocks(blocks[:1])
    with rejected(pool, match=rf"block {blocks[0].block_id} has ref_cnt 0.*already free"):
        pool.free_blocks(blocks[1:] + blocks[:1])


def test_free_blocks_same_block_twice_in_one_call(pool):
    """Freeing a ref_cnt-1 block twice in one call raises UsageError; nothing changes."""
    b = pool.blocks[4]
    assert b.ref_cnt == 1
    with rejected(pool, match=r"block 4 has ref_cnt 1 but is freed 2 time\(s\)"):
        pool.free_blocks([pool.blocks[1], b, pool.blocks[2], b])


def test_free_blocks_more_times_than_referenced(pool):
    """A block with ref_cnt 2 freed three times in one call is rejected; nothing changes."""
    b = pool.blocks[1]
    pool.touch([b])
    assert b.ref_cnt == 2
    with rejected(pool, match=r"block 1 has ref_cnt 2 but is freed 3 time\(s\)"):
        pool.free_blocks([b, b, b])


def test_free_blocks_id_out_of_range(pool, make_pool):
    """A handle from a bigger pool raises UsageError naming the id and range; nothing changes."""
    big = make_pool(32)
    stranger = big.blocks[20]
    with rejected(pool, match=r"free_blocks\(\): block id 20 is out of range \[0, 11\)"):
        pool.free_blocks([pool.blocks[1], stranger])


def test_free_blocks_not_handles(pool):
    """Plain ints instead of block handles raise UsageError; nothing changes."""
    with rejected(pool, match=r"free_blocks\(\) takes KVCacheBlock handles"):
        pool.free_blocks([1, 2])


# ----------------------------------------------------------------------------- touch


def test_touch_id_out_of_range(pool, make_pool):
    """touch() with a handle from a bigger pool raises UsageError; earlier ones not touched."""
    stranger = make_pool(32).blocks[11]
    free_cached = pool.blocks[pool.get_free_block_ids()[-1]]
    with rejected(pool, match=r"touch\(\): block id 11 is out of range \[0, 11\)"):
        pool.touch([pool.blocks[1], free_cached, stranger])


def test_touch_not_handles(pool):
    """touch() with plain ints raises UsageError; nothing changes."""
    with rejected(pool, match=r"touch\(\) takes KVCacheBlock handles"):
        pool.touch([5])


# ----------------------------------------------------------------------------- cache_full_blocks


@pytest.fixture
def fresh(pool):
    """Three newly allocated, uncached blocks of ``pool`` and a request covering them."""
    return pool.get_new_blocks(3), make_request(48, first_token=9000)


def test_cache_full_blocks_too_few_hashes(pool, fresh):
    """Fewer request hashes than num_full_blocks raises UsageError with the counts."""
    blocks, _ = fresh
    short = make_request(32, first_token=9000)  # 2 hashes for 3 blocks
    with rejected(pool, match=r"the request has 2 block hashes .* 3 are needed"):
        pool.cache_full_blocks(short, blocks, 0, 3, 16, 0)


def test_cache_full_blocks_too_few_hashes_at_block_size(pool, fresh):
    """Hashes enough at hash_block_size but too few at a 2x block size are rejected."""
    blocks, req = fresh  # 3 hashes of 16 tokens = 1 hash of 32 tokens
    with rejected(pool, match=r"3 block hashes at 16 tokens, 1 at block size 32; 2 are needed"):
        pool.cache_full_blocks(req, blocks, 0, 2, 32, 0)


@pytest.mark.parametrize("width", [16, 33, 0])
def test_cache_full_blocks_wrong_hash_length(pool, fresh, width):
    """A request hash of the wrong width raises UsageError; the valid ones before it are not
    cached either."""
    blocks, req = fresh
    req.block_hashes[2] = req.block_hashes[2][:width] if width < 32 else req.block_hashes[2] + b"!"
    with rejected(pool, match=r"block hash 2 must be 32 bytes"):
        pool.cache_full_blocks(req, blocks, 0, 3, 16, 0)


def test_cache_full_blocks_hash_not_bytes(pool, fresh):
    """A request hash that is a str (even of 32 characters) is rejected; nothing changes."""
    blocks, req = fresh
    req.block_hashes[0] = "x" * 32
    with rejected(pool, match=r"block hash 0 must be 32 bytes"):
        pool.cache_full_blocks(req, blocks, 0, 3, 16, 0)


def test_cache_full_blocks_block_already_cached(pool, fresh):
    """Caching a block that already holds a key raises UsageError; the others are not cached."""
    blocks, req = fresh
    cached = pool.blocks[2]  # cached by populate() with 32 tokens
    with rejected(pool, match=r"block 2 is already cached \(32 tokens, asked for 32\)"):
        pool.cache_full_blocks(req, [blocks[0], cached, blocks[2]], 0, 3, 16, 0)


def test_cache_full_blocks_same_block_twice(pool, fresh):
    """The same uncached block twice in one call's range is rejected; nothing changes."""
    blocks, req = fresh
    with rejected(pool, match=r"block \d+ appears twice in the blocks to cache"):
        pool.cache_full_blocks(req, [blocks[0], blocks[0], blocks[1]], 0, 3, 16, 0)


@pytest.mark.parametrize(
    "block_size, match",
    [
        (24, r"block_size 24 is not a positive multiple of hash_block_size 16"),
        (8, r"block_size 8 is not a positive multiple of hash_block_size 16"),
        (0, r"block_size 0 is not a positive multiple"),
        (-16, r"block_size must be an int >= 0, got -16"),
        (16.0, r"block_size must be an int >= 0, got 16.0"),
    ],
)
def test_cache_full_blocks_bad_block_size(pool, fresh, block_size, match):
    """A block_size that is not a positive multiple of hash_block_size is rejected."""
    blocks, req = fresh
    with rejected(pool, match=match):
        pool.cache_full_blocks(req, blocks, 0, 1, block_size, 0)


@pytest.mark.parametrize("mask", [[True, True], [True] * 4, []])
def test_cache_full_blocks_mask_wrong_length(pool, fresh, mask):
    """A block_mask whose length is not the number of new blocks is rejected."""
    blocks, req = fresh
    with rejected(pool, match=rf"block_mask has {len(mask)} entries for 3 blocks"):
        pool.cache_full_blocks(req, blocks, 0, 3, 16, 0, block_mask=mask)


def test_cache_full_blocks_fewer_blocks_than_num_full(pool, fresh):
    """num_full_blocks beyond the blocks given is rejected."""
    blocks, req = fresh
    with rejected(pool, match=r"blocks has 2 entries, fewer than num_full_blocks 3"):
        pool.cache_full_blocks(req, blocks[:2], 0, 3, 16, 0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_cached_blocks": -1}, r"num_cached_blocks must be an int >= 0, got -1"),
        ({"kv_cache_group_id": -1}, r"kv_cache_group_id must be an int >= 0, got -1"),
        ({"kv_cache_group_id": 1 << 31}, r"kv_cache_group_id 2147483648 >= 2\*\*31"),
        ({"kv_cache_group_id": "0"}, r"kv_cache_group_id must be an int >= 0, got '0'"),
    ],
)
def test_cache_full_blocks_bad_counts(pool, fresh, kwargs, match):
    """A negative or non-int num_cached_blocks / kv_cache_group_id is rejected."""
    blocks, req = fresh
    args = {"num_cached_blocks": 0, "kv_cache_group_id": 0} | kwargs
    with rejected(pool, match=match):
        pool.cache_full_blocks(req, blocks, args["num_cached_blocks"], 3, 16,
                               args["kv_cache_group_id"])


def test_cache_full_blocks_id_out_of_range(pool, fresh, make_pool):
    """A handle from a bigger pool in the range is rejected; nothing changes."""
    blocks, req = fresh
    stranger = make_pool(32).blocks[30]
    with rejected(pool, match=r"block id 30 is out of range \[0, 11\)"):
        pool.cache_full_blocks(req, [blocks[0], stranger, blocks[2]], 0, 3, 16, 0)


# ----------------------------------------------------------------------------- get_cached_block


@pytest.mark.parametrize("width", [16, 31, 33, 0])
def test_get_cached_block_wrong_hash_width(pool, width):
    """A hash that is not 32 bytes raises UsageError naming the width; nothing changes."""
    with rejected(pool, match=rf"block hash must be 32 bytes \(sha256\), got {width}"):
        pool.get_cached_block(b"\x07" * width, [0])


# ----------------------------------------------------------------------------- evict_blocks


@pytest.mark.parametrize("bad", [11, -1, 10**12, np.int64(11)])
def test_evict_blocks_out_of_range(pool, bad):
    """An id outside [0, num_gpu_blocks) raises UsageError; cached ids before it stay cached."""
    bad_repr = re.escape(repr(bad))
    with rejected(pool, match=rf"evict_blocks\(\): block id {bad_repr} is not in \[0, 11\)"):
        pool.evict_blocks([1, 5, bad])


@pytest.mark.parametrize("bad", ["1", 1.0, None, True, b"\x01"])
def test_evict_blocks_non_int(pool, bad):
    """An id that is not an int (str, float, None, bool, bytes) raises UsageError."""
    with rejected(pool, match=r"evict_blocks\(\): block id .* is not in \[0, 11\)"):
        pool.evict_blocks([2, bad])


def test_evict_blocks_handle_instead_of_id(pool):
    """A block handle where an int id is expected is rejected; nothing changes."""
    with rejected(pool, match=r"evict_blocks\(\): block id KVCacheBlock"):
        pool.evict_blocks([pool.blocks[1]])


# ----------------------------------------------------------------------------- reset_prefix_cache


def test_reset_prefix_cache_with_blocks_in_use(pool):
    """reset_prefix_cache() with blocks in use returns False and changes nothing."""
    before = segment_image(pool)
    assert pool.reset_prefix_cache() is False
    assert segment_image(pool) == before


# ----------------------------------------------------------------------------- unlink


@pytest.mark.parametrize("case", ["slash", "empty", "too_long", "not_str"])
def test_unlink_bad_name(case):
    """unlink() with a bad pool name raises UsageError instead of touching another name."""
    name, why = BAD_NAMES[case]
    with pytest.raises(UsageError, match=re.escape(why)):
        BlockPool.unlink(name)


def test_unlink_missing_returns_false(pool_name):
    """unlink() of a name with no segment returns False rather than raising."""
    assert BlockPool.unlink(pool_name) is False


# ----------------------------------------------------------------------------- after close


CLOSED_CALLS = {
    "handle.ref_cnt": lambda p, h: h.ref_cnt,
    "handle.block_hash_num_tokens": lambda p, h: h.block_hash_num_tokens,
    "get_new_blocks": lambda p, h: p.get_new_blocks(1),
    "free_blocks": lambda p, h: p.free_blocks([h]),
    "touch": lambda p, h: p.touch([h]),
    "cache_full_blocks": lambda p, h: p.cache_full_blocks(make_request(32), [h], 0, 1, 16, 0),
    "get_num_free_blocks": lambda p, h: p.get_num_free_blocks(),
    "has_free_blocks": lambda p, h: p.has_free_blocks(1),
    "has_free_blocks (short: reaps)": lambda p, h: p.has_free_blocks(10**6),
    "get_usage": lambda p, h: p.get_usage(),
    "reset_prefix_cache": lambda p, h: p.reset_prefix_cache(),
    "handle.block_hash": lambda p, h: h.block_hash,
    "get_cached_block": lambda p, h: p.get_cached_block(b"\x00" * 32, [0]),
    "evict_blocks": lambda p, h: p.evict_blocks([1]),
    "free_blocks([])": lambda p, h: p.free_blocks([]),
    "get_free_block_ids": lambda p, h: p.get_free_block_ids(),
    "check_invariants": lambda p, h: p.check_invariants(),
}


@pytest.mark.parametrize("call", list(CLOSED_CALLS))
def test_use_after_close_raises_pool_closed(make_pool, call):
    """Any use of a closed pool or of one of its handles raises PoolClosedError."""
    pool = populate(make_pool(11))
    handle = pool.blocks[1]
    pool.close()
    fn = CLOSED_CALLS[call]
    with pytest.raises(PoolClosedError, match="closed") as info:
        fn(pool, handle)
    assert isinstance(info.value, UsageError)


def test_close_twice_and_repr_after_close(make_pool):
    """close() is idempotent and a handle's repr still works after it."""
    pool = make_pool(4)
    handle = pool.blocks[1]
    pool.close()
    pool.close()
    assert repr(handle) == "KVCacheBlock(block_id=1, <pool closed>)"


def test_closed_pool_leaves_segment_usable_for_others(make_pool):
    """Closing a pool gives back its references but keeps the prefix cache for a fresh
    attach."""
    pool = populate(make_pool(11))
    cached = {b.block_id: b.block_hash for b in pool.blocks if b.block_hash is not None}
    name = pool.pool_name
    pool.close()
    other = BlockPool.attach(name)
    try:
        other.check_invariants()
        assert other.get_num_free_blocks() == 10
        assert {b.block_id: b.block_hash for b in other.blocks if b.block_hash} == cached
    finally:
        other.close()


def test_a_call_that_fails_half_way_is_undone(make_pool, monkeypatch, kernel):
    """An exception out of the middle of a mutation (KeyboardInterrupt, MemoryError, a bug)
    does not leave it half done: the words it wrote are put back from the undo journal, as
    if the call had been rejected; calls made before it in the same hold stand."""
    from shmkv.pool.free_queue import FreeKVCacheBlockQueue

    pool = populate(make_pool(16, enable_kv_cache_events=True))
    pool.take_events()
    with pool.lock():
        # Made in the same hold as the failing calls. Two blocks: the Python kernel's
        # one-block free journals its words together before its first write and calls no
        # queue method a patch could cut it at.
        kept = pool.get_new_blocks(2)
        image = segment_image(pool)

        def interrupted(*args, **kwargs):
            raise KeyboardInterrupt

        # Python kernel: free() writes ref_cnt and the ledger, then queues the block.
        monkeypatch.setattr(FreeKVCacheBlockQueue, "prepend", interrupted)
        monkeypatch.setattr(FreeKVCacheBlockQueue, "prepend_n", interrupted)
        # Both kernels: allocation evicts a key (events on), then records its BlockRemoved.
        monkeypatch.setattr(pool, "_record_removed", interrupted)
        if kernel == "python":
            with pytest.raises(KeyboardInterrupt):
                pool.free_blocks(kept)
        with pytest.raises(KeyboardInterrupt):
            pool.get_new_blocks(pool.get_num_free_blocks())  # reaches the cached blocks
        assert segment_image(pool) == image
        assert pool.take_events() == []
    monkeypatch.undo()
    assert kept[0].ref_cnt == 1
    pool.free_blocks(kept)
    pool.check_invariants()


# ----------------------------------------------------------------------------- crash safety


@pytest.mark.parametrize("kwargs, match", [
    ({"journal_entries": 10}, "journal_entries must be an int in"),
    ({"journal_entries": 0}, "journal_entries must be a positive int"),
    ({"journal_entries": True}, "journal_entries must be a positive int"),
    ({"journal_entries": "64"}, "journal_entries must be an int"),
    ({"stuck_after_s": 0}, "stuck_after_s must be a positive number"),
    ({"stuck_after_s": "2"}, "stuck_after_s must be a positive number"),
    ({"lock_timeout_s": -1}, "lock_timeout_s must be a positive number"),
    ({"label": "x" * (L.MAX_LABEL_BYTES + 1)}, "at most 24 bytes"),
])
def test_create_rejects_bad_crash_safety_settings(pool_name, kwargs, match):
    """create() with a bad journal size, stuck bound, lock timeout or label raises
    UsageError naming it, and leaves nothing in /dev/shm."""
    before = set(os.listdir("/dev/shm"))
    with pytest.raises(UsageError, match=match):
        BlockPool.create(pool_name, 8, **kwargs)
    assert set(os.listdir("/dev/shm")) - before == set()


def test_attach_rejects_a_bad_stuck_bound(make_pool):
    pool = make_pool(8)
    before = segment_image(pool)
    with pytest.raises(UsageError, match="stuck_after_s"):
        BlockPool.attach(pool.pool_name, stuck_after_s=-0.5)
    assert segment_image(pool) == before
    assert [p["slot"] for p in pool.processes()] == [pool.slot]


@pytest.mark.parametrize("slot, match", [
    (5, "slot 5 is not an active slot"),
    (-1, "slot -1 is not an active slot"),
    (99, "slot 99 is not an active slot"),
    ("1", "slot must be an int"),
    (True, "slot must be an int"),
])
def test_reclaim_slot_rejects_what_is_not_another_active_slot(make_pool, slot, match):
    pool = populate(make_pool(16))
    with rejected(pool, match=match):
        pool.reclaim_slot(slot)
    with rejected(pool, match="own slot"):
        pool.reclaim_slot(pool.slot)


@pytest.mark.parametrize("op, n, match", [
    ("alocate", 3, "unknown operation 'alocate'"),
    ("allocate", 0, "must be an int >= 1"),
    ("allocate", True, "must be an int >= 1"),
])
def test_fault_arm_rejects_bad_plans(op, n, match):
    from shmkv.pool import fault

    with pytest.raises(ValueError, match=match):
        fault.arm(op, n)
    assert fault.planned is None


@pytest.mark.parametrize("spec", ["allocate", "allocate:x", "allocate:-2", "allocate:3:halt"])
def test_fault_env_rejects_bad_specs(monkeypatch, spec):
    from shmkv.pool import fault

    monkeypatch.setenv(fault.ENV_VAR, spec)
    with pytest.raises(ValueError, match="SHMKV_FAULT"):
        fault.arm_from_env()
    assert fault.planned is None


def test_fault_env_stop_mode(monkeypatch):
    """SHMKV_FAULT=<op>:<n>:stop plans a stop (SIGSTOP) instead of a kill."""
    from shmkv.pool import fault

    monkeypatch.setenv(fault.ENV_VAR, "allocate:3:stop")
    try:
        fault.arm_from_env()
        assert fault.planned == ("allocate", 3) and fault.stop_not_kill
        fault.arm("free", 2)
        assert fault.planned == ("free", 2) and not fault.stop_not_kill
    finally:
        fault.planned = None
        fault.stop_not_kill = False
