"""KV events over ZMQ in vLLM's wire format: a plain SUB socket, vLLM's own decoder, replay
after a reconnect, a publisher restarted after SIGKILL, two schedulers through one pool."""

from __future__ import annotations

import os
import signal
import time

import msgspec
import pytest

zmq = pytest.importorskip("zmq")

from shmkv import BlockPool  # noqa: E402
from shmkv.events import BlockStored, decode_batch, external_block_hash  # noqa: E402
from shmkv.pool import layout as L  # noqa: E402
from shmkv.publisher import (  # noqa: E402
    END_SEQ,
    KVEventPublisher,
    KVEventSubscriber,
    PublisherError,
    saved_position,
    state_segment_name,
    unlink_state,
)
from tests.ecosystem_helpers import (  # noqa: E402
    free_port,
    pool_cached_hashes,
    rebuild_cached_hashes,
    serve_requests,
    shmkv,
    start_shmkv,
)

pytestmark = [pytest.mark.multiprocess, pytest.mark.long]
SEQ = 8  # bytes of a sequence number


@pytest.fixture(scope="module")
def vllm_decoder():
    """vLLM's own KVEventBatch decoder, or None when vLLM is not importable."""
    try:
        from vllm.distributed.kv_events import KVEventBatch as VllmKVEventBatch
    except Exception:  # noqa: BLE001  (vLLM absent or its imports broken)
        return None
    return msgspec.msgpack.Decoder(VllmKVEventBatch)


@pytest.fixture
def events_pool(pool_name):
    """A pool with the global event log on (small, so requests evict each other)."""
    pool = BlockPool.create(pool_name, 48, enable_kv_cache_events=True, max_processes=8)
    yield pool
    pool.close()
    unlink_state(pool_name)


def logged(pool):
    events, lost = pool.read_events(pool.event_cursor())
    assert lost == 0
    return events


def endpoints():
    return f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"


def plain_sub(endpoint: str, topic: bytes = b""):
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, topic)
    sock.connect(endpoint)
    return sock


def recv_all(sock, quiet_s: float = 0.5) -> list[list[bytes]]:
    """Every message until none came for ``quiet_s``."""
    out = []
    while sock.poll(int(quiet_s * 1000)):
        out.append(sock.recv_multipart())
    return out


def raw_replay(endpoint: str, start: int) -> list[list[bytes]]:
    """A replay request as a vLLM consumer sends it; the frames up to and with the end."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart([b"", start.to_bytes(SEQ, "big")])
        frames = []
        while True:
            assert sock.poll(10_000), "no answer from the replay socket"
            msg = sock.recv_multipart()
            frames.append(msg)
            if msg[2] == END_SEQ:
                return frames
    finally:
        sock.close(linger=0)


def wait_connected(sub, pool, hasher, first: int) -> int:
    """Produces events until the SUB socket receives one (ZMQ drops what a PUB sends before
    a subscription arrives); returns the next request number. What it receives is dropped
    here: the tests replay it."""
    r = first
    deadline = time.monotonic() + 30
    while not sub.poll(50):
        assert time.monotonic() < deadline, "the SUB socket never received anything"
        serve_requests(pool, hasher, r, 1)
        r += 1
    return r


def wait_published(pub, pool) -> None:
    """Until the publisher has sent everything logged so far."""
    end = pool.event_cursor(from_start=False).seq
    deadline = time.monotonic() + 30
    while pub.next_seq < end:
        assert time.monotonic() < deadline, (pub.next_seq, end)
        time.sleep(0.01)


def check_wire_and_decode(messages, topic: bytes, vllm_decoder) -> list[tuple[int, object]]:
    """Each message is [topic, 8-byte seq, payload]; decodes with shmkv's decoder and checks
    that vLLM's decoder reads the same batch."""
    out = []
    for msg in messages:
        assert len(msg) == 3 and msg[0] == topic and len(msg[1]) == SEQ
        seq = int.from_bytes(msg[1], "big")
        batch = decode_batch(msg[2])
        if vllm_decoder is not None:
            theirs = vllm_decoder.decode(msg[2])
            assert theirs.ts == batch.ts
            assert theirs.data_parallel_rank == batch.data_parallel_rank
            assert [type(e).__name__ for e in theirs.events] == \
                [type(e).__name__ for e in batch.events]
            for a, b in zip(theirs.events, batch.events, strict=True):
                assert getattr(a, "block_hashes", None) == getattr(b, "block_hashes", None)
                if isinstance(b, BlockStored):
                    assert (a.parent_block_hash, a.token_ids, a.block_size, a.medium,
                            a.group_idx) == (b.parent_block_hash, b.token_ids,
                                             b.block_size, b.medium, b.group_idx)
        out.append((seq, batch))
    return out


def test_plain_sub_socket_decodes_every_event_once_in_order(events_pool, vllm_decoder):
    """A plain SUB socket gets [topic, seq, KVEventBatch]; vLLM's decoder reads it; what the
    SUB missed before it was connected, a replay from 0 returns, ending with -1; together
    they are the pool's log, each event once, in order."""
    pool, hasher = events_pool, events_pool.make_block_hasher()
    serve_requests(pool, hasher, 0, 3)  # published before anyone listens
    pub_ep, replay_ep = endpoints()
    with KVEventPublisher(pool.pool_name, pub_ep, replay_ep, topic="kv@shmkv").start() as pub:
        end = pool.event_cursor(from_start=False).seq
        deadline = time.monotonic() + 30
        while pub.next_seq < end:  # sent to nobody: the SUB below can only replay them
            assert time.monotonic() < deadline
            time.sleep(0.005)
        sub = plain_sub(pub_ep, b"kv@shmkv")
        try:
            r = wait_connected(sub, pool, hasher, 3)
            serve_requests(pool, hasher, r, 60)
            live = check_wire_and_decode(recv_all(sub), b"kv@shmkv", vllm_decoder)
        finally:
            sub.close(linger=0)
        frames = raw_replay(pub.replay_endpoint, 0)
    log = logged(pool)
    kinds = {type(e.event).__name__ for e in log}
    assert kinds == {"BlockStored", "BlockRemoved"}  # 63+ requests in a 48-block pool
    # replay frames: [b"", topic, seq, payload] ... then [b"", b"", -1, b""]
    assert frames[-1] == [b"", b"", END_SEQ, b""]
    assert all(f[0] == b"" and f[1] == b"kv@shmkv" for f in frames[:-1])
    replayed = check_wire_and_decode([f[1:] for f in frames[:-1]], b"kv@shmkv", vllm_decoder)
    assert [s for s, _ in replayed] == [e.seq for e in log]  # the whole log, from 0
    first_live = live[0][0]
    assert first_live > 0
    stream = [x for x in replayed if x[0] < first_live] + live
    assert [s for s, _ in stream] == [e.seq for e in log] == list(range(len(log)))
    for (_, batch), entry in zip(stream, log, strict=True):
        assert batch.events == [entry.event] and batch.ts == entry.ts
        assert batch.data_parallel_rank == entry.slot  # the creator's slot, 0
    assert sum(isinstance(e.event, BlockStored) for e in log) == 63 + (r - 3)
    # and the pool's answer is the same as any process's, byte for byte
    assert [b for _, b in replayed] == [b for _, b in stream]


def test_replay_after_reconnect_fills_the_gap_exactly(events_pool, vllm_decoder):
    """A subscriber that was away asks for a replay from the first seq it missed: the
    replay holds exactly the missed batches (and what came since), nothing lost, nothing
    twice once joined at the first live seq."""
    pool, hasher = events_pool, events_pool.make_block_hasher()
    pub_ep, replay_ep = endpoints()
    with KVEventPublisher(pool.pool_name, pub_ep, replay_ep, buffer_steps=5).start() as pub:
        sub = plain_sub(pub_ep)
        r = wait_connected(sub, pool, hasher, 0)
        serve_requests(pool, hasher, r, 5)
        before = check_wire_and_decode(recv_all(sub), b"", vllm_decoder)
        sub.close(linger=0)
        last_seen = before[-1][0]
        serve_requests(pool, hasher, r + 5, 10)  # nobody listens: the gap
        wait_published(pub, pool)
        sub = plain_sub(pub_ep)
        try:
            r2 = wait_connected(sub, pool, hasher, r + 15)
            serve_requests(pool, hasher, r2, 5)
            after = check_wire_and_decode(recv_all(sub), b"", vllm_decoder)
        finally:
            sub.close(linger=0)
        first_after = after[0][0]
        assert first_after > last_seen + 1  # there is a gap
        # buffer_steps=5: the start of this replay comes back from the pool's log
        frames = raw_replay(pub.replay_endpoint, last_seen + 1)
    replayed = check_wire_and_decode([f[1:] for f in frames[:-1]], b"", vllm_decoder)
    log = logged(pool)
    assert [s for s, _ in replayed] == list(range(last_seen + 1, len(log)))
    gap = [x for x in replayed if x[0] < first_after]
    stream = [x for x in before if x[0] >= before[0][0]] + gap + after
    seqs = [s for s, _ in stream]
    assert seqs == list(range(before[0][0], len(log)))
    assert [b.events[0] for _, b in stream] == [e.event for e in log[before[0][0]:]]


def test_subscriber_class_drops_duplicates_and_fills_gaps(events_pool):
    """KVEventSubscriber(start_seq=0) delivers the whole log in order however late it
    joined and however often it reconnected."""
    pool, hasher = events_pool, events_pool.make_block_hasher()
    serve_requests(pool, hasher, 0, 4)
    pub_ep, replay_ep = endpoints()
    with KVEventPublisher(pool.pool_name, pub_ep, replay_ep).start():
        got = []
        for round_ in range(3):
            with KVEventSubscriber(pub_ep, replay_ep,
                                   start_seq=got[-1][0] + 1 if got else 0) as sub:
                serve_requests(pool, hasher, 100 * round_ + 10, 6)
                catch_up(sub, pool, hasher, 100 * round_ + 50, got)
                assert sub.unfilled == 0
            if round_ < 2:
                serve_requests(pool, hasher, 100 * round_ + 80, 3)  # missed while away
    log = logged(pool)
    assert [s for s, _ in got] == [e.seq for e in log]
    assert [b.events[0] for _, b in got] == [e.event for e in log]


def test_two_schedulers_one_consistent_stream(events_pool, spawn_ctx):
    """Two scheduler processes share the pool (hits and evictions across them); one
    publisher; a consumer that rebuilds the cached set from the stream ends with exactly
    the pool's cached set, and data_parallel_rank names the scheduler of each event."""
    from tests.multiprocess import event_workers

    pool = events_pool
    pub_ep, replay_ep = endpoints()
    start = spawn_ctx.Event()
    publisher = KVEventPublisher(pool.pool_name, pub_ep, replay_ep, rank_from="label")
    with publisher.start(), KVEventSubscriber(pub_ep, replay_ep, start_seq=0) as sub:
        procs = [spawn_ctx.Process(target=event_workers.scheduler,
                                   args=(pool.pool_name, i, 1000 * i, 40, start))
                 for i in range(2)]
        for p in procs:
            p.start()
        # The schedulers start once the publisher has read both labels: a process that
        # attached, logged and left between two of its polls would be named by its slot.
        deadline = time.monotonic() + 60
        while {"scheduler-0", "scheduler-1"} - set(publisher._labels.values()):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        start.set()
        for p in procs:
            p.join(120)
            assert p.exitcode == 0
        end = pool.event_cursor(from_start=False).seq
        got = []
        deadline = time.monotonic() + 60
        while (not got or got[-1][0] < end - 1) and time.monotonic() < deadline:
            item = sub.recv(1.0)
            if item is not None:
                got.append(item)
    log = logged(pool)
    assert [s for s, _ in got] == [e.seq for e in log] == list(range(end))
    rebuilt = rebuild_cached_hashes(b for _, b in got)
    assert rebuilt == pool_cached_hashes(pool)
    assert len(rebuilt) > 0
    ranks = {b.data_parallel_rank for _, b in got}
    assert ranks == {0, 1}
    removed = sum(type(b.events[0]).__name__ == "BlockRemoved" for _, b in got)
    assert removed > 0  # the pool is small: requests evicted each other's blocks
    pool.check_invariants()


def test_int_hashes_option(events_pool, monkeypatch):
    """A pool whose processes log 32-byte hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)
    is published as logged by default, and in the 64-bit integer form on request."""
    pool, hasher = events_pool, events_pool.make_block_hasher()
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    serve_requests(pool, hasher, 0, 2)
    log = logged(pool)
    stored = next(e for e in log if isinstance(e.event, BlockStored))
    assert all(isinstance(h, bytes) and len(h) == 32 for h in stored.event.block_hashes)
    for int_hashes in (None, True):
        with KVEventPublisher(pool.pool_name, "tcp://127.0.0.1:0", int_hashes=int_hashes,
                              resume=False) as pub:
            batch = decode_batch(pub.encode(stored))
        hashes = batch.events[0].block_hashes
        if int_hashes:
            assert hashes == [external_block_hash(h, True) for h in stored.event.block_hashes]
            assert all(isinstance(h, int) and 0 <= h < 1 << 64 for h in hashes)
        else:
            assert hashes == stored.event.block_hashes


def test_one_publisher_per_pool_and_no_log(events_pool, pool_name):
    with KVEventPublisher(pool_name, "tcp://127.0.0.1:0"):
        with pytest.raises(PublisherError, match="already has a publisher"):
            KVEventPublisher(pool_name, "tcp://127.0.0.1:0")
    KVEventPublisher(pool_name, "tcp://127.0.0.1:0").close()  # free again
    other = f"{pool_name}-nolog"
    BlockPool.create(other, 8).close()
    try:
        with pytest.raises(PublisherError, match="no event log"):
            KVEventPublisher(other, "tcp://127.0.0.1:0")
    finally:
        BlockPool.unlink(other)
        unlink_state(other)


def test_killed_between_send_and_save_resends_the_same_bytes(events_pool):
    """The one window of a restart: killed after sending batch N but before saving that it
    did. The next publisher sends N again, same seq, byte for byte the same payload, so a
    subscriber drops it as a duplicate; nothing is skipped."""
    import mmap

    import numpy as np
    import posix_ipc

    from shmkv.publisher import _STATE_BYTES, _STATE_DTYPE

    pool, hasher = events_pool, events_pool.make_block_hasher()
    serve_requests(pool, hasher, 0, 5)
    with KVEventPublisher(pool.pool_name, "tcp://127.0.0.1:0") as first:
        assert first.publish_pending() == 5
        last_payload = first._buffer[-1]
    shm = posix_ipc.SharedMemory(state_segment_name(pool.pool_name))
    with mmap.mmap(shm.fd, _STATE_BYTES) as mem:
        shm.close_fd()
        row = np.ndarray((1,), _STATE_DTYPE, buffer=mem)[0]
        assert int(row["next_seq"]) == 5
        # as if killed between the send of 4 and its save: the saved cursor is still the
        # start of that read (the log's start), and next_seq says 0..3 went out
        row["base_seq"][:] = 0
        row["base_pos"][:] = 0
        row["next_seq"] = 4
        del row
    with KVEventPublisher(pool.pool_name, "tcp://127.0.0.1:0") as second:
        assert second.next_seq == 4
        assert second.publish_pending() == 1
        assert second._buffer[-1] == last_payload


def test_fell_behind_the_ring_resumes_at_the_oldest_and_says_how_many(pool_name):
    """Events overwritten while no publisher ran are reported lost; the next publisher
    starts at the oldest event still there and a subscriber sees the jump (no replay can
    fill it)."""
    pool = BlockPool.create(pool_name, 48, enable_kv_cache_events=True,
                            event_log_bytes=8192)
    try:
        hasher = pool.make_block_hasher()
        serve_requests(pool, hasher, 0, 3)
        with KVEventPublisher(pool_name, "tcp://127.0.0.1:0") as pub:
            assert pub.publish_pending() == 3
        serve_requests(pool, hasher, 3, 200)  # wraps the 8 KiB ring many times
        oldest = pool.event_cursor().seq
        assert oldest > 3
        with KVEventPublisher(pool_name, "tcp://127.0.0.1:0") as pub:
            assert pub.lost == oldest - 3 and pub.next_seq == oldest
            assert pub.publish_pending() == pool.event_cursor(from_start=False).seq - oldest
        assert saved_position(pool_name)["lost"] == oldest - 3
    finally:
        pool.close()
        unlink_state(pool_name)


def test_connect_mode_reaches_a_bound_sub(events_pool):
    """--connect: the PUB socket connects to a SUB (a relay) that binds."""
    pool, hasher = events_pool, events_pool.make_block_hasher()
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind("tcp://127.0.0.1:0")
    try:
        endpoint = sub.getsockopt_string(zmq.LAST_ENDPOINT)
        with KVEventPublisher(pool.pool_name, endpoint, bind=False).start():
            wait_connected(sub, pool, hasher, 0)
            msgs = recv_all(sub)
        assert all(len(m) == 3 for m in msgs)
    finally:
        sub.close(linger=0)


def test_vllm_reads_shmkv_and_shmkv_reads_vllm(events_pool, tmp_path):
    """Both ways, with vLLM's own code: vLLM's KVEventBatch decoder reads every batch of
    shmkv's publisher to the same builtins as shmkv's decoder; KVEventSubscriber reads
    vLLM's own ZmqEventPublisher, live and by replay (its ROUTER socket, its -1 marker)."""
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    decoder = msgspec.msgpack.Decoder(kv_events.KVEventBatch)
    pool, hasher = events_pool, events_pool.make_block_hasher()
    serve_requests(pool, hasher, 0, 60)  # stored and removed events
    with KVEventPublisher(pool.pool_name, "tcp://127.0.0.1:0") as pub:
        records, _ = pool._log.read_raw(pool.event_cursor(), None)
        for _, slot, ts, body in records:
            payload = pub._payload(slot, ts, body)
            assert msgspec.to_builtins(decoder.decode(payload)) == \
                msgspec.to_builtins(decode_batch(payload))
    # vLLM's publisher, shmkv's subscriber (ipc endpoints: vLLM binds those)
    endpoint, replay = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    theirs = kv_events.ZmqEventPublisher(data_parallel_rank=0, endpoint=endpoint,
                                         replay_endpoint=replay, topic="kv")
    try:
        with KVEventSubscriber(endpoint, replay, "kv", start_seq=0) as sub:
            sent = []
            for i, entry in enumerate(logged(pool)[:30]):
                batch = kv_events.KVEventBatch(ts=entry.ts, events=[entry.event])
                theirs.publish(batch)
                sent.append(entry.event)
                if i == 0:
                    time.sleep(0.5)  # let the subscription arrive; batch 0 may be lost
            got = []
            while len(got) < len(sent) and (item := sub.recv(5.0)) is not None:
                got.append(item)
            assert [s for s, _ in got] == list(range(len(sent)))
            assert [msgspec.to_builtins(b.events[0]) for _, b in got] == \
                [msgspec.to_builtins(e) for e in sent]
            assert all(b.data_parallel_rank == 0 for _, b in got)
            replayed = sub.replay(10)
            assert [s for s, _ in replayed] == list(range(10, len(sent)))
    finally:
        theirs.shutdown()


# ------------------------------------------------------------------ the command


def read_banner(proc) -> int:
    line = proc.stdout.readline()
    assert line.startswith("publishing pool"), (line, proc.stderr.read())
    return int(line.rsplit("from seq ", 1)[1])


def stop(proc, sig=signal.SIGTERM) -> str:
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        out, err = proc.communicate(timeout=30)
    except Exception:
        proc.kill()
        out, err = proc.communicate(timeout=30)
    return out + err


def catch_up(sub, pool, hasher, r: int, got: list) -> int:
    """Receives until the subscriber has every event logged so far. What a publisher sends
    before a SUB socket's subscription reaches it is lost to that socket (ZMQ PUB) until a
    later batch shows the gap and a replay fills it, so while nothing comes the schedulers
    go on (one more request at a time). Returns the next request number."""
    deadline = time.monotonic() + 60
    while not got or got[-1][0] < pool.event_cursor(from_start=False).seq - 1:
        assert time.monotonic() < deadline, "the subscriber never caught up"
        item = sub.recv(0.5)
        if item is not None:
            got.append(item)
        else:
            serve_requests(pool, hasher, r, 1)
            r += 1
    return r


def test_shmkv_publish_restart_after_sigkill_resumes_without_gap_or_duplicate(events_pool):
    """`shmkv publish` killed with SIGKILL and started again continues at the first seq it
    had not sent: events logged while it was down are published by the new one, and the
    two together send every batch once; a subscriber that never reconnected by hand gets
    the whole log, each event once, in order."""
    pool, hasher = events_pool, events_pool.make_block_hasher()
    pub_ep, replay_ep = endpoints()
    args = ("publish", pool.pool_name, "--endpoint", pub_ep, "--replay-endpoint", replay_ep,
            "--topic", "t")
    proc = start_shmkv(*args)
    got = []
    try:
        assert read_banner(proc) == 0
        with KVEventSubscriber(pub_ep, replay_ep, "t", start_seq=0) as sub:
            serve_requests(pool, hasher, 0, 8)
            r = catch_up(sub, pool, hasher, 100, got)
            end = pool.event_cursor(from_start=False).seq
            assert got[-1][0] == end - 1
            deadline = time.monotonic() + 10  # its position is saved right after each send
            while saved_position(pool.pool_name)["next_seq"] != end:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            assert saved_position(pool.pool_name)["running"]
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
            assert not saved_position(pool.pool_name)["running"]
            serve_requests(pool, hasher, r, 6)  # logged while no publisher runs
            r += 6
            proc = start_shmkv(*args)
            assert read_banner(proc) == end  # resumes right after the last batch sent
            catch_up(sub, pool, hasher, r, got)
            assert sub.unfilled == 0
        out = stop(proc)
        assert proc.returncode == 143, out  # SIGTERM: a clean stop
        assert "published" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    log = logged(pool)
    assert [s for s, _ in got] == [e.seq for e in log]
    assert [b.events[0] for _, b in got] == [e.event for e in log]
    # the two publishers together sent every batch live exactly once (replays aside)
    assert saved_position(pool.pool_name)["published"] == len(log)


def test_shmkv_publish_errors(events_pool, pool_name):
    """Missing pool, bad endpoint, bad arguments, a second publisher: exit 2, one line on
    stderr, no traceback."""
    missing = shmkv("publish", f"{pool_name}-missing", "--endpoint", "tcp://127.0.0.1:0")
    assert missing.returncode == 2 and f"no pool named {pool_name}-missing" in missing.stderr
    bad = shmkv("publish", pool_name, "--endpoint", "nonsense")
    assert bad.returncode == 2 and "cannot bind" in bad.stderr
    no_endpoint = shmkv("publish", pool_name)
    assert no_endpoint.returncode == 2 and "--endpoint" in no_endpoint.stderr
    with KVEventPublisher(pool_name, "tcp://127.0.0.1:0"):
        second = shmkv("publish", pool_name, "--endpoint", "tcp://127.0.0.1:0")
    assert second.returncode == 2 and "already has a publisher" in second.stderr
    for out in (missing, bad, no_endpoint, second):
        assert "Traceback" not in out.stderr
    ok = shmkv("publish", pool_name, "--endpoint", "tcp://127.0.0.1:0", "--duration", "0.2")
    assert ok.returncode == 0, ok.stderr
    assert os.path.exists(f"/dev/shm/shmkv_pub-{pool_name}-v{L.PUBLISHER_STATE_VERSION}")


def test_a_scheduler_gone_before_the_first_poll_is_still_named(events_pool, spawn_ctx):
    """A scheduler that attached, logged and left before the publisher ever polled: its
    events still carry the rank of its label (a freed slot keeps its label until reused),
    not its slot number."""
    from tests.multiprocess import event_workers

    pool = events_pool
    start = spawn_ctx.Event()
    start.set()
    p = spawn_ctx.Process(target=event_workers.scheduler,
                          args=(pool.pool_name, 5, 0, 6, start))
    p.start()
    p.join(120)
    assert p.exitcode == 0
    assert 5 not in pool.process_table.active_slots()
    pub_ep, replay_ep = endpoints()
    publisher = KVEventPublisher(pool.pool_name, pub_ep, replay_ep, rank_from="label")
    end = pool.event_cursor(from_start=False).seq
    assert end > 0
    with publisher.start(), KVEventSubscriber(pub_ep, replay_ep) as sub:
        wait_published(publisher, pool)
        got = [(seq, decode_batch(payload)) for seq, payload in sub.replay(0)]
    assert [s for s, _ in got] == list(range(end))
    assert {b.data_parallel_rank for _, b in got} == {5}
    pool.check_invariants()
