"""Several scheduler processes, each with its own rank process, share one pool and one KV
store: greedy outputs equal the no-cache reference token for token, for requests whose
prefixes another process computed, across evictions and reuse of blocks, with full attention
and with a full-attention + sliding-window hybrid."""

from __future__ import annotations

import os
import random

import pytest

torch = pytest.importorskip("torch")

from shmkv import BlockPool, BlockRemoved  # noqa: E402
from shmkv.ranks.block_table import KVStore, SharedBlockTables  # noqa: E402
from shmkv.serve.model import TinyModelConfig, TinyTransformer  # noqa: E402
from shmkv.serve.rank import (  # noqa: E402
    create_rank_channels,
    from_rank_channel,
    rank_main,
    to_rank_channel,
    unlink_rank_channels,
)
from tests.conftest import unique_pool_name  # noqa: E402
from tests.multiprocess import rank_workers  # noqa: E402
from tests.multiprocess.conftest import join_processes, kill_processes  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.long]

MAX_NEW_TOKENS = 6



def _prompts(rng: random.Random, systems: list[list[int]], n: int, vocab: int) -> list[list[int]]:
    return [systems[i % len(systems)] + [rng.randrange(vocab) for _ in range(rng.randint(1, 9))]
            for i in range(n)]


@pytest.mark.parametrize("windows,num_schedulers", [((None, None, None), 2),
                                                    ((None, 8, None), 3)],
                         ids=["full", "full+swa"])
def test_shared_prefix_outputs_equal_the_reference(spawn_ctx, windows, num_schedulers):
    """Scheduler 0 serves its requests first; then the others run at once and their first
    requests hit the system-prompt blocks that scheduler 0's rank computed. The pool is small
    enough that blocks are evicted and reused (more allocations than blocks). Block 0 of the
    KV store is NaN: a read of the null block would show in the tokens."""
    config = TinyModelConfig(sliding_window=windows)
    num_groups = len(config.group_windows())
    name = unique_pool_name("rk")
    rng = random.Random(7)
    systems = [[rng.randrange(config.vocab_size) for _ in range(24)],
               [rng.randrange(config.vocab_size) for _ in range(20)]]
    prompts = [_prompts(rng, systems, 6, config.vocab_size) for _ in range(num_schedulers)]
    model = TinyTransformer(config)
    expected = [[model.reference_generate(p, MAX_NEW_TOKENS) for p in ps] for ps in prompts]
    num_blocks = 22 * num_groups  # 3 running requests of ~10 blocks each do not fit
    sched_names = [f"{name}-s{s}" for s in range(num_schedulers)]
    procs = []
    pool = BlockPool.create(name, num_blocks, hash_block_size=rank_workers.BLOCK_SIZE,
                            enable_kv_cache_events=True)
    cursor = pool.event_cursor()
    try:
        kv = KVStore.create(name, num_layers=config.num_layers, num_blocks=num_blocks,
                            block_size=rank_workers.BLOCK_SIZE,
                            num_kv_heads=config.num_kv_heads, head_size=config.head_size)
        kv.kv[:, :, 0] = float("nan")
        kv.close()
        for s in sched_names:
            SharedBlockTables.create(s, max_num_reqs=4, max_model_len=256,
                                     block_sizes=[rank_workers.BLOCK_SIZE] * num_groups).close()
            create_rank_channels(s)
        results = spawn_ctx.Queue()
        go = spawn_ctx.Event()
        ranks = [spawn_ctx.Process(target=rank_main,
                                   args=(s, name, to_rank_channel(s), from_rank_channel(s), config))
                 for s in sched_names]
        scheds = [spawn_ctx.Process(target=rank_workers.scheduler_main,
                                    args=(name, s, s, config, prompts[i], MAX_NEW_TOKENS, 3,
                                          None if i == 0 else go, results))
                  for i, s in enumerate(sched_names)]
        procs = ranks + scheds
        for p in procs:
            p.start()
        first = join_processes(scheds[:1])
        assert first == [0], f"scheduler 0 exited with {first}"
        go.set()
        codes = join_processes(scheds[1:] + ranks)
        assert codes == [0] * (len(procs) - 1), f"exit codes {codes}"
        got = {}
        num_preemptions = 0
        for _ in sched_names:
            tables_name, outputs, hits, allocated, num_preempted, steps = results.get(timeout=10)
            got[tables_name] = (outputs, hits, allocated)
            num_preemptions += num_preempted
        total_allocated = 0
        for i, s in enumerate(sched_names):
            outputs, hits, allocated = got[s]
            assert [outputs[j] for j in range(len(prompts[i]))] == expected[i], s
            total_allocated += len(allocated)
            if i > 0:  # the first request of every later scheduler hits scheduler 0's blocks
                assert hits[0] >= 20, (s, hits)
        assert total_allocated > num_blocks - 1  # so blocks were reused ...
        events, lost = pool.read_events(cursor)
        assert lost == 0
        evicted = sum(isinstance(e.event, BlockRemoved) for e in events)
        assert evicted > 0  # ... and cached blocks evicted
        print(f"{num_schedulers} schedulers: {total_allocated} allocations of {num_blocks} "
              f"blocks, {evicted} evictions, {num_preemptions} preemptions")
        pool.check_invariants()
        assert pool.get_num_free_blocks() == num_blocks - 1
    finally:
        kill_processes(procs)
        pool.close()
        BlockPool.unlink(name)
        KVStore.unlink(name)
        for s in sched_names:
            SharedBlockTables.unlink(s)
            unlink_rank_channels(s)
    leftovers = [e for e in os.listdir("/dev/shm") if name in e]  # segments and doorbells
    assert leftovers == []
