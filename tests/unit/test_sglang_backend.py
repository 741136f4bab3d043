"""shmkv's SGLang L3 backend in one process, built by SGLang's own factory from the
``dynamic`` config: same answers as SGLang's file backend, every host-pool layout (MHA and
MLA) byte-exact, identity refusals, and bad input at every entry point."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

import torch  # noqa: E402

from shmkv.errors import LayoutMismatchError, UsageError  # noqa: E402
from shmkv.sglang import SharedHostStorage  # noqa: E402
from shmkv.sglang.store import runs  # noqa: E402
from tests.sglang_helpers import (  # noqa: E402
    CLI_EXTRA,
    HostBuffer,
    make_backend,
    make_config,
    page_indices,
    remove_store,
    sgl_factory,
    sgl_storage,
)


def test_factory_loads_the_class_from_the_cli_json(store_name):
    """StorageBackendFactory's ``dynamic`` path, fed the CLI's JSON, builds SharedHostStorage."""
    extra = json.loads(CLI_EXTRA % (store_name, 1 << 20))
    assert extra["module_path"] == "shmkv.sglang" and extra["interface_v1"] == 1
    backend = make_backend(store_name, HostBuffer("page_first"))
    try:
        assert type(backend) is SharedHostStorage
        assert isinstance(backend, sgl_storage.HiCacheStorage)
        assert backend.store.num_pages == (1 << 20) // backend.store.page_bytes
        backend.store.pool.check_invariants()
    finally:
        backend.close()


def test_answers_equal_the_file_backend(store_name, tmp_path):
    """The same get/set/exists calls give the same answers as SGLang's HiCacheFile."""
    host = HostBuffer("layer_first")
    ours = make_backend(store_name, host)
    config = make_config(store_name)
    config.extra_config = {"file_storage_path": str(tmp_path)}
    theirs = sgl_storage.HiCacheFile(config, file_path=str(tmp_path))
    pages = [host.data_page(i * host.page_size).clone() for i in range(6)]
    keys = [f"{i:064x}" for i in range(6)]

    def both(call, *args):
        a, b = getattr(ours, call)(*args), getattr(theirs, call)(*args[:2]) \
            if call in ("get", "set") else getattr(theirs, call)(*args)
        return a, b

    try:
        calls = [("exists", keys[0]), ("batch_exists", keys), ("set", keys[0], pages[0]),
                 ("set", keys[0], pages[0]), ("exists", keys[0]), ("batch_exists", keys),
                 ("batch_set", keys[1:4], pages[1:4]), ("batch_exists", keys),
                 ("batch_exists", keys[1:]), ("exists", keys[5])]
        for call in calls:
            a, b = both(*call)
            assert a == b, call
        for i in (0, 2, 5):
            out_a = torch.zeros_like(pages[0])
            out_b = torch.zeros_like(pages[0])
            a, b = ours.get(keys[i], out_a), theirs.get(keys[i], out_b)
            assert (a is None) == (b is None), i
            if a is not None:
                assert torch.equal(a, b) and torch.equal(a, pages[i])
        got = ours.batch_get(keys[:3], [torch.zeros_like(pages[0]) for _ in range(3)])
        ref = theirs.batch_get(keys[:3], [torch.zeros_like(pages[0]) for _ in range(3)])
        assert all(torch.equal(x, y) for x, y in zip(got, ref, strict=True))
        ours.store.pool.check_invariants()
    finally:
        ours.close()


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_v1_paths_are_byte_exact_in_every_layout(store_name, layout, mla):
    """batch_set_v1 stores each page as SGLang's flat data page; batch_get_v1 puts it back
    at other host pages; the generic get returns the same bytes."""
    host = HostBuffer(layout, mla=mla)
    backend = make_backend(store_name, host, mla=mla)
    try:
        ps = host.page_size
        keys = [f"key{i}" for i in range(5)]
        src = [0, 1, 2, 7, 8]
        want = [host.data_page(p * ps).clone() for p in src]
        assert backend.batch_set_v1(keys, page_indices(src, ps)) == [True] * 5
        assert backend.batch_exists(keys + ["other"]) == 5
        for i, key in enumerate(keys):
            assert torch.equal(backend.get(key), want[i])
        dst = [10, 11, 3, 12, 13]
        for p in dst:
            backend._view[p].zero_()  # the host pages the loads go to start as zeros
            assert not host.data_page(p * ps).any()
        res = backend.batch_get_v1(keys[:4] + ["missing"], page_indices(dst, ps))
        assert res == [True, True, True, True, False]
        for i, p in enumerate(dst[:4]):
            assert torch.equal(host.data_page(p * ps), want[i]), (layout, i)
        backend.store.pool.check_invariants()
        assert all(b.ref_cnt == 0 for b in backend.store.pool.get_cached_prefix(
            backend._hashes("t", keys), 0))
    finally:
        backend.close()


def test_runs_cut_where_either_side_breaks():
    """One copy per run of pages consecutive in both the store and the host pool."""
    assert runs([4, 5, 6, 9, 10], [0, 1, 2, 3, 4]) == [(4, 0, 3), (9, 3, 2)]
    assert runs([1, 2, 3], [5, 7, 8]) == [(1, 5, 1), (2, 7, 2)]
    assert runs([], []) == []


def test_full_store_evicts_lru_but_never_a_pinned_page(store_name):
    """Over budget, the least recently used unpinned pages go; a pinned page stays."""
    host = HostBuffer("page_first")
    probe = make_backend(store_name + "x", host)
    page_bytes = probe.store.page_bytes
    probe.close()
    remove_store(store_name + "x")
    backend = make_backend(store_name, host, store_bytes=4 * page_bytes)
    try:
        ps = host.page_size
        four = page_indices([0, 1, 2, 3], ps)
        assert backend.batch_set_v1(["a", "b", "c", "d"], four) == [True] * 4
        pinned = backend.store.pin(backend._hashes("t", ["a"]))
        assert backend.batch_set_v1(["e", "f"], page_indices([4, 5], ps)) == [True, True]
        assert [backend.exists(k) for k in "abcdef"] == [True, False, False, True, True, True]
        backend.store.unpin(pinned)
        backend.store.pool.check_invariants()
    finally:
        backend.close()


def test_mla_non_writer_rank_stores_nothing(store_name):
    """With MLA only TP rank 0 writes; rank 1's pages are rank 0's (one shared key)."""
    host = HostBuffer("page_first", mla=True)
    r1 = make_backend(store_name, host, mla=True, tp_rank=1, tp_size=2)
    r0 = make_backend(store_name, host, mla=True, tp_rank=0, tp_size=2)
    try:
        assert r1.batch_set_v1(["k"], page_indices([0], 4)) == [True]
        assert r1.counters()["stored_pages"] == 0 and not r1.exists("k")
        assert r0.batch_set_v1(["k"], page_indices([0], 4)) == [True]
        assert r1.exists("k") and r0.exists("k")
    finally:
        r1.close()
        r0.close()


def test_tp_ranks_of_mha_keep_their_own_shards(store_name):
    """Without MLA every TP rank's page of one key is its own."""
    host = HostBuffer("page_first")
    r0 = make_backend(store_name, host, tp_rank=0, tp_size=2)
    r1 = make_backend(store_name, host, tp_rank=1, tp_size=2)
    try:
        r0.batch_set_v1(["k"], page_indices([0], 4))
        assert r0.exists("k") and not r1.exists("k")
    finally:
        r0.close()
        r1.close()


@pytest.mark.parametrize("change,field", [
    ({"model": "org/other"}, "model"), ({"tp_size": 4}, "tp_size"),
    ({"host": HostBuffer("page_first", page_size=8, num_pages=8)}, "page_size"),
    ({"host": HostBuffer("page_first", dtype=torch.float16)}, "kv_dtype"),
    ({"host": HostBuffer("layer_first")}, "layout"), ({"mla": True}, "mla_writer"),
])
def test_an_instance_of_another_identity_is_refused(store_name, change, field):
    """A second instance differing in one field is refused at start, naming it and both
    values; the first keeps working."""
    first = make_backend(store_name, HostBuffer("page_first"))
    try:
        host = change.pop("host", HostBuffer("page_first", mla=change.get("mla", False)))
        kwargs = dict(change)
        with pytest.raises(LayoutMismatchError, match=f"field {field}: the store has"):
            make_backend(store_name, host, **kwargs)
        assert first.batch_set_v1(["k"], page_indices([0], 4)) == [True]
        first.store.pool.check_invariants()
    finally:
        first.close()


def test_unknown_extra_config_key_is_refused(store_name):
    """An unknown extra_config key, or a bad value, is refused naming it."""
    with pytest.raises(UsageError, match="unknown key.*'shmkv_size'"):
        make_backend(store_name, extra={"shmkv_size": 1})
    with pytest.raises(UsageError, match="bytes must be an int > 0, got -1"):
        make_backend(store_name, extra={"bytes": -1})
    with pytest.raises(UsageError, match="shmkv_pool must be a pool name"):
        make_backend(store_name, extra={"shmkv_pool": 3})


def test_bad_input_at_every_entry_point_changes_nothing(store_name):
    """Each public call refuses bad input naming the argument; the store is unchanged."""
    unregistered = make_backend(store_name)
    with pytest.raises(UsageError, match="register_mem_pool_host"):
        unregistered.exists("k")
    host = HostBuffer("page_first")
    backend = make_backend(store_name, host)
    try:
        bad = [
            ("batch_set_v1", ("k", page_indices([0], 4)), "keys must be a list"),
            ("batch_set_v1", ([1], page_indices([0], 4)), "every key must be a non-empty str"),
            ("batch_set_v1", (["k"], page_indices([0, 1], 4)), "host_indices has 8 entries"),
            ("batch_set_v1", (["k"], torch.arange(1, 5)), "page-aligned"),
            ("batch_set_v1", (["k"], torch.arange(0, 4).float()), "1-d int tensor"),
            ("batch_get_v1", (["k"], torch.arange(64, 68)), r"in \[0, 64\)"),
            ("batch_get_v1", (["k"], [0, 1, 2, 3]), "1-d int tensor"),
            ("set", ("k", torch.zeros(3)), "value must be a CPU tensor of one page"),
            ("batch_set", (["k"], [torch.zeros(3)]), "value must be"),
            ("batch_set", (["k", "j"], [host.data_page(0)]), "values must be a list of 2"),
            ("get", ("k", torch.zeros(3)), "target_location must be"),
            ("batch_get", (["k"], []), "target_locations must be a list of 1"),
            ("exists", (7,), "every key must be"),
            ("batch_exists", ("k",), "keys must be a list"),
            ("batch_exists_v2", (["k"],), "hybrid pools are not supported"),
            ("batch_get_v2", ([],), "hybrid pools are not supported"),
            ("batch_set_v2", ([],), "hybrid pools are not supported"),
            ("register_mem_host_pool_v2", (host, "mamba"), "hybrid pools"),
            ("register_mem_pool_host", (HostBuffer("page_first"),), "registered already"),
        ]
        for call, args, match in bad:
            with pytest.raises(UsageError, match=match):
                getattr(backend, call)(*args)
        assert backend.store.pool.get_num_free_blocks() == backend.store.num_pages
        backend.store.pool.check_invariants()
        other = HostBuffer("page_first")
        other.layout = "page_head"
        with pytest.raises(UsageError, match="layout 'page_head' is not supported"):
            make_backend(store_name + "h", other)
        with pytest.raises(UsageError, match="HiCacheStorageConfig"):
            SharedHostStorage(object(), {})
    finally:
        backend.close()
        remove_store(store_name + "h")


def test_clear_drops_unpinned_pages(store_name):
    """clear() forgets every stored page nobody pins."""
    backend = make_backend(store_name, HostBuffer("page_first"))
    try:
        backend.batch_set_v1(["a", "b"], page_indices([0, 1], 4))
        assert backend.clear() is True and backend.batch_exists(["a", "b"]) == 0
        backend.store.pool.check_invariants()
    finally:
        backend.close()


assert sgl_factory  # the factory module is what make_backend drives


def _weights(path, weight_bytes: int) -> str:
    path.mkdir()
    (path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (path / "model.safetensors").write_bytes(bytes(weight_bytes))
    return str(path)


def test_instances_serving_other_weights_under_one_name_are_refused(store_name, tmp_path):
    """SGLang fills the storage config's model_name with --served-model-name: two
    instances serving different weights (another weight file, another quantization) under
    one alias have the same model_name, and differ in what their server args say of the
    weights; the second is refused naming the field. Outside an SGLang server (no server
    args) the identity says the weights are unknown."""
    from types import SimpleNamespace

    from shmkv.sglang import identity as ident

    def args(path, quantization=None):
        return SimpleNamespace(model_path=path, revision=None, quantization=quantization,
                               dtype="auto")

    base = _weights(tmp_path / "base", 1000)
    instruct = _weights(tmp_path / "instruct", 1200)
    config = make_config(store_name, model="alias")

    def identity(server_args):
        return ident.store_identity(config, 4, "bfloat16", "page_first", 4096, 1 << 20,
                                    server_args)

    recorded = ident.encode(identity(args(base)))
    ident.compare(recorded, identity(args(base)), store_name)  # the same weights: accepted
    with pytest.raises(LayoutMismatchError, match="field model_files: the store has"):
        ident.compare(recorded, identity(args(instruct)), store_name)
    with pytest.raises(LayoutMismatchError, match="field quantization: the store has 'None', "
                                                  "this instance 'fp8'"):
        ident.compare(recorded, identity(args(base, "fp8")), store_name)
    assert ident.current_server_args() is None
    assert identity(None)["model_files"].startswith("unknown")


def test_the_same_weights_at_another_model_path_share_the_store(store_name, tmp_path):
    """A local --model-path is named by the digest of its files, its path shown, not
    compared: a copy at another path is accepted; a copy whose shard differs in a sampled
    window (same names, sizes and headers) is refused naming model_files, both paths shown;
    another hub id is refused naming model_path."""
    from types import SimpleNamespace

    from shmkv.sglang import identity as ident
    from tests.model_dirs import copy_of, make_model_dir, tuned_copy

    config = make_config(store_name, model="alias")

    def identity(path):
        args = SimpleNamespace(model_path=path, revision=None, quantization=None,
                               dtype="auto")
        return ident.store_identity(config, 4, "bfloat16", "page_first", 4096, 1 << 20, args)

    model = make_model_dir(str(tmp_path / "model"))
    recorded = ident.encode(identity(model))
    ident.compare(recorded, identity(copy_of(model, str(tmp_path / "mnt" / "model"))),
                  store_name)
    tuned = tuned_copy(model, str(tmp_path / "tuned"))
    with pytest.raises(LayoutMismatchError) as info:
        ident.compare(recorded, identity(tuned), store_name)
    theirs, mine = identity(model)["model_files"], identity(tuned)["model_files"]
    assert (f"field model_files: the store has {theirs!r}, this instance {mine!r}; field "
            f"model_dir: the store has {model!r}, this instance {tuned!r} (model_dir shown, "
            "not compared). Every instance") in str(info.value)
    hub = ident.encode(identity("org/base"))
    ident.compare(hub, identity("org/base"), store_name)
    with pytest.raises(LayoutMismatchError, match="field model_path: the store has "
                                                  "'org/base', this instance 'org/instruct'"):
        ident.compare(hub, identity("org/instruct"), store_name)
