"""The publisher binds loopback only unless told otherwise (issue 15, item 11): its
sockets have no authentication. Who may connect on this host is restricted by an ipc://
endpoint in a private directory."""

from __future__ import annotations

import os
import signal
import stat
import time

import pytest

zmq = pytest.importorskip("zmq")

from shmkv import BlockPool  # noqa: E402
from shmkv.publisher import (  # noqa: E402
    IDENTITY_REQUEST,
    KVEventPublisher,
    PublisherError,
    is_loopback_endpoint,
)

pytestmark = pytest.mark.long


@pytest.mark.parametrize("endpoint, local", [
    ("tcp://127.0.0.1:5557", True), ("tcp://127.3.4.5:1", True), ("tcp://[::1]:5557", True),
    ("tcp://localhost:5557", True), ("ipc:///tmp/x", True), ("inproc://x", True),
    ("tcp://0.0.0.0:5557", False), ("tcp://*:5557", False), ("tcp://10.0.0.5:5557", False),
    ("tcp://eth0:5557", False), ("tcp://[::]:5557", False),
])
def test_loopback_endpoints(endpoint, local):
    assert is_loopback_endpoint(endpoint) is local


def test_a_non_loopback_bind_is_refused_unless_allowed(pool_name):
    pool = BlockPool.create(pool_name, 16, enable_kv_cache_events=True)
    try:
        for endpoint, replay in (("tcp://0.0.0.0:0", None), ("tcp://127.0.0.1:0", "tcp://*:0")):
            with pytest.raises(PublisherError, match="not a loopback address.*--allow-remote"):
                KVEventPublisher(pool, endpoint, replay)
        pub = KVEventPublisher(pool, "tcp://0.0.0.0:0", allow_remote=True)
        assert pub.endpoint.startswith("tcp://0.0.0.0:")
        pub.close()
        pub = KVEventPublisher(pool, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
        pub.close()
        pool.check_invariants()
    finally:
        pool.close()


def _asks_identity_as(uid: int, replay_endpoint: str, timeout_ms: int = 1000) -> bool:
    """Whether a process running as ``uid`` gets an answer from the replay socket (a forked
    child drops to ``uid``, then asks with a context of its own)."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 3
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            ctx = zmq.Context()
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(replay_endpoint)
            sock.send_multipart((b"", IDENTITY_REQUEST))
            code = 0 if sock.poll(timeout_ms) else 1
            sock.close(linger=0)
            ctx.term()
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout_ms / 1000 + 10
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError("the peer process did not finish")
        time.sleep(0.01)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) in (0, 1), status
    return os.WEXITSTATUS(status) == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to run a peer as another user")
def test_an_ipc_endpoint_in_a_0700_directory_keeps_other_users_out(pool_name, tmp_path):
    """On loopback TCP any local user is answered; on ipc:// in a directory of mode 0700,
    only its owner is (what docs/events.md advises)."""
    from tests.ecosystem_helpers import free_port, start_shmkv

    private = tmp_path / "shmkv-events"
    private.mkdir(mode=0o700)
    tcp_replay = f"tcp://127.0.0.1:{free_port()}"
    ipc_replay = f"ipc://{private}/replay"
    pool = BlockPool.create(pool_name, 16, enable_kv_cache_events=True)
    procs = []
    try:
        for pub, replay in ((f"tcp://127.0.0.1:{free_port()}", tcp_replay),
                            (f"ipc://{private}/pub", ipc_replay)):
            if procs:  # one publisher per pool: the first goes before the second starts
                procs[-1].send_signal(signal.SIGTERM)
                procs[-1].communicate(timeout=30)
                assert procs[-1].returncode == 143
            procs.append(start_shmkv("publish", pool_name, "--endpoint", pub,
                                     "--replay-endpoint", replay))
            assert procs[-1].stdout.readline().startswith("publishing pool")
            if replay == tcp_replay:
                assert _asks_identity_as(65534, tcp_replay)  # the open door
            else:
                assert stat.S_IMODE(private.stat().st_mode) == 0o700
                assert not _asks_identity_as(65534, ipc_replay)
                assert _asks_identity_as(os.getuid(), ipc_replay)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.communicate(timeout=30)
        pool.close()
        BlockPool.unlink(pool_name)
        from shmkv.publisher import unlink_state

        unlink_state(pool_name)
