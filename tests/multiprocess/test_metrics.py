"""Prometheus metrics: `shmkv metrics` scraped over HTTP, every figure checked against the
pool and against what the scheduler processes recorded."""

from __future__ import annotations

import signal
import urllib.request

import pytest

prometheus_client = pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from shmkv import BlockPool  # noqa: E402
from shmkv.events import BlockRemoved, BlockStored  # noqa: E402
from shmkv.stats import LOCK_BUCKETS_S, PoolStats, read_stats, unlink_stats  # noqa: E402
from tests.ecosystem_helpers import free_port, shmkv, start_shmkv  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.long]
N = 20  # requests per scheduler: enough to evict in a 40-block pool


def scrape(port: int) -> dict:
    """{(sample name, frozenset of labels): value} of one scrape."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = dict(sample.labels)
            labels.pop("pool")  # every metric has it: checked below
            out[(sample.name, frozenset(labels.items()))] = sample.value
    assert 'pool="' in text
    return out


def value(samples: dict, name: str, **labels) -> float:
    return samples[(name, frozenset(labels.items()))]


def start_metrics(name: str) -> tuple:
    port = free_port()
    proc = start_shmkv("metrics", name, "--port", str(port))
    line = proc.stdout.readline()
    assert line.startswith("serving metrics"), (line, proc.stderr.read())
    assert f":{port}/metrics" in line
    return proc, port


def stop(proc) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except Exception:
        proc.kill()
        proc.wait(30)


@pytest.fixture
def metrics_pool(pool_name):
    pool = BlockPool.create(pool_name, 40, enable_kv_cache_events=True, max_processes=8)
    yield pool
    pool.close()
    unlink_stats(pool_name)


def test_scraped_metrics_match_the_pool(metrics_pool, spawn_ctx):
    """Two recording schedulers and a process that died without close(): the scrape's
    usage, blocks, processes, prefix-cache queries and hits per engine, lock histograms,
    evictions and reaps are the pool's and the schedulers' own figures."""
    from tests.multiprocess import event_workers

    pool = metrics_pool
    name = pool.pool_name
    held = pool.get_new_blocks(5)  # in use while we scrape
    results, release = spawn_ctx.Queue(), spawn_ctx.Event()
    procs = [spawn_ctx.Process(target=event_workers.recording_scheduler,
                               args=(name, i, N, results, release)) for i in range(2)]
    for p in procs:
        p.start()
    doomed = spawn_ctx.Process(target=event_workers.attach_and_die, args=(name,))
    metrics = None
    try:
        rows = {}
        for _ in procs:
            index, slot, row = results.get(timeout=120)
            rows[slot] = row
        doomed.start()
        doomed.join(60)
        assert doomed.exitcode == 0
        metrics, port = start_metrics(name)
        s = scrape(port)

        # the pool: usage, blocks
        assert value(s, "shmkv_blocks_in_use_ratio") == pytest.approx(pool.get_usage())
        assert value(s, "shmkv_blocks", state="total") == 39
        assert value(s, "shmkv_blocks", state="free") == pool.get_num_free_blocks()
        assert value(s, "shmkv_blocks", state="in_use") == 39 - pool.get_num_free_blocks()
        assert value(s, "shmkv_blocks", state="cached") == \
            len(pool.cached_block_hash_to_block)
        # processes: this one + 2 schedulers alive (the exporter left out), 1 dead
        assert value(s, "shmkv_attached_processes", state="alive") == 3
        assert value(s, "shmkv_attached_processes", state="dead") == 1
        assert value(s, "shmkv_reaped_processes_total") == 0
        assert value(s, "shmkv_repairs_total") == 0
        # per engine: what each scheduler recorded
        assert len(rows) == 2
        for slot, row in rows.items():
            engine = str(slot)
            assert value(s, "shmkv_prefix_cache_queries_total", engine=engine) == \
                row["queries"] == N * (48 + 24)
            assert value(s, "shmkv_prefix_cache_hits_total", engine=engine) == row["hits"]
            assert value(s, "shmkv_prefix_cache_requests_total", engine=engine) == N
            for what in ("wait", "hold"):
                count = row[f"lock_{what}_count"]
                assert count == 2 * N  # one hold per request + one per free_blocks
                metric = f"shmkv_lock_{what}_seconds"
                assert value(s, f"{metric}_count", engine=engine) == count
                assert value(s, f"{metric}_sum", engine=engine) == \
                    pytest.approx(row[f"lock_{what}_sum_ns"] / 1e9)
                assert value(s, f"{metric}_bucket", engine=engine, le="+Inf") == count
                le = repr(LOCK_BUCKETS_S[9])
                assert value(s, f"{metric}_bucket", engine=engine, le=le) == \
                    sum(row[f"lock_{what}_buckets"][:10])
        assert sum(r["hits"] for r in rows.values()) > 0  # the system prompt was shared
        # the event log: stored blocks and evictions
        events, lost = pool.read_events(pool.event_cursor())
        assert lost == 0
        evicted = sum(len(e.event.block_hashes) for e in events
                      if isinstance(e.event, BlockRemoved))
        stored = sum(len(e.event.block_hashes) for e in events
                     if isinstance(e.event, BlockStored))
        assert evicted > 0  # 40 blocks: the schedulers evicted each other's blocks
        assert value(s, "shmkv_evictions_total") == evicted
        assert value(s, "shmkv_blocks_stored_total") == stored
        assert value(s, "shmkv_events_logged_total") == len(events)
        assert value(s, "shmkv_lock_acquisitions_total") > 2 * 2 * N

        # reap the dead one: the counters move
        assert pool.reap_dead() == 1
        s = scrape(port)
        assert value(s, "shmkv_attached_processes", state="dead") == 0
        assert value(s, "shmkv_reaped_processes_total") == 1
        pool.free_blocks(held)
        s = scrape(port)
        assert value(s, "shmkv_blocks_in_use_ratio") == pytest.approx(pool.get_usage())
    finally:
        release.set()
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
                p.join(10)
        if metrics is not None:
            stop(metrics)
            assert metrics.returncode == 143  # SIGTERM: a clean stop
    assert all(p.exitcode == 0 for p in procs)


def test_stats_rows_are_per_slot_and_monotonic(metrics_pool):
    """PoolStats: a row per slot, kept after close (a later process adds to it); lock
    timing counts outermost holds only, one still going on at a sync is counted once it
    ends, and timing stops at close."""
    pool = metrics_pool
    stats = PoolStats.open(pool, time_lock=True)
    with pool.lock():
        pool.get_num_free_blocks()
        pool.free_blocks(pool.get_new_blocks(2))  # nested: not counted apart
        stats.sync()  # inside the hold: it is not counted yet
        assert stats.row["lock_hold_count"] == 0
    stats.add_prefix_cache(64, 32, requests=2)
    stats.add_prefix_cache(16, 0, preempted=True)
    row = stats.row
    assert row["lock_hold_count"] == row["lock_wait_count"] == 1
    assert (row["requests"], row["queries"], row["hits"]) == (2, 64, 32)
    assert (row["preempted_requests"], row["preempted_queries"]) == (1, 16)
    stats.close()
    pool.free_blocks(pool.get_new_blocks(1))  # no longer timed
    again = PoolStats.open(pool)
    again.add_prefix_cache(10, 5)
    again.close()
    rows = read_stats(pool.pool_name)
    assert rows[pool.slot]["queries"] == 74 and rows[pool.slot]["lock_hold_count"] == 1


def test_shmkv_metrics_errors(pool_name):
    """Missing pool, a port in use, bad arguments: exit 2, no traceback."""
    missing = shmkv("metrics", pool_name, "--port", "0")
    assert missing.returncode == 2 and f"no pool named {pool_name}" in missing.stderr
    no_port = shmkv("metrics", pool_name)
    assert no_port.returncode == 2 and "--port" in no_port.stderr
    bad_port = shmkv("metrics", pool_name, "--port", "x")
    assert bad_port.returncode == 2 and "invalid int value" in bad_port.stderr
    BlockPool.create(pool_name, 8).close()
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = shmkv("metrics", pool_name, "--port", str(busy.getsockname()[1]))
    assert taken.returncode == 2 and "cannot listen" in taken.stderr
    out_of_range = [shmkv("metrics", pool_name, "--port", port) for port in ("99999", "-1")]
    for out, port in zip(out_of_range, ("99999", "-1"), strict=True):
        assert out.returncode == 2, out.stderr
        assert out.stderr.splitlines() == [
            f"shmkv metrics: --port {port}: must be a TCP port in 0..65535 (0: any free one)"]
    for out in (missing, no_port, bad_port, taken, *out_of_range):
        assert "Traceback" not in out.stderr
    ok = shmkv("metrics", pool_name, "--port", "0", "--duration", "0.2")
    assert ok.returncode == 0 and "serving metrics" in ok.stdout, ok.stderr
