#!/usr/bin/env python
"""Single-process micro-benchmark of shmkv's BlockPool, side by side with vLLM's.

Every op runs the SAME workload (same call sequence, same 32-byte sha256 block hashes) on
shmkv's ``BlockPool`` (a fresh shared-memory pool per op, created under a unique name and
closed and unlinked afterwards) and, when ``import vllm.v1.core.block_pool`` works and
``--no-vllm`` is not given, on vLLM's ``BlockPool(num_gpu_blocks, enable_caching=True,
hash_block_size=16)``. Both pools use 16-token blocks and one KV-cache group (group 0).

Ops (``n`` is the number of blocks per call; the unit is one block unless noted):

``alloc_free``
    ``free_blocks(get_new_blocks(n))`` in a loop, n = 1, 16, 256. The pool holds no hashes,
    so nothing is evicted; freed blocks go back to the queue head and are reused.
``cache_full_blocks``
    ``cache_full_blocks(req, blocks, 0, 16, 16, 0)`` for 16-block requests whose blocks were
    just allocated (n = 16). Each round allocates ``(num_blocks - 1) // 16`` requests' worth
    of blocks, times only the caching calls, then frees the blocks (hashed, to the queue
    tail); the next round's allocation evicts them. Every round uses fresh hashes.
``get_cached_block.hit`` / ``get_cached_block.miss``
    ``get_cached_block(h, [0])`` per hash (unit: one lookup, n = 1) on a pool whose every
    block is cached and free (ref_cnt 0); hits walk the cached hashes in request order,
    misses use hashes that were never cached.
``touch_free``
    ``touch(chunk); free_blocks(chunk)`` on chunks of n = 1, 16, 256 cached prefix-hit blocks
    (ref_cnt 0, so touch takes them out of the free queue and free appends them back).

Method: the timer is ``time.perf_counter_ns`` around a whole batch of calls (never around a
single call), untimed set-up (allocation, hashing, freeing) stays outside it, and the
garbage collector is off while a batch runs (as ``timeit`` does). One *repeat* is a batch of
about ``--work`` units (blocks or lookups); ``--warmup`` repeats are run and dropped, then
``--repeats`` repeats per implementation, alternating shmkv and vLLM (and which one goes
first) so slow drift hits both alike. Reported: the median and the min over the repeats,
in ns per unit; ``ratio`` is vLLM's median over shmkv's (> 1 means shmkv is faster).

Implementations: ``shmkv`` (the default build: the C kernel), ``shmkv-py`` (the pure-Python
kernel, what an install without a C compiler runs) and ``vllm``.

Output: stdout carries one JSON object per (op, n, impl), one per line, with at least
``bench, op, n, impl, kernel, unit, ns_per_block`` (= the median), ``median_ns, min_ns,
repeats, warmup, units_per_repeat, num_blocks, ratio`` (vLLM's median over this impl's; null
without vLLM) and the raw ``samples_ns``; then a blank line and a readable aligned table
(op | n | shmkv ns | shmkv-py ns | vLLM ns | vLLM/shmkv | vLLM/shmkv-py, medians).
``--json PATH`` also writes the JSON lines to PATH. Progress goes to stderr (one
self-rewriting line on a terminal, one line per op otherwise; ``--no-progress`` silences it).

Examples::

    python benchmarks/bench_block_pool.py                       # defaults, < 1 min
    python benchmarks/bench_block_pool.py --quick               # smoke run, a few seconds
    python benchmarks/bench_block_pool.py --repeats 15 --json benchmarks/results/bp.jsonl
    python benchmarks/bench_block_pool.py --no-vllm --ops alloc_free,touch_free

Without vLLM installed the script still runs; the vLLM columns then show "-". Importing
vLLM takes several seconds (torch); that time is not part of any measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

try:
    import shmkv
except ImportError:  # run from a checkout without installing: use the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import shmkv

from shmkv import BlockPool as ShmBlockPool

BLOCK_SIZE = 16  # tokens per block == hash_block_size
REQ_BLOCKS = 16  # blocks per request in the caching ops
GROUPS = [0]  # kv_cache_group_ids for get_cached_block

perf_counter_ns = time.perf_counter_ns

# A sample: (elapsed ns in the timed region, units done in it).
Sample = tuple[int, int]


# ---------------------------------------------------------------------------- workload data

class _Request:
    """The part of a vLLM Request that ``cache_full_blocks`` reads (events off)."""

    __slots__ = ("block_hashes", "all_token_ids")

    def __init__(self, block_hashes: list[bytes], all_token_ids: list[int]) -> None:
        self.block_hashes = block_hashes
        self.all_token_ids = all_token_ids


_TOKENS = list(range(REQ_BLOCKS * BLOCK_SIZE))  # never read with events off; shared


class _HashSource:
    """Deterministic, never-repeating 32-byte sha256 digests; the same seed gives both
    implementations the same sequence."""

    def __init__(self, seed: int) -> None:
        self._prefix = f"shmkv-bench/{seed}/".encode()
        self._next = 0

    def take(self, count: int) -> list[bytes]:
        start, self._next = self._next, self._next + count
        p = self._prefix
        return [hashlib.sha256(p + i.to_bytes(8, "little")).digest()
                for i in range(start, start + count)]

    def requests(self, count: int) -> list[_Request]:
        return [_Request(self.take(REQ_BLOCKS), _TOKENS) for _ in range(count)]


def _fill_cache(pool, hashes: _HashSource, num_requests: int) -> list[bytes]:
    """Caches ``num_requests`` 16-block requests and frees their blocks (cached, ref_cnt 0).
    Returns the cached hashes in request order."""
    reqs = hashes.requests(num_requests)
    blocks = [pool.get_new_blocks(REQ_BLOCKS) for _ in reqs]
    for req, blks in zip(reqs, blocks, strict=True):
        pool.cache_full_blocks(req, blks, 0, REQ_BLOCKS, BLOCK_SIZE, 0)
    for blks in blocks:
        pool.free_blocks(blks[::-1])  # as the scheduler does: the tail is evicted first
    return [h for req in reqs for h in req.block_hashes]


# ---------------------------------------------------------------------------- the ops
# Each factory takes (pool, hash source, config) and returns a no-argument callable that
# runs one repeat and returns its Sample. All set-up happens in the factory, untimed.

@dataclass(frozen=True)
class Config:
    num_blocks: int
    work: int  # units per repeat (approximately)

    @property
    def requests_per_pool(self) -> int:
        return (self.num_blocks - 1) // REQ_BLOCKS


def op_alloc_free(n: int):
    def factory(pool, hashes: _HashSource, cfg: Config) -> Callable[[], Sample]:
        iters = max(1, cfg.work // n)
        get, free = pool.get_new_blocks, pool.free_blocks

        def run() -> Sample:
            t0 = perf_counter_ns()
            for _ in range(iters):
                free(get(n))
            return perf_counter_ns() - t0, iters * n
        return run
    return factory


def op_cache_full_blocks(pool, hashes: _HashSource, cfg: Config) -> Callable[[], Sample]:
    per_round = cfg.requests_per_pool
    rounds = max(1, -(-cfg.work // (per_round * REQ_BLOCKS)))
    get, free, cache = pool.get_new_blocks, pool.free_blocks, pool.cache_full_blocks

    def run() -> Sample:
        elapsed = 0
        for _ in range(rounds):
            reqs = hashes.requests(per_round)
            blocks = [get(REQ_BLOCKS) for _ in range(per_round)]  # evicts the last round's
            pairs = list(zip(reqs, blocks, strict=True))
            t0 = perf_counter_ns()
            for req, blks in pairs:
                cache(req, blks, 0, REQ_BLOCKS, BLOCK_SIZE, 0)
            elapsed += perf_counter_ns() - t0
            for blks in blocks:
                free(blks[::-1])
        return elapsed, rounds * per_round * REQ_BLOCKS
    return run


def op_lookup(hit: bool):
    def factory(pool, hashes: _HashSource, cfg: Config) -> Callable[[], Sample]:
        cached = _fill_cache(pool, hashes, cfg.requests_per_pool)
        keys = cached if hit else hashes.take(len(cached))
        lookup = pool.get_cached_block
        for h in keys[:: max(1, len(keys) // 64)]:  # the workload is what it claims to be
            if (lookup(h, GROUPS) is not None) != hit:
                raise AssertionError(f"get_cached_block: expected hit={hit}")
        passes = max(1, -(-cfg.work // len(keys)))

        def run() -> Sample:
            groups = GROUPS
            t0 = perf_counter_ns()
            for _ in range(passes):
                for h in keys:
                    lookup(h, groups)
            return perf_counter_ns() - t0, passes * len(keys)
        return run
    return factory


def op_touch_free(n: int):
    def factory(pool, hashes: _HashSource, cfg: Config) -> Callable[[], Sample]:
        cached = _fill_cache(pool, hashes, cfg.requests_per_pool)
        hits = [pool.get_cached_block(h, GROUPS)[0] for h in cached]
        if any(b.ref_cnt != 0 for b in hits):
            raise AssertionError("touch_free: the cached blocks should be free")
        chunks = [hits[i:i + n] for i in range(0, len(hits) - n + 1, n)]
        iters = max(1, cfg.work // n)
        seq = [chunks[i % len(chunks)] for i in range(iters)]
        touch, free = pool.touch, pool.free_blocks

        def run() -> Sample:
            t0 = perf_counter_ns()
            for chunk in seq:
                touch(chunk)
                free(chunk)
            return perf_counter_ns() - t0, iters * n
        return run
    return factory


@dataclass(frozen=True)
class Case:
    op: str
    n: int
    unit: str
    factory: Callable[..., Callable[[], Sample]]
    min_blocks: int  # smallest num_blocks the case fits in


def all_cases() -> list[Case]:
    cases = [Case("alloc_free", n, "block", op_alloc_free(n), n + 1) for n in (1, 16, 256)]
    cases.append(Case("cache_full_blocks", REQ_BLOCKS, "block", op_cache_full_blocks,
                      REQ_BLOCKS + 1))
    cases.append(Case("get_cached_block.hit", 1, "lookup", op_lookup(True), REQ_BLOCKS + 1))
    cases.append(Case("get_cached_block.miss", 1, "lookup", op_lookup(False), REQ_BLOCKS + 1))
    # touch_free needs n cached blocks: whole 16-block requests' worth, plus the null block.
    cases += [Case("touch_free", n, "block", op_touch_free(n),
                   -(-n // REQ_BLOCKS) * REQ_BLOCKS + 1)
              for n in (1, 16, 256)]
    return cases


OP_NAMES = sorted({c.op for c in all_cases()})


# ---------------------------------------------------------------------------- pools

def import_vllm_block_pool():
    """vLLM's BlockPool class and version, or (None, reason)."""
    try:
        # vLLM may configure logging on import; keep anything it prints off our stdout.
        with contextlib.redirect_stdout(sys.stderr):
            import vllm
            from vllm.v1.core.block_pool import BlockPool as VllmBlockPool
        return VllmBlockPool, getattr(vllm, "__version__", "?")
    except Exception as exc:  # ImportError, or a broken torch/vllm install
        return None, f"{type(exc).__name__}: {exc}"


# shmkv implementations benchmarked: "shmkv" is the default build (the C kernel when it is
# built), "shmkv-py" the pure-Python kernel every install has.
SHMKV_KERNELS = {"shmkv": "c", "shmkv-py": "python"}


class Pools:
    """Makes the pools of one case and tears them down (shmkv: close + unlink)."""

    _seq = 0

    def __init__(self, num_blocks: int, vllm_cls) -> None:
        self.num_blocks = num_blocks
        self.vllm_cls = vllm_cls
        self._shm: list[tuple[ShmBlockPool, str]] = []

    def make(self, impl: str):
        if impl in SHMKV_KERNELS:
            Pools._seq += 1
            name = f"bench-{os.getpid()}-{Pools._seq}"
            pool = ShmBlockPool.create(name, self.num_blocks, enable_caching=True,
                                       hash_block_size=BLOCK_SIZE, kernel=SHMKV_KERNELS[impl])
            self._shm.append((pool, name))
            return pool
        return self.vllm_cls(self.num_blocks, enable_caching=True, hash_block_size=BLOCK_SIZE)

    def close(self) -> None:
        while self._shm:
            pool, name = self._shm.pop()
            try:
                pool.close()
            finally:
                ShmBlockPool.unlink(name)


# ---------------------------------------------------------------------------- driver

class Progress:
    """One line on stderr: rewritten in place on a terminal, one line per op otherwise."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total = total
        self.done = 0
        self.enabled = enabled
        self.tty = enabled and sys.stderr.isatty()
        self.t0 = time.monotonic()
        self._last_label = None

    def step(self, label: str, detail: str) -> None:
        """Counts one finished repeat of ``label`` (the op); ``detail`` says which."""
        self.done += 1
        if not self.enabled:
            return
        if self.tty:
            line = (f"[{self.done:>4}/{self.total}] {time.monotonic() - self.t0:5.1f}s  "
                    f"{label} {detail}")
            sys.stderr.write("\r" + line[:100].ljust(100))
            sys.stderr.flush()
        elif label != self._last_label:
            self._last_label = label
            print(f"[{self.done:>4}/{self.total}] {time.monotonic() - self.t0:5.1f}s  {label}",
                  file=sys.stderr, flush=True)

    def finish(self) -> None:
        if self.enabled:
            if self.tty:
                sys.stderr.write("\r" + " " * 100 + "\r")
            print(f"benchmarked {self.total} repeats in {time.monotonic() - self.t0:.1f}s",
                  file=sys.stderr, flush=True)


def timed(run: Callable[[], Sample]) -> tuple[float, int]:
    """One repeat with the GC off: (ns per unit, units)."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        elapsed, units = run()
    finally:
        if was_enabled:
            gc.enable()
    return elapsed / units, units


@dataclass
class Result:
    case: Case
    samples: dict[str, list[float]] = field(default_factory=dict)
    units_per_repeat: int = 0

    def median(self, impl: str) -> float | None:
        s = self.samples.get(impl)
        return statistics.median(s) if s else None

    def minimum(self, impl: str) -> float | None:
        s = self.samples.get(impl)
        return min(s) if s else None

    def ratio(self, impl: str = "shmkv") -> float | None:
        s, v = self.median(impl), self.median("vllm")
        return v / s if s and v else None


def run_case(case: Case, case_idx: int, impls: list[str], cfg: Config, repeats: int,
             warmup: int, vllm_cls, progress: Progress) -> Result:
    result = Result(case)
    pools = Pools(cfg.num_blocks, vllm_cls)
    try:
        runners = {}
        for impl in impls:
            # Same seed for every impl of a case: identical hashes, identical call sequence.
            runners[impl] = case.factory(pools.make(impl), _HashSource(case_idx), cfg)
        label = f"{case.op} n={case.n}"
        for impl in impls:
            for _ in range(warmup):
                timed(runners[impl])
                progress.step(label, f"{impl} warm-up")
        for impl in impls:
            result.samples[impl] = []
        for r in range(repeats):
            for impl in (impls if r % 2 == 0 else impls[::-1]):
                ns_per_unit, result.units_per_repeat = timed(runners[impl])
                result.samples[impl].append(ns_per_unit)
                progress.step(label, f"{impl} repeat {r + 1}/{repeats}")
    finally:
        pools.close()
    return result


def json_rows(results: list[Result], cfg: Config, repeats: int, warmup: int,
              vllm_version: str | None) -> list[dict]:
    rows = []
    for res in results:
        for impl, samples in res.samples.items():
            med = statistics.median(samples)
            rows.append({
                "bench": "block_pool",
                "op": res.case.op,
                "n": res.case.n,
                "impl": impl,
                "unit": res.case.unit,
                "ns_per_block": round(med, 2),
                "median_ns": round(med, 2),
                "min_ns": round(min(samples), 2),
                "repeats": repeats,
                "warmup": warmup,
                "units_per_repeat": res.units_per_repeat,
                "num_blocks": cfg.num_blocks,
                "kernel": SHMKV_KERNELS.get(impl),
                "ratio": (round(res.ratio(impl), 4) if res.ratio(impl) is not None else None)
                if impl != "vllm" else None,
                "samples_ns": [round(s, 2) for s in samples],
                "python": platform.python_version(),
                "shmkv_version": shmkv.__version__,
                "vllm_version": vllm_version if impl == "vllm" else None,
            })
    return rows


def format_table(results: list[Result], cfg: Config, repeats: int, warmup: int,
                 vllm_note: str) -> str:
    def ns(x: float | None) -> str:
        return "-" if x is None else f"{x:,.1f}"

    def x(r: float | None) -> str:
        return "-" if r is None else f"{r:.2f}x"

    header = ("op", "n", "shmkv ns", "shmkv-py ns", "vLLM ns", "vLLM/shmkv", "vLLM/shmkv-py")
    body = []
    for res in results:
        body.append((res.case.op, str(res.case.n), ns(res.median("shmkv")),
                     ns(res.median("shmkv-py")), ns(res.median("vllm")),
                     x(res.ratio("shmkv")), x(res.ratio("shmkv-py"))))
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    align = ["<", ">", ">", ">", ">", ">", ">"]

    def line(row) -> str:
        return "  ".join(f"{c:{a}{w}}" for c, a, w in zip(row, align, widths, strict=True)).rstrip()

    rule = "  ".join("-" * w for w in widths)
    out = [
        f"BlockPool micro-benchmark: num_blocks={cfg.num_blocks}, block size {BLOCK_SIZE}, "
        f"~{cfg.work} units/repeat, median of {repeats} repeats ({warmup} warm-up), "
        f"python {platform.python_version()}, {vllm_note}",
        "median ns per block (get_cached_block: per lookup); shmkv = C kernel, shmkv-py = "
        "pure-Python kernel; vLLM/shmkv > 1 means shmkv is faster",
        line(header), rule, *map(line, body),
    ]
    return "\n".join(out)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="shmkv BlockPool vs vLLM BlockPool, ns per block, single process.",
        epilog="See the module docstring (and benchmarks/README.md) for what each op does.",
    )
    p.add_argument("--num-blocks", type=int, default=4096,
                   help="blocks per pool, the null block included (default 4096)")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed repeats per op and impl (default 7; 3 with --quick)")
    p.add_argument("--warmup", type=int, default=None,
                   help="dropped warm-up repeats per op and impl (default 2; 1 with --quick)")
    p.add_argument("--work", type=int, default=None,
                   help="units (blocks or lookups) per repeat (default 16384; 2048 with --quick)")
    p.add_argument("--quick", action="store_true", help="a fast smoke run")
    p.add_argument("--no-vllm", action="store_true", help="benchmark shmkv only")
    p.add_argument("--ops", default=None,
                   help=f"comma-separated subset of: {', '.join(OP_NAMES)}")
    p.add_argument("--json", metavar="PATH", default=None,
                   help="also write the JSON lines to PATH")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    args = p.parse_args(argv)
    args.repeats = args.repeats if args.repeats is not None else (3 if args.quick else 7)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    args.work = args.work if args.work is not None else (2048 if args.quick else 16384)
    if args.num_blocks < REQ_BLOCKS + 1:
        p.error(f"--num-blocks must be at least {REQ_BLOCKS + 1}")
    if args.repeats < 1 or args.warmup < 0 or args.work < 1:
        p.error("--repeats and --work must be >= 1, --warmup >= 0")
    if args.ops:
        args.ops = [o.strip() for o in args.ops.split(",") if o.strip()]
        unknown = sorted(set(args.ops) - set(OP_NAMES))
        if unknown:
            p.error(f"unknown op(s) {', '.join(unknown)}; choose from {', '.join(OP_NAMES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = Config(num_blocks=args.num_blocks, work=args.work)
    progress_on = not args.no_progress

    vllm_cls, vllm_version = None, None
    if args.no_vllm:
        vllm_note = "vLLM: skipped (--no-vllm)"
    else:
        t0 = time.monotonic()
        if progress_on:
            print("importing vllm.v1.core.block_pool ...", file=sys.stderr, flush=True)
        vllm_cls, info = import_vllm_block_pool()
        if vllm_cls is None:
            vllm_note = "vLLM: not importable"
            print(f"vLLM not importable ({info}); shmkv only", file=sys.stderr)
        else:
            vllm_version = info
            vllm_note = f"vLLM {vllm_version}"
            if progress_on:
                print(f"  vLLM {vllm_version} imported in {time.monotonic() - t0:.1f}s",
                      file=sys.stderr, flush=True)
    from shmkv.pool.block_pool import _ckernel

    impls = (["shmkv"] if _ckernel is not None else []) + ["shmkv-py"]
    impls += ["vllm"] if vllm_cls is not None else []

    # Move everything imported so far (torch and vLLM: millions of objects) out of the GC's
    # reach, so the gc.collect() before each repeat costs microseconds, not 0.3 s.
    gc.collect()
    gc.freeze()

    cases = [(i, c) for i, c in enumerate(all_cases()) if not args.ops or c.op in args.ops]
    runnable = []
    for i, c in cases:
        if c.min_blocks > cfg.num_blocks:
            print(f"skipping {c.op} n={c.n}: needs --num-blocks >= {c.min_blocks}",
                  file=sys.stderr)
        else:
            runnable.append((i, c))

    progress = Progress(len(runnable) * len(impls) * (args.warmup + args.repeats), progress_on)
    results = []
    try:
        for i, case in runnable:
            results.append(run_case(case, i, impls, cfg, args.repeats, args.warmup,
                                    vllm_cls, progress))
    finally:
        progress.finish()

    rows = json_rows(results, cfg, args.repeats, args.warmup, vllm_version)
    table = format_table(results, cfg, args.repeats, args.warmup, vllm_note)
    for row in rows:
        print(json.dumps(row))
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        print(f"wrote {len(rows)} JSON lines to {path}", file=sys.stderr)
    print()
    print(table, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
