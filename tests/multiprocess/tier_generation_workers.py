"""Child processes of ``test_vllm_tier_generation.py`` (importable by the spawn context)."""

from __future__ import annotations

import os


def worker_that_dies(pool: str, num_chunks: int, data_bytes: int, replica: str) -> None:
    """Replica A's GPU worker: makes (or joins) the tier, maps nothing more, and dies during
    warm-up (its process exits before its engine core ever attaches)."""
    from shmkv.vllm.lifecycle import join_as_worker

    locks, _ = join_as_worker(pool, num_chunks, 16, replica, data_bytes)
    os._exit(0)  # no close: the kernel drops its locks, as for a crash


# An earlier release of shmkv, run from its own tree (``sys.argv[1]``) on the same pool
# name: its replica's worker and core look key 1 up, store key 2 and write b"O" into the
# chunk, then load key 2 back through the tier and print what they saw as one JSON line.
EARLIER_RELEASE_REPLICA = r"""
import json, os, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
pool, num_chunks, data_bytes = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
import shmkv
assert shmkv.__file__.startswith(sys.argv[1]), shmkv.__file__
from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
from shmkv.vllm import SharedCPUOffloadingManager
from shmkv.vllm.region import join_as_worker, region_path
locks, tag = join_as_worker(pool, num_chunks, 16, "earlier", data_bytes)
region = np.memmap(region_path(pool), np.uint8, "r+", 0, (num_chunks, data_bytes // num_chunks))
m = SharedCPUOffloadingManager(pool, num_chunks, replica_id="earlier")
ctx = ReqContext("earlier")
key = lambda i: make_offload_key(str(i).encode(), 0)
out = {"lookup_1": m.lookup(key(1), ctx).name}
if out["lookup_1"] == "HIT":
    chunk = int(m.prepare_load([key(1)], ctx).block_ids[0])
    out["loaded_1"] = region[chunk, :4].tobytes().hex()
    m.complete_load([key(1)], ctx)
spec = m.prepare_store([key(2)], ctx)
chunk = int(spec.store_spec.block_ids[0])
region[chunk, :] = ord("O")
m.complete_store(spec.keys_to_store, ctx)
print(json.dumps(out), flush=True)
m.close()
locks.close()
"""


# A replica of the release before tier table v5 (tier v4 on a v9 pool), run from its own tree
# (``sys.argv[1]``): ``store`` key ``sys.argv[4]`` writing byte ``sys.argv[5]`` into its chunk,
# or ``load`` it; prints what it saw (the lookup, and the first loaded byte) as one JSON line.
TIER_V4_REPLICA = r"""
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
pool, num_chunks, data_bytes = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
action, i, value = sys.argv[5], sys.argv[6], int(sys.argv[7])
import shmkv
assert shmkv.__file__.startswith(sys.argv[1]), shmkv.__file__
from vllm.v1.kv_offload.base import ReqContext, make_offload_key
from shmkv.vllm import SharedCPUOffloadingManager
from shmkv.vllm.lifecycle import join_as_worker
from shmkv.vllm.region import region_path
locks, _ = join_as_worker(pool, num_chunks, 16, "tier-v4", data_bytes)
region = np.memmap(region_path(pool), np.uint8, "r+", 0, (num_chunks, data_bytes // num_chunks))
m = SharedCPUOffloadingManager(pool, num_chunks, replica_id="tier-v4")
ctx = ReqContext("tier-v4")
key = make_offload_key(i.encode(), 0)
out = {"region": region_path(pool), "lookup": m.lookup(key, ctx).name}
if action == "store":
    spec = m.prepare_store([key], ctx)
    region[int(spec.store_spec.block_ids[0]), :] = value
    m.complete_store(spec.keys_to_store, ctx)
elif out["lookup"] == "HIT":
    chunk = int(m.prepare_load([key], ctx).block_ids[0])
    out["loaded"] = int(region[chunk, 0])
    m.complete_load([key], ctx)
print(json.dumps(out), flush=True)
m.close()
locks.close()
"""
