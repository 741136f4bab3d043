"""Channels between real processes: order, integrity, a producer killed mid-frame."""

from __future__ import annotations

import os
import signal
import time

import pytest

from shmkv.messages import Channel, create_doorbell, recv_any, unlink_doorbell
from tests.conftest import unique_pool_name
from tests.multiprocess import channel_workers as W

pytestmark = pytest.mark.multiprocess


def _join(proc, timeout_s: float = 60) -> int:
    proc.join(timeout_s)
    if proc.is_alive():
        proc.kill()
        proc.join(10)
    return proc.exitcode


def test_two_producers_on_one_doorbell_deliver_every_message_in_order(spawn_ctx):
    bell = create_doorbell(unique_pool_name("bell"))
    names = [unique_pool_name("ch") for _ in range(2)]
    chans = [Channel.create(n, 16384, doorbell=bell) for n in names]
    procs = [spawn_ctx.Process(target=W.produce, args=(n, i, 1500)) for i, n in enumerate(names)]
    try:
        for p in procs:
            p.start()
        expected = {ch.name: 0 for ch in chans}
        deadline = time.monotonic() + 60
        while sum(expected.values()) < 3000 and time.monotonic() < deadline:
            ch, msg = recv_any(chans, timeout_s=1)
            if msg is None:
                continue
            assert msg.step == expected[ch.name] and W.step_is_intact(msg)
            expected[ch.name] += 1
        assert expected == dict.fromkeys(names, 1500)
        assert [_join(p) for p in procs] == [0, 0]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for ch, n in zip(chans, names, strict=True):
            ch.close()
            Channel.unlink(n)
        unlink_doorbell(bell)


def test_a_producer_killed_mid_stream_leaves_only_whole_frames(spawn_ctx):
    name = unique_pool_name("ch")
    ch = Channel.create(name, 8192)
    proc = spawn_ctx.Process(target=W.produce, args=(name, 3, -1))
    try:
        proc.start()
        received = 0
        kill_at = 400
        while received < kill_at:
            msg = ch.recv(timeout_s=30)
            assert msg is not None, "the producer stopped sending"
            assert msg.step == received and W.step_is_intact(msg)
            received += 1
        os.kill(proc.pid, signal.SIGKILL)  # most likely inside send(): the ring is busy
        assert _join(proc) == -signal.SIGKILL
        while (msg := ch.poll()) is not None:
            assert msg.step == received and W.step_is_intact(msg)
            received += 1
        assert ch.num_unread_bytes == 0
        # The ring goes on working for a new producer.
        again = spawn_ctx.Process(target=W.produce, args=(name, 4, 10))
        again.start()
        got = [ch.recv(timeout_s=30) for _ in range(10)]
        assert [m.step for m in got] == list(range(10))
        assert _join(again) == 0
    finally:
        if proc.is_alive():
            proc.kill()
        ch.close()
        Channel.unlink(name)
    assert not any(name in entry for entry in os.listdir("/dev/shm"))
