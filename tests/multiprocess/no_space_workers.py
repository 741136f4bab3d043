"""Run inside a private mount namespace whose /dev/shm is a small tmpfs (test_no_space.py):
``python -m tests.multiprocess.no_space_workers KERNEL``. Prints one JSON object.

1. a pool bigger than the tmpfs: its error, and what /dev/shm and this process's
   descriptors hold before and after;
2. a pool that fits, then the tmpfs filled by another file: the pool serves on (every block
   allocated, cached, freed, with events), where a sparse segment would SIGBUS;
3. with the tmpfs full, each sibling segment's create (block tables, KV store, channel,
   stats, publisher state, doorbell): its error, and what is left behind;
4. room for a small pool's segment but not for its semaphore: the create's error;
5. three worker processes serving on one pool while the tmpfs fills: each goes on serving,
   and exits 0 (a sparse segment killed all three with SIGBUS).
"""

from __future__ import annotations

import errno
import json
import mmap
import multiprocessing as mp
import os
import sys
from types import SimpleNamespace

from shmkv import BlockPool, NoSpaceError
from shmkv.messages import Channel, create_doorbell, unlink_doorbell
from shmkv.pool import layout as L
from shmkv.publisher import KVEventPublisher
from shmkv.ranks.block_table import KVStore, SharedBlockTables
from shmkv.stats import PoolStats

SHM = "/dev/shm"


def state() -> dict:
    return {"shm": sorted(os.listdir(SHM)), "fds": len(os.listdir("/proc/self/fd"))}


def attempt(make) -> dict:
    """What ``make()`` raised, with the state before and after."""
    before = state()
    try:
        made = make()
    except NoSpaceError as exc:
        return {"error": str(exc), "before": before, "after": state()}
    except Exception as exc:  # noqa: BLE001  (reported, the test says what was wanted)
        return {"other": f"{type(exc).__name__}: {exc}", "before": before, "after": state()}
    return {"made": repr(made), "before": before, "after": state()}


def fill(leave_pages: int = 0) -> int:
    """Fills the tmpfs with one file until it has ``leave_pages`` pages left; returns the
    file's size."""
    fd = os.open(f"{SHM}/filler", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    st = os.statvfs(SHM)
    total = st.f_bavail * st.f_frsize - leave_pages * mmap.PAGESIZE
    try:
        if leave_pages:
            return os.write(fd, b"\1" * total)
        total, chunk = 0, b"\1" * 65536
        while True:
            try:
                total += os.write(fd, chunk)
            except OSError as exc:
                if exc.errno == errno.ENOSPC:
                    return total
                raise
    finally:
        os.close(fd)


def serve(pool: BlockPool) -> int:
    """Every block allocated, cached with a hash, freed; twice. Returns events taken."""
    taken = 0
    for round_ in range(2):
        blocks = pool.get_new_blocks(pool.get_num_free_blocks())
        hashes = [(b"%d-%d" % (round_, i)).ljust(32, b"\0") for i in range(len(blocks))]
        request = SimpleNamespace(block_hashes=hashes, all_token_ids=[7] * (16 * len(blocks)),
                                  lora_request=None)
        pool.cache_full_blocks(request, blocks, 0, len(blocks), 16, 0)
        pool.free_blocks(blocks)
        taken += len(pool.take_events())
    pool.check_invariants()
    return taken


def serve_some(pool: BlockPool, tag: bytes, num_blocks: int = 100) -> None:
    """``num_blocks`` blocks allocated, cached under hashes of ``tag``, freed."""
    blocks = pool.get_new_blocks(num_blocks)
    hashes = [(tag + b"-%d" % i).ljust(32, b"\0") for i in range(num_blocks)]
    request = SimpleNamespace(block_hashes=hashes, all_token_ids=[7] * (16 * num_blocks),
                              lora_request=None)
    pool.cache_full_blocks(request, blocks, 0, num_blocks, 16, 0)
    pool.free_blocks(blocks)


def worker(kernel: str, index: int, started, filled, rounds) -> None:
    """Serves on the pool "fits" until the tmpfs is full, then 20 rounds more."""
    pool = BlockPool.attach("fits", kernel=kernel)
    round_ = 0
    while not filled.is_set():
        serve_some(pool, b"w%d-%d" % (index, round_))
        round_ += 1
        started.release()
    for more in range(20):
        serve_some(pool, b"w%d-%d" % (index, round_ + more))
        rounds[index] += 1
    pool.close()


def three_workers_while_full(kernel: str) -> dict:
    """Three spawned workers serve on one pool while this process fills the tmpfs."""
    ctx = mp.get_context("spawn")
    started, filled = ctx.Semaphore(0), ctx.Event()
    rounds = ctx.Array("i", 3)
    with BlockPool.create("fits", 2_000, kernel=kernel, event_log_bytes=1 << 20) as pool:
        procs = [ctx.Process(target=worker, args=(kernel, i, started, filled, rounds))
                 for i in range(3)]
        for p in procs:
            p.start()
        for _ in procs:
            started.acquire(timeout=60)  # every worker served at least once
        out = {"filled": fill()}
        filled.set()
        for p in procs:
            p.join(60)
        out["exitcodes"] = [p.exitcode for p in procs]
        out["rounds_after_fill"] = list(rounds)
        pool.check_invariants()
        os.unlink(f"{SHM}/filler")
    return out


def main(kernel: str) -> None:
    out: dict = {}
    out["too_big"] = attempt(lambda: BlockPool.create("big", 200_000, kernel=kernel))
    pool = BlockPool.create("fits", 2_000, kernel=kernel, enable_kv_cache_events=True,
                            event_log_bytes=1 << 20)
    bell = create_doorbell("bell")
    out["filled"] = fill()
    out["events"] = serve(pool)
    out["block_tables"] = attempt(lambda: SharedBlockTables.create(
        "bt", max_num_reqs=64, max_model_len=4096, block_sizes=[16], pool="fits"))
    out["kv_store"] = attempt(lambda: KVStore.create(
        "kv", num_layers=2, num_blocks=64, block_size=16, num_kv_heads=2, head_size=64,
        pool="fits"))
    out["channel"] = attempt(lambda: Channel.create("ch", 1 << 16, doorbell=bell, pool="fits"))
    out["stats"] = attempt(lambda: PoolStats.open(pool))
    out["publisher"] = attempt(lambda: KVEventPublisher(pool, "tcp://127.0.0.1:0"))
    out["doorbell"] = attempt(lambda: create_doorbell("bell2"))
    os.unlink(f"{SHM}/filler")
    out["events_after"] = serve(pool)
    unlink_doorbell(bell)
    pool.close()
    BlockPool.unlink("fits")
    # room for a small pool's segment, not for its semaphore
    with BlockPool.create("probe", 2, kernel=kernel):
        pages = -(-os.stat(f"{SHM}/shmkv-probe-v{L.LAYOUT_VERSION}").st_size // mmap.PAGESIZE)
    fill(leave_pages=pages)
    out["semaphore"] = attempt(lambda: BlockPool.create("tight", 2, kernel=kernel))
    os.unlink(f"{SHM}/filler")
    out["three_workers"] = three_workers_while_full(kernel)
    out["end"] = state()["shm"]
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
