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
