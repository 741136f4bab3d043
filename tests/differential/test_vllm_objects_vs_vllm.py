"""vLLM's own KV-cache objects given to shmkv as they are (issue 20, item 6): vLLM's specs,
``KVCacheGroupSpec`` and ``KVCacheConfig`` build shmkv's managers and coordinators, and what
they hand back is what vLLM's own callers test for: each manager's ``kv_cache_spec`` is an
instance of vLLM's spec class (vLLM's ``EngineCore`` and scheduler check that), with vLLM's
field values; a manager built from vLLM's config returns vLLM's event classes. The managers
answer as vLLM's managers built from the same objects (the call-for-call workload is
``test_kv_cache_manager_vs_vllm.py``'s ``*-vllm-objects`` setups). Without vLLM, shmkv never
imports it."""

from __future__ import annotations

import dataclasses
import pickle
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from shmkv import KVCacheManager
from shmkv.core import kv_cache_interface as S
from shmkv.core.single_type_kv_cache_manager import (
    FullAttentionManager,
    MambaManager,
    SlidingWindowManager,
    get_manager_for_kv_cache_spec,
)
from shmkv.core.vllm_objects import VllmSpecBridge, from_vllm
from shmkv.errors import UsageError

torch = pytest.importorskip("torch")
V = pytest.importorskip("vllm.v1.kv_cache_interface")
vllm_manager = pytest.importorskip("vllm.v1.core.kv_cache_manager")
vllm_stm = pytest.importorskip("vllm.v1.core.single_type_kv_cache_manager")
vllm_kv_events = pytest.importorskip("vllm.distributed.kv_events")
vllm_kv_cache_utils = pytest.importorskip("vllm.v1.core.kv_cache_utils")
vllm_hashing = pytest.importorskip("vllm.utils.hashing")

pytestmark = pytest.mark.differential

BS = 16


def _specs():
    return [
        V.FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=8, dtype=torch.float16),
        V.MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.bfloat16),
        V.SlidingWindowSpec(block_size=BS, num_kv_heads=2, head_size=8, dtype=torch.float16,
                            sliding_window=32),
        V.ChunkedLocalAttentionSpec(block_size=BS, num_kv_heads=2, head_size=8,
                                    dtype=torch.float16, attention_chunk_size=32),
        V.MambaSpec(BS, ((2, 4),), (torch.float32,), mamba_cache_mode="align"),
        V.CrossAttentionSpec(block_size=BS, num_kv_heads=2, head_size=8, dtype=torch.float16),
    ]


@pytest.mark.parametrize("spec", _specs(), ids=lambda s: type(s).__name__)
def test_bridged_spec_is_both_classes_with_vllms_values(spec):
    """A vLLM spec taken by shmkv is an instance of both classes and reads as vLLM's."""
    bridged = from_vllm(spec)
    ours = getattr(S, type(spec).__name__)
    assert isinstance(bridged, VllmSpecBridge)
    assert isinstance(bridged, ours) and isinstance(bridged, type(spec))
    for f in dataclasses.fields(type(spec)):
        assert getattr(bridged, f.name) == getattr(spec, f.name), f.name
    for attr in ("block_size", "page_size_bytes", "prefix_cacheable"):
        assert getattr(bridged, attr) == getattr(spec, attr), attr
    assert V.get_kv_cache_spec_kind(bridged) == V.get_kv_cache_spec_kind(spec)
    assert V.is_full_attention_spec(bridged) == V.is_full_attention_spec(spec)
    assert from_vllm(bridged) is bridged
    again = pickle.loads(pickle.dumps(bridged))  # a spawned process gets one too
    assert again == bridged and isinstance(again, type(spec))


@pytest.mark.parametrize("spec,ours,theirs", [
    (_specs()[0], FullAttentionManager, "FullAttentionManager"),
    (_specs()[2], SlidingWindowManager, "SlidingWindowManager"),
    (_specs()[4], MambaManager, "MambaManager"),
], ids=["full", "swa", "mamba"])
def test_get_manager_for_vllm_spec(make_pool, spec, ours, theirs):
    """get_manager_for_kv_cache_spec takes vLLM's spec: the same manager kind as vLLM's, the
    same block size and admission cap, and a spec vLLM's callers recognise."""
    pool = make_pool(32, hash_block_size=BS)
    kwargs = {"enable_caching": True, "kv_cache_group_id": 0, "scheduler_block_size": BS}
    manager = get_manager_for_kv_cache_spec(spec, max_in_flight_tokens=256, max_model_len=256,
                                            block_pool=pool, **kwargs)
    vllm_pool = pytest.importorskip("vllm.v1.core.block_pool").BlockPool(32, True, BS)
    reference = vllm_stm.get_manager_for_kv_cache_spec(
        spec, max_in_flight_tokens=256, max_model_len=256, block_pool=vllm_pool, **kwargs)
    assert type(manager) is ours and type(reference).__name__ == theirs
    assert isinstance(manager.kv_cache_spec, type(spec))
    assert manager.block_size == reference.block_size
    assert (getattr(manager, "max_admission_blocks_per_request", None)
            == getattr(reference, "max_admission_blocks_per_request", None))
    pool.check_invariants()


def _vllm_config(num_blocks=40):
    full, swa = _specs()[0], _specs()[2]
    return V.KVCacheConfig(num_blocks, [], [V.KVCacheGroupSpec(["full"], full),
                                            V.KVCacheGroupSpec(["swa"], swa)])


def test_engine_core_and_scheduler_recognise_the_managers(make_pool):
    """vLLM's EngineCore finds the attention block size from the managers' specs, and the
    specs are vLLM's classes for the scheduler's isinstance checks."""
    from vllm.config import CacheConfig
    from vllm.v1.engine.core import EngineCore

    pool = make_pool(40, hash_block_size=BS, enable_kv_cache_events=True)
    manager = KVCacheManager(_vllm_config(), max_model_len=256, scheduler_block_size=BS,
                             hash_block_size=BS, enable_kv_cache_events=True, block_pool=pool)
    core = EngineCore.__new__(EngineCore)
    core.vllm_config = SimpleNamespace(cache_config=CacheConfig(block_size=BS))
    core.scheduler = SimpleNamespace(kv_cache_manager=manager)
    core._initialize_effective_attention_block_size()
    assert core.vllm_config.cache_config.effective_attention_block_size == BS
    kinds = [type(m.kv_cache_spec).__mro__ for m in manager.coordinator.single_type_managers]
    assert V.FullAttentionSpec in kinds[0] and V.SlidingWindowSpec in kinds[1]
    assert not any(isinstance(m.kv_cache_spec, V.MambaSpec)
                   for m in manager.coordinator.single_type_managers)
    pool.check_invariants()


def test_manager_from_vllm_config_hands_back_vllm_events(make_pool, monkeypatch):
    """Built from vLLM's config, the manager's events are vLLM's classes, with the bytes of
    vLLM's own manager's events for the same calls."""
    import msgspec

    from shmkv import Request

    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    pool = make_pool(40, hash_block_size=BS, enable_kv_cache_events=True)
    common = {"max_model_len": 256, "scheduler_block_size": BS, "hash_block_size": BS,
              "enable_kv_cache_events": True}
    ours = KVCacheManager(_vllm_config(), block_pool=pool, **common)
    theirs = vllm_manager.KVCacheManager(_vllm_config(), **common)
    hasher = pool.make_block_hasher()
    encoded = []
    for manager in (ours, theirs):
        request = Request("r", list(range(3 * BS + 5)), block_hasher=hasher)
        # The scheduler's fields vLLM's manager reads.
        request.status = pytest.importorskip("vllm.v1.request").RequestStatus.WAITING
        request.num_preemptions = request.num_in_flight_tokens = 0
        request.skip_reading_prefix_cache = False
        assert manager.allocate_slots(request, request.num_tokens) is not None
        events = manager.take_events()
        assert events and all(type(e).__module__ == vllm_kv_events.__name__ for e in events)
        encoded.append(msgspec.msgpack.encode(vllm_kv_events.KVEventBatch(ts=0.0,
                                                                          events=events)))
    assert encoded[0] == encoded[1]
    pool.check_invariants()


def test_vllm_class_without_shmkv_counterpart_is_refused():
    """A vLLM spec shmkv has no class for is a UsageError naming it."""
    spec = V.UniformTypeKVCacheSpecs(block_size=BS, kv_cache_specs={"a": _specs()[0]}) \
        if hasattr(V, "UniformTypeKVCacheSpecs") else None
    if spec is None or hasattr(S, "UniformTypeKVCacheSpecs"):
        pytest.skip("shmkv has every vLLM spec class this vLLM has")
    with pytest.raises(UsageError, match="shmkv has no UniformTypeKVCacheSpecs"):
        from_vllm(spec)


def test_shmkv_never_imports_vllm_for_its_own_objects(tmp_path):
    """A manager on shmkv's own objects, events included, imports no vLLM module."""
    code = textwrap.dedent("""
        import sys, uuid
        from shmkv import BlockPool, KVCacheManager, Request
        from shmkv.core import kv_cache_interface as S
        name = "novllm-" + uuid.uuid4().hex[:10]
        pool = BlockPool.create(name, 16, hash_block_size=4, enable_kv_cache_events=True)
        try:
            spec = S.FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8,
                                       dtype="float16")
            config = S.KVCacheConfig(16, [], [S.KVCacheGroupSpec(["l"], spec)])
            m = KVCacheManager(config, 64, 4, 4, enable_kv_cache_events=True, block_pool=pool)
            r = Request("r", list(range(9)), block_hasher=pool.make_block_hasher())
            assert m.allocate_slots(r, 9) is not None and m.take_events()
            m.free(r)
        finally:
            pool.close()
            BlockPool.unlink(name)
        bad = sorted(n for n in sys.modules if n == "vllm" or n.startswith("vllm."))
        assert not bad, bad
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
