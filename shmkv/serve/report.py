"""The figures of a ``shmkv run``: one dict (the ``--json`` file), a readable report and a
PNG of hit rate and pool usage over time.

Definitions (vLLM's ``PrefixCacheStats`` counts the same way):

- ``prompt_tokens``: tokens of every finished request's prompt at its first scheduling
  (a conversation turn's prompt includes the history it resends);
- ``prefill_tokens_saved``: of those, the tokens its prefix-cache hit covered (the model
  did not compute them); ``prefix_hit_rate`` = saved / prompt tokens;
- ``kv_cache_groups`` / ``blocks_per_group``: the model's KV-cache groups (the tiny model
  has two: full attention and a sliding window) and the blocks each gets of a pool: every
  cached block of a prompt takes one pool block in each group, so a pool of N blocks
  caches as much as an LRU cache of N / groups blocks would;
- ``evictions``: prefix-cache keys that allocations evicted; ``lock_wait_s``: time the
  schedulers spent waiting for their pool's lock, ``lock_hold_s`` holding it, and
  ``lock_wait_share`` = lock_wait_s / (schedulers x wall_s);
- ``peak_blocks_held`` (per scheduler): the most blocks its running requests held at once,
  as its ``SchedulerStats`` (a few a second) saw it; ``ttft_*`` / ``latency_*``: seconds
  from a request's arrival at its scheduler to its first token / its last;
  ``queued_*``: seconds from a request's arrival at its scheduler to its first scheduling
  (waiting in the scheduler's queue); ``ttft_steps_*``: the first-token wait counted in its
  scheduler's steps. In a replay every time is the cost model's (``cost_model``:
  ``prefill_ms_per_token``, ``decode_ms_per_step``, shmkv/serve/replay.py), which steps
  take by sleeping, plus the KV-cache layer's own time;
- ``duplicate_prefill_tokens``: prompt tokens a request computed that another request cached
  while it computed them (two requests computing one prefix at once: on a shared pool two
  schedulers, on a private pool two requests of one scheduler), a lower bound;
- ``imbalance``: the most requests one scheduler served / the fewest (None when one served
  none); ``requests_per_scheduler`` lists them;
- ``tokens_checked`` / ``token_mismatches``: generated tokens compared with the model's
  no-cache greedy reference, and how many differed (counting from the first wrong token
  of each request). ``exact_tokens``: whether a mismatch fails the run (float32) or is
  only reported (bfloat16, where a greedy choice between near-equal logits may flip):
  ``divergences`` lists the first wrong token of (up to 5) requests, its position among
  the generated tokens and ``logit_gap``, the reference's logit of its own choice there
  minus its logit of the served token; ``max_logit_gap`` is the largest of all requests';
- ``device``, ``kv``, ``dtype``: where the ranks computed and the KV cache lived
  (``shmkv/serve/device.py``); ``prefill_tokens_computed`` = prompt tokens - saved;
  ``peak_device_memory_bytes``: the most GPU memory in use (every process) the samples
  saw, None on the CPU.
"""

from __future__ import annotations

import json

__all__ = ["COMPARE_HINT", "comparison_output", "comparison_text", "figures", "intro_text",
           "plot_timeline", "pool_text", "report_text", "run_line", "run_summary",
           "timeline_title", "write_json"]


def figures(runner, records: dict, stats: dict, timeline: list[dict], pool_checks: list[dict],
            *, wall_s: float, startup_s: float) -> dict:
    cfg = runner.cfg
    n = cfg.num_schedulers
    finished = [r for r in records.values() if r.result is not None]
    per = [_scheduler_figures(runner, i, finished, stats.get(i)) for i in range(n)]
    prompt = sum(r.result.num_prompt_tokens for r in finished)
    saved = sum(r.result.num_cached_tokens for r in finished)
    checked = [r for r in finished if r.checked is not None]
    tokens_checked = sum(r.checked for r in checked)
    mismatches = sum(r.checked - r.mismatch for r in checked if r.mismatch >= 0)
    generated = sum(len(r.result.output_token_ids) for r in finished)
    killed = getattr(runner, "killed_at", None)
    ttft = sorted(r.result.first_token_s for r in finished)
    ttft_steps = sorted(r.result.first_token_steps for r in finished)
    queued = sorted(r.result.queued_s for r in finished)
    served = [p["requests"] for p in per]
    cost = getattr(cfg, "cost", None)
    latency = sorted(r.result.finished_s for r in finished)
    groups = len(cfg.model.group_windows()) if cfg.model is not None else 1
    return {
        "pool": cfg.pool,
        "model_free": cfg.model_free,
        "schedulers": n,
        "routing": cfg.routing,
        "num_blocks": cfg.num_blocks,
        "blocks_per_pool": cfg.num_blocks // (n if cfg.pool == "private" else 1),
        "kv_cache_groups": groups,
        "blocks_per_group": cfg.num_blocks // (n if cfg.pool == "private" else 1) // groups,
        "block_size": cfg.block_size,
        "requests": len(finished),
        "requests_total": len(records) if records else len(runner.workload),
        "prompt_tokens": prompt,
        "prefill_tokens_saved": saved,
        "prefix_hit_rate": saved / prompt if prompt else 0.0,
        "generated_tokens": generated,
        "prefill_tokens_computed": prompt - saved,
        "tokens_checked": tokens_checked,
        "token_mismatches": mismatches,
        "requests_mismatched": sum(1 for r in checked if r.mismatch >= 0),
        **_device_figures(cfg, checked, timeline),
        "requests_failed": sum(1 for r in records.values() if r.failed),
        "requests_resent": sum(1 for r in finished if r.num_sends > 1),
        "wall_s": wall_s,
        "startup_s": startup_s,
        "stop_s": getattr(runner, "stop_s", 0.0),
        "requests_per_s": len(finished) / wall_s if wall_s > 0 else 0.0,
        "ttft_p50_s": _quantile(ttft, 0.5),
        "ttft_p99_s": _quantile(ttft, 0.99),
        "ttft_mean_s": sum(ttft) / len(ttft) if ttft else 0.0,
        "queued_p50_s": _quantile(queued, 0.5),
        "queued_p99_s": _quantile(queued, 0.99),
        "latency_p50_s": _quantile(latency, 0.5),
        "requests_per_scheduler": served,
        "imbalance": max(served) / min(served) if served and min(served) > 0 else None,
        "cost_model": ({"prefill_ms_per_token": cost.prefill_ms_per_token,
                        "decode_ms_per_step": cost.decode_ms_per_step}
                       if cfg.model_free and cost is not None else None),
        "ttft_steps_mean": sum(ttft_steps) / len(ttft_steps) if ttft_steps else 0.0,
        "ttft_steps_p50": _quantile(ttft_steps, 0.5),
        "ttft_steps_p99": _quantile(ttft_steps, 0.99),
        "peak_pool_usage": max((p["pool_usage"] for p in timeline), default=0.0),
        "evictions": sum(p["evictions"] for p in per),
        "duplicate_prefill_tokens": sum(p["duplicate_prefill_tokens"] for p in per),
        "preemptions": sum(p["preemptions"] for p in per),
        "lock_wait_s": sum(p["lock_wait_s"] for p in per),
        "lock_hold_s": sum(p["lock_hold_s"] for p in per),
        # The schedulers' time waiting for the pool lock, of all their wall time.
        "lock_wait_share": (sum(p["lock_wait_s"] for p in per) / (n * wall_s)
                            if wall_s > 0 else 0.0),
        "killed_scheduler": None if killed is None else {
            "scheduler": min(runner.killed), "after_s": killed[0],
            "after_requests": killed[1]},
        "restart": getattr(cfg, "restart", ""),
        "restarts": list(getattr(runner, "restarts", [])),
        "prefix_cache_reset": getattr(runner, "prefix_cache_reset", None),
        "pools_after": pool_checks,
        "pool_valid": all(p["invariants_ok"] and not p["blocks_in_use_after"]
                          for p in pool_checks),
        "problems": list(runner.problems),
        "notes": list(runner.notes),
        "per_scheduler": per,
        "timeline": timeline,
        "model": runner.model_dict if hasattr(runner, "model_dict") else None,
        "processes": {p.name: p.pid for p in runner.schedulers + runner.ranks},
    }


def _device_figures(cfg, checked: list, timeline: list[dict]) -> dict:
    """Where the run computed, the token check's strictness and its divergences."""
    run = cfg.run_device
    wrong = sorted((r for r in checked if r.mismatch >= 0), key=lambda r: r.mismatch)
    gaps = [r.logit_gap for r in wrong if r.logit_gap is not None]
    memory = [p["device_memory_bytes"] for p in timeline if p.get("device_memory_bytes")]
    return {
        "device": run.device if run else "cpu",
        "kv": run.kv if run else "device",
        "dtype": run.dtype if run else "float32",
        "exact_tokens": run.exact_tokens if run else True,
        "divergences": [{"request_id": r.trace.request_id, "position": r.mismatch,
                         "logit_gap": r.logit_gap} for r in wrong[:5]],
        "max_logit_gap": max(gaps) if gaps else None,
        "peak_device_memory_bytes": max(memory) if memory else None,
    }


def _scheduler_figures(runner, i: int, finished: list, st) -> dict:
    """Scheduler ``i``'s line of ``per_scheduler``; ``st``: its last ``SchedulerStats``."""
    mine = [r for r in finished if r.result.scheduler == i]
    prompt = sum(r.result.num_prompt_tokens for r in mine)
    hit = sum(r.result.num_cached_tokens for r in mine)
    return {
        "scheduler": i,
        "alive_at_end": runner.schedulers[i].exitcode == 0 if runner.schedulers else False,
        "requests": len(mine),
        "prompt_tokens": prompt,
        "prefill_tokens_saved": hit,
        "prefix_hit_rate": hit / prompt if prompt else 0.0,
        "generated_tokens": sum(len(r.result.output_token_ids) for r in mine),
        "peak_blocks_held": runner.peak_blocks_held.get(i, 0),
        "steps": st.num_steps if st else 0,
        "preemptions": st.num_preemptions if st else 0,
        "evictions": st.num_evictions if st else 0,
        "duplicate_prefill_tokens": st.num_duplicate_tokens if st else 0,
        "lock_wait_s": st.lock_wait_s if st else 0.0,
        "lock_hold_s": st.lock_hold_s if st else 0.0,
        "lock_acquired": st.num_lock_acquired if st else 0,
        "model_s": st.model_s if st else 0.0,
    }


def _divergence_text(f: dict) -> str:
    """The device line, and in bfloat16 where the greedy tokens left the reference's."""
    if "device" not in f:
        return ""
    text = f"\n  device             {f['device']}, KV cache {f['kv']} placement, {f['dtype']}"
    if f["device"].startswith("cuda") and f.get("peak_device_memory_bytes"):
        text += f", GPU memory in use at most {f['peak_device_memory_bytes'] / 2**30:.1f} GiB"
    if not f["exact_tokens"] and f["divergences"]:
        first = f["divergences"][0]
        text += (f"\n  {f['dtype']} flips     {f['requests_mismatched']} requests left the "
                 f"reference's greedy tokens (reported, not failed); the earliest at generated "
                 f"token {first['position']} of {first['request_id']}; largest logit gap "
                 f"there {f['max_logit_gap']:.3g}")
    return text


def _quantile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def _int(n: float) -> str:
    return f"{int(n):,}"


def _command(f: dict) -> str:
    return "shmkv replay" if f.get("model_free") else "shmkv run"


def pool_text(f: dict) -> str:
    """"one shared pool of 512 blocks" / "4 private pools of 128 blocks"."""
    return (f"one shared pool of {_int(f['num_blocks'])} blocks" if f["pool"] == "shared"
            else f"{f['schedulers']} private pools of {_int(f['blocks_per_pool'])} blocks")


def groups_text(f: dict) -> str:
    """How many blocks each KV-cache group gets, in words."""
    g = f.get("kv_cache_groups", 1)
    if g == 1:
        return f"{f['block_size']} tokens each"
    each = "pool" if f["pool"] == "shared" else "private pool"
    return (f"{f['block_size']} tokens each; {g} KV-cache groups, so each prompt block "
            f"takes {g}: {_int(f['blocks_per_group'])} per group in each {each}")


def cost_text(f: dict) -> str:
    """The replay's cost model, in words."""
    c = f.get("cost_model")
    if not c:
        return ""
    return (f"{c['prefill_ms_per_token']:g} ms per prefill token (not hit in the cache), "
            f"{c['decode_ms_per_step']:g} ms per step: a replay's times are this model's "
            "(--prefill-ms-per-token, --decode-ms-per-step)")


def imbalance_text(f: dict) -> str:
    imb = f.get("imbalance")
    return "-" if imb is None and not f.get("requests_per_scheduler") else (
        "inf" if imb is None else f"{imb:.2f}x")


def lock_wait_text(f: dict) -> str:
    """Why the lock wait is what it is (a replay's is high on a shared pool)."""
    if not f.get("model_free"):
        return ""
    if f["pool"] != "shared":
        return ("each private pool has a lock of its own: no scheduler waits for another")
    return ("a replay has no model step between the KV-cache calls, so its schedulers do "
            "little else than take the one pool lock and queue for it; with a model "
            "step between them (shmkv run) the share is a small one")


def report_text(f: dict) -> str:
    lines = [
        f"{_command(f)}: {f['schedulers']} schedulers, {pool_text(f)} ({groups_text(f)}), "
        f"routing {f['routing']}",
        f"  requests           {f['requests']} of {f['requests_total']} finished in "
        f"{f['wall_s']:.1f} s ({f['requests_per_s']:.1f}/s; start-up {f['startup_s']:.1f} s)"
        + (f", {f['requests_failed']} not served" if f["requests_failed"] else ""),
        f"  prompt tokens      {_int(f['prompt_tokens'])}",
        f"  prefix hit rate    {f['prefix_hit_rate']:.1%}  ({_int(f['prefill_tokens_saved'])} "
        "prefill tokens saved)",
        (f"  generated tokens   {_int(f['generated_tokens'])}; model-free replay (no model, "
         "tokens not checked)" if f.get("model_free") else
         f"  generated tokens   {_int(f['generated_tokens'])}; checked against the no-cache "
         f"reference: {_int(f['tokens_checked'])}, mismatches {f['token_mismatches']}"
         + _divergence_text(f)),
        f"  latency            first token p50 {f['ttft_p50_s'] * 1e3:.0f} ms, p99 "
        f"{f['ttft_p99_s'] * 1e3:.0f} ms; queued p50 {f.get('queued_p50_s', 0.0) * 1e3:.0f} "
        f"ms, p99 {f.get('queued_p99_s', 0.0) * 1e3:.0f} ms; request p50 "
        f"{f['latency_p50_s'] * 1e3:.0f} ms; steps waited for the first token mean "
        f"{f.get('ttft_steps_mean', 0.0):.1f}, p99 {f.get('ttft_steps_p99', 0)}"
        + (f"\n  cost model         {cost_text(f)}" if f.get("cost_model") else ""),
        f"  balance            requests per scheduler "
        f"{'/'.join(str(n) for n in f.get('requests_per_scheduler', []))}: "
        f"{imbalance_text(f)} (most / fewest)",
        f"  pool               peak {f['peak_pool_usage']:.0%} in use, {_int(f['evictions'])} "
        f"evictions, {f['preemptions']} preemptions, "
        + (f"{_int(f['duplicate_prefill_tokens'])} prompt tokens computed twice (cached by "
           "another request meanwhile), " if "duplicate_prefill_tokens" in f else "")
        + "lock wait "
        f"{f['lock_wait_s'] * 1e3:.1f} ms in all ({f.get('lock_wait_share', 0.0):.1%} of the "
        f"schedulers' {f['schedulers'] * f['wall_s']:.1f} s; held "
        f"{f.get('lock_hold_s', 0.0) * 1e3:.1f} ms)",
    ]
    if lock_wait_text(f):
        lines.append(f"  lock wait          {lock_wait_text(f)}")
    if f.get("trace"):
        lines.insert(1, f"  trace              {f['trace']['summary']}")
    if f["killed_scheduler"]:
        k = f["killed_scheduler"]
        lines.append(f"  --kill-one         scheduler-{k['scheduler']} killed at "
                     f"{k['after_s']:.1f} s (after {k['after_requests']} requests); "
                     f"{f['requests_resent']} requests sent again to the others")
    for r in f.get("restarts", []):
        back = (f", serving again at {r['serving_again_s']:.2f} s"
                if "serving_again_s" in r else ", never served again")
        lines.append(f"  restart            scheduler-{r['scheduler']} killed at "
                     f"{r['killed_s']:.2f} s (after {r['after_requests']} requests){back}"
                     + ("; its private pool emptied" if f["pool"] == "private" else
                        "; the shared pool kept the cache"))
    valid = "valid" if f["pool_valid"] else "NOT valid"
    reset = {True: "; drained, prefix cache reset", False: "; prefix cache reset FAILED",
             None: ""}[f["prefix_cache_reset"]]
    lines.append(f"  after the run      pool {valid}: invariants "
                 + ", ".join("OK" if p["invariants_ok"] else "BROKEN" for p in f["pools_after"])
                 + f"; blocks in use {sum(p['blocks_in_use_after'] for p in f['pools_after'])}"
                 + reset)
    header = ["scheduler", "requests", "prompt tok", "hit rate", "saved", "peak blocks",
              "steps", "preempt", "evictions", "lock wait"]
    rows = [[str(p["scheduler"]) + ("" if p["alive_at_end"] else " (died)"),
             str(p["requests"]), _int(p["prompt_tokens"]), f"{p['prefix_hit_rate']:.1%}",
             _int(p["prefill_tokens_saved"]), str(p["peak_blocks_held"]), str(p["steps"]),
             str(p["preemptions"]),
             _int(p["evictions"]), f"{p['lock_wait_s'] * 1e3:.1f} ms"]
            for p in f["per_scheduler"]]
    widths = [max(len(r[k]) for r in [header, *rows]) for k in range(len(header))]
    lines.append("")
    for r in [header, *rows]:
        lines.append("  " + "  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))
    if f["problems"] or f["notes"]:
        lines.append("")
        lines.extend(f"  note: {p}" for p in f["notes"])
        lines.extend(f"  problem: {p}" for p in f["problems"])
    return "\n".join(lines)


def write_json(f: dict, path: str) -> None:
    with open(path, "w") as out:
        json.dump(f, out, indent=1)
        out.write("\n")


def _label(f: dict) -> str:
    return f"{f['pool']}, {f['routing']}" + (f", {f['schedulers']} schedulers"
                                               if f["schedulers"] != 4 else "")


def intro_text(f: dict, configs: list[tuple[str, str]]) -> str:
    """What a comparison is about to run, from the keys of a run's figures it has already
    (``model_free``, ``requests_total``, ``schedulers``, ``num_blocks``, ``kv_cache_groups``,
    ``trace``) and its ``(pool, routing)`` configurations (one line each follows)."""
    trace = f.get("trace")
    what = (f"the trace {trace['summary']}" if trace else
            f"the built-in chat workload ({f['requests_total']} requests)")
    who = ("no model (the KV-cache layer alone)" if f.get("model_free") else
           f"each with a rank process running the {f.get('model_name') or 'tiny'} model")
    g = f.get("kv_cache_groups", 1)
    per_group = f" ({_int(f['num_blocks'] // g)} per KV-cache group)" if g > 1 else ""
    return _wrap(f"{_command(f)}: {what}; {f['schedulers']} schedulers, {who}; "
                 f"{_int(f['num_blocks'])} blocks in all{per_group}; {len(configs)} runs:",
                 "")


def _wrap(text: str, indent: str) -> str:
    """``text`` in lines of at most 100 characters, the later ones indented."""
    import textwrap

    return textwrap.fill(text, width=100, subsequent_indent=indent, break_on_hyphens=False)


def run_line(f: dict, k: int, n: int) -> str:
    """One run of several, on one line: ``run 2 of 3: 4 private pools of 128 blocks,
    round-robin: 224/224 requests, hit rate 33.2%, 3.7 s``."""
    failed = f", {f['requests_failed']} not served" if f["requests_failed"] else ""
    return (f"  run {k} of {n}: {pool_text(f)}, {f['routing']}: {f['requests']}/"
            f"{f['requests_total']} requests{failed}, hit rate {f['prefix_hit_rate']:.1%}, "
            f"{f['wall_s']:.1f} s")


def run_summary(f: dict, k: int, n: int) -> str:
    """:func:`run_line` and, under it, the run's first three notes and problems (if any),
    saying how many more there are."""
    lines = [run_line(f, k, n)]
    for kind, items in (("note", f.get("notes", [])), ("problem", f["problems"])):
        lines += [f"    {kind}: {p}" for p in items[:3]]
        if len(items) > 3:
            lines.append(f"    ... and {len(items) - 3} more {kind}(s) (--verbose or "
                         "--json: all)")
    return "\n".join(lines)


COMPARE_HINT = "  (--verbose: every run's full report; --no-compare: one configuration)"


def comparison_output(f: dict, outputs: list[str]) -> str:
    """What ``shmkv run`` / ``shmkv replay`` print (without ``--verbose``) for the figures
    of a comparison (``f``, its ``--json``: the first run's figures with ``compare``, the
    others'), followed by ``outputs`` (the lines naming the JSON and plot files). The
    command prints the same lines as its runs end; docs/ samples are rendered with it."""
    runs = [f, *f.get("compare", [])]
    configs = [(r["pool"], r["routing"]) for r in runs]
    lines = [intro_text(f, configs)]
    lines += [run_summary(r, k, len(runs)) for k, r in enumerate(runs, 1)]
    lines += ["", comparison_text(runs), *outputs, COMPARE_HINT]
    return "\n".join(lines) + "\n"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:,.0f}"


def best_baseline(runs: list[dict]) -> dict | None:
    """The best baseline: of the private-pool runs with a router users run for prefix reuse
    (``BASELINE_ROUTERS``: SGLang's cache-aware router and llm-d's scorer), the one with the
    lowest TTFT p99 (then the highest hit rate). Round-robin and least-loaded runs are no
    baselines, whatever their figures. None if no baseline ran."""
    from shmkv.serve.routing import BASELINE_ROUTERS

    base = [f for f in runs if f["pool"] == "private" and f["routing"] in BASELINE_ROUTERS
            and f["requests"]]
    if not base:
        return None
    return min(base, key=lambda f: (f["ttft_p99_s"], -f["prefix_hit_rate"]))


# Two TTFT p99s within this fraction of each other are a tie: one run's p99 rests on its two
# or three slowest requests, and the same configuration's p99 moves by more than this from
# one run to the next on a quiet machine (far more on a busy one).
TTFT_TIE_BAND = 0.10


def ttft_text(t_s: float, t_b: float) -> str:
    """The shared run's TTFT p99 (``t_s``) against the baseline's (``t_b``): ``1.50x higher:
    a loss``, ``2.00x lower: a gain``, and within :data:`TTFT_TIE_BAND` a tie, saying so."""
    if not (t_b > 0 and t_s > 0):
        return "not measured"
    ratio = t_s / t_b
    way = (f"{1 / ratio:.2f}x lower" if ratio < 1 else f"{ratio:.2f}x higher" if ratio > 1
           else "equal")
    if max(ratio, 1 / ratio) <= 1 + TTFT_TIE_BAND:
        return f"{way}, within the {TTFT_TIE_BAND:.0%} taken as noise: a tie"
    return f"{way}: {'a gain' if ratio < 1 else 'a loss'}"


def _and(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def gain_text(shared: dict, base: dict, runs: list[dict] | None = None) -> str:
    """The shared run against the best baseline (:func:`best_baseline` of ``runs``), in hit
    rate and TTFT p99, whichever way they go, naming the rule that chose it: the baselines
    that ran, and the private-pool routers that are no baselines."""
    from shmkv.serve.routing import BASELINE_ROUTERS

    runs = [base] if runs is None else runs
    private = list(dict.fromkeys(f["routing"] for f in runs if f["pool"] == "private"))
    baselines = [r for r in private if r in BASELINE_ROUTERS] or [base["routing"]]
    others = [r for r in private if r not in BASELINE_ROUTERS]
    rule = (f"the lowest TTFT p99 of the baselines {_and(baselines)}" if len(baselines) > 1
            else "the only baseline that ran")
    if others:
        rule += f"; {_and(others)} {'is' if len(others) == 1 else 'are'} no baseline"
    d_hit = 100 * (shared["prefix_hit_rate"] - base["prefix_hit_rate"])
    t_s, t_b = shared["ttft_p99_s"], base["ttft_p99_s"]
    hit_how = ("a gain" if d_hit > 0.05 else "a loss" if d_hit < -0.05 else "no change")
    return (f"  shared pool ({shared['routing']}) against the best baseline router, private "
            f"pools with {base['routing']} ({rule}): "
            f"hit rate {shared['prefix_hit_rate']:.1%} against {base['prefix_hit_rate']:.1%} "
            f"({d_hit:+.1f} points, {hit_how}); TTFT p99 {_ms(t_s)} ms against {_ms(t_b)} ms "
            f"({ttft_text(t_s, t_b)})")


def comparison_text(runs: list[dict]) -> str:
    """One line per run (hit rate, prefill tokens saved, time to the first token, queueing,
    balance, evictions, checks), then the shared pool against the best baseline router
    (:func:`best_baseline`) in hit rate and TTFT p99, and whether everything checked."""
    first = runs[0]
    header = ["pool, routing", "hit rate", "prefill tokens saved", "TTFT p50/p99 ms",
              "queued p99", "imbalance", "evictions", "mismatches", "wall s"]
    body = [[_label(f), f"{f['prefix_hit_rate']:.1%}",
             f"{_int(f['prefill_tokens_saved'])} of {_int(f['prompt_tokens'])}",
             f"{_ms(f.get('ttft_p50_s'))} / {_ms(f.get('ttft_p99_s'))}",  # ms
             _ms(f.get("queued_p99_s")), imbalance_text(f),
             _int(f["evictions"]),
             "-" if f.get("model_free") else str(f["token_mismatches"]), f"{f['wall_s']:.1f}"]
            for f in runs]
    widths = [max(len(r[k]) for r in [header, *body]) for k in range(len(header))]
    g = first.get("kv_cache_groups", 1)
    per_group = (f" ({_int(first['num_blocks'] // g)} per KV-cache group)" if g > 1 else "")
    lines = [f"same workload, {first['num_blocks']:,} blocks in all{per_group}, "
             f"{first['schedulers']} schedulers:"]
    for r in [header, *body]:
        lines.append("  " + "  ".join(c.ljust(w) if k == 0 else c.rjust(w)
                                      for k, (c, w) in enumerate(zip(r, widths, strict=True))))
    if first.get("cost_model"):
        lines.append(_wrap(f"  times: the replay's cost model, {cost_text(first)}", "    "))
    shared = next((f for f in runs if f["pool"] == "shared"), None)
    base = best_baseline(runs)
    if shared is not None and base is not None:
        lines.append(_wrap(gain_text(shared, base, runs), "    "))
    if not first.get("model_free"):
        checked = sum(f["tokens_checked"] for f in runs)
        wrong = sum(f["token_mismatches"] for f in runs)
        lines.append(f"  generated tokens checked against the model's no-cache reference: "
                     f"{_int(checked)}, {wrong} different")
    valid = all(f["pool_valid"] for f in runs)
    finished = all(f["requests"] == f["requests_total"] for f in runs)
    lines.append(f"  every request {'finished' if finished else 'did NOT finish'}; every "
                 f"pool {'valid' if valid else 'NOT valid'} after its run (invariants "
                 "checked, no block left in use)")
    return "\n".join(lines)


def timeline_title(runs: list[dict]) -> str:
    """The title of :func:`plot_timeline`'s chart: the command (run or replay) and what
    it compared."""
    first = runs[0]
    if len(runs) == 1:
        return (f"{_command(first)}: {first['pool']} pool, {first['schedulers']} schedulers, "
                f"{first['routing']} routing")
    return (f"{_command(first)}: shared and private pools, {first['schedulers']} schedulers, "
            f"{first['num_blocks']:,} blocks in all")


def plot_timeline(runs: dict | list[dict], path: str) -> None:
    """Hit rate (so far, solid) and pool usage (dashed) over the run, in percent; several
    runs (``--compare``) share the chart, one colour each. Raises
    :class:`shmkv.plot.PlotUnavailable` without matplotlib."""
    from shmkv.plot import draw_lines, figure, save

    runs = [runs] if isinstance(runs, dict) else runs
    fig, (ax,) = figure(title=timeline_title(runs))
    series = {}
    for f in runs:
        t = [p["t_s"] for p in f["timeline"]] or [0.0]
        hit = [100 * p["prefix_hit_rate"] for p in f["timeline"]] or [0.0]
        series["prefix hit rate (so far)" if len(runs) == 1 else f"hit rate: {_label(f)}"] = (
            t, hit)
    draw_lines(ax, series, x_label="time since the first request (s)",
               y_label="percent (%)", y_lim=(0, 105))
    for f, line in zip(runs, list(ax.get_lines()), strict=True):
        t = [p["t_s"] for p in f["timeline"]] or [0.0]
        use = [100 * p["pool_usage"] for p in f["timeline"]] or [0.0]
        color = "C1" if len(runs) == 1 else line.get_color()
        ax.plot(t, use, linestyle="--", linewidth=1.5, color=color,
                label="pool blocks in use" if len(runs) == 1 else f"in use: {_label(f)}")
    ax.legend(loc="best", fontsize="small", framealpha=0.9)
    save(fig, path)
