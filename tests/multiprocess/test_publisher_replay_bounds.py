"""What a local peer can cost the publisher through its replay socket: bounded memory,
bounded replies, and the other peers still answered."""

from __future__ import annotations

import signal
import time

import pytest

zmq = pytest.importorskip("zmq")

from shmkv import BlockPool  # noqa: E402
from shmkv.publisher import (  # noqa: E402
    SNAPSHOT_REQUEST,
    KVEventSubscriber,
    saved_position,
    unlink_state,
)
from tests.ecosystem_helpers import free_port, serve_requests, start_shmkv  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.long]


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def test_a_peer_that_asks_hundreds_of_replays_and_reads_nothing(pool_name):
    """400 replay requests (and 40 snapshot requests) from peers that read nothing: the
    publisher's RSS stays within 30 MB of where it was, its live stream goes on, and a
    fresh subscriber still gets a whole replay."""
    pool = BlockPool.create(pool_name, 256, enable_kv_cache_events=True,
                            event_log_bytes=4 << 20)
    endpoint, replay = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    proc = start_shmkv("publish", pool_name, "--endpoint", endpoint, "--replay-endpoint",
                       replay)
    ctx = zmq.Context()
    peers = []
    try:
        assert proc.stdout.readline().startswith("publishing pool"), proc.stderr.read()
        hasher = pool.make_block_hasher()
        serve_requests(pool, hasher, 0, 1500)
        end = pool.event_cursor(from_start=False).seq
        assert end > 2000, end  # each replay from 0 is thousands of frames
        deadline = time.monotonic() + 10
        while saved_position(pool_name)["next_seq"] != end:
            assert time.monotonic() < deadline, saved_position(pool_name)
            time.sleep(0.02)
        rss_before = _rss_mb(proc.pid)
        for _ in range(4):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(replay)
            for _ in range(100):
                sock.send_multipart((b"", (0).to_bytes(8, "big")))
            for _ in range(10):
                sock.send_multipart((b"", SNAPSHOT_REQUEST))
            peers.append(sock)
        samples = []
        t0 = time.monotonic()
        while time.monotonic() - t0 < 3.0:
            samples.append(_rss_mb(proc.pid) - rss_before)
            time.sleep(0.1)
        assert proc.poll() is None, proc.stderr.read()
        assert max(samples) < 30, f"RSS grew by {[round(s) for s in samples]} MB"
        # the live stream still flows, and another peer still gets a whole replay
        serve_requests(pool, hasher, 1000, 5)
        new_end = pool.event_cursor(from_start=False).seq
        deadline = time.monotonic() + 5
        while saved_position(pool_name)["next_seq"] != new_end:
            assert time.monotonic() < deadline, saved_position(pool_name)
            time.sleep(0.02)
        sub = KVEventSubscriber(endpoint, replay, replay_timeout_s=4)
        try:
            got = sub.replay(new_end - 50)
        finally:
            sub.close()
        assert [seq for seq, _ in got] == list(range(new_end - 50, new_end))
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 143, out + err
    finally:
        for sock in peers:
            sock.close(linger=0)
        ctx.term()
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
        pool.close()
        BlockPool.unlink(pool_name)
        unlink_state(pool_name)


def test_a_peer_that_stops_reading_is_dropped_and_then_ignored(pool_name, monkeypatch,
                                                               caplog):
    """A replay whose peer reads nothing (its queue full) is dropped after
    ``REPLAY_STALL_S``, that peer's later requests go unanswered, and another peer is
    answered meanwhile."""
    import logging

    import shmkv.publisher as P

    monkeypatch.setattr(P, "REPLAY_STALL_S", 0.3)
    pool = BlockPool.create(pool_name, 256, enable_kv_cache_events=True)
    ctx = zmq.Context.instance()
    pub = P.KVEventPublisher(pool, f"inproc://{pool_name}-pub",
                             f"inproc://{pool_name}-replay", buffer_steps=0)
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 1)
    try:
        serve_requests(pool, pool.make_block_hasher(), 0, 1500)  # > REPLAY_SNDHWM events
        while pub.publish_pending():
            pass
        sock.connect(pub.replay_endpoint)
        sock.send_multipart((b"", (0).to_bytes(8, "big")))
        with caplog.at_level(logging.WARNING, logger="shmkv.publisher"):
            deadline = time.monotonic() + 5
            while pub.replays_dropped == 0:
                assert time.monotonic() < deadline, "the stalled replay was never dropped"
                pub.poll(0.001)
        assert "dropped a replay whose peer read nothing" in caplog.text
        assert not pub._jobs
        sock.send_multipart((b"", P.IDENTITY_REQUEST))  # ignored from now on
        other = ctx.socket(zmq.DEALER)
        other.setsockopt(zmq.LINGER, 0)
        other.connect(pub.replay_endpoint)
        other.send_multipart((b"", P.IDENTITY_REQUEST))
        t0 = time.monotonic()
        while not other.poll(0) and time.monotonic() - t0 < 2:
            pub.poll(0.001)
        frames = other.recv_multipart(zmq.NOBLOCK)
        other.close(linger=0)
        assert frames[2] == P.END_SEQ and frames[3].decode() == P.pool_identity(pool)
        while pub.replays_dropped < 2 and time.monotonic() - t0 < 2:
            pub.poll(0.001)
        assert pub.replays_dropped == 2  # the stalled replay, then its peer's request
    finally:
        sock.close(linger=0)
        pub.close()
        pool.close()
        BlockPool.unlink(pool_name)
        unlink_state(pool_name)


def test_pending_replays_keep_each_turn_short_and_the_lock_rarely_taken(pool_name):
    """100 replay requests from peers that read nothing: every ``poll()`` turn stays short
    (the live stream is never held up behind them) and the publisher takes the pool lock
    only for what its peers' queues can take, not for every request's whole replay."""
    import shmkv.publisher as P

    pool = BlockPool.create(pool_name, 256, enable_kv_cache_events=True)
    ctx = zmq.Context.instance()
    pub = P.KVEventPublisher(pool_name, f"inproc://{pool_name}-pub",  # its own handle
                             f"inproc://{pool_name}-replay", buffer_steps=0)
    peers = []
    try:
        hasher = pool.make_block_hasher()
        serve_requests(pool, hasher, 0, 1500)
        while pub.publish_pending():
            pass
        num_events = pub.next_seq
        for _ in range(4):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 1)
            sock.connect(pub.replay_endpoint)
            for _ in range(25):
                sock.send_multipart((b"", (0).to_bytes(8, "big")))
            peers.append(sock)
        holds_before = pub.pool._lock.num_acquired
        longest = 0.0
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.0:
            start = time.monotonic()
            pub.poll(0.001)
            longest = max(longest, time.monotonic() - start)
        holds = pub.pool._lock.num_acquired - holds_before
        assert longest < 0.25, f"a poll() turn took {longest:.2f} s"
        # Whole replays would be 100 x num_events / 16 holds (17,000); each peer's queue
        # takes about REPLAY_SNDHWM frames, 16 a hold.
        assert holds < 4 * 2 * P.REPLAY_SNDHWM // 16, (holds, num_events)
        serve_requests(pool, hasher, 10_000, 3)  # the live stream still flows at once
        for _ in range(3):
            pub.poll(0.001)
        assert pub.next_seq == pool.event_cursor(from_start=False).seq
    finally:
        for sock in peers:
            sock.close(linger=0)
        pub.close()
        pool.close()
        BlockPool.unlink(pool_name)
        unlink_state(pool_name)
