"""shmkv on a GPU: its figures, part by part, each against a limit measured in the same run.

Parts (``--part``, default: all of them); each is a function ``run_<part>(args)`` that
returns its rows (dicts: one JSON line each) and prints its table:

- ``transfers``: ``KVStore.load_blocks`` / ``store_blocks`` between the node-wide store and
  each process's device cache (``allocate_device_cache``), at a Llama-3-8B-like geometry
  (bf16, 32 layers, 8 KV heads, head size 128, 16-token blocks: 2 MiB a block; a store of
  1,024 blocks, pinned with ``pin()`` on CUDA). Id sets: ``consecutive`` (256 blocks in a
  row), ``random`` (256 distinct blocks anywhere in the store, copied to random rows),
  ``decode`` (64 random blocks: a decode step's batch). Both directions, by 1 and by 4
  processes at once (disjoint ids; every process maps and pins the same store). The limit
  is the same bytes in ONE contiguous copy: on CUDA between a pinned host buffer and device
  memory, on the CPU a plain memcpy (``--device cpu``: the host tier of CPU ranks; it also
  keeps this benchmark exercised without a GPU). ``ratio`` is GB/s over the limit's GB/s,
  ``x limit`` the time over the limit's time. ``--layouts block_major,layer_major`` adds the
  store's layer-major layout, whose copies go per layer and K/V.

Each measured case: 1 untimed warm-up, then ``--repeats`` timed runs; the processes start
each run together (a barrier) and its time is from the first start to the last end (after a
device synchronize). Medians are shown.

    python benchmarks/bench_gpu.py --part transfers [--device auto|cpu|cuda|cuda:N]
        [--layouts block_major[,layer_major]] [--procs 1,4] [--repeats 5] [--quick]
        [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from shmkv.ranks.kv_store import BLOCK_MAJOR, KV_LAYOUTS, KVStore  # noqa: E402

MIB = 1 << 20
ID_SETS = ("consecutive", "random", "decode")
DIRECTIONS = ("load", "store")


# --------------------------------------------------------------------------- transfers


def _device(spec: str) -> str:
    if spec == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if spec.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {spec}: torch.cuda.is_available() is False")
    if spec != "cpu" and not spec.startswith("cuda"):
        raise SystemExit(f"--device must be auto, cpu, cuda or cuda:N, got {spec!r}")
    return spec


def _sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize(device)


def _plans(args, proc: int) -> dict[str, tuple[list[int], list[int]]]:
    """(store ids, cache rows) per id set for process ``proc``: disjoint across processes."""
    rng = np.random.default_rng(args.seed)
    perm = rng.permutation(args.store_blocks)  # every process draws the same permutation
    b, d = args.blocks, args.decode_blocks
    rows_rng = np.random.default_rng(args.seed + 1 + proc)
    return {
        "consecutive": (list(range(proc * b, (proc + 1) * b)), list(range(b))),
        "random": (perm[proc * b:(proc + 1) * b].tolist(), rows_rng.permutation(b).tolist()),
        "decode": (perm[proc * d:(proc + 1) * d].tolist(), rows_rng.permutation(b)[:d].tolist()),
    }


def transfer_worker(args, proc: int, stores: dict[str, str], barrier, results) -> None:
    """One process of a group: attaches every store, pins it on CUDA, then runs each case
    in lockstep with the others: (layout, ids, direction, "kvstore" or "limit")."""
    try:
        device = args.device
        torch.set_num_threads(args.threads)
        if device.startswith("cuda") and torch.device(device).index is not None:
            torch.cuda.set_device(torch.device(device))  # (set_device refuses a bare "cuda")
        opened = {layout: KVStore.attach(name) for layout, name in stores.items()}
        any_store = next(iter(opened.values()))
        if device != "cpu":
            for s in opened.values():
                s.pin()
        cache = any_store.allocate_device_cache(device, args.blocks)
        block_bytes = cache[:, :, 0].numel() * cache.element_size()
        pin = device != "cpu"
        host_buf = torch.ones(args.blocks * block_bytes, dtype=torch.uint8, pin_memory=pin)
        dev_buf = torch.ones(args.blocks * block_bytes, dtype=torch.uint8, device=device)
        plans = _plans(args, proc)
        out = []
        for layout, store in opened.items():
            for ids in ID_SETS:
                host_ids, rows = plans[ids]
                nbytes = len(host_ids) * block_bytes
                for direction in DIRECTIONS:
                    for impl in ("kvstore", "limit"):
                        if impl == "kvstore":
                            op = (store.load_blocks if direction == "load"
                                  else store.store_blocks)
                            def run(op=op, host_ids=host_ids, rows=rows, cache=cache):  # noqa: E306
                                op(cache, host_ids, rows)
                        else:
                            src, dst = ((host_buf, dev_buf) if direction == "load"
                                        else (dev_buf, host_buf))
                            def run(src=src[:nbytes], dst=dst[:nbytes]):  # noqa: E306
                                dst.copy_(src, non_blocking=pin)
                        spans = []
                        for rep in range(args.repeats + 1):
                            barrier.wait(timeout=args.timeout_s)
                            t0 = time.perf_counter()
                            run()
                            _sync(device)
                            t1 = time.perf_counter()
                            if rep:  # the first is the warm-up
                                spans.append((t0, t1))
                        out.append(((layout, ids, direction, impl), len(host_ids), spans))
        del cache, host_buf, dev_buf
        for s in opened.values():
            s.close()
        results.put((proc, block_bytes, out))
    except BaseException as exc:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        barrier.abort()
        results.put((proc, None, repr(exc)))


def _run_group(args, stores: dict[str, str], procs: int) -> tuple[int, dict]:
    """Runs ``procs`` workers; returns (block bytes, {case: (blocks per process,
    [time of each run over all processes])})."""
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(procs)
    results = ctx.Queue()
    workers = [ctx.Process(target=transfer_worker, args=(args, p, stores, barrier, results))
               for p in range(procs)]
    for w in workers:
        w.start()
    try:
        got = [results.get(timeout=args.timeout_s) for _ in workers]
    finally:
        for w in workers:
            w.join(60)
            if w.is_alive():
                w.kill()
                w.join(10)
    failed = [r for r in got if r[1] is None]
    if failed:
        raise SystemExit(f"transfer worker {failed[0][0]} failed: {failed[0][2]}")
    block_bytes = got[0][1]
    cases: dict = {}
    for case_index, (case, n, _) in enumerate(got[0][2]):
        runs = []
        for rep in range(args.repeats):
            starts = [r[2][case_index][2][rep][0] for r in got]
            ends = [r[2][case_index][2][rep][1] for r in got]
            runs.append(max(ends) - min(starts))
        cases[case] = (n, runs)
    return block_bytes, cases


def _transfer_args(args) -> None:
    """Fills in the sizes: the issue's geometry, or a small one with --quick."""
    quick = args.quick
    defaults = {"num_layers": 4 if quick else 32, "blocks": 64 if quick else 256,
                "decode_blocks": 16 if quick else 64, "repeats": 3 if quick else 5}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    procs = max(args.procs)
    if args.store_blocks is None:
        args.store_blocks = max(procs * args.blocks, 4 * args.blocks)
    if args.store_blocks < procs * args.blocks or args.decode_blocks > args.blocks:
        raise SystemExit(f"--store-blocks {args.store_blocks} must hold {procs} x "
                         f"{args.blocks} blocks, and --decode-blocks <= --blocks")


def run_transfers(args) -> list[dict]:
    """The transfer table: rows of (layout, ids, direction, processes)."""
    _transfer_args(args)
    args.device = _device(args.device)
    layouts = args.layouts.split(",")
    for layout in layouts:
        if layout not in KV_LAYOUTS:
            raise SystemExit(f"--layouts: {layout!r} is not one of {list(KV_LAYOUTS)}")
    stores: dict[str, str] = {}
    made: list[tuple[KVStore, str]] = []
    rows: list[dict] = []
    try:
        for layout in layouts:
            name = f"bench-gpu-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            store = KVStore.create(name, num_layers=args.num_layers,
                                   num_blocks=args.store_blocks, block_size=args.block_size,
                                   num_kv_heads=args.num_kv_heads, head_size=args.head_size,
                                   dtype=args.dtype, layout=layout)
            made.append((store, name))
            store.kv.view(torch.uint8).fill_(1)  # every page present before anyone pins
            stores[layout] = name
        gpu = torch.cuda.get_device_name(args.device) if args.device != "cpu" else "cpu"
        for procs in args.procs:
            _progress(args, f"transfers: {procs} process(es) ...")
            block_bytes, cases = _run_group(args, stores, procs)
            for layout in layouts:
                for ids in ID_SETS:
                    for direction in DIRECTIONS:
                        n, ours = cases[(layout, ids, direction, "kvstore")]
                        _, limit = cases[(layout, ids, direction, "limit")]
                        rows.append(_transfer_row(args, gpu, layout, ids, direction, procs, n,
                                                  block_bytes, ours, limit))
    finally:
        for store, name in made:
            store.close()
            KVStore.unlink(name)
    _emit(args, rows)
    _transfer_table(rows)
    return rows


def _transfer_row(args, gpu, layout, ids, direction, procs, n, block_bytes, ours, limit):
    nbytes = procs * n * block_bytes
    ms, limit_ms = statistics.median(ours) * 1e3, statistics.median(limit) * 1e3
    return {
        "bench": "bench_gpu", "part": "transfers", "device": args.device, "gpu": gpu,
        "layout": layout, "ids": ids, "direction": direction, "procs": procs,
        "blocks_per_proc": n, "block_bytes": block_bytes, "bytes": nbytes,
        "ms": round(ms, 3), "gbps": round(nbytes / ms / 1e6, 2),
        "limit_ms": round(limit_ms, 3), "limit_gbps": round(nbytes / limit_ms / 1e6, 2),
        "ratio": round(limit_ms / ms, 3), "time_x_limit": round(ms / limit_ms, 3),
        "repeats": args.repeats, "runs_ms": [round(t * 1e3, 3) for t in ours],
        "limit_runs_ms": [round(t * 1e3, 3) for t in limit],
    }


def _transfer_table(rows: list[dict]) -> None:
    limit = "pinned copy" if rows and rows[0]["device"] != "cpu" else "memcpy"
    print()
    print(f"transfers on {rows[0]['gpu'] if rows else '-'} ({rows[0]['device'] if rows else '-'}"
          f"); limit: one {limit} of the same bytes, same run")
    print(f"| layout | ids | direction | procs | blocks | MiB | ms | GB/s | {limit} GB/s | "
          f"ratio | x limit time |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['layout']} | {r['ids']} | {r['direction']} | {r['procs']} | "
              f"{r['procs'] * r['blocks_per_proc']} | {r['bytes'] / MIB:,.0f} | {r['ms']:,.2f} | "
              f"{r['gbps']:,.1f} | {r['limit_gbps']:,.1f} | {r['ratio']:.2f} | "
              f"{r['time_x_limit']:.2f} |")
    goals = [r for r in rows if r["layout"] == BLOCK_MAJOR and r["procs"] == 1]
    where = "" if not rows or rows[0]["device"] != "cpu" else " (set for a GPU; here the CPU)"
    for r in goals:
        if r["ids"] == "random":
            verdict = "meets" if r["ratio"] >= 0.85 else "MISSES"
            print(f"goal{where}: random {r['direction']}, ratio >= 0.85: {r['ratio']:.2f} "
                  f"({verdict})")
        elif r["ids"] == "decode":
            verdict = "meets" if r["time_x_limit"] <= 1.3 else "MISSES"
            print(f"goal{where}: decode {r['direction']}, time <= 1.3x the limit's: "
                  f"{r['time_x_limit']:.2f}x ({verdict})")


# --------------------------------------------------------------------------- main

def run_serve(args) -> list[dict]:
    """``shmkv run`` on the device (benchmarks/bench_gpu_serve.py): the shared device
    placement against private pools, and the host placement."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_gpu_serve

    device = _device(args.device)
    if args.quick:
        argv = ["--quick"]
    else:  # the small model on a GPU; on the CPU the tiny one (0.6 B parameters per
        # rank process would take minutes to serve there)
        argv = ["--device", device] + ([] if device != "cpu" else ["--model", "tiny"])
    if args.json:
        argv += ["--json", str(Path(args.json).with_suffix(".serve.jsonl"))]
    code = bench_gpu_serve.main(argv)
    if code:
        raise SystemExit(f"bench_gpu_serve exited with {code}")
    return []


PARTS = {"transfers": run_transfers, "serve": run_serve}  # run_<part>(args) -> its rows


def _emit(args, rows: list[dict]) -> None:
    """One JSON line per row on stdout, and appended to ``--json PATH`` if given."""
    lines = [json.dumps(row) for row in rows]
    for line in lines:
        print(line, flush=True)
    if args.json:
        with open(args.json, "a") as f:
            f.writelines(line + "\n" for line in lines)


def _progress(args, text: str) -> None:
    if not args.no_progress:
        print(text, file=sys.stderr, flush=True)


def _procs(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--procs must be ints separated by commas, got "
                                         f"{text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"--procs must be >= 1 each, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=["all", *PARTS], default="all")
    p.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, cuda, cuda:N")
    p.add_argument("--quick", action="store_true",
                   help="small sizes (4 layers, 64 and 16 blocks, 3 repeats): a smoke run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", metavar="PATH", help="also append the JSON lines to PATH")
    t = p.add_argument_group("transfers")
    t.add_argument("--layouts", default=BLOCK_MAJOR,
                   help=f"store layouts, comma separated, of {list(KV_LAYOUTS)}")
    t.add_argument("--procs", type=_procs, default=[1, 4])
    t.add_argument("--blocks", type=int, default=None, help="per process and call (256)")
    t.add_argument("--decode-blocks", type=int, default=None, help="a decode batch (64)")
    t.add_argument("--store-blocks", type=int, default=None,
                   help="blocks in the store (max(procs, 4) x --blocks)")
    t.add_argument("--repeats", type=int, default=None, help="timed runs per case (5)")
    t.add_argument("--num-layers", type=int, default=None, help="32")
    t.add_argument("--num-kv-heads", type=int, default=8)
    t.add_argument("--head-size", type=int, default=128)
    t.add_argument("--block-size", type=int, default=16)
    t.add_argument("--dtype", default="bfloat16")
    t.add_argument("--threads", type=int, default=1,
                   help="torch threads per process (CPU copies; 1: processes do not "
                        "oversubscribe the cores)")
    t.add_argument("--timeout-s", type=float, default=300.0,
                   help="how long a group of processes may take")
    args = p.parse_args(argv)
    for part in PARTS if args.part == "all" else [args.part]:
        PARTS[part](args)


if __name__ == "__main__":
    main()
