"""Two "nodes" (two pools with their own scheduler processes and publishers) and one Redis:
the router's answer for every prompt equals the longest prefix cached in each pool, after
evictions, a reset, a crash-repair, an indexer killed and restarted, and a Redis restart."""

from __future__ import annotations

import random
import signal
import time

import pytest

from shmkv import BlockPool, Request
from tests.cluster import index_workers as W
from tests.conftest import unique_pool_name
from tests.ecosystem_helpers import free_port, start_shmkv

pytest.importorskip("zmq")
redis = pytest.importorskip("redis")
from shmkv.cluster_index import PrefixRouter, RedisPrefixIndex  # noqa: E402
from shmkv.publisher import pool_identity  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.long]
JOIN_S = 60


def _join(proc, expect: int = 0) -> None:
    proc.join(JOIN_S)
    if proc.is_alive():
        proc.kill()
        proc.join(10)
    assert proc.exitcode == expect


class Node:
    """A pool, its publisher (the real `shmkv publish`) and its scheduler processes."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.name = unique_pool_name(label)
        self.pool = BlockPool.create(self.name, 40, hash_block_size=W.BS,
                                     enable_kv_cache_events=True, lock_timeout_s=20,
                                     label="test")
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.replay = f"tcp://127.0.0.1:{free_port()}"
        self.publisher = start_shmkv("publish", self.name, "--endpoint", self.endpoint,
                                     "--replay-endpoint", self.replay)
        banner = self.publisher.stdout.readline()
        assert banner.startswith("publishing pool"), (banner, self.publisher.stderr.read())

    @property
    def source(self) -> tuple:
        return (self.label, self.endpoint, self.replay, "", self.label)

    def truth(self, prompt: list[int]) -> int:
        req = Request("q", prompt, block_hasher=self.pool.make_block_hasher())
        return len(self.pool.get_cached_prefix(req.block_hashes)) * W.BS

    def close(self) -> None:
        if self.publisher.poll() is None:
            self.publisher.send_signal(signal.SIGTERM)
        try:
            self.publisher.communicate(timeout=30)
        except Exception:
            self.publisher.kill()
            self.publisher.communicate(timeout=30)
        self.pool.close()
        BlockPool.unlink(self.name)
        from shmkv.publisher import unlink_state

        unlink_state(self.name)


@pytest.fixture
def nodes():
    made = [Node("node-a"), Node("node-b")]
    yield made
    for node in made:
        node.close()


def _header(pool: BlockPool):
    return pool.layout.view(pool._segment.buf, "header")[0].copy()


def _start_indexer(ctx, redis_url, key_prefix, nodes):
    stop, stats = ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=W.indexer,
                       args=(redis_url, key_prefix, [n.source for n in nodes], stop, stats))
    proc.start()
    return proc, stop, stats


def _wait_exact(router: PrefixRouter, nodes, prompts, timeout_s: float = 30) -> None:
    """Waits until the index has caught up, then checks every prompt on every node."""
    deadline = time.monotonic() + timeout_s
    index = router.index
    while True:
        state = {st.source: st.seq for st in index.sources()}
        ends = {n.label: n.pool.event_cursor(from_start=False).seq - 1 for n in nodes}
        if all(state.get(label, -2) == end for label, end in ends.items()):
            break
        assert time.monotonic() < deadline, f"index at {state}, logs end at {ends}"
        time.sleep(0.05)
    for prompt in prompts:
        cached = router.cached_tokens(prompt)
        for node in nodes:
            assert cached.get(node.label, 0) == node.truth(prompt), (node.label, prompt[:3])


def test_the_router_stays_exact_through_every_kind_of_change(nodes, redis_server, spawn_ctx):
    key_prefix = unique_pool_name("ix")
    index = RedisPrefixIndex.from_url(redis_server.url, key_prefix)
    router = PrefixRouter(index, hash_block_size=W.BS)
    rng = random.Random(0)
    prompts = [W.prompt(rng) for _ in range(12)] + [system + [7] for system in W.SYSTEMS]
    a, b = nodes

    def serve(seed_base: int, n: int, crash_op: str | None = None, node=None) -> None:
        targets = [node] if node is not None else nodes
        procs = [spawn_ctx.Process(target=W.scheduler,
                                   args=(nd.name, seed_base + i, n, crash_op))
                 for i, nd in enumerate(targets)]
        for p in procs:
            p.start()
        for p in procs:
            _join(p, -signal.SIGKILL if crash_op else 0)

    proc, stop, stats = _start_indexer(spawn_ctx, redis_server.url, key_prefix, nodes)
    try:
        serve(10, 30)  # 40-block pools: many evictions
        _wait_exact(router, nodes, prompts)
        assert a.pool.reset_prefix_cache()
        serve(20, 10, node=b)
        _wait_exact(router, nodes, prompts)
        # A scheduler killed inside the lock; the next process that wants the lock (the
        # publisher, or this one) takes it over and rolls the hold back.
        takeovers = _header(a.pool)["num_takeovers"]
        serve(30, 5, crash_op="allocate", node=a)
        a.pool.reap_dead()
        assert _header(a.pool)["num_takeovers"] == takeovers + 1
        serve(40, 5, node=a)
        _wait_exact(router, nodes, prompts)
        # The indexer killed and started again: it resumes by replay.
        proc.kill()
        proc.join(JOIN_S)
        serve(50, 10)
        proc, stop, stats = _start_indexer(spawn_ctx, redis_server.url, key_prefix, nodes)
        _wait_exact(router, nodes, prompts)
        # Redis restarted empty: the indexer resyncs from snapshots.
        redis_server.restart()
        index._redis.connection_pool.disconnect()
        serve(60, 10)
        _wait_exact(router, nodes, prompts)
        stop.set()
        _join(proc)
        final = stats.get(timeout=10)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(10)
    assert final["replayed"] > 0  # its restart resumed by replay
    assert final["snapshots"] >= 2  # ... and Redis's restart was healed from snapshots
    for node in nodes:
        node.pool.check_invariants()


def test_a_pool_recreated_under_its_name_is_indexed_as_another_one(redis_server, spawn_ctx):
    """Issue 15, item 7: the node's pool is removed and created again under its name by the
    same process (same creator pid, as in a container that reuses pids), with its publisher
    on the same endpoints. The indexer must take it for another pool: the old pool's keys
    leave the index and the new pool's stream is applied from its start. With the identity
    of before (name:creator_pid:NONE_HASH[:4]) the indexer took the new stream, whose
    sequence numbers start again at 0, for duplicates of the old one and kept the old keys."""
    key_prefix = unique_pool_name("ix")
    index = RedisPrefixIndex.from_url(redis_server.url, key_prefix)
    router = PrefixRouter(index, hash_block_size=W.BS)
    # Each old prompt has a full block of its own: one BlockStored each, so the old log is
    # longer than the new one (whose seqs the old identity made look like duplicates).
    old_prompts = [W.SYSTEMS[i % 2] + list(range(100 * i, 100 * i + 20)) for i in range(6)]
    new_prompts = [W.SYSTEMS[2] + [5], W.SYSTEMS[3] + [6, 7]]
    node = Node("node-r")
    proc = None
    try:
        proc, stop, stats = _start_indexer(spawn_ctx, redis_server.url, key_prefix, [node])

        def serve(prompts) -> None:
            hasher = node.pool.make_block_hasher()
            for i, tokens in enumerate(prompts):
                blocks = W.admit(node.pool, Request(f"r{i}", tokens, block_hasher=hasher))
                node.pool.free_blocks(reversed(blocks))

        serve(old_prompts)
        _wait_exact(router, [node], old_prompts)
        assert all(router.cached_tokens(p).get(node.label, 0) > 0 for p in old_prompts)
        old_creator = int(node.pool.header_snapshot()["creator_pid"])
        endpoint, replay = node.endpoint, node.replay
        node.close()
        node.pool = BlockPool.create(node.name, 40, hash_block_size=W.BS,
                                     enable_kv_cache_events=True, lock_timeout_s=20,
                                     label="test")
        assert int(node.pool.header_snapshot()["creator_pid"]) == old_creator
        node.publisher = start_shmkv("publish", node.name, "--endpoint", endpoint,
                                     "--replay-endpoint", replay)
        banner = node.publisher.stdout.readline()
        assert banner.startswith("publishing pool"), (banner, node.publisher.stderr.read())
        serve(new_prompts)
        new_identity = pool_identity(node.pool)
        deadline = time.monotonic() + 30
        while {st.source: st.epoch for st in index.sources()}.get(node.label) != new_identity:
            assert time.monotonic() < deadline, "the indexer never took up the new identity"
            time.sleep(0.05)
        _wait_exact(router, [node], old_prompts + new_prompts)
        assert all(router.cached_tokens(p).get(node.label, 0) == 0 for p in old_prompts)
        assert all(router.cached_tokens(p).get(node.label, 0) > 0 for p in new_prompts)
        stop.set()
        _join(proc)
        assert stats.get(timeout=10)["snapshots"] >= 2  # the new pool started from one
    finally:
        if proc is not None and proc.is_alive():
            proc.kill()
            proc.join(10)
        node.close()


def _index_seqs(index: RedisPrefixIndex) -> dict[str, int]:
    return {st.source: st.seq for st in index.sources()}


def _log_end(node: Node) -> int:
    return node.pool.event_cursor(from_start=False).seq - 1


def _serve_some(node: Node, seed: int, n: int) -> None:
    rng = random.Random(seed)
    hasher = node.pool.make_block_hasher()
    for i in range(n):
        blocks = W.admit(node.pool, Request(f"d{seed}-{i}", W.prompt(rng), block_hasher=hasher))
        node.pool.free_blocks(reversed(blocks))


def test_a_silent_source_does_not_stop_the_others(nodes, redis_server):
    """`shmkv index` with one source stopped (SIGSTOP: connections open, nothing answers)
    keeps indexing the other within a second or two, retries the silent one with a backoff,
    catches it up once it answers again, and is still running at the end (SIGTERM: 143)."""
    a, b = nodes
    key_prefix = unique_pool_name("ix")
    index = RedisPrefixIndex.from_url(redis_server.url, key_prefix)
    sources = [f"{n.label}={n.endpoint},{n.replay},{n.label}" for n in nodes]
    proc = start_shmkv("index", "--redis", redis_server.url, "--key-prefix", key_prefix,
                       "--identity-check", "0.2", "--source-timeout", "0.5",
                       *(arg for s in sources for arg in ("--source", s)))
    stopped = False
    try:
        assert proc.stdout.readline().startswith("indexing 2 source(s)")
        _serve_some(a, 1, 3)
        _serve_some(b, 2, 3)
        deadline = time.monotonic() + 10
        while _index_seqs(index) != {a.label: _log_end(a), b.label: _log_end(b)}:
            assert time.monotonic() < deadline, (_index_seqs(index), _log_end(a), _log_end(b))
            time.sleep(0.02)
        b.publisher.send_signal(signal.SIGSTOP)
        stopped = True
        time.sleep(0.8)  # an identity check of b goes unanswered: b is down
        _serve_some(b, 3, 3)
        b_end_while_down = _log_end(b)
        t0 = time.monotonic()
        for k in range(3):  # a's events keep being indexed, each within 2 s
            _serve_some(a, 10 + k, 2)
            while _index_seqs(index)[a.label] != _log_end(a):
                assert proc.poll() is None, _stop(proc)
                assert time.monotonic() - t0 < 2 * (k + 1), (
                    f"a's events not indexed while b is silent: index {_index_seqs(index)}, "
                    f"a's log ends at {_log_end(a)}")
                time.sleep(0.02)
            time.sleep(0.3)
        assert _index_seqs(index)[b.label] < b_end_while_down
        b.publisher.send_signal(signal.SIGCONT)
        stopped = False
        deadline = time.monotonic() + 4  # the backoff is short after a short outage
        while _index_seqs(index) != {a.label: _log_end(a), b.label: _log_end(b)}:
            assert time.monotonic() < deadline, (_index_seqs(index), _log_end(a), _log_end(b))
            time.sleep(0.02)
        assert proc.poll() is None
        out = _stop(proc)
        assert proc.returncode == 143, out
        assert f"source {b.label}" in out and "did not answer within 0.5 s" in out, out
        assert "answers again" in out, out
    finally:
        if stopped:
            b.publisher.send_signal(signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)


def _stop(proc) -> str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=30)
    except Exception:
        proc.kill()
        out, err = proc.communicate(timeout=30)
    return out + err


def test_a_source_nobody_listens_on_is_retried_with_a_backoff(nodes, redis_server):
    """A source whose address nobody listens on (a node that is down from the start) is
    retried after 0.25, 0.5, 1 s ..., not at every poll, while a live one is indexed."""
    from shmkv.cluster_index import ClusterIndexer, IndexSource

    a = nodes[0]
    index = RedisPrefixIndex.from_url(redis_server.url, unique_pool_name("ix"))
    dead = IndexSource("dead", f"tcp://127.0.0.1:{free_port()}",
                       f"tcp://127.0.0.1:{free_port()}")
    live = IndexSource(a.label, a.endpoint, a.replay)
    with ClusterIndexer(index, [dead, live], identity_check_s=0.2, replay_timeout_s=0.2,
                        retry_min_s=0.25, retry_max_s=30) as ix:
        _serve_some(a, 1, 3)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 2.9:
            ix.poll(0.01)
        assert _index_seqs(index) == {a.label: _log_end(a)}
        assert ix.down_sources() == ["dead"]
        # unanswered at 0.2 s, then after waits of 0.25, 0.5 and 1 s (each 0.2 s long):
        # at 0.65, 1.35 and 2.55 s (the next at 4.75); with a fixed 0.25 s wait it would be
        # every 0.45 s, 6 times (3 allows for a slow machine)
        assert 3 <= ix.stats.source_errors <= 4, ix.stats
