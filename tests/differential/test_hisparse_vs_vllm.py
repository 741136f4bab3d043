"""Differential test: HiSparse groups (a host source group, an indexer, resident and hot
groups; ``shmkv/core/hisparse.py``) on shmkv and on vLLM 0.33.0, the same calls on both: the
block tables, the page transfers planned, the residency sent to the worker, the pages lost
when the pool reuses unpinned copies, host prefix hits and the copies they adopt, the events
(with their medium), and the free counts of both pools. On shmkv the host pages live in the
pool's host tier, and both pools pass ``check_invariants()`` after every step.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

import shmkv
from tests.vllm_upstream.shmkv_upstream_plugin import to_shmkv
from tests.vllm_upstream.test_twins import IMPLS

torch = pytest.importorskip("torch")
vspecs = pytest.importorskip("vllm.v1.kv_cache_interface")
vkvm = pytest.importorskip("vllm.v1.core.kv_cache_manager")
vhisparse = pytest.importorskip("vllm.v1.hisparse.coordinator")
vrequest = pytest.importorskip("vllm.v1.request")
vsampling = pytest.importorskip("vllm.sampling_params")

pytestmark = pytest.mark.differential
BS = 4  # tokens per page (block) in every group, and per hash


def hisparse_config(num_blocks, host_blocks, num_resident_groups=1):
    source = vspecs.FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1,
                                      dtype=torch.float32)
    role = vspecs.KVCacheGroupRole
    groups = [
        vspecs.KVCacheGroupSpec(["source"], source, role=role.HISPARSE_SOURCE,
                                host_resident=True),
        vspecs.KVCacheGroupSpec(["indexer"], source, enable_kv_transfer=False,
                                role=role.HISPARSE_INDEXER),
        vspecs.KVCacheGroupSpec(["resident"], vspecs.HiSparseResidentSpec(
            block_size=BS, page_size=4 * BS), enable_kv_transfer=False),
        vspecs.KVCacheGroupSpec(["hot"], vspecs.HiSparseHotSpec(
            block_size=BS, page_size=4 * BS, blocks_per_request=2), enable_kv_transfer=False),
    ]
    for i in range(1, num_resident_groups):
        groups += [replace(g, layer_names=[f"{g.layer_names[0]}{i}"]) for g in groups[2:4]]
    return vspecs.KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                kv_cache_groups=groups, hisparse_host_num_blocks=host_blocks)


# Whether vLLM's page transfers say when they run (after_forward: up to 0.33).
VLLM_AFTER_FORWARD = "after_forward" in getattr(
    pytest.importorskip("vllm.v1.hisparse.types").SparseKVPageTransfer,
    "__dataclass_fields__", {})


class HiSide:
    """One implementation's KVCacheManager with its HiSparse coordinator."""

    def __init__(self, impl, make_pool, cfg, *, caching=True, events=True, max_model_len=64):
        self.impl = impl
        hasher_pool = make_pool(4, hash_block_size=BS)
        self.hasher = hasher_pool.make_block_hasher()
        kwargs = {"max_model_len": max_model_len, "scheduler_block_size": BS,
                  "hash_block_size": BS, "enable_caching": caching,
                  "enable_kv_cache_events": events}
        if impl == "vllm":
            self.manager = vkvm.KVCacheManager(cfg, **kwargs)
            self.coordinator = vhisparse.get_hisparse_coordinator(self.manager)
        else:
            self.device = make_pool(cfg.num_blocks, hash_block_size=BS, enable_caching=caching,
                                    enable_kv_cache_events=events, partial_keys=True)
            self.manager = shmkv.KVCacheManager(to_shmkv(cfg), block_pool=self.device, **kwargs)
            self.coordinator = shmkv.get_hisparse_coordinator(self.manager)
            assert shmkv.get_hisparse_coordinator(self.manager) is self.coordinator
        self.host = self.coordinator.get_host_block_pool()

    def check(self):
        if self.impl == "shmkv":
            self.device.check_invariants()
            self.host.check_invariants()
            assert self.host.medium == "CPU" and self.host.pool_name.endswith(".host")

    def request(self, rid, tokens):
        return vrequest.Request(rid, list(tokens), vsampling.SamplingParams(max_tokens=8),
                                None, block_hasher=self.hasher)

    def step(self, req, num_new, **kwargs):
        """allocate_slots, then the per-step work HiSparse's connector runs."""
        new = self.manager.allocate_slots(req, num_new, **kwargs)
        if new is None:
            return None
        done = min(req.num_computed_tokens + kwargs.get("num_new_computed_tokens", 0)
                   + num_new, req.num_tokens)
        self.coordinator.advance_scheduled([(req.request_id, done)])
        req.num_computed_tokens = done
        return new.get_block_ids()

    def transfers(self, complete=True):
        """The page transfers planned (as tuples) and, if ``complete``, every worker done."""
        command = self.coordinator.build_offload_command()
        # vLLM 0.34 dropped after_forward; shmkv keeps it for 0.33's workers.
        plans = [(t.transfer_id, t.host_block_id, t.resident_block_ids,
                  t.after_forward if VLLM_AFTER_FORWARD else None,
                  t.restore) for t in command.page_transfers]
        if complete:
            counts = {t[0]: 1 for t in plans}
            self.coordinator.update_spills(counts, counts)
        return plans

    def residency(self, *rids):
        updates = self.coordinator.take_residency_updates(rids)
        return {rid: (u.pages, u.block_ids) for rid, u in sorted(updates.items())}

    def resident_row(self, rid):
        manager = self.coordinator.resident_managers[0]
        return [b.block_id for b in manager.get_residency_row(rid)]

    def counts(self):
        return (self.manager.block_pool.get_num_free_blocks(), self.host.get_num_free_blocks(),
                self.coordinator.has_pending_work())



def _trace(events):
    return [(type(e).__name__, tuple(getattr(e, "block_hashes", ()) or ()),
             getattr(e, "medium", None), getattr(e, "group_idx", None)) for e in events]


def _lifecycle(impl, make_pool, num_resident_groups):
    """Prefill, write-back, hot region, pressure that reuses unpinned copies, a host prefix
    hit that adopts surviving copies, and the end of both requests."""
    side = HiSide(impl, make_pool,
                  hisparse_config(8 + 12 * num_resident_groups, 16, num_resident_groups))
    out = []
    a = side.request("a", range(5 * BS))
    out.append(side.step(a, 5 * BS))
    out.append(side.transfers())                  # every sealed page written back
    out.append(side.residency("a"))
    out.append(side.coordinator.all_context_pages_resident([("a", 5 * BS, 0)]))
    out.append(side.counts())
    side.check()
    for hot in side.coordinator.hot_managers:      # a asks to read from the host
        hot.require_hot("a")
    a.append_output_token_ids(1)
    out.append(side.step(a, 1))                   # the hot region; clean pages unpinned
    out.append((side.resident_row("a"), side.counts()))
    side.check()
    # Pressure: b's new blocks reuse a's unpinned copies, which a then reads from the host.
    b = side.request("b", [1000 + t for t in range(4 * BS)])
    out.append(side.step(b, 4 * BS))
    out.append(side.transfers())
    out.append((side.resident_row("a"), side.residency("a", "b"), side.counts()))
    side.check()
    side.manager.free(a)
    out.append((side.resident_row("a"), side.counts()))
    # A host prefix hit: adopted copies where they survived, host-only pages elsewhere.
    c = side.request("c", list(range(5 * BS)) + [7])
    hit, num_hit, _ = side.manager.get_computed_blocks(c)
    out.append((num_hit, hit.get_block_ids()))
    out.append(side.step(c, c.num_tokens - num_hit, num_new_computed_tokens=num_hit,
                         new_computed_blocks=hit))
    out.append((side.resident_row("c"), side.residency("c")))
    out.append(side.transfers())
    out.append([(m.source_starts, m.destination_start, m.num_rows) for m in
                side.coordinator.build_row_mirrors([("c", num_hit, c.num_tokens - num_hit)])])
    side.check()
    for r in (b, c):
        side.manager.free(r)
    out.append((side.counts(), _trace(side.manager.take_events())))
    side.check()
    return out


@pytest.mark.parametrize("num_resident_groups", [1, 2])
def test_hisparse_lifecycle_matches_vllm(make_pool, num_resident_groups):
    traces = {impl: _lifecycle(impl, make_pool, num_resident_groups) for impl in IMPLS}
    assert traces["shmkv"] == traces["vllm"]
    trace = traces["vllm"]
    # The scenario reaches what it is about: pages written back, copies reused under
    # pressure (a host-only page in a's row), and a host hit on c's prefix.
    assert trace[1] and trace[5] is not None and trace[7] is not None
    assert 0 in trace[9][0]
    assert trace[11][0] == 5 * BS


def _import_and_cow(impl, make_pool, available):
    """An external load into host pages (then its completion), and host copy-on-write."""
    side = HiSide(impl, make_pool, hisparse_config(12, 16))
    out = []
    r = side.request("imp", range(6 * BS))
    out.append(side.step(r, 0, num_external_computed_tokens=available,
                         delay_cache_blocks=True, full_sequence_must_fit=True))
    out.append((side.resident_row("imp"), side.counts()))
    side.coordinator.finish_host_import("imp", failed=False)
    out.append(side.transfers())                 # the restore of the last imported page
    out.append((side.resident_row("imp"), side.counts()))
    side.check()
    source = side.coordinator.host_manager
    block = source.block_pool.get_new_blocks(1)[0]
    source.req_to_blocks["cow"] = [block]
    source._partial_hit_reqs["cow"] = (0, block)
    new = source.allocate_new_blocks("cow", BS, BS)
    copies = side.coordinator.take_host_block_copies()
    out.append(([b.block_id for b in new], [tuple(c) for c in copies], side.counts()))
    source.free("cow")
    side.coordinator.release_completed_host_copies([c.dst_block_id for c in copies])
    side.manager.free(r)
    out.append(side.counts())
    side.check()
    return out


@pytest.mark.parametrize("available", [2 * BS, 4 * BS + 1])
def test_hisparse_import_and_host_cow_match_vllm(make_pool, available):
    traces = {impl: _import_and_cow(impl, make_pool, available) for impl in IMPLS}
    assert traces["shmkv"] == traces["vllm"]
    assert traces["vllm"][3], "the import's last page is restored"


def _host_exhaustion(impl, make_pool):
    """Host capacity bounds admission: a request whose pages the host tier cannot back is
    refused, and fits once another frees its host pages."""
    side = HiSide(impl, make_pool, hisparse_config(32, 5), caching=False)
    a = side.request("a", range(3 * BS))
    b = side.request("b", range(100, 100 + 3 * BS))
    out = [side.step(a, 3 * BS), side.step(b, 3 * BS), side.counts()]
    out.append(side.transfers())   # a's spills hold its host pages until they complete
    side.manager.free(a)
    out += [side.step(b, 3 * BS), side.counts()]
    side.manager.free(b)
    out.append(side.counts())
    side.check()
    return out


def test_hisparse_host_exhaustion_matches_vllm(make_pool):
    traces = {impl: _host_exhaustion(impl, make_pool) for impl in IMPLS}
    assert traces["shmkv"] == traces["vllm"]
    assert traces["vllm"][1] is None and traces["vllm"][4] is not None
