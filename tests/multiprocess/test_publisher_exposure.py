"""The publisher binds loopback only unless told otherwise (issue 15, item 11): its
sockets have no authentication."""

from __future__ import annotations

import pytest

zmq = pytest.importorskip("zmq")

from shmkv import BlockPool  # noqa: E402
from shmkv.publisher import KVEventPublisher, PublisherError, is_loopback_endpoint  # noqa: E402


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
