"""Scheduler steps per second per replica for N data-parallel vLLM replicas, each a real
vLLM 0.33.0 ``Scheduler`` with the offloading connector in its own process, on vLLM's
private CPU offload tiers against shmkv's one shared tier, in the same run:

- ``private``: ``OffloadingConnector`` + vLLM's ``CPUOffloadingSpec`` (its own manager per
  replica), ``cpu_bytes_to_use`` = the tier's total / N each;
- ``shared``: ``SharedOffloadingConnector`` + ``SharedCPUOffloadingSpec`` (``shmkv.vllm``)
  on one pool of the whole total, every replica attached to it.

The schedulers are built on CPU as in ``tests/multiprocess/vllm_scheduler_driver.py`` (a
two-layer Llama config, 32 GPU blocks of 16 tokens, one 8 KiB chunk per block). Each step
plays the GPU worker's part as the driver does: every load and store job of the step's
connector metadata is reported done at once (no bytes move), one token is sampled per
scheduled request, and the forward pass is a sleep of ``--forward-ms`` (0: scheduler only).
Each replica keeps ``--in-flight`` chat-like requests submitted: 4-12 full blocks plus a
partial one, the first 4 blocks one of 8 system prompts shared by all replicas (so the
shared tier gets cross-replica hits), ``max_tokens`` 8. The replicas wait on a barrier,
run ``--warmup-s`` uncounted, then count ``--seconds`` together.

    python benchmarks/bench_vllm_tier_steps.py [--replicas 4,8] [--forward-ms 10,0]
        [--seconds 10] [--tier-chunks 256] [--in-flight 64] [--seed 0] [--quick]

Prints one JSON line per (setup, replicas, forward_ms): steps/s per replica (mean over the
replicas, and the slowest), requests finished, chunks loaded from / stored to the tier
and, for the shared tier, the pool lock's holds per step and mean wait/hold (this
process's holds, summed over replicas). Then a table with the ratio shared/private of
steps/s (above 1: the shared tier's replicas step faster).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import random
import shutil
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm import SamplingParams  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (  # noqa: E402
    OffloadingWorkerMetadata,
)
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from shmkv.vllm import SharedCPUOffloadingManager  # noqa: E402
from tests.multiprocess.conftest import join_processes  # noqa: E402
from tests.multiprocess.vllm_scheduler_driver import (  # noqa: E402
    BLOCK_SIZE,
    LAYERS,
    NUM_GPU_BLOCKS,
    PAGE_BYTES,
    _report,
    make_kv_cache_config,
    make_scheduler,
    write_model_dir,
)

CHUNK_BYTES = len(LAYERS) * PAGE_BYTES  # one GPU block per chunk (4 KiB aligned already)
SYSTEM_PROMPTS, SYSTEM_BLOCKS, MAX_TOKENS = 8, 4, 8


def private_scheduler(model_dir: str, cpu_bytes: int, engine_id: str) -> Scheduler:
    """vLLM's own offloading: ``make_vllm_config``'s shape with vLLM's connector and spec
    (``CPUOffloadingSpec``, no shmkv keys)."""
    config = VllmConfig(
        model_config=ModelConfig(model=model_dir, tokenizer=None, skip_tokenizer_init=True,
                                 dtype="float16", max_model_len=1024),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024,
                                         max_model_len=1024, is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, cache_dtype="auto",
                                 enable_prefix_caching=True),
        parallel_config=ParallelConfig(),
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both", engine_id=engine_id,
            kv_connector_extra_config={"spec_name": "CPUOffloadingSpec",
                                       "cpu_bytes_to_use": cpu_bytes}),
        device_config=DeviceConfig("cpu"),
    )
    config.cache_config.num_gpu_blocks = NUM_GPU_BLOCKS
    return Scheduler(vllm_config=config, kv_cache_config=make_kv_cache_config(),
                     structured_output_manager=StructuredOutputManager(config),
                     block_size=BLOCK_SIZE, log_stats=True)


def prompts(seed: int, replica: int):
    """Endless prompts: a shared system prompt (4 blocks) + 0-8 unique blocks + 1-15 tokens."""
    shared = random.Random("system prompts")  # the same in every replica
    system = [[1 + shared.randrange(998) for _ in range(SYSTEM_BLOCKS * BLOCK_SIZE)]
              for _ in range(SYSTEM_PROMPTS)]
    rng = random.Random(f"{seed}-{replica}")
    while True:
        tail = BLOCK_SIZE * rng.randint(0, 8) + rng.randint(1, BLOCK_SIZE - 1)
        yield rng.choice(system) + [1 + rng.randrange(998) for _ in range(tail)]


def replica(setup: str, index: int, pool: str, model_dir: str, cpu_bytes: int,
            args: argparse.Namespace, barrier, results) -> None:
    """One replica's engine core: builds its scheduler, waits for the others, steps."""
    init_none_hash(sha256)
    engine_id = f"replica{index}"
    scheduler = (make_scheduler(pool, model_dir, cpu_bytes, engine_id=engine_id)
                 if setup == "shared" else private_scheduler(model_dir, cpu_bytes, engine_id))
    manager = scheduler.connector.connector_scheduler.manager
    lock = manager.pool.lock() if setup == "shared" else None
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
    source, forward_s = prompts(args.seed, index), args.forward_ms / 1000
    count = dict.fromkeys(("steps", "submitted", "loaded", "stored"), 0)
    barrier.wait(timeout=300)
    t0 = time.perf_counter()
    start, end = t0 + args.warmup_s, t0 + args.warmup_s + args.seconds
    at_start = None
    while (now := time.perf_counter()) < end:
        if at_start is None and now >= start:
            at_start = dict(count, in_flight=len(scheduler.requests), t=now, lock=lock and (
                lock.num_acquired, lock.wait_ns_total, lock.hold_ns_total))
        while len(scheduler.requests) < args.in_flight:
            scheduler.add_request(Request(
                request_id=f"{engine_id}-{count['submitted']}", prompt_token_ids=next(source),
                sampling_params=params, pooling_params=None, block_hasher=hasher))
            count["submitted"] += 1
        out = scheduler.schedule()
        meta, worker_meta = out.kv_connector_metadata, OffloadingWorkerMetadata()
        for job_id, job in meta.load_jobs.items():
            count["loaded"] += len(job.src_spec.block_ids)
            worker_meta.mark_completed(job_id)
        for job_id, job in meta.store_jobs.items():
            count["stored"] += len(job.dst_spec.block_ids)
            worker_meta.mark_completed(job_id)
        if forward_s:
            time.sleep(forward_s)
        _report(scheduler, out, worker_meta, {job.req_id for job in meta.load_jobs.values()})
        count["steps"] += 1
    row = {k: v - at_start[k] for k, v in count.items()}
    row["seconds"] = now - at_start["t"]
    row["finished"] = (row.pop("submitted") + at_start["in_flight"]
                       - len(scheduler.requests))
    if lock is not None:
        row["lock"] = [a - b for a, b in zip(
            (lock.num_acquired, lock.wait_ns_total, lock.hold_ns_total), at_start["lock"],
            strict=True)]
    scheduler.connector.shutdown()
    results.put(row)


def run(ctx, setup: str, n: int, forward_ms: float, args, model_dir: str, tag: str) -> dict:
    """N replica processes of one setup; returns the row of their figures."""
    pool = f"{tag}-{setup}-{n}-{int(forward_ms)}"
    total = args.tier_chunks * CHUNK_BYTES
    cpu_bytes = total if setup == "shared" else total // n
    barrier, results = ctx.Barrier(n), ctx.Queue()
    args = argparse.Namespace(**{**vars(args), "forward_ms": forward_ms})
    procs = [ctx.Process(target=replica, args=(setup, i, pool, model_dir, cpu_bytes, args,
                                               barrier, results))
             for i in range(n)]
    rows, deadline = [], time.monotonic() + 300 + args.warmup_s + args.seconds
    try:
        for p in procs:
            p.start()
        while len(rows) < n:  # a replica that dies fails the run at once, not at a timeout
            try:
                rows.append(results.get(timeout=1))
            except queue.Empty:
                if any(p.exitcode for p in procs) or time.monotonic() > deadline:
                    break
    finally:
        if len(rows) < n:
            barrier.abort()
            for p in procs:
                if p.is_alive():
                    p.kill()
        codes = join_processes(procs)
        if setup == "shared":
            SharedCPUOffloadingManager.unlink(pool)
    if codes != [0] * n:
        raise RuntimeError(f"{setup} x{n}: replica exit codes {codes}")
    per_replica = [r["steps"] / r["seconds"] for r in rows]
    steps = sum(r["steps"] for r in rows)
    out = {"setup": setup, "impl": "shmkv" if setup == "shared" else "vllm", "replicas": n,
           "forward_ms": forward_ms, "seconds": args.seconds,
           "steps_per_s": round(sum(per_replica) / n, 2),
           "steps_per_s_min": round(min(per_replica), 2), "steps": steps,
           "finished": sum(r["finished"] for r in rows),
           "loaded_chunks": sum(r["loaded"] for r in rows),
           "stored_chunks": sum(r["stored"] for r in rows),
           "tier_chunks": args.tier_chunks,
           "chunks_per_tier": args.tier_chunks // (1 if setup == "shared" else n)}
    if setup == "shared":
        holds, wait, hold = (sum(r["lock"][i] for r in rows) for i in range(3))
        out.update(lock_holds_per_step=round(holds / max(steps, 1), 1),
                   lock_wait_ns=round(wait / max(holds, 1)),
                   lock_hold_ns=round(hold / max(holds, 1)))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", default="4,8", help="comma-separated N")
    p.add_argument("--forward-ms", default="10,0", help="comma-separated; 0: scheduler only")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--warmup-s", type=float, default=1.0)
    p.add_argument("--tier-chunks", type=int, default=256, help="total, all replicas")
    p.add_argument("--in-flight", type=int, default=64, help="requests per replica")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="N=2, 2 s, 10 ms: a smoke test")
    args = p.parse_args(argv)
    if args.quick:
        args.replicas, args.forward_ms, args.seconds, args.warmup_s = "2", "10", 2.0, 0.5
    ns = [int(n) for n in args.replicas.split(",")]
    forwards = [float(f) for f in args.forward_ms.split(",")]
    if any(args.tier_chunks % n for n in ns):
        p.error(f"--tier-chunks {args.tier_chunks} is not a multiple of every N {ns}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # still unlink the pool
    ctx = mp.get_context("spawn")
    tag = f"bench-vts-{uuid.uuid4().hex[:8]}"
    tmp = tempfile.mkdtemp(prefix="bench-vts-")
    rows = []
    try:
        model_dir = write_model_dir(os.path.join(tmp, "model"))
        for n in ns:
            for forward_ms in forwards:
                for setup in ("private", "shared"):
                    rows.append(run(ctx, setup, n, forward_ms, args, model_dir, tag))
                    print(json.dumps(rows[-1]), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        left = [f for f in os.listdir("/dev/shm") if tag in f]
        for name in left:
            print(f"left in /dev/shm: {name}", file=sys.stderr)
    print(f"\nsteps/s per replica (mean over replicas; slowest in brackets), "
          f"{args.seconds:g} s each, tier {args.tier_chunks} chunks in all, "
          f"{args.in_flight} requests in flight per replica, {os.cpu_count()} CPUs")
    header = (f"{'N':>3}{'forward ms':>12}{'private (vLLM)':>20}{'shared (shmkv)':>20}"
              f"{'shared/private':>16}{'loaded chunks (priv / shared)':>32}")
    print(header)
    print("-" * len(header))
    for priv, shar in zip(rows[::2], rows[1::2], strict=True):
        print(f"{priv['replicas']:>3}{priv['forward_ms']:>12g}"
              f"{priv['steps_per_s']:>11.1f} ({priv['steps_per_s_min']:>5.1f})"
              f"{shar['steps_per_s']:>11.1f} ({shar['steps_per_s_min']:>5.1f})"
              f"{shar['steps_per_s'] / priv['steps_per_s']:>15.2f}x"
              f"{priv['loaded_chunks']:>21,} /{shar['loaded_chunks']:>9,}")
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
