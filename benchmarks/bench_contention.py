#!/usr/bin/env python
"""Cross-process contention: 1, 2, 4 and 8 scheduler processes on one shmkv pool.

Every process runs the same scheduler-like loop for ``--seconds``:

1. build a request (one of four shared 64-token system prompts + a unique user message of
   8 to 40 tokens) and hash it with the pool's block hasher (outside the lock, as a
   scheduler hashes when a request arrives);
2. under ONE hold of the pool lock (a scheduler step): finish the oldest of the 8 running
   requests (``free_blocks``) when there are 8, look up the new request's longest cached
   prefix (``get_cached_prefix``), ``touch`` the hits, ``get_new_blocks`` for the rest,
   ``cache_full_blocks``.

Reported per configuration: aggregate requests per second over all processes, the speedup
over one process, and the p50 / p99 of the lock wait and hold times (every hold of every
process, measured by ``PoolLock.record``). Output: one JSON line per configuration on stdout,
then a readable table, then the path of a PNG plot (throughput and lock wait against the
number of processes; drawn with matplotlib, or one line saying it is not installed).
``--json PATH`` also writes the JSON lines to a file.

    python benchmarks/bench_contention.py                  # 1,2,4,8 processes, 3 rounds
    python benchmarks/bench_contention.py --quick          # one round of 1 s runs
    python benchmarks/bench_contention.py --kernel python  # the pure-Python kernel
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import random
import sys
import time
from pathlib import Path

import numpy as np

from shmkv import BlockPool, Request
from shmkv.plot import PlotUnavailable
from shmkv.pool.block_pool import default_kernel
from shmkv.pool.lock import SPIN_S

HERE = Path(__file__).resolve().parent
SYSTEM_PROMPTS = [list(range(10_000 * p, 10_000 * p + 64)) for p in range(4)]
RUNNING = 8


def scheduler(name: str, index: int, seconds: float, kernel: str, spin_s: float, start,
              results) -> None:
    """One scheduler process; puts (requests, elapsed_s, waits_ns, holds_ns) on results."""
    pool = BlockPool.attach(name, kernel=kernel, label=f"bench-{index}")
    hasher = pool.make_block_hasher()
    bs = pool.hash_block_size
    rng = random.Random(index)
    lock = pool.lock()
    lock.spin_s = spin_s
    lock.record = []
    running: list[list] = []
    served = 0
    start.wait(60)
    t0 = time.perf_counter()
    deadline = t0 + seconds
    while time.perf_counter() < deadline:
        tokens = rng.choice(SYSTEM_PROMPTS) + [rng.randrange(50_000, 90_000)
                                               for _ in range(rng.randint(8, 40))]
        req = Request(f"{index}-{served}", tokens, block_hasher=hasher)
        with lock:
            if len(running) == RUNNING:  # the step also finishes the oldest request
                pool.free_blocks(reversed(running.pop(0)))
            hits = pool.get_cached_prefix(req.block_hashes)
            pool.touch(hits)
            blocks = hits + pool.get_new_blocks(-(-req.num_tokens // bs) - len(hits))
            pool.cache_full_blocks(req, blocks, len(hits), req.num_tokens // bs, bs, 0)
        running.append(blocks)
        served += 1
    elapsed = time.perf_counter() - t0
    for blocks in running:
        pool.free_blocks(reversed(blocks))
    record = lock.record
    lock.record = None
    pool.close()
    waits = np.array([w for w, _ in record], dtype=np.int64)
    holds = np.array([h for _, h in record], dtype=np.int64)
    results.put((served, elapsed, waits, holds))


def run_config(num_procs: int, seconds: float, kernel: str, num_blocks: int,
               spin_s: float) -> dict:
    name = f"bench-contention-{os.getpid()}-{num_procs}"
    ctx = mp.get_context("spawn")
    pool = BlockPool.create(name, num_blocks, max_processes=num_procs + 1, kernel=kernel,
                            label="bench-parent")
    try:
        start, results = ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=scheduler, args=(name, i, seconds, kernel, spin_s, start,
                                                       results))
                 for i in range(num_procs)]
        for p in procs:
            p.start()
        time.sleep(0.5 + 0.1 * num_procs)  # let every process attach before the start
        start.set()
        outcomes = [results.get(timeout=seconds + 120) for _ in procs]
        for p in procs:
            p.join(60)
            if p.exitcode != 0:
                raise RuntimeError(f"a scheduler process exited with {p.exitcode}")
        pool.check_invariants()
        if pool.get_num_free_blocks() != num_blocks - 1:
            raise RuntimeError("blocks were not all returned")
    finally:
        pool.close()
        BlockPool.unlink(name)
    served = sum(o[0] for o in outcomes)
    elapsed = max(o[1] for o in outcomes)
    waits = np.concatenate([o[2] for o in outcomes]) / 1e3
    holds = np.concatenate([o[3] for o in outcomes]) / 1e3
    return {
        "bench": "contention",
        "processes": num_procs,
        "kernel": kernel,
        "spin_us": round(spin_s * 1e6, 3),
        "seconds": round(elapsed, 3),
        "requests": served,
        "requests_per_s": round(served / elapsed, 1),
        "lock_holds": int(len(holds)),
        "wait_p50_us": round(float(np.percentile(waits, 50)), 2),
        "wait_p99_us": round(float(np.percentile(waits, 99)), 2),
        "hold_p50_us": round(float(np.percentile(holds, 50)), 2),
        "hold_p99_us": round(float(np.percentile(holds, 99)), 2),
        "num_blocks": num_blocks,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }


def format_table(rows: list[dict]) -> str:
    """One line per (spin, processes): the speedup over one process with the same spin, and
    the requests/s against the first spin setting's at the same process count (the before /
    after of spinning, in one run)."""
    header = ("spin us", "processes", "requests/s", "speedup", "vs first spin", "wait p50 us",
              "wait p99 us", "hold p50 us", "hold p99 us")
    one = {r["spin_us"]: r["requests_per_s"] for r in rows if r["processes"] == 1}
    first = {}
    for r in rows:
        first.setdefault(r["processes"], r["requests_per_s"])
    body = [
        (f"{r['spin_us']:g}", str(r["processes"]), f"{r['requests_per_s']:,.0f}",
         f"{r['requests_per_s'] / one[r['spin_us']]:.2f}x" if r["spin_us"] in one else "-",
         f"{r['requests_per_s'] / first[r['processes']]:.2f}x",
         f"{r['wait_p50_us']:.1f}", f"{r['wait_p99_us']:.1f}", f"{r['hold_p50_us']:.1f}",
         f"{r['hold_p99_us']:.1f}")
        for r in rows
    ]
    widths = [max(len(x[i]) for x in [header, *body]) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True))
             for row in [header, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """Two panels against the number of processes: aggregate requests/s (with one process's
    rate times N, the ideal), and the p50 / p99 lock wait."""
    from shmkv.plot import draw_lines, figure, save

    procs = [r["processes"] for r in rows]
    fig, (left, right) = figure(2, title=f"shmkv contention: one pool, {rows[0]['kernel']} "
                                f"kernel, {os.cpu_count()} cores")
    base = rows[0]["requests_per_s"] / rows[0]["processes"]
    draw_lines(left, {"measured": (procs, [r["requests_per_s"] / 1e3 for r in rows]),
                      "linear (one process x N)": (procs, [base * n / 1e3 for n in procs])},
               x_label="scheduler processes", y_label="requests/s, all processes (thousands)",
               title="throughput", x_ticks=procs, log_x=True)
    left.get_lines()[1].set(linestyle="--", color="0.55", marker="")
    left.legend(loc="best", fontsize="small")
    draw_lines(right, {"p99": (procs, [r["wait_p99_us"] for r in rows]),
                       "p50": (procs, [r["wait_p50_us"] for r in rows])},
               x_label="scheduler processes", y_label="lock wait (µs)",
               title="time to take the pool lock", x_ticks=procs, log_x=True, log_y=True)
    save(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", default="1,2,4,8", help="process counts (1,2,4,8)")
    parser.add_argument("--seconds", type=float, default=2.0, help="per run (2)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds over all configurations, interleaved; medians are "
                        "reported (3)")
    parser.add_argument("--quick", action="store_true", help="1 round of 1 s runs")
    parser.add_argument("--kernel", default=default_kernel(), choices=["c", "python"])
    parser.add_argument("--spin-us", default="",
                        help="comma-separated spin times of the lock's waiters, in us, each "
                        "run at every process count in the same run (e.g. 0,20: before and "
                        f"after spinning); default the pool's ({SPIN_S * 1e6:g})")
    parser.add_argument("--blocks", type=int, default=4096, help="pool size (4096)")
    parser.add_argument("--json", metavar="PATH", help="also write the JSON lines to PATH")
    parser.add_argument("--plot", metavar="PATH", default=str(HERE / "results" / "contention.png"),
                        help="PNG plot path (benchmarks/results/contention.png; \"\" for none)")
    args = parser.parse_args(argv)
    counts = [int(x) for x in args.procs.split(",")]
    spins = [float(x) * 1e-6 for x in args.spin_us.split(",")] if args.spin_us else [SPIN_S]
    seconds = 1.0 if args.quick else args.seconds
    rounds = 1 if args.quick else args.rounds
    # The machines here drift (other tenants, frequency): interleave the configurations over
    # several rounds and report, per configuration, the run with the median throughput.
    # Each process count runs with every spin setting back to back, so the before and after
    # of a spin share the machine's state; the table groups them by spin.
    configs = [(spin, n) for n in counts for spin in spins]
    runs: dict[tuple[float, int], list[dict]] = {c: [] for c in configs}
    total = rounds * len(configs)
    for r in range(rounds):
        for i, (spin, n) in enumerate(configs):
            print(f"[{r * len(configs) + i + 1}/{total}] round {r + 1}: {n} process(es), "
                  f"spin {spin * 1e6:g} us, {seconds:g} s ...", file=sys.stderr, flush=True)
            runs[spin, n].append(run_config(n, seconds, args.kernel, args.blocks, spin))
    rows = []
    for c in sorted(configs):
        ordered = sorted(runs[c], key=lambda row: row["requests_per_s"])
        row = dict(ordered[len(ordered) // 2])
        row["rounds"] = rounds
        row["requests_per_s_all"] = [x["requests_per_s"] for x in runs[c]]
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print()
    print(f"one pool, {args.kernel} kernel, {os.cpu_count()} cores, median of {rounds} "
          f"interleaved {seconds:g} s runs; wait = time to take the pool lock, hold = time "
          "holding it")
    print(format_table(rows))
    if not args.plot:  # --plot "": no plot
        return 0
    plot_path = Path(args.plot)
    plot_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        plot([r for r in rows if r["spin_us"] == rows[-1]["spin_us"]], plot_path)
        print(f"plot: {plot_path}")
    except PlotUnavailable as e:
        print(f"plot: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
