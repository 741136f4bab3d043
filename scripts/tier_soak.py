"""The vLLM offload tier's long soak: the randomized interleavings of
``tests/crash/test_vllm_tier_interleavings.py`` (replicas killed, started and stopped,
cleanup, one tier object removed or replaced, the whole tier removed, an earlier release's
replica on the same name), seed after seed, for as long as asked. Every load is
byte-checked. Prints a JSON line per seed, a progress line, and a table at the end; exit 1
if any seed saw wrong KV, an unexpected exit, a stuck process or a leftover object.

    python scripts/tier_soak.py --hours 2                # seeds 0, 1, 2, ... for two hours
    python scripts/tier_soak.py --seeds 5 --seconds 120  # five seeds of two minutes

Run it from the checkout's root with vLLM's KV layer installed
(``bash benchmarks/vllm_peer/install.sh``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hours", type=float, default=0.0,
                        help="run seeds until this many hours have passed")
    parser.add_argument("--seeds", type=int, default=0, help="run this many seeds")
    parser.add_argument("--seconds", type=float, default=300.0,
                        help="seconds of interleavings per seed (default 300)")
    parser.add_argument("--first-seed", type=int, default=0)
    args = parser.parse_args()
    if args.hours <= 0 and args.seeds <= 0:
        parser.error("give --hours or --seeds")
    from tests.crash.test_vllm_tier_interleavings import ENDED, run_interleavings

    end = time.monotonic() + args.hours * 3600 if args.hours > 0 else float("inf")
    rows, seed, failed = [], args.first_seed, 0
    began = time.monotonic()
    while time.monotonic() < end and (args.seeds <= 0 or len(rows) < args.seeds):
        with tempfile.TemporaryDirectory() as tmp:
            r = run_interleavings(seed=seed, seconds=args.seconds, tmp=Path(tmp))
        bad_exits = [(n, c) for n, c in r["ended"] if any(x not in ENDED for x in c)]
        earlier_wrong = sum(e["wrong"] for e in r["earlier"])
        ok = (r["wrong"] == 0 and earlier_wrong == 0 and not bad_exits and not r["stuck"]
              and not r["left"])
        failed += not ok
        row = {"seed": seed, "ok": ok, "steps": r["steps"], "loads_checked": r["checked"],
               "wrong": r["wrong"], "stores": r["stores"], "replicas": r["replicas"],
               "actions": sum(r["actions"].values()),
               "earlier_loads_checked": sum(e["checked"] for e in r["earlier"]),
               "earlier_wrong": earlier_wrong, "bad_exits": bad_exits, "stuck": r["stuck"],
               "left": r["left"]}
        rows.append(row)
        print(json.dumps(row), flush=True)
        elapsed = time.monotonic() - began
        print(f"[{len(rows)} seeds, {elapsed / 60:.1f} min] seed {seed}: "
              f"{'ok' if ok else 'FAILED'}", file=sys.stderr, flush=True)
        seed += 1
    total = {k: sum(r[k] for r in rows) for k in ("steps", "loads_checked", "wrong",
                                                  "stores", "replicas", "actions",
                                                  "earlier_loads_checked", "earlier_wrong")}
    minutes = (time.monotonic() - began) / 60
    print(f"\ntier soak: {len(rows)} seeds in {minutes:.1f} min, {failed} failed")
    print(f"  {'steps':>10} {'loads checked':>14} {'wrong':>6} {'stores':>8} "
          f"{'replicas':>9} {'driver actions':>15} {'earlier-release loads':>22}")
    print(f"  {total['steps']:>10,} {total['loads_checked']:>14,} {total['wrong']:>6} "
          f"{total['stores']:>8,} {total['replicas']:>9,} {total['actions']:>15,} "
          f"{total['earlier_loads_checked']:>22,}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
