"""Scheduler processes for the KV-event publisher tests (spawned: module-level targets)."""

from __future__ import annotations

SYSTEM_PROMPT = list(range(5000, 5048))  # 3 blocks of 16, shared by every request


def scheduler(name: str, index: int, first: int, count: int, start) -> None:
    """Attach as ``scheduler-<index>`` and serve ``count`` requests sharing a system prompt."""
    from shmkv import BlockPool
    from tests.ecosystem_helpers import serve_requests

    pool = BlockPool.attach(name, label=f"scheduler-{index}")
    try:
        start.wait(60)
        serve_requests(pool, pool.make_block_hasher(), first, count, SYSTEM_PROMPT)
    finally:
        pool.close()


def recording_scheduler(name: str, index: int, count: int, results, release) -> None:
    """A scheduler that records its prefix-cache figures and lock times (shmkv.stats), puts
    its stats row on ``results``, and stays attached until ``release``."""
    from shmkv import BlockPool
    from shmkv.stats import PoolStats
    from tests.ecosystem_helpers import serve_requests

    pool = BlockPool.attach(name, label=f"scheduler-{index}")
    stats = PoolStats.open(pool, time_lock=True)
    try:
        bs = pool.hash_block_size
        for r in range(count):
            hits = serve_requests(pool, pool.make_block_hasher(), 1000 * index + r, 1,
                                  SYSTEM_PROMPT)
            stats.add_prefix_cache(len(SYSTEM_PROMPT) + 24, hits * bs)
        row = stats.row
        results.put((index, pool.slot, {k: (row[k].tolist() if row[k].ndim else int(row[k]))
                                        for k in row.dtype.names}))
        release.wait(120)
    finally:
        stats.close()
        pool.close()


def attach_and_die(name: str) -> None:
    """Attach and exit without close(): a dead process in the table until reaped."""
    import os

    from shmkv import BlockPool

    pool = BlockPool.attach(name, label="doomed")
    pool.get_new_blocks(2)
    os._exit(0)
