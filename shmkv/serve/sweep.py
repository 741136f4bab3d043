"""The capacity sweep of ``shmkv run`` / ``shmkv replay`` (``--blocks 2048,8192,32768``):
every configuration (pool and routing) at every capacity on one workload, one table, the
infinite-cache bound, a plot of hit rate against capacity and the same figures as JSON.

The configurations are ``--compare``'s (:func:`configurations`): the one asked for
(``--pool``, ``--routing``), then private pools with each router users run in front of
replicas (SGLang's cache-aware router, llm-d's scorers) and with round-robin (for ``--pool
private``: the shared pool with ``SHARED_ROUTING`` and the other private routers). Each row is one
:class:`~shmkv.serve.runner.Runner` run; the bound (:func:`bound_for`) is what an infinite
cache would hit with the requests in trace order, computed from the trace (from the first
run's prompts when conversations resend their history, as those include generated tokens).
"""

from __future__ import annotations

import dataclasses
import json

from shmkv.serve.trace import infinite_cache_bound

__all__ = ["PRIVATE_ROUTINGS", "ROW_FIELDS", "SHARED_ROUTING", "bound_for", "configurations",
           "plot_sweep", "row", "sweep_json", "sweep_table"]

ROW_FIELDS = ("pool", "routing", "schedulers", "num_blocks", "blocks_per_pool",
              "kv_cache_groups", "blocks_per_group", "block_size",
              "model_free", "requests", "requests_total", "prompt_tokens",
              "prefill_tokens_saved", "prefix_hit_rate", "evictions", "preemptions",
              "ttft_steps_mean", "ttft_steps_p50", "ttft_steps_p99", "wall_s",
              "requests_per_s", "lock_wait_s")


# The shared pool's routing in a comparison: prefix-aware, which on a shared pool follows
# the pool's event log (who computed what; every scheduler hits it anyway) and balances
# load; measured against least-loaded and round-robin on a shared pool in docs/serving.md
# ("Against the routers users run"): its TTFT p99 was the lowest or near it on every
# workload there.
SHARED_ROUTING = "prefix-aware"
# Private pools are compared with the routers users run, and with round-robin.
PRIVATE_ROUTINGS = ("sglang-cache-aware", "llm-d-scorer", "round-robin")


def configurations(pool: str, routing: str) -> list[tuple[str, str]]:
    """``--compare``'s runs: the one asked for, then the others to compare it with."""
    others = [("private", r) for r in PRIVATE_ROUTINGS]
    if pool == "private":
        others = [("shared", SHARED_ROUTING)] + others
    return [(pool, routing)] + [c for c in others if c != (pool, routing)]


def bound_for(workload, block_size: int, records: dict | None = None) -> dict:
    """The infinite-cache bound of ``workload`` (trace order). Without conversations the
    prompts are the trace's; with them, ``records`` (a run's ``RequestRecord`` by id) give
    each turn's prompt as sent (history included) and its output."""
    if not any(t.conversation for t in workload):
        return infinite_cache_bound(((t.prompt_token_ids, None, t.cache_salt)
                                     for t in workload), block_size)
    if records is None:
        raise ValueError("a workload with conversations needs a run's records for its bound")
    items = []
    for t in workload:
        rec = records.get(t.request_id)
        if rec is None or rec.result is None:
            continue
        out = list(rec.result.output_token_ids)
        items.append((rec.prompt_token_ids, rec.prompt_token_ids + out[:-1], t.cache_salt))
    return infinite_cache_bound(items, block_size)


def row(figures: dict, bound: dict | None = None) -> dict:
    """One configuration at one capacity: the figures a sweep keeps."""
    out = {k: figures.get(k) for k in ROW_FIELDS}
    if bound is not None:
        out["infinite_cache_hit_rate"] = bound["prefix_hit_rate"]
    return out


def _int(n) -> str:
    return f"{int(n):,}"


def sweep_table(rows: list[dict], bound: dict) -> str:
    """One line per configuration and capacity, then the bound."""
    groups = rows[0].get("kv_cache_groups") or 1
    header = ["pool, routing", "blocks (per group)" if groups > 1 else "blocks", "hit rate",
              "prefill tokens saved", "evictions", "steps to 1st token (mean / p99)", "wall s"]
    body = [[f"{r['pool']}, {r['routing']}", _int(r["num_blocks"]) + (
                f" ({_int(r['num_blocks'] // groups)})" if groups > 1 else ""),
             f"{r['prefix_hit_rate']:.1%}",
             f"{_int(r['prefill_tokens_saved'])} of {_int(r['prompt_tokens'])}",
             _int(r["evictions"]), f"{r['ttft_steps_mean']:.1f} / {r['ttft_steps_p99']}",
             f"{r['wall_s']:.1f}"] for r in rows]
    body.append(["infinite cache (bound)", "inf", f"{bound['prefix_hit_rate']:.1%}",
                 f"{_int(bound['prefill_tokens_saved'])} of {_int(bound['prompt_tokens'])}",
                 "0", "", ""])
    widths = [max(len(r[k]) for r in [header, *body]) for k in range(len(header))]
    first = rows[0]
    lines = [f"capacity sweep: {first['schedulers']} schedulers, {first['block_size']}-token "
             "blocks, blocks in all (split evenly between private pools)"
             + (f"; {groups} KV-cache groups: every cached prompt block takes one pool "
                f"block in each, so each group gets 1/{groups} of the blocks (in brackets)"
                if groups > 1 else "") + ":"]
    for r in [header, *body]:
        lines.append("  " + "  ".join(c.ljust(w) if k == 0 else c.rjust(w)
                                      for k, (c, w) in enumerate(zip(r, widths, strict=True))))
    return "\n".join(lines)


def sweep_json(rows: list[dict], bound: dict, trace: dict | None, path: str) -> None:
    """``{"runs": [one object per configuration and capacity], "infinite_cache_bound":
    {...}, "trace": {...}}``."""
    with open(path, "w") as out:
        json.dump({"runs": rows, "infinite_cache_bound": bound, "trace": trace}, out,
                  indent=1)
        out.write("\n")


def plot_sweep(rows: list[dict], bound: dict, path: str) -> None:
    """Hit rate against capacity (log x), one line per configuration, the bound dashed.
    Raises :class:`shmkv.plot.PlotUnavailable` without matplotlib."""
    from shmkv.plot import draw_lines, figure, save

    series: dict[str, tuple[list, list]] = {}
    for r in rows:
        xs, ys = series.setdefault(f"{r['pool']}, {r['routing']}", ([], []))
        xs.append(r["num_blocks"])
        ys.append(100 * r["prefix_hit_rate"])
    caps = sorted({r["num_blocks"] for r in rows})
    first = rows[0]
    fig, (ax,) = figure(title=f"prefix hit rate against capacity: {first['schedulers']} "
                        f"schedulers, {first['block_size']}-token blocks")
    top = max([100 * bound["prefix_hit_rate"]] + [y for _, ys in series.values() for y in ys])
    draw_lines(ax, series, x_label="KV-cache blocks in all", y_label="prefix hit rate (%)",
               x_ticks=caps, log_x=len(caps) > 1, y_lim=(0, min(100.0, top * 1.2 + 2)))
    for k, line in enumerate(ax.get_lines()):  # lines that coincide stay told apart
        line.set_marker("osD^v<>"[k % 7])
        line.set_markersize(9 - 2 * (k % 3))
    ax.axhline(100 * bound["prefix_hit_rate"], linestyle="--", color="black", linewidth=1.5,
               label="infinite cache (bound)")
    ax.legend(loc="best", fontsize="small", framealpha=0.9)
    save(fig, path)


def with_capacity(cfg, pool: str, routing: str, num_blocks: int):
    """``cfg`` for one row of the sweep."""
    return dataclasses.replace(cfg, pool=pool, routing=routing, num_blocks=num_blocks,
                               kill_one=False)
