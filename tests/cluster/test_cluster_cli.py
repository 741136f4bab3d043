"""`shmkv index` and `shmkv route`, the real commands in subprocesses, with their errors."""

from __future__ import annotations

import json
import random
import signal
import time

import pytest

from shmkv import BlockPool, Request
from tests.cluster import index_workers as W
from tests.conftest import unique_pool_name
from tests.ecosystem_helpers import free_port, shmkv, start_shmkv

pytest.importorskip("zmq")
redis = pytest.importorskip("redis")
pytestmark = pytest.mark.multiprocess


def _stop(proc) -> str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=30)
    except Exception:
        proc.kill()
        out, err = proc.communicate(timeout=30)
    return out + err


def test_index_then_route_answers_what_the_pool_holds(redis_server):
    name = unique_pool_name("cli")
    pool = BlockPool.create(name, 64, hash_block_size=W.BS, enable_kv_cache_events=True)
    pub_ep, replay_ep = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    procs = []
    try:
        procs.append(start_shmkv("publish", name, "--endpoint", pub_ep, "--replay-endpoint",
                                 replay_ep))
        assert procs[0].stdout.readline().startswith("publishing pool")
        procs.append(start_shmkv("index", "--redis", redis_server.url, "--source",
                                 f"node0={pub_ep},{replay_ep},hostA"))
        assert procs[1].stdout.readline().startswith("indexing 1 source(s)")
        rng = random.Random(1)
        hasher = pool.make_block_hasher()
        prompt = W.SYSTEMS[0] + [5] * 20
        W.admit(pool, Request("a", prompt, block_hasher=hasher))  # held: stays cached
        for i in range(5):
            blocks = W.admit(pool, Request(f"r{i}", W.prompt(rng), block_hasher=hasher))
            pool.free_blocks(reversed(blocks))
        truth = len(pool.get_cached_prefix(Request("q", prompt, block_hasher=hasher)
                                           .block_hashes)) * W.BS
        assert truth == 80
        deadline = time.monotonic() + 30
        while True:
            out = shmkv("route", "--redis", redis_server.url, "--json", "--tokens",
                        " ".join(map(str, prompt)))
            assert out.returncode == 0, out.stderr
            answer = json.loads(out.stdout)
            if answer["sources"] and answer["sources"][0]["cached_tokens"] == truth:
                break
            assert time.monotonic() < deadline, answer
            time.sleep(0.1)
        assert answer == {"prompt_tokens": len(prompt), "sources": [
            {"source": "node0", "node": "hostA", "cached_tokens": truth}]}
        text = shmkv("route", "--redis", redis_server.url, "--tokens",
                     ",".join(map(str, prompt)))
        assert text.returncode == 0 and "node0" in text.stdout and "80 tokens" in text.stdout
        out = _stop(procs.pop())
        assert "applied" in out and "snapshots" in out
    finally:
        for proc in procs:
            _stop(proc)
        pool.close()
        BlockPool.unlink(name)
        from shmkv.publisher import unlink_state

        unlink_state(name)


@pytest.mark.parametrize(
    "args, says",
    [
        (("index", "--source", "nonsense"), "expected NAME=PUB_ENDPOINT"),
        (("index", "--source", "a=tcp://127.0.0.1:1,tcp://127.0.0.1:2", "--redis",
          "redis://127.0.0.1:1/0"), "cannot reach Redis"),
        (("route", "--tokens", "1 two 3"), "must be token ids"),
        (("route", "--tokens", " "), "prompt is empty"),
        (("route", "--tokens", "1 2", "--redis", "redis://127.0.0.1:1/0"),
         "cannot reach Redis"),
        (("route",), "one of the arguments --tokens --prompt-file is required"),
        (("index",), "--source"),
    ],
)
def test_errors_exit_2_with_one_line_and_no_traceback(args, says):
    out = shmkv(*args)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert says in out.stderr
    assert "Traceback" not in out.stderr


def test_index_exits_2_in_one_line_on_a_redis_error_it_cannot_retry(redis_server):
    """A Redis that refuses the index's writes (out of memory under noeviction) ends
    `shmkv index` with one line naming Redis and its error, exit 2, no traceback."""
    name = unique_pool_name("cli")
    pool = BlockPool.create(name, 64, hash_block_size=W.BS, enable_kv_cache_events=True)
    pub_ep, replay_ep = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    client = redis.Redis.from_url(redis_server.url)
    procs = []
    try:
        procs.append(start_shmkv("publish", name, "--endpoint", pub_ep, "--replay-endpoint",
                                 replay_ep))
        assert procs[0].stdout.readline().startswith("publishing pool")
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", "1")
        procs.append(start_shmkv("index", "--redis", redis_server.url, "--source",
                                 f"node0={pub_ep},{replay_ep}"))
        assert procs[1].stdout.readline().startswith("indexing 1 source(s)")
        W.admit(pool, Request("a", W.SYSTEMS[0] + [5], block_hasher=pool.make_block_hasher()))
        _, err = procs[1].communicate(timeout=10)
        assert procs[1].returncode == 2, err
        assert "Redis at" in err and "maxmemory" in err and "Traceback" not in err, err
        assert len(err.strip().splitlines()) == 1, err
    finally:
        for proc in procs:
            _stop(proc)
        client.close()
        pool.close()
        BlockPool.unlink(name)
        from shmkv.publisher import unlink_state

        unlink_state(name)
