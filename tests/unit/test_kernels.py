"""The two kernels (pure Python, C) make byte-identical shared state, and the C kernel
treats corrupt shared memory as an error, never as a crash."""

from __future__ import annotations

import random

import numpy as np
import pytest

from shmkv import BlockPool, InvariantViolation, OutOfBlocksError, UsageError
from shmkv.pool.block_pool import _C_GEOMETRY, _ckernel
from tests.conftest import unique_pool_name
from tests.helpers import make_request, segment_image

needs_c = pytest.mark.skipif(_ckernel is None, reason="shmkv.pool._ckernel is not built")


def _state_bytes(pool: BlockPool) -> bytes:
    """The pool's shared state: block rows, index, ledger and the free-queue counters (not
    what names the process, nor the event log's timestamps)."""
    buf = pool._segment.buf
    lay = pool.layout
    parts = [bytes(lay.view(buf, name)) for name in ("block_meta", "index_buckets", "ledger")]
    hdr = lay.view(buf, "header")[0]
    counters = [int(hdr[f]) for f in ("num_free_blocks", "queue_head_key", "queue_tail_key",
                                      "next_event_seq", "log_write_pos")]
    return b"".join(parts) + repr(counters).encode()


def _workload(pool: BlockPool, rng: random.Random) -> list:
    """A seeded mix of every mutating call; returns what the calls returned."""
    results = []
    running = []
    for _ in range(300):
        op = rng.random()
        if op < 0.45:
            req = make_request(rng.randint(1, 80) * 4, first_token=rng.choice([0, 0, 1000, 5000]))
            hits = pool.get_cached_prefix(req.block_hashes)
            pool.touch(hits)
            need = -(-len(req.all_token_ids) // 16) - len(hits)
            try:
                blocks = hits + pool.get_new_blocks(need)
            except ValueError as exc:
                results.append(str(exc))
                pool.free_blocks(reversed(hits))
                continue
            pool.cache_full_blocks(req, blocks, len(hits), len(req.block_hashes), 16, 0)
            running.append(blocks)
            results.append([b.block_id for b in blocks])
        elif op < 0.85 and running:
            blocks = running.pop(rng.randrange(len(running)))
            if rng.random() < 0.3:  # to the queue's tail, hashed or not; reported on reuse
                pool.unpin_blocks(blocks, lambda b: results.append(("reused", b.block_id)))
            else:
                pool.free_blocks(reversed(blocks))
        elif op < 0.95:
            pool.evict_blocks({rng.randrange(pool.num_gpu_blocks)})
        else:
            results.append(pool.reset_prefix_cache())
        results.append(pool.take_events())
    return results


@needs_c
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kernels_write_identical_bytes(seed):
    """The same calls on a Python-kernel pool and a C-kernel pool leave byte-identical
    segments and return the same results and events."""
    pools = [
        BlockPool.create(unique_pool_name(), 97, enable_kv_cache_events=True, kernel=k)
        for k in ("python", "c")
    ]
    try:
        outcomes = [_workload(p, random.Random(seed)) for p in pools]
        assert outcomes[0] == outcomes[1]
        assert _state_bytes(pools[0]) == _state_bytes(pools[1])
        for p in pools:
            p.check_invariants()
    finally:
        for p in pools:
            name = p.pool_name
            p.close()
            BlockPool.unlink(name)


@needs_c
def test_c_kernel_refuses_another_geometry(make_pool):
    """A C kernel built for another row layout refuses to run rather than corrupt memory."""
    pool = make_pool(8, kernel="python")
    wrong = (_C_GEOMETRY[0] + 1,) + _C_GEOMETRY[1:]
    lay = pool.layout
    with pytest.raises(ValueError, match="built for another block layout"):
        _ckernel.Kernel(pool._segment.buf, lay.offsets["block_meta"],
                        lay.offsets["index_buckets"], lay.offsets["ledger"], 8,
                        lay.config.num_index_buckets, lay.offsets["journal"],
                        lay.config.journal_entries, 0, wrong)


@needs_c
@pytest.mark.parametrize("bad_next", [10**6, -7])
def test_c_kernel_corrupt_queue_raises_not_crashes(make_pool, bad_next):
    """A free-queue link that points outside the blocks raises InvariantViolation."""
    pool = make_pool(8, kernel="c")
    pool._blocks["next"][2] = bad_next
    with pytest.raises(InvariantViolation, match="corrupt shared state"):
        pool.get_new_blocks(5)


@pytest.mark.parametrize("bad_next", [10**6, -7, 0])
@pytest.mark.parametrize("n", [1, 5])
def test_a_corrupt_queue_link_is_refused_alike_then_repaired(make_pool, bad_next, n):
    """Both kernels refuse a free-queue link that leaves the free blocks with the same
    InvariantViolation, before any write, and the pool is repaired at once. The Python
    kernel used to raise IndexError, or follow -7 and 0 (negative and null rows) and
    corrupt the pool further."""
    pool = make_pool(8)
    if n == 1:
        pool._blocks["next"][pool.layout.free_head] = bad_next
    else:
        pool._blocks["next"][2] = bad_next
    row = bad_next
    with pytest.raises(InvariantViolation, match=f"corrupt shared state: free queue links .*"
                       f"\\(row {row}\\)"):
        pool.get_new_blocks(n)
    pool.check_invariants()
    assert len(pool.get_new_blocks(n)) == n


@needs_c
def test_c_kernel_corrupt_index_chain_raises_not_loops(make_pool):
    """A prefix-index chain that loops raises InvariantViolation instead of spinning."""
    pool = make_pool(8, kernel="c")
    req = make_request(32)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, 2, 16, 0)
    buckets = pool.layout.view(pool._segment.buf, "index_buckets")
    bucket = int(np.flatnonzero(buckets == blocks[0].block_id)[0])
    pool._blocks["index_next"][blocks[0].block_id] = blocks[0].block_id  # a self-loop
    probe = bytes(31) + b"\x01"
    probe = bytes(8) + probe[8:]  # any hash that lands in that bucket
    while pool._index.bucket_of(probe, 0) != bucket:
        probe = bytes([probe[0] + 1]) + probe[1:]
    with pytest.raises(InvariantViolation, match="prefix-index chain"):
        pool.get_cached_block(probe, [0])


@pytest.mark.parametrize("call", ["get_cached_block", "get_cached_prefix"])
def test_a_lookup_that_meets_a_looping_chain_repairs_the_pool(make_pool, call):
    """A lookup whose bucket chain loops raises InvariantViolation on both kernels and, like
    a write that meets corruption, repairs the pool under the same hold: the invariants hold
    again and the cached blocks are found by their keys. Lookups used to raise and leave
    the loop for every later lookup (and check_invariants, which poisons the pool)."""
    pool = make_pool(8)
    req = make_request(32)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, 2, 16, 0)
    b0 = blocks[0].block_id
    key = pool._index.block_key(b0)
    bucket = pool._index.bucket_of(bytes(key[0]), int(key[1]))
    pool._blocks["index_next"][b0] = b0  # a self-loop
    probe = next(p for p in (i.to_bytes(2, "big") + bytes(30) for i in range(1 << 16))
                 if pool._index.bucket_of(p, 0) == bucket)
    with pytest.raises(InvariantViolation, match="prefix-index chain"):
        if call == "get_cached_block":
            pool.get_cached_block(probe, [0])
        else:
            pool.get_cached_prefix([probe])
    assert pool.last_repair is not None and pool.last_repair.rebuilt
    pool.check_invariants()
    assert pool.get_cached_block(req.block_hashes[0], [0])[0].block_id == b0
    assert pool.get_cached_block(probe, [0]) is None


def test_unknown_kernel_is_a_usage_error(pool_name):
    """kernel= must name a kernel; nothing is left behind when it does not."""
    with pytest.raises(UsageError, match="kernel must be one of"):
        BlockPool.create(pool_name, 8, kernel="fortran")
    with pytest.raises(Exception, match="no shared-memory segment"):
        BlockPool.attach(pool_name)


def _cached_pair(pool):
    """Two cached blocks of one request; returns (block ids, the first block's bucket)."""
    req = make_request(32)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, 2, 16, 0)
    key = pool._index.block_key(blocks[0].block_id)
    return [b.block_id for b in blocks], pool._index.bucket_of(bytes(key[0]), int(key[1]))


def test_index_pop_of_block_missing_from_its_chain_raises_then_repairs(make_pool):
    """A hashed block whose bucket chain does not reach it: popping its key raises
    InvariantViolation on both kernels (the C kernel used to go on silently, leaving the
    chain as it was), the call changes nothing, and the pool is repaired under the same
    hold: the invariants hold again and the block is found by its key."""
    pool = make_pool(8)
    (b0, b1), bucket = _cached_pair(pool)
    key = pool._index.block_key(b0)
    buckets = pool.layout.view(pool._segment.buf, "index_buckets")
    buckets[bucket] = -1  # the chain no longer reaches b0
    with pytest.raises(InvariantViolation, match=f"block {b0} is not in the chain"):
        pool.evict_blocks({b0})
    pool.check_invariants()
    assert pool.last_repair is not None and pool.last_repair.rebuilt
    assert pool.get_cached_block(bytes(key[0]), [0])[0].block_id == b0


def _pop_in_looping_chain(name: str) -> None:
    """Child: evicts a block whose bucket chain loops before reaching it."""
    pool = BlockPool.attach(name)
    try:
        pool.evict_blocks({1})
    except InvariantViolation as exc:
        assert "not in the chain" in str(exc), exc
        pool.check_invariants()
        pool.close()
        raise SystemExit(0) from None
    raise SystemExit(3)  # no error: the corruption went unnoticed


@needs_c
def test_c_index_pop_of_looping_chain_raises_not_spins(pool_name):
    """A bucket chain that loops before it reaches the block being unlinked: the C kernel
    used to spin for ever inside the lock (and the GIL); it raises InvariantViolation, and
    the pool is repaired. Run in a spawned process with a timeout: the old kernel hangs."""
    import multiprocessing as mp

    pool = BlockPool.create(pool_name, 8, kernel="c")
    try:
        (b0, b1), bucket = _cached_pair(pool)
        assert b0 == 1
        buckets = pool.layout.view(pool._segment.buf, "index_buckets")
        buckets[bucket] = 5
        pool._blocks["index_next"][5] = 5  # a self-loop ahead of block 1
        ctx = mp.get_context("spawn")
        child = ctx.Process(target=_pop_in_looping_chain, args=(pool_name,))
        child.start()
        child.join(20)
        if child.is_alive():
            child.kill()
            child.join(10)
            pytest.fail("the C kernel spun in a looping index chain")
        assert child.exitcode == 0
        pool.check_invariants()
    finally:
        pool.close()


@pytest.mark.parametrize("group", [1 << 32, (1 << 32) + 3, 1 << 31, -1, "0", 0.0, None])
def test_out_of_range_group_ids_are_refused_alike(make_pool, group):
    """A group id outside [0, 2**31) or not an int is refused with one message by both
    kernels, in every call that takes one. The C kernel used to truncate 2**32 to group 0
    (and hit group 0's block) where the Python kernel missed."""
    pool = make_pool(8)
    req = make_request(32)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, 2, 16, 0)
    message = f"kv_cache_group_id {group!r} is not an int in \\[0, 2\\*\\*31\\)"
    with pytest.raises(UsageError, match=message):
        pool.get_cached_block(req.block_hashes[0], [0, group])
    with pytest.raises(UsageError, match=message):
        pool._kernel.lookup(req.block_hashes[0], group)
    with pytest.raises(UsageError, match=message):
        pool._kernel.prefix(req.block_hashes, group, -1, pool._handles, pool._handle)
    with pytest.raises(UsageError, match=message):
        pool._kernel.insert(bytes(32), group, 5, 16)
    assert pool.get_cached_block(req.block_hashes[0], [0])[0].block_id == blocks[0].block_id
    pool.check_invariants()


# ----------------------------------------------------------------------------- bad arguments

# Counts and ids around every width a kernel converts to (int32, C long, ssize_t, uint64),
# numpy integers of both signs, and what is not an integer at all.
_BAD_NUMBERS = [
    -1, 11, 2**31 - 1, 2**31, 2**32 + 1, 2**63 - 1, 2**63, 2**64, -2**63, -2**63 - 1, 10**30,
    np.int32(-1), np.int64(2**40), np.uint64(2**63), np.uint64(2**64 - 1),
]
_NOT_INTS = [1.5, 2.0, float("nan"), None, "2", b"\x01", True, False, [1], object]


def _bad_argument_calls(pool: BlockPool, value) -> dict[str, object]:
    """Every call of the pool's kernel-facing API that takes ``value`` as a count, a limit,
    a group id or a handle's block id (alone, among good ones, in a bulk batch)."""
    from shmkv.pool.block_pool import KVCacheBlock

    held = pool.get_new_blocks(3)
    request = make_request(48)
    bad = KVCacheBlock(pool, value)
    calls = {
        "get_new_blocks": lambda: pool.get_new_blocks(value),
        "has_free_blocks": lambda: pool.has_free_blocks(value),
        "evict_blocks": lambda: pool.evict_blocks([value]),
        "get_cached_block": lambda: pool.get_cached_block(b"\x01" * 32, [value]),
        "get_cached_prefix group": lambda: pool.get_cached_prefix([b"\x01" * 32], value),
        "get_cached_prefix max": lambda: pool.get_cached_prefix([b"\x01" * 32], 0, value),
        "unpin_blocks": lambda: pool.unpin_blocks([bad], print),
        "cache_full_blocks id": lambda: pool.cache_full_blocks(request, [bad], 0, 1, 16, 0),
    }
    for method in ("touch", "free_blocks"):
        call = getattr(pool, method)
        calls[method] = lambda call=call: call([bad])
        calls[f"{method} among good"] = lambda call=call: call([held[0], bad])
        calls[f"{method} bulk"] = lambda call=call: call([held[1]] * 30 + [bad])
    for i, label in enumerate(("num_cached_blocks", "num_full_blocks", "block_size",
                               "kv_cache_group_id")):
        args = [0, 3, 16, 0]
        args[i] = value
        calls[f"cache_full_blocks {label}"] = (
            lambda args=args: pool.cache_full_blocks(request, held, *args)
        )
    return calls


def _outcome(call) -> tuple:
    try:
        result = call()
    except Exception as exc:  # noqa: BLE001 (the outcome is what is compared)
        return type(exc).__name__, str(exc), isinstance(exc, (UsageError, OutOfBlocksError))
    return "returned", repr(result)


@needs_c
@pytest.mark.parametrize("value", _BAD_NUMBERS + _NOT_INTS, ids=repr)
def test_kernels_refuse_every_bad_argument_alike(value):
    """Differential: each count, limit, group id and block id, on both kernels, gives the
    same outcome: a result, or a shmkv error (UsageError, or OutOfBlocksError for a count no
    pool has) of one class with one message, never a raw OverflowError or TypeError. Each
    refused call changed nothing (the pool's bytes are the same as a twin's)."""
    outcomes = {}
    for kernel in ("python", "c"):
        pool = BlockPool.create(unique_pool_name(), 11, kernel=kernel)
        try:
            calls = _bad_argument_calls(pool, value)
            outcomes[kernel] = {}
            for name, call in calls.items():
                before = segment_image(pool)
                outcomes[kernel][name] = outcome = _outcome(call)
                if outcome[0] != "returned":
                    assert segment_image(pool) == before, (kernel, name, outcome)
            pool.check_invariants()
        finally:
            pool.close()
            BlockPool.unlink(pool.pool_name)
    for name, py in outcomes["python"].items():
        assert outcomes["c"][name] == py, (name, py, outcomes["c"][name])
        assert py[0] == "returned" or py[2], (name, py)  # a shmkv error, not a raw one
