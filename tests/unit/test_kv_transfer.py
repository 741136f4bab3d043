"""Block copies between the KV store and a device cache, on the CPU: both store layouts,
both copy paths (direct, and staged: the CUDA path's algorithm run on CPU tensors), every
kind of id set, the planner's runs, and bad input refused with nothing changed. The CUDA
runs of the same copies are compared with these byte for byte in tests/gpu/."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from shmkv.errors import LayoutMismatchError, UsageError  # noqa: E402
from shmkv.pool import layout as L  # noqa: E402
from shmkv.ranks import transfer  # noqa: E402
from shmkv.ranks.kv_store import (  # noqa: E402
    BLOCK_MAJOR,
    KV_HEADER_DTYPE,
    KV_LAYOUTS,
    LAYER_MAJOR,
    KVStore,
    kv_store_segment_name,
)
from tests.conftest import unique_pool_name  # noqa: E402

NUM_BLOCKS = 24
ROWS = 16
GEOMETRY = {"num_layers": 3, "block_size": 4, "num_kv_heads": 2, "head_size": 8}


@pytest.fixture
def name():
    n = unique_pool_name("kvt")
    yield n
    KVStore.unlink(n)
    assert not os.path.exists(f"/dev/shm{kv_store_segment_name(n)}")


def make_store(name: str, layout: str, dtype: str = "bfloat16", seed: int = 0,
               **geometry) -> KVStore:
    """A store of NUM_BLOCKS blocks holding random bytes (every bit pattern, NaNs too)."""
    args = dict(GEOMETRY, **geometry)
    store = KVStore.create(name, num_blocks=NUM_BLOCKS, dtype=dtype, layout=layout, **args)
    _fill(store.kv, seed)
    return store


def _fill(t: torch.Tensor, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    b = t.view(torch.uint8)
    b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=gen))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).clone()


def _block(store: KVStore, block_id: int) -> torch.Tensor:
    """Block ``block_id``'s bytes in the device cache's order: [layers, 2, block_size, ...]."""
    return torch.stack([torch.stack([store.key_cache[i][block_id], store.value_cache[i][block_id]])
                        for i in range(store.num_layers)])


def _assert_rows_hold(store, dev, host_ids, dev_ids, label) -> None:
    for h, d in zip(host_ids, dev_ids, strict=True):
        assert torch.equal(_bytes(dev[:, :, d]), _bytes(_block(store, h))), \
            f"{label}: row {d} is not store block {h}"


def _load(store, dev, host_ids, dev_ids, path: str) -> None:
    if path == "direct":
        store.load_blocks(dev, host_ids, dev_ids)
    else:  # the CUDA path's algorithm on CPU tensors; a chunk of 3 blocks cuts runs
        plan = transfer.plan_transfer(host_ids, dev_ids, store.num_blocks, dev.shape[2],
                                      unique="device")
        transfer.copy_staged(store.kv, dev, plan, to_device=True,
                             chunk_bytes=3 * dev[:, :, 0].numel() * dev.element_size())


def _store(store, dev, host_ids, dev_ids, path: str) -> None:
    if path == "direct":
        store.store_blocks(dev, host_ids, dev_ids)
    else:
        plan = transfer.plan_transfer(host_ids, dev_ids, store.num_blocks, dev.shape[2],
                                      unique="host")
        transfer.copy_staged(store.kv, dev, plan, to_device=False,
                             chunk_bytes=3 * dev[:, :, 0].numel() * dev.element_size())


def _id_sets() -> dict[str, tuple[list[int], list[int]]]:
    """(store ids, cache rows) of every kind the tests copy."""
    rng = random.Random(7)
    rand = rng.sample(range(NUM_BLOCKS), 9)
    return {
        "consecutive": (list(range(5, 5 + ROWS)), list(range(ROWS))),
        "random": (rand, rng.sample(range(ROWS), 9)),
        "reversed": (list(range(12, 4, -1)), list(range(8))),
        "runs-scrambled-rows": ([2, 3, 4, 10, 11, 20], [9, 1, 2, 3, 15, 0]),
        "first-and-last": ([0, NUM_BLOCKS - 1], [ROWS - 1, 0]),
        "one": ([NUM_BLOCKS - 1], [3]),
        "empty": ([], []),
    }


LAYOUT_PATHS = [(LAYER_MAJOR, "direct"), (BLOCK_MAJOR, "direct"), (BLOCK_MAJOR, "staged")]


@pytest.mark.parametrize("layout,path", LAYOUT_PATHS)
@pytest.mark.parametrize("ids", list(_id_sets()))
def test_load_then_store_moves_exact_bytes(name, layout, path, ids):
    """Loaded rows hold the store's blocks byte for byte; rows stored back land in the
    named store blocks and nowhere else."""
    host_ids, dev_ids = _id_sets()[ids]
    with make_store(name, layout) as store:
        dev = store.allocate_device_cache("cpu", ROWS)
        _load(store, dev, host_ids, dev_ids, path)
        _assert_rows_hold(store, dev, host_ids, dev_ids, f"{layout}/{path}/{ids} load")
        untouched = sorted(set(range(ROWS)) - set(dev_ids))
        assert int(dev[:, :, untouched].view(torch.uint8).count_nonzero()) == 0
        _fill(dev, seed=99)
        before = _bytes(store.kv)
        targets = [(h + 7) % NUM_BLOCKS for h in host_ids]  # other blocks, still distinct
        _store(store, dev, targets, dev_ids, path)
        _assert_rows_hold(store, dev, targets, dev_ids, f"{layout}/{path}/{ids} store")
        for b in sorted(set(range(NUM_BLOCKS)) - set(targets)):
            assert torch.equal(_bytes(_block(store, b)), _bytes(_block_of(before, store, b)))


def _block_of(raw_bytes: torch.Tensor, store: KVStore, block_id: int) -> torch.Tensor:
    kv = raw_bytes.view(store.dtype).view(store.kv.shape)
    if store.layout == BLOCK_MAJOR:
        return kv[block_id]
    return kv[:, :, block_id]


@pytest.mark.parametrize("dtype,head_size", [
    ("float32", 3),  # 12-byte rows: an int32 view
    ("float16", 1),  # 2-byte rows: int16
    ("uint8", 5),  # 5-byte rows: bytes
    ("float8_e4m3fn", 16),  # no arithmetic on it anywhere: an int64 view
    ("float64", 2),
])
def test_every_dtype_moves_bit_for_bit_on_both_paths(name, dtype, head_size):
    """The staged and the direct copy give the same bytes for every dtype, whatever width
    of integer view the row allows (NaN payloads included: random bits)."""
    host_ids, dev_ids = [3, 4, 5, 17, 0, 9], [0, 1, 2, 7, 5, 6]
    with make_store(name, BLOCK_MAJOR, dtype=dtype, head_size=head_size) as store:
        a = store.allocate_device_cache("cpu", 8)
        b = store.allocate_device_cache("cpu", 8)
        _load(store, a, host_ids, dev_ids, "direct")
        _load(store, b, host_ids, dev_ids, "staged")
        assert torch.equal(_bytes(a), _bytes(b))
        _assert_rows_hold(store, a, host_ids, dev_ids, dtype)


def test_the_staged_path_equals_the_direct_one_on_random_sets(name):
    """The CUDA path's algorithm (staging, chunks, index kernels) against the direct copy,
    on 30 random sets of ids, both directions: the same bytes every time."""
    rng = random.Random(3)
    with make_store(name, BLOCK_MAJOR) as store:
        for trial in range(30):
            n = rng.randint(0, ROWS)
            host_ids, dev_ids = rng.sample(range(NUM_BLOCKS), n), rng.sample(range(ROWS), n)
            a = store.allocate_device_cache("cpu", ROWS)
            b = store.allocate_device_cache("cpu", ROWS)
            _load(store, a, host_ids, dev_ids, "direct")
            _load(store, b, host_ids, dev_ids, "staged")
            assert torch.equal(_bytes(a), _bytes(b)), f"trial {trial} load"
            _fill(a, seed=trial)
            snapshot = _bytes(store.kv)
            _store(store, a, host_ids, dev_ids, "direct")
            after_direct = _bytes(store.kv)
            store.kv.view(torch.uint8).copy_(snapshot)
            _store(store, a, host_ids, dev_ids, "staged")
            assert torch.equal(_bytes(store.kv), after_direct), f"trial {trial} store"


def test_a_store_block_may_be_loaded_into_several_rows(name):
    with make_store(name, BLOCK_MAJOR) as store:
        for path in ("direct", "staged"):
            dev = store.allocate_device_cache("cpu", 4)
            _load(store, dev, [6, 6, 2], [0, 3, 1], path)
            _assert_rows_hold(store, dev, [6, 6, 2], [0, 3, 1], path)


def test_a_non_contiguous_cache_still_gets_exact_bytes(name):
    """A cache whose last dimension is not contiguous (no integer view of its rows): both
    paths fall back to the dtype itself."""
    with make_store(name, BLOCK_MAJOR, dtype="float32") as store:
        for path in ("direct", "staged"):
            big = torch.zeros((3, 2, 8, 4, 8, 2), dtype=torch.float32)  # heads and size swapped
            dev = big.transpose(-1, -2)
            assert dev.stride(-1) != 1 and transfer.raw(dev) is dev
            _load(store, dev, [1, 2, 9], [4, 5, 0], path)
            _assert_rows_hold(store, dev, [1, 2, 9], [4, 5, 0], path)


# --------------------------------------------------------------------------- the plan


def test_runs_coalesce_consecutive_ids():
    """host_runs: one per run of consecutive store ids (in id order, whatever the order
    given); pair_runs: where the rows go up by one as well."""
    p = transfer.plan_transfer([9, 1, 3, 5, 7], [0, 1, 2, 3, 4], 10, 5, unique="device")
    assert p.host_ids.tolist() == [1, 3, 5, 7, 9] and p.device_ids.tolist() == [1, 2, 3, 4, 0]
    assert p.host_runs.tolist() == [[0, 1, 1], [1, 3, 1], [2, 5, 1], [3, 7, 1], [4, 9, 1]]
    p = transfer.plan_transfer([4, 5, 6, 1, 2, 9], [10, 11, 12, 0, 5, 13], 10, 14,
                               unique="device")
    assert p.host_runs.tolist() == [[0, 1, 2], [2, 4, 3], [5, 9, 1]]
    assert p.pair_runs.tolist() == [[1, 0, 1], [2, 5, 1], [4, 10, 3], [9, 13, 1]]
    whole = list(range(NUM_BLOCKS))
    p = transfer.plan_transfer(whole[::-1], whole[::-1], NUM_BLOCKS, NUM_BLOCKS, unique="host")
    assert p.host_runs.tolist() == [[0, 0, NUM_BLOCKS]]
    assert p.pair_runs.tolist() == [[0, 0, NUM_BLOCKS]]
    p = transfer.plan_transfer(np.array([], np.int64), None, 4, 4, unique="host")
    assert p.num_blocks == 0 and p.host_runs.shape == (0, 3) and p.pair_runs.shape == (0, 3)
    p = transfer.plan_transfer(torch.tensor([3, 3]), [0, 1], 4, 2, unique="device")
    assert p.host_runs.tolist() == [[0, 3, 1], [1, 3, 1]]  # a repeat is not a run


def test_chunks_cut_runs_at_their_borders():
    p = transfer.plan_transfer(list(range(2, 9)) + [12], None, 16, 16, unique="device")
    chunks = list(transfer._chunks(p, 3))
    assert chunks == [(0, 3, [(0, 2, 3)]), (3, 6, [(3, 5, 3)]),
                      (6, 8, [(6, 8, 1), (7, 12, 1)])]
    assert list(transfer._chunks(p, 100)) == [(0, 8, [(0, 2, 7), (7, 12, 1)])]


# --------------------------------------------------------------------------- bad input

BAD_CALLS = [
    ("load", [NUM_BLOCKS], [0], r"block_ids must lie in \[0, 24\): found 24"),
    ("load", [-1, 2], [0, 1], r"block_ids must lie in \[0, 24\): found -1"),
    ("store", [1], [ROWS], r"device_block_ids must lie in \[0, 16\): found 16"),
    ("load", [1, 2], [3, 3], "device_block_ids repeats 3: a destination block is written once"),
    ("store", [5, 5], [0, 1], "block_ids repeats 5"),
    ("load", [1, 2], [0], "2 block_ids for 1 device_block_ids"),
    ("load", [1.0], [0], "block_ids must be a 1-d sequence of ints, got 1-d float64"),
    ("store", [True], [0], "block_ids must be a 1-d sequence of ints, got 1-d bool"),
    ("load", [[1, 2]], None, "block_ids must be a 1-d sequence of ints, got 2-d"),
    ("load", [1], ["a"], "device_block_ids must be a 1-d sequence of ints"),
    ("load", [1], None, "device_kv of shape .* does not match the store", "shape"),
    ("store", [1], None, "device_kv has dtype torch.float32; the store holds torch.bfloat16",
     "dtype"),
    ("load", [1], None, "device_kv must be a torch.Tensor, got ndarray", "numpy"),
    ("load", 3, None, "block_ids must be a 1-d sequence of ints, got 0-d"),
    ("load", [1, 2], [3, 4], "device_kv has overlapping memory: dim 0 has stride 0",
     "expanded"),
]


@pytest.mark.parametrize("layout", KV_LAYOUTS)
@pytest.mark.parametrize("call", BAD_CALLS, ids=[c[3][:30] for c in BAD_CALLS])
def test_bad_input_is_refused_and_changes_nothing(name, layout, call):
    op, host_ids, dev_ids, match, *cache = call
    with make_store(name, layout) as store:
        dev = store.allocate_device_cache("cpu", ROWS)
        _fill(dev, seed=5)
        if cache == ["shape"]:
            dev = torch.zeros((3, 2, ROWS, 4, 8, 2), dtype=store.dtype)
        elif cache == ["dtype"]:
            dev = torch.zeros((3, 2, ROWS, 4, 2, 8), dtype=torch.float32)
        elif cache == ["numpy"]:
            dev = np.zeros((3, 2, ROWS, 4, 2, 8))
        elif cache == ["expanded"]:  # every layer one memory: a load would mix them
            dev = dev[:1].clone().expand(3, 2, ROWS, 4, 2, 8)
        before_store, before_dev = _bytes(store.kv), (
            _bytes(dev) if isinstance(dev, torch.Tensor) else dev.copy())
        fn = store.load_blocks if op == "load" else store.store_blocks
        with pytest.raises(UsageError, match=match):
            fn(dev, host_ids, dev_ids)
        assert torch.equal(_bytes(store.kv), before_store)
        if isinstance(dev, torch.Tensor):
            assert torch.equal(_bytes(dev), before_dev)


def test_create_refuses_an_unknown_layout(name):
    with pytest.raises(UsageError, match=r"layout 'rows' is not one of \['layer_major', "
                                         r"'block_major'\]"):
        KVStore.create(name, num_blocks=4, layout="rows", **GEOMETRY)
    assert not os.path.exists(f"/dev/shm{kv_store_segment_name(name)}")


# --------------------------------------------------------------------------- the layouts


def test_the_layout_is_in_the_header_and_attach_maps_it(name):
    """An attacher sees the creator's layout and the same bytes through key_cache; an
    unknown layout code is refused naming the field."""
    with make_store(name, BLOCK_MAJOR) as store:
        assert kv_store_segment_name(name).endswith(f"-v{L.KV_LAYOUT_VERSION}")
        assert L.KV_LAYOUT_VERSION == 4
        other = KVStore.attach(name)
        try:
            assert other.layout == BLOCK_MAJOR
            assert tuple(other.kv.shape) == (NUM_BLOCKS, 3, 2, 4, 2, 8)
            assert tuple(other.key_cache[2].shape) == (NUM_BLOCKS, 4, 2, 8)
            store.value_cache[1][7, 2, 1, 3] = 2.5
            assert float(other.kv[7, 1, 1, 2, 1, 3]) == 2.5  # block 7 is one range
            assert float(other.value_cache[1][7, 2, 1, 3]) == 2.5
        finally:
            other.close()
        hdr = np.ndarray((1,), KV_HEADER_DTYPE, buffer=store._segment.buf)
        hdr["layout"] = 2
        try:
            with pytest.raises(LayoutMismatchError, match="header field layout is 2"):
                KVStore.attach(name)
        finally:
            hdr["layout"] = 1
            del hdr


def test_block_major_keeps_each_block_contiguous_and_layer_major_each_layer(name):
    """The byte order the module docstring draws: block-major, block b's bytes are one
    range [b * block_bytes, (b + 1) * block_bytes); layer-major, layer l's K is one range."""
    for layout in KV_LAYOUTS:
        with make_store(name, layout) as store:
            flat = store.kv.reshape(-1).view(torch.uint8)
            per_block = flat.numel() // NUM_BLOCKS
            if layout == BLOCK_MAJOR:
                b = 11
                assert torch.equal(flat[b * per_block:(b + 1) * per_block],
                                   _bytes(_block(store, b)).reshape(-1))
            else:
                per_layer_k = flat.numel() // (2 * store.num_layers)
                assert torch.equal(flat[2 * per_layer_k:3 * per_layer_k],
                                   _bytes(store.key_cache[1]).reshape(-1))
        KVStore.unlink(name)
