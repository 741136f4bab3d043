"""Messages and the shared-memory channel, in one process: framing, errors, wrap-around."""

from __future__ import annotations

import os
import random

import msgspec
import pytest

from shmkv.errors import (
    LayoutMismatchError,
    ProtocolError,
    SegmentExistsError,
    SegmentNotFoundError,
    UsageError,
)
from shmkv.messages import (
    PROTOCOL_VERSION,
    Channel,
    ChannelFullError,
    ExecuteModel,
    Message,
    ModelOutput,
    ScheduledRequest,
    Shutdown,
    channel_segment_name,
    create_doorbell,
    decode,
    encode,
    message,
    recv_any,
    unlink_doorbell,
)
from shmkv.pool import layout as L
from tests.conftest import unique_pool_name


@pytest.fixture
def make_channel():
    made: list[tuple[Channel, str]] = []

    def factory(capacity_bytes: int = 4096, doorbell: str | None = None) -> Channel:
        name = unique_pool_name("ch")
        ch = Channel.create(name, capacity_bytes, doorbell=doorbell)
        made.append((ch, name))
        return ch

    yield factory
    for ch, name in made:
        ch.close()
        Channel.unlink(name)
        assert not os.path.exists(f"/dev/shm{channel_segment_name(name)}")


def test_messages_round_trip_with_their_tag():
    step = ExecuteModel(step=3, requests=[ScheduledRequest("r1", 2, [5, 6, 7], 16)])
    assert decode(encode(step)) == step
    assert decode(encode(ModelOutput(step=3, sampled_token_ids=[9]))).sampled_token_ids == [9]
    version, body = msgspec.msgpack.decode(encode(Shutdown(reason="bye")))
    assert version == PROTOCOL_VERSION and body == {"type": "Shutdown", "reason": "bye"}


@pytest.mark.parametrize(
    "frame, says",
    [
        (b"\xc1", "not a shmkv message frame"),
        (msgspec.msgpack.encode([PROTOCOL_VERSION + 1, {"type": "Shutdown"}]),
         f"protocol version {PROTOCOL_VERSION + 1}"),
        (msgspec.msgpack.encode([PROTOCOL_VERSION, {"type": "NoSuchThing"}]), "NoSuchThing"),
        (msgspec.msgpack.encode([PROTOCOL_VERSION, {"type": "ModelOutput", "step": "x"}]),
         "step"),
        (msgspec.msgpack.encode("hello"), "not a shmkv message frame"),
    ],
)
def test_undecodable_frames_raise_protocol_error_naming_the_problem(frame, says):
    with pytest.raises(ProtocolError, match=says):
        decode(frame)


def test_registration_refuses_what_is_not_a_message():
    class NotAMessage(msgspec.Struct):
        x: int

    with pytest.raises(UsageError, match="not a subclass"):
        message(NotAMessage)

    class Unregistered(Message):
        x: int

    with pytest.raises(UsageError, match="not a registered message type"):
        encode(Unregistered(x=1))


def test_send_and_receive_in_order_across_many_wraps(make_channel):
    ch = make_channel(4096)
    peer = Channel.open(ch.name)
    rng = random.Random(7)
    sent = 0
    received = 0
    try:
        for _ in range(2000):
            for _ in range(rng.randint(1, 4)):
                tokens = [rng.randrange(1 << 20) for _ in range(rng.randint(0, 300))]
                ch.send(ExecuteModel(step=sent, requests=[ScheduledRequest("r", 0, tokens, 0)]),
                        timeout_s=0)
                sent += 1
                if ch.num_unread_bytes > 1000:
                    break
            while (msg := peer.poll()) is not None:
                assert msg.step == received
                received += 1
        assert received == sent > 2000
        assert int(ch._tail[0]) > 20 * ch.capacity_bytes  # many laps of the ring
        assert peer.recv(timeout_s=0.01) is None
    finally:
        peer.close()


def test_a_message_too_big_is_refused_and_changes_nothing(make_channel):
    ch = make_channel(4096)
    before = bytes(ch._map)
    with pytest.raises(UsageError, match="too big for channel"):
        ch.send(ExecuteModel(step=0, requests=[ScheduledRequest("r", 0, [1 << 20] * 600, 0)]))
    assert bytes(ch._map) == before


def test_a_full_channel_times_out_naming_its_consumer(make_channel):
    ch = make_channel(4096)
    payload = b"x" * 1000
    for _ in range(4):
        ch.send_bytes(payload)
    with pytest.raises(ChannelFullError, match=r"consumer \(pid 0\) is gone"):
        ch.send_bytes(payload, timeout_s=0.05)
    assert ch.poll_bytes() == payload  # room again
    ch.send_bytes(payload, timeout_s=0)


def test_a_bad_frame_is_consumed_and_the_next_one_is_read(make_channel):
    ch = make_channel()
    ch.send_bytes(b"garbage")
    ch.send(Shutdown(reason="after"))
    with pytest.raises(ProtocolError):
        ch.recv(timeout_s=1)
    assert ch.recv(timeout_s=1) == Shutdown(reason="after")


def test_one_doorbell_wakes_a_consumer_of_several_channels(make_channel):
    bell = create_doorbell(unique_pool_name("bell"))
    try:
        a, b = make_channel(doorbell=bell), make_channel(doorbell=bell)
        b.send(Shutdown(reason="b"))
        got_ch, got = recv_any([a, b], timeout_s=1)
        assert got_ch is b and got.reason == "b"
        assert recv_any([a, b], timeout_s=0.01) == (None, None)
        other = make_channel()
        with pytest.raises(UsageError, match="different doorbells"):
            recv_any([a, other], timeout_s=0)
    finally:
        assert unlink_doorbell(bell)


@pytest.mark.parametrize("capacity", [0, 4095, 4100, 1 << 32, True, "4096"])
def test_bad_capacities_are_refused(capacity):
    name = unique_pool_name("ch")
    with pytest.raises(UsageError, match="capacity_bytes"):
        Channel.create(name, capacity)
    assert not os.path.exists(f"/dev/shm{channel_segment_name(name)}")


def test_open_refuses_missing_and_foreign_segments(make_channel):
    with pytest.raises(SegmentNotFoundError, match="no channel named"):
        Channel.open(unique_pool_name("missing"))
    ch = make_channel()
    with pytest.raises(SegmentExistsError):
        Channel.create(ch.name)
    ch._hdr[0]["version"] = L.CHANNEL_LAYOUT_VERSION + 1
    with pytest.raises(LayoutMismatchError, match="version"):
        Channel.open(ch.name)
    ch._hdr[0]["version"] = L.CHANNEL_LAYOUT_VERSION
    ch._hdr[0]["magic"] = 0
    with pytest.raises(LayoutMismatchError, match="magic"):
        Channel.open(ch.name)


def test_a_closed_channel_says_so(make_channel):
    ch = make_channel()
    ch.close()
    with pytest.raises(UsageError, match="is closed"):
        ch.send(Shutdown())
    with pytest.raises(UsageError, match="is closed"):
        ch.poll()


def test_bad_names_are_refused():
    with pytest.raises(UsageError, match="contains '/'"):
        Channel.create("a/b")


def test_a_corrupt_frame_header_is_skipped_counted_and_the_channel_goes_on():
    """A frame header whose length is garbage (over half the ring, or past what was
    published): the reader used to raise ProtocolError without advancing head, for ever.
    Now the unread bytes up to the tail are skipped and counted, and later frames arrive."""
    from shmkv.messages import Channel
    from tests.conftest import unique_pool_name

    name = unique_pool_name("ch")
    ch = Channel.create(name, 4096)
    try:
        for payload in (b"one", b"two", b"three"):
            ch.send_bytes(payload)
        assert ch.poll_bytes() == b"one"
        head = int(ch._head[0]) % ch.capacity_bytes
        ch._data[head:head + 4] = (10**6).to_bytes(4, "little")  # "two" is now garbage
        assert ch.poll_bytes() is None
        assert ch.poll_bytes() is None  # not wedged: the ring is simply empty now
        assert ch.corrupt_frames == 1 and ch.corrupt_bytes_skipped == 8 + 16
        ch.send_bytes(b"four")
        assert ch.poll_bytes() == b"four"
        # A length that fits the ring but runs past the published tail is corrupt too.
        ch.send_bytes(b"five")
        head = int(ch._head[0]) % ch.capacity_bytes
        ch._data[head:head + 4] = (1000).to_bytes(4, "little")
        assert ch.poll_bytes() is None and ch.corrupt_frames == 2
        ch.send_bytes(b"six")
        assert ch.poll_bytes() == b"six"
    finally:
        ch.close()
        Channel.unlink(name)
