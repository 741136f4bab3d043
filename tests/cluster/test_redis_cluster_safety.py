"""The cluster index's Redis scripts (issue 15, item 11): every key a script touches is
named in KEYS (what Redis Cluster routes by), and clearing a large source is done in
bounded chunks, never in one long script that blocks Redis."""

from __future__ import annotations

import re

import pytest

from shmkv import cluster_index as ci
from shmkv.cluster_index import RedisPrefixIndex
from shmkv.events import AllBlocksCleared, BlockStored, KVEventBatch

redis = pytest.importorskip("redis")

SCRIPTS = {name: getattr(ci, name) for name in dir(ci)
           if name.endswith("_LUA") and isinstance(getattr(ci, name), str)}


def test_every_script_names_its_keys_in_KEYS():
    """No key is built inside a script (no string concatenation, no ARGV as a key), and no
    script walks a whole set (SMEMBERS): each key a redis.call touches comes from KEYS."""
    assert {"_APPLY_LUA", "_LOOKUP_LUA", "_FORGET_LUA", "_CLEAR_CHUNK_LUA"} <= set(SCRIPTS)
    for name, script in SCRIPTS.items():
        assert ".." not in script, f"{name} builds key names"
        assert "SMEMBERS" not in script, f"{name} walks a whole set"
        from_keys = set(re.findall(r"local ([\w, ]+) = (KEYS\[[^\n]+)", script))
        names = {v.strip() for lhs, _ in from_keys for v in lhs.split(",")}
        for call in re.finditer(r"redis\.call\('(\w+)', ([^,)]+)", script):
            key = call.group(2).strip()
            assert key.startswith("KEYS[") or key in names, f"{name}: {call.group(0)}"


def _stored(hashes, group=0):
    return KVEventBatch(ts=0.0, events=[BlockStored(
        block_hashes=list(hashes), parent_block_hash=None, token_ids=[], block_size=16,
        lora_id=None, medium="GPU", lora_name=None, group_idx=group)])


def _evalsha_calls(client) -> int:
    return int(client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


def test_a_large_source_is_cleared_in_bounded_chunks(redis_server):
    """forget_source, a snapshot and an AllBlocksCleared over 2,500 keys each clear the
    source CLEAR_CHUNK_KEYS keys per script call (it used to be one script over all)."""
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    index = RedisPrefixIndex(client, key_prefix="{safety}")
    # Warm up: redis-py's first call of each script is an EVALSHA that loads it.
    index.apply_snapshot("w", 0, _stored([1]), epoch="e1")
    index.apply_batch("w", 1, KVEventBatch(ts=0.0, events=[AllBlocksCleared()]), epoch="e1")
    index.forget_source("w")
    n = 2500
    chunks = -(-n // ci.CLEAR_CHUNK_KEYS)
    index.apply_snapshot("a", 0, _stored(range(n)), epoch="e1")
    assert len(index.source_keys("a")) == n
    before = _evalsha_calls(client)
    assert index.apply_batch("a", 1, KVEventBatch(ts=0.0, events=[AllBlocksCleared()]),
                             epoch="e1") == ci.APPLIED
    assert _evalsha_calls(client) - before == chunks + 1  # the chunks, then the batch
    assert index.source_keys("a") == set() and index.sources()[0].seq == 1
    # the same batch again is a duplicate and clears nothing
    assert index.apply_batch("a", 1, KVEventBatch(ts=0.0, events=[AllBlocksCleared()]),
                             epoch="e1") == ci.DUPLICATE
    index.apply_batch("a", 2, _stored(range(n)), epoch="e1")
    before = _evalsha_calls(client)
    assert index.forget_source("a") == n
    assert _evalsha_calls(client) - before == chunks + 1
    assert index.sources() == [] and index.longest_prefixes([0, 1, 2]) == {}
    assert client.keys("{safety}:*") == []
