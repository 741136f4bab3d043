"""How fast the model-free replay (``shmkv replay``) goes: requests per second of the
KV-cache layer alone (front end, routing, scheduler processes, KVCacheManagers, one shared
pool or private pools), at 1 and 4 schedulers by default.

On the public Mooncake conversation trace (``--trace``, see docs/serving.md for how to
fetch it), or without one on a synthetic trace in the same format (shared system prefixes,
multi-turn sessions that grow their prefix). Prints one JSON line per run (the figures of
``shmkv replay --json`` less the timeline and the per-scheduler lines), then a table.

    python benchmarks/bench_replay.py [--trace conversation_trace.jsonl] [--requests N]
        [--schedulers 1,4] [--blocks 8192] [--pool shared] [--routing round-robin]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shmkv.serve.config import TinyModelConfig  # noqa: E402
from shmkv.serve.replay import CostModel  # noqa: E402
from shmkv.serve.runner import RunConfig, Runner  # noqa: E402
from shmkv.serve.trace import read_mooncake  # noqa: E402


def synthetic_trace(path: Path, n: int, seed: int = 0) -> None:
    """``n`` Mooncake-format lines: 8 system prefixes (skewed popularity) of 2-6 ids,
    sessions of 1-5 turns that resend their previous turn's ids and add 1-4."""
    rng = random.Random(seed)
    next_id = 0

    def fresh(k):
        nonlocal next_id
        next_id += k
        return list(range(next_id - k, next_id))

    systems = [fresh(rng.randint(2, 6)) for _ in range(8)]
    sessions: list[list[int]] = []
    with open(path, "w") as f:
        for k in range(n):
            if sessions and rng.random() < 0.5:
                ids = sessions.pop(rng.randrange(len(sessions)))
                ids = ids + fresh(rng.randint(1, 4))
            else:
                ids = rng.choices(systems, [1 / (i + 1) for i in range(8)])[0] + fresh(
                    rng.randint(1, 4))
            if len(ids) < 24 and rng.random() < 0.8:
                sessions.append(ids)
            f.write(json.dumps({"timestamp": k * 10, "input_length": 512 * len(ids) - 100,
                                "output_length": rng.randint(32, 512),
                                "hash_ids": ids}) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", help="a Mooncake trace (default: a synthetic one)")
    p.add_argument("--requests", type=int, default=0,
                   help="the first N requests (0: all; 3000 for the synthetic trace)")
    p.add_argument("--schedulers", default="1,4", help="scheduler counts to run (1,4)")
    p.add_argument("--blocks", type=int, default=8192, help="blocks in all (8192)")
    p.add_argument("--pool", choices=["shared", "private"], default="shared")
    p.add_argument("--routing", default="round-robin")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--concurrency", type=int, default=16)
    args = p.parse_args(argv)
    counts = [int(c) for c in args.schedulers.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        path = args.trace
        if path is None:
            path = str(Path(tmp) / "synthetic.jsonl")
            synthetic_trace(Path(path), args.requests or 3000)
        model = TinyModelConfig()
        workload, info = read_mooncake(path, block_size=16, vocab_size=model.vocab_size,
                                       max_model_len=args.max_model_len)
    if args.requests:
        workload = workload[:args.requests]
    rows = []
    for n in counts:
        cfg = RunConfig(num_schedulers=n, pool=args.pool, routing=args.routing,
                        num_blocks=args.blocks, max_model_len=args.max_model_len,
                        concurrency=args.concurrency, model=model, model_free=True,
                        cost=CostModel(0.0, 0.0))  # the KV-cache layer's own speed
        result = Runner(cfg, workload, log=lambda _: None).run()
        f = {k: v for k, v in result.figures.items()
             if k not in ("timeline", "per_scheduler", "processes", "pools_after")}
        f["trace"] = args.trace or "synthetic"
        print(json.dumps(f), flush=True)
        rows.append(f)
        if result.problems:
            print(f"problems: {result.problems}", file=sys.stderr)
            return 1
    header = ["schedulers", "pool", "requests", "wall s", "requests/s", "hit rate",
              "evictions", "lock wait s"]
    body = [[str(f["schedulers"]), f["pool"], f"{f['requests']:,}", f"{f['wall_s']:.2f}",
             f"{f['requests_per_s']:,.0f}", f"{f['prefix_hit_rate']:.1%}",
             f"{f['evictions']:,}", f"{f['lock_wait_s']:.2f}"] for f in rows]
    widths = [max(len(r[k]) for r in [header, *body]) for k in range(len(header))]
    print(f"\nshmkv replay, {rows[0]['trace']} ({info.requests:,} requests in the trace, "
          f"{args.blocks:,} blocks, {args.routing}):")
    for r in [header, *body]:
        print("  " + "  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
