"""Publishing a step's block tables and computing its slot mappings, for a 256-request batch:
shmkv's shared tables against building the same tensors from Python lists as vLLM's worker
does, in the same run, on the same steps.

- shmkv: the scheduler writes the rows into its ``SharedBlockTables`` (``add_rows`` for new
  requests, ``append_rows`` for new blocks: one vectorised call per step) and ``commit``s;
  the rank builds token indices and positions (``batch_token_indices``) and the slot
  mappings. Nothing about block ids crosses a process boundary: the rank reads the segment.
  ``shmkv`` computes the slots straight from the shared tables
  (``SharedBlockTables.compute_slot_mappings``); ``shmkv-snapshot`` first copies the batch's
  rows (``read``, what the model runner does, as it also needs the rows for attention).
- vLLM: the block ids travel as Python lists (the scheduler output's ``new_block_ids``),
  msgpack-encoded and decoded as a transport would; the worker appends them to vLLM
  0.33.0's own ``MultiGroupBlockTable`` (CPU numpy buffers), then computes token indices,
  positions and slot mappings with numpy the way vLLM's CPU path did (vLLM 0.33.0 computes
  slots in a Triton kernel, which needs a GPU) and wraps them as torch tensors.
  ``vllm-no-transport`` is the same without the encode/decode.

Both sides produce identical int64 slot mappings (checked). Scenarios: ``prefill`` (256 new
requests of 64 tokens: every row written) and ``decode`` (256 running requests with about
1,000 tokens of context, one token each; a new block for the 1 in 16 crossing a block
boundary). Prints one JSON line per (scenario, impl), then a table; ratios are vLLM's time
over shmkv's (above 1: shmkv is faster). Median of ``--repeats`` runs of ``--steps`` steps.

    python benchmarks/bench_block_table.py [--reqs 256] [--groups 1] [--steps 50]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import msgspec  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from shmkv.ranks.block_table import (  # noqa: E402
    SharedBlockTables,
    batch_token_indices,
)

BS = 16
MAX_MODEL_LEN = 4096


def make_steps(scenario: str, reqs: int, groups: int, steps: int, seed: int = 0):
    """Per step: (rows, new block ids per row and group, replace?, tokens per row, start
    positions). Block ids are arbitrary but distinct-looking ints."""
    rng = np.random.default_rng(seed)
    out = []
    context = 1000 + rng.integers(0, 64, reqs)
    for s in range(steps):
        rows = list(range(reqs))
        if scenario == "prefill":
            n = 64
            ids = [[rng.integers(1, 1 << 20, n // BS).tolist() for _ in range(groups)]
                   for _ in rows]
            out.append((rows, ids, True, [n] * reqs, [0] * reqs))
        else:
            pos = context + s
            ids = [[rng.integers(1, 1 << 20, 1).tolist() if p % BS == 0 else []
                    for _ in range(groups)] for p in pos.tolist()]
            out.append((rows, ids, s == 0, [1] * reqs, pos.tolist()))
    return out


def prefill_rows(tables_or_vllm, scenario, reqs, groups, is_shmkv):
    """Decode steps start from rows that already hold ~1,000 tokens of blocks."""
    if scenario != "decode":
        return
    rng = np.random.default_rng(1)
    for r in range(reqs):
        ids = tuple(rng.integers(1, 1 << 20, 1000 // BS).tolist() for _ in range(groups))
        tables_or_vllm.add_row(ids, r)
    if is_shmkv:
        tables_or_vllm.commit(0)


def run_shmkv(name, steps, groups, reqs, scenario, check, snapshot=False):
    tables = SharedBlockTables.create(name, max_num_reqs=reqs, max_model_len=MAX_MODEL_LEN,
                                      block_sizes=[BS] * groups)
    rank = SharedBlockTables.attach(name)
    try:
        prefill_rows(tables, scenario, reqs, groups, True)
        publish_ns = rank_ns = 0
        step_no = 1
        slots = None
        grown = []
        for rows, ids, _, _, _ in steps:
            keep = [i for i, row_ids in enumerate(ids) if any(row_ids)]
            grown.append(([ids[i] for i in keep], [rows[i] for i in keep]))
        for rows, ids, replace, counts, starts in steps:
            t0 = time.perf_counter_ns()
            if replace:
                tables.add_rows(ids, rows)
            else:  # only the rows that got a block (the scheduler knows which)
                tables.append_rows(*grown[step_no - 1])
            tables.commit(step_no)
            t1 = time.perf_counter_ns()
            req_indices, positions = batch_token_indices(counts, starts)
            if snapshot:  # a copy of the batch's rows, then slots from it
                snap = rank.read(rows, min_step=step_no)
                slots = snap.slot_mappings(req_indices, positions)
            else:  # slots straight from the shared tables, under the seqlock
                _, slots = rank.compute_slot_mappings(rows, req_indices, positions,
                                                      min_step=step_no)
            t2 = time.perf_counter_ns()
            publish_ns += t1 - t0
            rank_ns += t2 - t1
            step_no += 1
        if check is not None:
            check.append([s.clone() for s in slots])
        return publish_ns, rank_ns
    finally:
        rank.close()
        tables.close()
        SharedBlockTables.unlink(name)


def run_vllm(steps, groups, reqs, scenario, transport, check):
    from vllm.v1.worker.block_table import MultiGroupBlockTable

    width = -(-MAX_MODEL_LEN // BS)
    bt = MultiGroupBlockTable(reqs, 1 << 17, False, torch.device("cpu"), [BS] * groups,
                              [width] * groups)
    prefill_rows(bt, scenario, reqs, groups, False)
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(list[list[list[int]]])
    publish_ns = rank_ns = 0
    slots = None
    for rows, ids, replace, counts, starts in steps:
        t0 = time.perf_counter_ns()
        wire = enc.encode(ids) if transport else None  # the scheduler output's block ids
        t1 = time.perf_counter_ns()
        new_ids = dec.decode(wire) if transport else ids
        for row, row_ids in zip(rows, new_ids, strict=True):
            if replace:
                bt.add_row(tuple(row_ids), row)
            elif any(row_ids):
                bt.append_row(tuple(row_ids), row)
        # vLLM's CPU-side batch bookkeeping and slot mapping (pre-Triton formula).
        num_scheduled = np.asarray(counts, dtype=np.int32)
        req_indices = np.repeat(np.arange(len(rows), dtype=np.int32), num_scheduled)
        cu = np.cumsum(num_scheduled)
        arange = np.arange(cu[-1]) - np.repeat(cu - num_scheduled, num_scheduled)
        positions = np.asarray(starts, dtype=np.int64)[req_indices] + arange
        slots = []
        for g in range(groups):
            table = bt[g].get_numpy_array()
            flat = req_indices * table.shape[1] + positions // BS
            block_numbers = table.ravel()[flat]
            slots.append(torch.from_numpy(block_numbers.astype(np.int64) * BS + positions % BS))
        t2 = time.perf_counter_ns()
        publish_ns += t1 - t0
        rank_ns += t2 - t1
    if check is not None:
        check.append(slots)
    return publish_ns, rank_ns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reqs", type=int, default=256)
    ap.add_argument("--groups", type=int, default=1)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--scenarios", default="prefill,decode")
    ap.add_argument("--no-vllm", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    try:
        import vllm.v1.worker.block_table  # noqa: F401
        have_vllm = not args.no_vllm
    except ImportError:
        have_vllm = False
    rows_out = []
    for scenario in args.scenarios.split(","):
        steps = make_steps(scenario, args.reqs, args.groups, args.steps)
        impls = ["shmkv", "shmkv-snapshot"] + (["vllm", "vllm-no-transport"] if have_vllm
                                               else [])
        times: dict[str, list[tuple[int, int]]] = {i: [] for i in impls}
        for rep in range(args.repeats):
            check: list = [] if rep == 0 else None
            for impl in impls:  # interleaved, so machine noise hits all alike
                if impl.startswith("shmkv"):
                    name = f"bench-bt-{os.getpid()}-{uuid.uuid4().hex[:8]}"
                    times[impl].append(run_shmkv(name, steps, args.groups, args.reqs,
                                                 scenario, check, impl == "shmkv-snapshot"))
                else:
                    times[impl].append(run_vllm(steps, args.groups, args.reqs, scenario,
                                                impl == "vllm", check))
            if check is not None and len(check) > 1:
                for other in check[1:]:
                    assert all(torch.equal(a, b) for a, b in zip(check[0], other, strict=True)), \
                        "slot mappings differ between implementations"
        for impl in impls:
            pub = statistics.median(p for p, _ in times[impl]) / args.steps / 1e3
            rank = statistics.median(r for _, r in times[impl]) / args.steps / 1e3
            tot = statistics.median(p + r for p, r in times[impl]) / args.steps / 1e3
            row = {"bench": "block_table", "scenario": scenario, "impl": impl, "reqs": args.reqs,
                       "groups": args.groups, "block_size": BS,
                       "tokens": sum(steps[0][3]), "publish_us": round(pub, 1),
                       "rank_us": round(rank, 1), "step_us": round(tot, 1)}
            rows_out.append(row)
            print(json.dumps(row), flush=True)
    print()
    print("| scenario | impl | tokens | publish us | rank us | step us | vLLM/shmkv |")
    print("|---|---|---:|---:|---:|---:|---:|")
    base = {r["scenario"]: r["step_us"] for r in rows_out if r["impl"] == "shmkv"}
    for r in rows_out:
        ratio = base[r["scenario"]] and r["step_us"] / base[r["scenario"]]
        print(f"| {r['scenario']} | {r['impl']} | {r['tokens']:,} | {r['publish_us']:,.1f} | "
              f"{r['rank_us']:,.1f} | {r['step_us']:,.1f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
