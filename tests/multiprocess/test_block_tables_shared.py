"""Block tables across real processes: a rank never accepts a torn table (and the check
does catch torn tables when the seqlock is off), and a rank's tensors are the segment's
memory (a scheduler's write shows through them, no copy)."""

from __future__ import annotations

import os
import time

import pytest

torch = pytest.importorskip("torch")

from shmkv.ranks.block_table import KVStore, SharedBlockTables  # noqa: E402
from tests.conftest import unique_pool_name  # noqa: E402
from tests.multiprocess import table_workers  # noqa: E402
from tests.multiprocess.conftest import JOIN_TIMEOUT_S, join_processes, kill_processes  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.long]

NUM_READERS = 2
LAST_STEP = 60



def _race(spawn_ctx, seqlock: bool) -> tuple[int, int]:
    """The parent writes LAST_STEP steps (every row encodes its step, written row by row,
    so a write takes a while); NUM_READERS processes read as fast as they can."""
    name = unique_pool_name("race")
    procs = []
    tables = SharedBlockTables.create(name, max_num_reqs=32, max_model_len=256,
                                      block_sizes=[8, 16])
    try:
        tables._seqlock = seqlock
        results = spawn_ctx.Queue()
        readies = [spawn_ctx.Event() for _ in range(NUM_READERS)]
        procs = [spawn_ctx.Process(target=table_workers.race_reader,
                                   args=(name, LAST_STEP, seqlock, ready, results))
                 for ready in readies]
        for p in procs:
            p.start()
        for ready in readies:
            assert ready.wait(JOIN_TIMEOUT_S), "a reader never attached"
        widths = tables.max_num_blocks_per_req
        for step in range(1, LAST_STEP + 1):
            for row in range(tables.max_num_reqs):
                tables.add_row([[step] * table_workers.encoded_row_length(step, row, w)
                                for w in widths], row)
            tables.commit(step)
            time.sleep(0.002)  # the rank's compute time: the tables are idle
        codes = join_processes(procs)
        assert codes == [0] * NUM_READERS, f"reader exit codes {codes}"
        accepted = torn = 0
        for _ in procs:
            a, t = results.get(timeout=10)
            assert a > 0
            accepted, torn = accepted + a, torn + t
        print(f"seqlock={seqlock}: {accepted} snapshots accepted, {torn} torn")
        return accepted, torn
    finally:
        kill_processes(procs)
        tables.close()
        SharedBlockTables.unlink(name)


def test_readers_never_accept_a_torn_table(spawn_ctx):
    accepted, torn = _race(spawn_ctx, seqlock=True)
    assert accepted >= NUM_READERS and torn == 0


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="with the seqlock off, readers see half-written tables")
def test_the_torn_check_fails_without_the_seqlock(spawn_ctx):
    accepted, torn = _race(spawn_ctx, seqlock=False)
    assert torn == 0


def test_a_rank_sees_the_schedulers_write_through_the_same_tensor(spawn_ctx):
    """The rank maps the tables once and keeps the tensor; the scheduler then writes a row
    and commits; the rank reads the new ids through that tensor (same data pointer, inside
    the segment's mapping), and the K it writes into the KV store is seen by the parent."""
    name = unique_pool_name("zc")
    proc = None
    tables = SharedBlockTables.create(name, max_num_reqs=4, max_model_len=32,
                                      block_sizes=[4, 4])
    kv = KVStore.create(name, num_layers=2, num_blocks=8, block_size=4, num_kv_heads=1,
                        head_size=4)
    try:
        attached, written = spawn_ctx.Event(), spawn_ctx.Event()
        results = spawn_ctx.Queue()
        proc = spawn_ctx.Process(target=table_workers.zero_copy_rank,
                                 args=(name, attached, written, results))
        proc.start()
        assert attached.wait(JOIN_TIMEOUT_S)
        tables.add_row(([1], [7, 8, 9]), 3)
        tables.commit(0)
        written.set()
        assert join_processes([proc]) == [0]
        inside, same_ptr, same_tensor, before, after = results.get(timeout=10)
        assert inside and same_ptr and same_tensor
        assert before == [0, 0, 0] and after == [7, 8, 9]
        assert kv.key_cache[1][5, 0, 0, :4].tolist() == [1.25] * 4
    finally:
        if proc is not None and proc.is_alive():
            proc.kill()
            proc.join(10)
        tables.close()
        kv.close()
        SharedBlockTables.unlink(name)
        KVStore.unlink(name)
    assert [e for e in os.listdir("/dev/shm") if name in e] == []
