"""Processes for the cleanup tests (importable, for the spawn start method)."""

from __future__ import annotations

import time

from shmkv import BlockPool


def make_pool_and_siblings(name: str, ready, stop, with_kv: bool = False) -> None:
    """Create pool ``name`` and one of every sibling it can have: two channels on a shared
    doorbell and one with its own, block tables, stats, a publisher position (and a KV
    store); then wait (to be killed)."""
    from shmkv.messages import Channel, create_doorbell
    from shmkv.ranks.block_table import KVStore, SharedBlockTables
    from shmkv.stats import PoolStats

    pool = BlockPool.create(name, 32, enable_kv_cache_events=True, label="creator")
    bell = create_doorbell(f"{name}-bell")
    Channel.create(f"{name}-a", 4096, doorbell=bell, pool=name).close()
    Channel.create(f"{name}-b", 4096, doorbell=bell, pool=name).close()
    Channel.create(f"{name}-own", 4096, pool=name).close()
    SharedBlockTables.create(f"{name}-s0", max_num_reqs=2, max_model_len=32, block_sizes=[16],
                             pool=name).close()
    if with_kv:
        KVStore.create(name, num_layers=1, num_blocks=32, block_size=16, num_kv_heads=1,
                       head_size=4, pool=name).close()
    PoolStats.open(pool).close()
    try:
        from shmkv.publisher import KVEventPublisher

        KVEventPublisher(pool, "tcp://127.0.0.1:0").close()
    except Exception:  # noqa: BLE001  (no pyzmq: no publisher position)
        pass
    pool.get_new_blocks(2)
    ready.set()
    stop.wait(120)


def attach_and_wait(name: str, ready, stop) -> None:
    """Attach to pool ``name`` and stay (a live user of the pool)."""
    pool = BlockPool.attach(name, label="user")
    ready.set()
    stop.wait(120)
    pool.close()


def serve_forever() -> None:
    time.sleep(120)


def attach_and_wait_for_sigterm(name: str, ignore_sigterm: bool, ready) -> None:
    """Attach pool ``name`` and take blocks; on SIGTERM close the handle and exit 143, as a
    scheduler does (or, with ``ignore_sigterm``, keep waiting: only a SIGKILL ends it)."""
    import signal
    import sys

    pool = BlockPool.attach(name, label="partner")
    pool.get_new_blocks(3)
    if ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        ready.set()
        while True:
            time.sleep(0.05)
    finally:
        pool.close()
