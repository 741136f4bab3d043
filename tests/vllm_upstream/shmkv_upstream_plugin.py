"""pytest plugin that runs a vLLM release's own KV-cache tests against shmkv.

Loaded only in the adapter's own pytest session (a subprocess started by
``tests/vllm_upstream/test_upstream.py``, or by hand)::

    cd tests/vllm_upstream/_upstream/<release> && \\
    PYTHONPATH=<shmkv's root>:<this dir> python -m pytest -p shmkv_upstream_plugin \\
        tests/v1/core/test_prefix_caching.py

``$SHMKV_UPSTREAM_TARGET`` picks what the tests exercise: ``shmkv`` (default) or ``vllm``
(vLLM itself, untouched: the baseline). With ``shmkv``, before any test module is imported the
plugin rebinds, in vLLM's own modules, the names the tests and vLLM's scheduler look up:

- ``vllm.v1.core.block_pool.BlockPool``: a shmkv pool in a fresh shared-memory segment with a
  unique name (vLLM's constructor arguments; ``partial_keys=True`` as vLLM's blocks always can
  take a partial key), closed and unlinked when the test ends;
- ``KVCacheManager``, ``get_kv_cache_coordinator``, ``get_manager_for_kv_cache_spec`` and the
  single-type manager classes: shmkv's, given vLLM's specs / ``KVCacheConfig`` as they are
  (shmkv takes them itself: ``shmkv/core/vllm_objects.py``), creating their pool when vLLM's
  callers give none; their ``take_events`` return vLLM's event classes.

Everything else (vLLM's request, hashing, scheduler, planning code) stays vLLM's. Tests listed
in ``expectations.DESELECTED`` are deselected; ``expectations.KNOWN_GAPS`` are strict xfails.
With ``$SHMKV_UPSTREAM_RESULTS`` set, the outcome of every test (and whether it constructed a
shmkv object) is written there as JSON when the session ends.
"""

from __future__ import annotations

import inspect
import itertools
import json
import os
import sys

import pytest

from shmkv.core.vllm_objects import from_vllm as to_shmkv
from shmkv.core.vllm_objects import to_vllm_events

TARGET = os.environ.get("SHMKV_UPSTREAM_TARGET", "shmkv")
if TARGET not in ("shmkv", "vllm"):
    raise pytest.UsageError(f"SHMKV_UPSTREAM_TARGET must be shmkv or vllm, got {TARGET!r}")

_results: dict[str, dict] = {}
_touched = False
_test_pools: list = []
_counter = itertools.count()
# One process, so a wait for the pool lock means a lock left taken: fail fast, not in 10 s.
LOCK_TIMEOUT_S = 2.0


# ------------------------------------------------------------------ conversion (vLLM -> shmkv)

# vLLM's objects as shmkv takes them, and shmkv's KV events as vLLM's classes, come from
# shmkv's own bridge (shmkv/core/vllm_objects.py: from_vllm as to_shmkv, to_vllm_events).


# ------------------------------------------------------------------ the shims

def _new_pool(num_blocks, enable_caching, hash_block_size, enable_kv_cache_events,
              num_hash_lookahead_tokens=0, medium="GPU"):
    import shmkv

    global _touched
    _touched = True
    name = f"vup{os.getpid()}-{next(_counter)}"
    pool = shmkv.BlockPool.create(
        name, num_blocks, enable_caching=enable_caching, hash_block_size=hash_block_size,
        enable_kv_cache_events=enable_kv_cache_events, max_processes=2, partial_keys=True,
        lock_timeout_s=LOCK_TIMEOUT_S, num_hash_lookahead_tokens=num_hash_lookahead_tokens,
        medium=medium,
    )
    pool.__class__ = _classes()["BlockPool"]
    _test_pools.append((name, pool))
    return pool


_CLASSES: dict = {}


def _classes() -> dict:
    if _CLASSES:
        return _CLASSES
    import shmkv
    from shmkv.core import kv_cache_coordinator as C
    from shmkv.core import single_type_kv_cache_manager as M

    class BlockPool(shmkv.BlockPool):
        """shmkv's pool, built with vLLM's constructor arguments."""

        _shim_raw_events = False

        def __new__(cls, num_gpu_blocks, enable_caching, hash_block_size,
                    enable_kv_cache_events=False, metrics_collector=None,
                    num_hash_lookahead_tokens=0, medium="GPU"):
            pool = _new_pool(num_gpu_blocks, enable_caching, hash_block_size,
                             enable_kv_cache_events, num_hash_lookahead_tokens, medium)
            pool.metrics_collector = metrics_collector
            return pool

        def __init__(self, *args, **kwargs):
            pass

        def take_events(self):
            events = super().take_events()
            return events if self._shim_raw_events else to_vllm_events(events)

    vllm_kvm_sig = None

    class KVCacheManager(shmkv.KVCacheManager):
        """shmkv's manager, taking vLLM's config and making its pool when given none."""

        def __init__(self, kv_cache_config, *args, block_pool=None, **kwargs):
            from vllm.v1.core import kv_cache_manager as vkvm

            global _touched
            _touched = True
            nonlocal vllm_kvm_sig
            if vllm_kvm_sig is None:
                vllm_kvm_sig = inspect.signature(vkvm._VllmKVCacheManager)
            bound = vllm_kvm_sig.bind(kv_cache_config, *args, **kwargs)
            bound.apply_defaults()
            a = bound.arguments
            if block_pool is None:
                block_pool = _new_pool(kv_cache_config.num_blocks, a["enable_caching"],
                                       a["hash_block_size"], a["enable_kv_cache_events"],
                                       a["num_hash_lookahead_tokens"])
            super().__init__(kv_cache_config, *args, block_pool=block_pool, **kwargs)

        def take_events(self):
            pool = self.block_pool
            pool._shim_raw_events = True
            try:
                events = super().take_events()
            finally:
                pool._shim_raw_events = False
            return to_vllm_events(events)

    def get_kv_cache_coordinator(kv_cache_config, *args, **kwargs):
        global _touched
        _touched = True
        if kwargs.get("block_pool") is None:
            sig = inspect.signature(C.get_kv_cache_coordinator)
            a = sig.bind(kv_cache_config, *args, **kwargs)
            a.apply_defaults()
            a = a.arguments
            kwargs["block_pool"] = _new_pool(kv_cache_config.num_blocks, a["enable_caching"],
                                             a["hash_block_size"], a["enable_kv_cache_events"],
                                             a["num_hash_lookahead_tokens"])
        return C.get_kv_cache_coordinator(kv_cache_config, *args, **kwargs)

    def get_manager_for_kv_cache_spec(kv_cache_spec, *args, **kwargs):
        global _touched
        _touched = True
        return M.get_manager_for_kv_cache_spec(kv_cache_spec, *args, **kwargs)

    def _spec_converting(method):
        sig = inspect.signature(method)

        def call(*args, **kwargs):
            bound = sig.bind(*args, **kwargs)
            if "kv_cache_spec" in bound.arguments:
                bound.arguments["kv_cache_spec"] = to_shmkv(bound.arguments["kv_cache_spec"])
            return method(*bound.args, **bound.kwargs)

        return call

    def manager_class(shm_cls):
        class Manager(shm_cls):
            def __init__(self, kv_cache_spec, *args, **kwargs):
                global _touched
                _touched = True
                super().__init__(kv_cache_spec, *args, **kwargs)

        # Class-level calls that take a spec (vLLM's tests call them on the class).
        for name in ("reachable_block_mask", "find_longest_cache_hit"):
            if hasattr(shm_cls, name):
                setattr(Manager, name, staticmethod(_spec_converting(getattr(shm_cls, name))))
        Manager.__name__ = Manager.__qualname__ = shm_cls.__name__
        return Manager

    _CLASSES.update(
        BlockPool=BlockPool,
        KVCacheManager=KVCacheManager,
        KVCacheBlocks=shmkv.KVCacheBlocks,
        get_kv_cache_coordinator=get_kv_cache_coordinator,
        get_manager_for_kv_cache_spec=get_manager_for_kv_cache_spec,
    )
    for name in ("FullAttentionManager", "SlidingWindowManager", "ChunkedLocalAttentionManager",
                 "MambaManager", "CrossAttentionManager", "SinkFullAttentionManager",
                 "RSWAManager"):
        if hasattr(M, name):
            _CLASSES[name] = manager_class(getattr(M, name))
    from shmkv.core import hisparse as H

    # HiSparse: the managers are made by the coordinator (shmkv's registry), so vLLM's names
    # are shmkv's classes as they are (isinstance checks in vLLM's connector then hold).
    for name in HISPARSE_NAMES:
        _CLASSES[name] = getattr(H, name)
    return _CLASSES


# vLLM's HiSparse names the tests and vLLM's connector look up, rebound to shmkv's.
HISPARSE_NAMES = ("HiSparseSourceManager", "HiSparseHotManager", "HiSparseResidentManager",
                  "HiSparseCoordinator", "get_hisparse_coordinator")


def install_shims() -> None:
    """Rebinds vLLM's names to shmkv's (this process only; the adapter's own session)."""
    import vllm.v1.core.block_pool as vbp
    import vllm.v1.core.kv_cache_coordinator as vcoord
    import vllm.v1.core.kv_cache_manager as vkvm
    import vllm.v1.core.sched.scheduler as vsched
    import vllm.v1.core.single_type_kv_cache_manager as vstm

    c = _classes()
    vkvm._VllmKVCacheManager = vkvm.KVCacheManager
    vbp.BlockPool = c["BlockPool"]
    for mod in (vkvm, vsched):
        mod.KVCacheManager = c["KVCacheManager"]
    vkvm.KVCacheBlocks = c["KVCacheBlocks"]
    vkvm.get_kv_cache_coordinator = c["get_kv_cache_coordinator"]
    vcoord.get_kv_cache_coordinator = c["get_kv_cache_coordinator"]
    vstm.get_manager_for_kv_cache_spec = c["get_manager_for_kv_cache_spec"]
    for name in ("FullAttentionManager", "SlidingWindowManager", "ChunkedLocalAttentionManager",
                 "MambaManager", "CrossAttentionManager", "SinkFullAttentionManager",
                 "RSWAManager"):
        if name in c and hasattr(vstm, name):
            setattr(vstm, name, c[name])
    # vLLM's offloading connector checks the manager's coordinator by vLLM's class name.
    import vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector as voffload

    from shmkv.core import kv_cache_coordinator as shm_coord

    voffload.HybridKVCacheCoordinator = shm_coord.HybridKVCacheCoordinator
    import vllm.v1.hisparse.coordinator as vhisparse

    hisparse_modules = [vstm, vhisparse]
    try:
        import vllm.distributed.kv_transfer.kv_connector.v1.hisparse.connector as vhconn
    except ImportError:  # pragma: no cover - vLLM without the HiSparse connector
        pass
    else:
        hisparse_modules.append(vhconn)
    for mod in hisparse_modules:
        for name in HISPARSE_NAMES:
            if hasattr(mod, name):
                setattr(mod, name, c[name])
    for mod_name in ("vllm.v1.core.sched.async_scheduler",):
        mod = sys.modules.get(mod_name)
        if mod is not None and hasattr(mod, "KVCacheManager"):
            mod.KVCacheManager = c["KVCacheManager"]


# ------------------------------------------------------------------ pytest hooks

def pytest_configure(config):
    config.addinivalue_line("markers", "cpu_test: vLLM's marker")
    config.addinivalue_line("markers", "skip_global_cleanup: vLLM's marker")
    if TARGET == "shmkv":
        install_shims()


def _expectations():
    import expectations

    return expectations


def _match(nodeid: str, table: dict) -> str | None:
    base = nodeid.split("[", 1)[0]
    return table.get(nodeid) or table.get(base)


def pytest_collection_modifyitems(config, items):
    if TARGET != "shmkv":
        return
    exp = _expectations()
    kept, dropped = [], []
    for item in items:
        if _match(item.nodeid, exp.DESELECTED):
            dropped.append(item)
            _results[item.nodeid] = {"outcome": "deselected"}
            continue
        gap = _match(item.nodeid, exp.KNOWN_GAPS)
        if gap:
            item.add_marker(pytest.mark.xfail(reason=gap, strict=True))
        kept.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


@pytest.fixture(autouse=True)
def _shmkv_pools():
    """Every pool a test made is closed and its segment unlinked when the test ends."""
    global _touched
    _touched = False
    yield
    import shmkv

    while _test_pools:
        name, pool = _test_pools.pop()
        try:
            pool.close()
        finally:
            shmkv.BlockPool.unlink(name)


def _crash_line(report) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return f"{os.path.basename(crash.path)}:{crash.lineno}: {crash.message}"[:400]
    lines = str(report.longrepr).strip().splitlines()
    return lines[-1][:400] if lines else ""


def pytest_runtest_logreport(report):
    entry = _results.setdefault(report.nodeid, {"outcome": "passed", "touched": False})
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        if hasattr(report, "wasxfail"):
            entry["outcome"] = "xfailed" if report.skipped else "xpassed"
        else:
            entry["outcome"] = report.outcome
        if report.outcome == "failed":
            entry["error"] = _crash_line(report)
    elif report.when == "teardown" and report.outcome == "failed":
        entry["outcome"] = "failed"
        entry["error"] = "teardown: " + _crash_line(report)
    if report.when == "call" or report.when == "teardown":
        entry["touched"] = entry.get("touched", False) or _touched


def pytest_sessionfinish(session):
    path = os.environ.get("SHMKV_UPSTREAM_RESULTS")
    if path:
        with open(path, "w") as f:
            json.dump({"target": TARGET, "results": _results}, f, indent=1, sort_keys=True)
