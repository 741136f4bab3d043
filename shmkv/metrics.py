"""Prometheus metrics of a live pool, every one under a ``shmkv_`` name.

``PoolMetrics(pool)`` reads a pool from any process (it needs an attached handle of its
own) and serves as a ``prometheus_client`` collector; ``shmkv metrics NAME --port P``
serves it over HTTP. Every metric has the label ``pool``; per-process ones also
``engine``, the process-table slot (vLLM labels its per-engine metrics ``engine`` too).
None is exported under vLLM's ``vllm:`` names: a vLLM server exports those for its own
cache, and a pool's figures are another cache's (a tier's chunks are kept when no request
holds them, so "in use" says nothing of how full a tier is).

| metric | type | labels | meaning |
|---|---|---|---|
| `shmkv_blocks_in_use_ratio` | gauge | pool | fraction of blocks held (ref count above 0), 0..1 |
| `shmkv_blocks_with_data_ratio` | gauge | pool | fraction of blocks holding data: held, or cached with a key (a tier's chunks with data), 0..1 |
| `shmkv_prefix_cache_queries_total` | counter | pool, engine | prompt tokens looked up in the prefix cache |
| `shmkv_prefix_cache_hits_total` | counter | pool, engine | of them found |
| `shmkv_prefix_cache_requests_total` | counter | pool, engine | lookups (new requests) |
| `shmkv_blocks` | gauge | pool, state | blocks `total` (without the null block), `free`, `in_use`, `cached` (keys), `with_data` (held or keyed) |
| `shmkv_evictions_total` | counter | pool | cached keys evicted (``BlockRemoved`` keys in the event log) |
| `shmkv_blocks_stored_total` | counter | pool | blocks cached (``BlockStored`` hashes) |
| `shmkv_prefix_cache_resets_total` | counter | pool | ``AllBlocksCleared`` |
| `shmkv_attached_processes` | gauge | pool, state | process-table slots whose process is `alive` / `dead` (not yet reaped), this exporter left out |
| `shmkv_reaped_processes_total` | counter | pool | processes reaped after dying without ``close()`` |
| `shmkv_repairs_total` | counter | pool | repairs (roll-backs after a dead holder, rebuilds) |
| `shmkv_lock_takeovers_total` | counter | pool | locks taken over from a dead holder |
| `shmkv_lock_acquisitions_total` | counter | pool | holds of the pool lock, every process |
| `shmkv_lock_wait_seconds` | histogram | pool, engine | time to take the pool lock |
| `shmkv_lock_hold_seconds` | histogram | pool, engine | time the pool lock was held |
| `shmkv_events_logged_total` | counter | pool | events written to the global log (its next sequence number) |
| `shmkv_events_dropped_total` | counter | pool | events too large for the log |
| `shmkv_event_log_lost_total` | counter | pool | events this exporter could not count (overwritten before it read them) |
| `shmkv_tier_chunks` | gauge | pool, state | a tier pool's chunks (vLLM offload tier, SGLang store): `total`, `with_data`, `storing`, `held` |
| `shmkv_tier_stored_chunks_total` | counter | pool, replica, dp_rank, engine_id | chunks whose store completed, per replica row (`node`: all) |
| `shmkv_tier_loaded_chunks_total` | counter | pool, replica, dp_rank, engine_id | chunks loaded (pinned for the copy) |
| `shmkv_tier_cross_replica_hit_chunks_total` | counter | pool, replica, dp_rank, engine_id | of them, chunks another replica stored |

The eviction, stored and reset counters come from the pool's global event log (a pool
made without ``enable_kv_cache_events`` has none of them); they count what the log still
held when the exporter started and everything since. The per-engine counters and lock
histograms come from ``shmkv.stats`` rows that scheduler processes record (``PoolStats``);
an engine appears once its process recorded something. prometheus-client is an optional
dependency: ``pip install 'shmkv[metrics]'``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from shmkv.errors import SegmentError, UsageError
from shmkv.events import AllBlocksCleared, BlockRemoved, BlockStored
from shmkv.pool.event_log import decode_event
from shmkv.pool.tier_counters import TierCounts, TierFiles, read_tier_counts
from shmkv.stats import LOCK_BUCKETS_S, read_stats


def require_prometheus():
    try:
        import prometheus_client
    except ImportError as exc:  # pragma: no cover  (prometheus-client is in the dev extra)
        raise UsageError(
            "serving metrics needs prometheus-client: pip install 'shmkv[metrics]'"
        ) from exc
    return prometheus_client


@dataclass
class PoolSnapshot:
    """A pool's figures at one instant (what ``shmkv stats`` prints and metrics export)."""

    pool: str
    num_blocks: int  # without the null block
    free: int
    cached: int
    with_data: int  # blocks held or holding a key (a tier's chunks with data)
    alive: int
    dead: int
    reaped: int
    repairs: int
    takeovers: int
    lock_acquisitions: int
    events_logged: int
    events_dropped: int
    evictions: int
    stored: int
    resets: int
    log_lost: int
    engines: dict[int, dict] = field(default_factory=dict)  # slot -> stats row as a dict
    tier: TierCounts | None = None  # the vLLM offload tier's or SGLang store's counters
    # what was found at a tier's or the stats segment's path instead (a FIFO, a directory,
    # another user's file...): not read
    notes: list[str] = field(default_factory=list)

    @property
    def in_use(self) -> int:
        return self.num_blocks - self.free

    @property
    def in_use_ratio(self) -> float:
        """Blocks held (ref count above 0) per block, the null block left out."""
        return self.in_use / self.num_blocks if self.num_blocks else 0.0

    @property
    def with_data_ratio(self) -> float:
        """Blocks holding data (held, or cached with a key) per block: how full the pool is;
        for a tier, its chunks with data per chunk."""
        return self.with_data / self.num_blocks if self.num_blocks else 0.0

    @property
    def queries(self) -> int:
        return sum(e["queries"] for e in self.engines.values())

    @property
    def hits(self) -> int:
        return sum(e["hits"] for e in self.engines.values())


def blocks_with_data(pool) -> int:
    """The pool's blocks that hold data: held (ref count above 0) or holding a key, the
    null block left out. Call it under the pool lock."""
    from shmkv.pool import layout as L

    rows = pool.block_rows()[1:]
    return int(((rows["hash_num_tokens"] != L.NO_HASH_TOKENS) | (rows["ref_cnt"] > 0)).sum())


class PoolMetrics:
    """Reads a pool's figures (and tails its event log for eviction counts).

    Args:
        pool: an attached ``BlockPool`` used only by this object (from one thread at a time;
            the HTTP server's thread calls ``collect``).
    """

    def __init__(self, pool) -> None:
        self.pool = pool
        self._mutex = threading.Lock()
        self._has_log = bool(pool.event_log.capacity)
        self._cursor = pool.event_cursor(from_start=True) if self._has_log else None
        self._evictions = self._stored = self._resets = self._lost = 0

    def _tail_log(self) -> None:
        while True:
            with self.pool.lock():  # copy under the lock, decode after
                records, lost = self.pool.event_log.read_raw(self._cursor, 64)
            self._lost += lost
            if not records:
                return
            for _, _, _, body in records:
                event = decode_event(body)
                if isinstance(event, BlockRemoved):
                    self._evictions += len(event.block_hashes)
                elif isinstance(event, BlockStored):
                    self._stored += len(event.block_hashes)
                elif isinstance(event, AllBlocksCleared):
                    self._resets += 1

    def snapshot(self) -> PoolSnapshot:
        """The figures now."""
        with self._mutex:
            pool = self.pool
            if self._has_log:
                self._tail_log()
            with TierFiles(pool.pool_name) as tier_files, pool.lock():  # opened before
                hdr = pool.header_snapshot()
                free = pool.get_num_free_blocks()
                cached = len(pool.cached_block_hash_to_block)
                with_data = blocks_with_data(pool)
                counters = (int(hdr["num_reaped"]), int(hdr["epoch"]) - 1,
                            int(hdr["num_takeovers"]), int(hdr["lock_seq"]),
                            int(hdr["next_event_seq"]), int(hdr["num_events_dropped"]))
                table = pool.process_table
                others = [s for s in table.active_slots() if s != pool.slot]
                alive = [s for s in others if table.is_alive(s)]
                dead = [s for s in others if not table.is_alive(s)]
                tier = read_tier_counts(pool, tier_files)
            notes = list(tier_files.notes)
            try:
                rows = read_stats(pool.pool_name)
            except SegmentError as exc:  # something planted at its path: not read
                rows = None
                notes.append(f"stats: not read: {exc}")
            engines = {}
            if rows is not None:
                for slot in range(len(rows)):
                    row = rows[slot]
                    if row["pid"] == 0:
                        continue  # no process ever recorded in this slot
                    engines[slot] = {name: (row[name].tolist() if row[name].ndim
                                            else int(row[name]))
                                     for name in row.dtype.names}
            return PoolSnapshot(
                pool=pool.pool_name, num_blocks=pool.num_gpu_blocks - 1, free=free,
                cached=cached, with_data=with_data, alive=len(alive), dead=len(dead),
                reaped=counters[0], repairs=counters[1], takeovers=counters[2],
                lock_acquisitions=counters[3], events_logged=counters[4],
                events_dropped=counters[5], evictions=self._evictions, stored=self._stored,
                resets=self._resets, log_lost=self._lost, engines=engines, tier=tier,
                notes=notes)

    # ------------------------------------------------------------------ prometheus

    def collect(self):
        """The prometheus_client collector protocol."""
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        s = self.snapshot()
        name = s.pool

        def gauge(metric, doc, value, **labels):
            fam = GaugeMetricFamily(metric, doc, labels=["pool", *labels])
            fam.add_metric([name, *labels.values()], value)
            return fam

        def counter(metric, doc, value):
            fam = CounterMetricFamily(metric, doc, labels=["pool"])
            fam.add_metric([name], value)
            return fam

        yield gauge("shmkv_blocks_in_use_ratio", "Fraction of the pool's blocks held (ref "
                    "count above 0), the null block left out; 0..1.", s.in_use_ratio)
        yield gauge("shmkv_blocks_with_data_ratio", "Fraction of the pool's blocks holding "
                    "data: held, or cached with a key (a tier's chunks with data); 0..1.",
                    s.with_data_ratio)
        blocks = GaugeMetricFamily("shmkv_blocks", "Blocks of the pool by state (the null "
                                   "block left out): total, free, in_use, cached (keys), "
                                   "with_data (held or keyed).", labels=["pool", "state"])
        for state, value in (("total", s.num_blocks), ("free", s.free),
                             ("in_use", s.in_use), ("cached", s.cached),
                             ("with_data", s.with_data)):
            blocks.add_metric([name, state], value)
        yield blocks
        procs = GaugeMetricFamily("shmkv_attached_processes", "Processes attached to the "
                                  "pool: alive, or dead and not yet reaped.",
                                  labels=["pool", "state"])
        procs.add_metric([name, "alive"], s.alive)
        procs.add_metric([name, "dead"], s.dead)
        yield procs
        yield counter("shmkv_reaped_processes", "Processes reaped after dying without "
                      "close().", s.reaped)
        yield counter("shmkv_repairs", "Repairs of the pool: roll-backs of a dead holder's "
                      "hold and rebuilds.", s.repairs)
        yield counter("shmkv_lock_takeovers", "Pool locks taken over from a dead holder.",
                      s.takeovers)
        yield counter("shmkv_lock_acquisitions", "Holds of the pool lock by every process.",
                      s.lock_acquisitions)
        yield counter("shmkv_events_logged", "Events written to the pool's global event log.",
                      s.events_logged)
        yield counter("shmkv_events_dropped", "Events too large for the event log.",
                      s.events_dropped)
        if self._has_log:
            yield counter("shmkv_evictions", "Cached blocks evicted from the prefix cache "
                          "(BlockRemoved keys of the event log).", s.evictions)
            yield counter("shmkv_blocks_stored", "Blocks added to the prefix cache "
                          "(BlockStored hashes of the event log).", s.stored)
            yield counter("shmkv_prefix_cache_resets", "Prefix-cache resets "
                          "(AllBlocksCleared).", s.resets)
            yield counter("shmkv_event_log_lost", "Events overwritten in the log before this "
                          "exporter counted them.", s.log_lost)

        queries = CounterMetricFamily(
            "shmkv_prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            labels=["pool", "engine"])
        hits = CounterMetricFamily(
            "shmkv_prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            labels=["pool", "engine"])
        requests = CounterMetricFamily(
            "shmkv_prefix_cache_requests", "Prefix-cache lookups (new requests).",
            labels=["pool", "engine"])
        waits = HistogramMetricFamily("shmkv_lock_wait_seconds", "Time to take the pool "
                                      "lock.", labels=["pool", "engine"])
        holds = HistogramMetricFamily("shmkv_lock_hold_seconds", "Time the pool lock was "
                                      "held.", labels=["pool", "engine"])
        for slot, row in sorted(s.engines.items()):
            labels = [name, str(slot)]
            queries.add_metric(labels, row["queries"])
            hits.add_metric(labels, row["hits"])
            requests.add_metric(labels, row["requests"])
            for fam, what in ((waits, "lock_wait"), (holds, "lock_hold")):
                cumulative = np.cumsum(row[f"{what}_buckets"]).tolist()
                buckets = [(repr(b), c) for b, c in zip(LOCK_BUCKETS_S, cumulative[:-1], strict=True)]
                buckets.append(("+Inf", cumulative[-1]))
                fam.add_metric(labels, buckets, row[f"{what}_sum_ns"] / 1e9)
        yield from (queries, hits, requests, waits, holds)
        if s.tier is not None:
            yield from _tier_metrics(name, s.tier)


# The tier's counters, per replica (a vLLM replica row, an SGLang process slot) and for the
# node: (metric, help, TierCounts field).
TIER_COUNTERS = (
    ("shmkv_tier_stored_chunks", "Chunks (SGLang: pages) whose store into the tier "
     "completed.", "stored"),
    ("shmkv_tier_loaded_chunks", "Chunks loaded from the tier (pinned for the copy).",
     "loaded"),
    ("shmkv_tier_cross_replica_hit_chunks", "Chunks loaded from the tier that another "
     "replica stored.", "cross_replica_hits"),
)


def _tier_metrics(name: str, tier: TierCounts):
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    chunks = GaugeMetricFamily("shmkv_tier_chunks", "Chunks of the tier by state: total, "
                               "with_data (complete or being stored), storing, held.",
                               labels=["pool", "state"])
    for state, value in (("total", tier.num_chunks), ("with_data", tier.chunks_with_data),
                         ("storing", tier.chunks_storing), ("held", tier.chunks_held)):
        chunks.add_metric([name, state], value)
    yield chunks
    for metric, doc, what in TIER_COUNTERS:
        fam = CounterMetricFamily(metric, doc + " replica=\"node\": every replica, those "
                                  "gone included.", labels=["pool", "replica", "dp_rank",
                                                            "engine_id"])
        fam.add_metric([name, "node", "", ""], getattr(tier, what))
        for row in tier.rows:
            dp_rank = "" if row["dp_rank"] is None else str(row["dp_rank"])
            fam.add_metric([name, str(row["row"]), dp_rank, row["engine_id"] or ""], row[what])
        yield fam


def serve(pool, port: int, addr: str = "127.0.0.1"):
    """Serves a pool's metrics at ``http://addr:port/metrics`` from a daemon thread.
    Returns (server, thread, PoolMetrics); ``server.shutdown()`` stops it."""
    prometheus_client = require_prometheus()
    registry = prometheus_client.CollectorRegistry(auto_describe=False)
    metrics = PoolMetrics(pool)
    registry.register(metrics)
    server, thread = prometheus_client.start_http_server(port, addr=addr, registry=registry)
    return server, thread, metrics
