"""Scheduler processes for the GPU-rank tests (module level, so spawn can import them).

Each is a plain continuous-batching loop over its own ``KVCacheManager`` on the shared pool:
admit (prefix lookup + allocate), decode one token per running request per step, preempt the
newest request when the pool is full, publish the rows, let its rank compute, then cache
the blocks the step filled (``delay_cache_blocks``: a block is a hit for others only once
its K/V is written). Exit code 0 is success; failures print why to stderr.
"""

from __future__ import annotations

import sys
import time
import traceback

from shmkv import BlockPool, KVCacheManager, Request
from shmkv.ranks.block_table import SharedBlockTables
from shmkv.serve.config import TinyModelConfig, make_kv_cache_config
from shmkv.serve.rank import RankClient, ScheduledRequest

BLOCK_SIZE = 4


def scheduler_main(pool_name: str, tables_name: str, channel: str, config: TinyModelConfig,
                   prompts: list[list[int]], max_new_tokens: int, max_running: int,
                   start_event, results, duration_s: float = 90.0) -> None:
    try:
        if start_event is not None and not start_event.wait(duration_s):
            raise AssertionError("never told to start")
        pool = BlockPool.attach(pool_name, label=f"sched-{tables_name[-6:]}")
        kvm = KVCacheManager(make_kv_cache_config(config, pool.num_gpu_blocks, BLOCK_SIZE),
                             max_model_len=256, scheduler_block_size=BLOCK_SIZE,
                             hash_block_size=BLOCK_SIZE, block_pool=pool)
        hasher = pool.make_block_hasher()
        tables = SharedBlockTables.attach(tables_name)
        rank = RankClient(channel)
        waiting = [Request(f"{tables_name}-{i}", p, block_hasher=hasher)
                   for i, p in enumerate(prompts)]
        index = {r.request_id: i for i, r in enumerate(waiting)}
        running: list[Request] = []
        rows: dict[str, int] = {}
        free_rows = list(range(tables.max_num_reqs))
        outputs: dict[int, list[int]] = {}
        hits: dict[int, int] = {}
        allocated: list[int] = []
        num_preempted = 0
        step = 0
        deadline = time.monotonic() + duration_s
        while waiting or running:
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out: {len(outputs)} done, {len(running)} running")
            kvm.new_step_starts()
            scheduled: list[tuple[Request, int]] = []  # (request, first position)
            # Decode: one new token for every running request, newest preempted on no room.
            for r in list(running):
                if r not in running:
                    continue
                while True:
                    new = kvm.allocate_slots(r, 1, delay_cache_blocks=True)
                    if new is not None:
                        allocated.extend(b for g in new.get_block_ids() for b in g)
                        scheduled.append((r, r.num_computed_tokens))
                        break
                    victim = running.pop()
                    scheduled = [(q, p) for q, p in scheduled if q is not victim]
                    kvm.free(victim)
                    victim.num_computed_tokens = 0
                    free_rows.append(rows.pop(victim.request_id))
                    waiting.insert(0, victim)
                    num_preempted += 1
                    if victim is r:
                        break
            # Admit.
            while waiting and len(running) < max_running:
                r = waiting[0]
                hit, num_hit, _ = kvm.get_computed_blocks(r)
                new = kvm.allocate_slots(r, r.num_tokens - num_hit, num_hit, hit,
                                         delay_cache_blocks=True)
                if new is None:
                    break
                waiting.pop(0)
                allocated.extend(b for g in new.get_block_ids() for b in g)
                i = index[r.request_id]
                hits[i] = max(hits.get(i, 0), num_hit)
                r.num_computed_tokens = num_hit
                rows[r.request_id] = free_rows.pop()
                running.append(r)
                scheduled.append((r, num_hit))
            if not scheduled:
                time.sleep(0.01)  # every block is held elsewhere: wait for other processes
                continue
            for r, _ in scheduled:
                tables.add_row(kvm.get_block_ids(r.request_id), rows[r.request_id])
            tables.commit(step)
            batch = [ScheduledRequest(r.request_id, rows[r.request_id],
                                      list(r.all_token_ids[first:]), first)
                     for r, first in scheduled]
            next_tokens = rank.execute(step, batch)
            step += 1
            for (r, _), tok in zip(scheduled, next_tokens, strict=True):
                r.num_computed_tokens = r.num_tokens
                kvm.cache_blocks(r, r.num_computed_tokens)  # its K/V is in the store now
                r.append_output_token_ids(tok)
                if r.num_output_tokens >= max_new_tokens:
                    outputs[index[r.request_id]] = list(r.output_token_ids)
                    kvm.free(r)
                    running.remove(r)
                    free_rows.append(rows.pop(r.request_id))
        rank.shutdown()
        rank.close()
        tables.close()
        pool.check_invariants()
        pool.close()
        results.put((tables_name, outputs, hits, allocated, num_preempted, step))
    except BaseException:
        traceback.print_exc(file=sys.stderr)
        sys.exit(1)
