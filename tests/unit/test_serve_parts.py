"""The parts of ``shmkv run`` that live in one process: the workload and its JSONL format,
the front-end <-> scheduler messages, the routing policies and the scheduler's batching over
a real pool (with the rank's step replaced by a recorder: the model runs in the
multi-process tests)."""

from __future__ import annotations

import pytest

from shmkv import BlockPool, KVCacheManager
from shmkv.core.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from shmkv.errors import ProtocolError, ShmKVError, UsageError
from shmkv.messages import decode, encode
from shmkv.serve import messages as M
from shmkv.serve.routing import (
    LeastLoaded,
    PrefixAware,
    PrivatePoolsView,
    RoundRobin,
    SharedPoolView,
    make_router,
)
from shmkv.serve.scheduler import Scheduler
from shmkv.serve.workload import (
    ChatWorkloadConfig,
    TraceRequest,
    chat_workload,
    read_trace,
    write_trace,
)
from tests.conftest import unique_pool_name

# ---------------------------------------------------------------------------- workload


def test_chat_workload_shape():
    """Deterministic in its seed; conversations with several turns, tenants with their
    salts, system prompts shared by many conversations; turns of a conversation in order."""
    cfg = ChatWorkloadConfig(num_conversations=40, seed=3, vocab_size=97)
    w = chat_workload(cfg)
    assert w == chat_workload(cfg) and w != chat_workload(ChatWorkloadConfig(seed=4))
    assert {r.cache_salt for r in w} == {"tenant-a", "tenant-b", "tenant-c"}
    assert all(0 < t < 97 for r in w for t in r.prompt_token_ids)
    turns: dict[str, list[int]] = {}
    for r in w:
        turns.setdefault(r.conversation, []).append(int(r.request_id.split("-t")[1]))
    assert len(turns) == 40 and all(t == list(range(len(t))) for t in turns.values())
    assert max(len(t) for t in turns.values()) >= 3
    firsts = [tuple(r.prompt_token_ids[:cfg.system_prompt_tokens[0]])
              for r in w if r.request_id.endswith("-t0")]
    assert len(set(firsts)) <= cfg.num_system_prompts < len(firsts)


def test_trace_round_trip_and_errors(tmp_path):
    w = chat_workload(ChatWorkloadConfig(num_conversations=5))
    path = tmp_path / "t.jsonl"
    write_trace(path, w)
    assert read_trace(path) == w
    bad = tmp_path / "bad.jsonl"
    bad.write_text('# comment\n\n{"request_id": "a", "prompt_token_ids": [1, 2]}\n'
                   '{"request_id": "b", "prompt_token_ids": [1], "colour": 3}\n')
    with pytest.raises(UsageError, match=r"bad.jsonl:4: .*colour"):
        read_trace(bad)
    bad.write_text('{"request_id": "a", "prompt_token_ids": [1, 200]}\n')
    with pytest.raises(UsageError, match=r":1: token id 200 is outside"):
        read_trace(bad, vocab_size=97)
    bad.write_text('{"request_id": "a", "prompt_token_ids": [1]}\n' * 2)
    with pytest.raises(UsageError, match="repeated"):
        read_trace(bad)
    bad.write_text('{"request_id": "a", "prompt_token_ids": [1], "max_tokens": 0}\n')
    with pytest.raises(UsageError, match="max_tokens"):
        read_trace(bad)


# ---------------------------------------------------------------------------- messages


def test_serve_messages_round_trip_and_refusals():
    msgs = [
        M.AttachScheduler(scheduler=1, config=M.SchedulerConfig(
            pool_name="p", model={"vocab_size": 97}, max_num_seqs=4,
            max_num_batched_tokens=64, max_model_len=256, block_tables_name="bt")),
        M.SchedulerAttached(scheduler=1, pid=5, pool_slot=2, num_gpu_blocks=64),
        M.GenerateTokens(request_id="r", prompt_token_ids=[1, 2], max_tokens=3,
                         cache_salt="s"),
        M.TokensGenerated(request_id="r", scheduler=1, output_token_ids=[4], num_prompt_tokens=2,
                          num_cached_tokens=0, num_preemptions=0, first_token_s=0.1,
                          finished_s=0.2),
        M.DrainScheduler(), M.SchedulerDrained(scheduler=0, num_requests_finished=3),
        M.ResetPrefixCache(), M.PrefixCacheReset(scheduler=0, success=True),
        M.MessageRejected(sender="scheduler-0", reason="x", request_id="r"),
    ]
    for msg in msgs:
        assert decode(encode(msg)) == msg
    with pytest.raises(ProtocolError, match="not a shmkv message frame"):
        decode(b"\x00garbage")
    with pytest.raises(ProtocolError):
        decode(encode(M.DrainScheduler()).replace(b"DrainScheduler", b"DrainSchedulez"))


# ---------------------------------------------------------------------------- routing


def test_round_robin_and_least_loaded():
    rr = RoundRobin()
    assert [rr.route([1], None, [0, 2, 3], {}) for _ in range(4)] == [0, 2, 3, 0]
    ll = LeastLoaded()
    assert ll.route([1], None, [0, 1, 2], {0: 3, 1: 1, 2: 2}) == 1
    assert {ll.route([1], None, [0, 1], {0: 0, 1: 0}) for _ in range(4)} == {0, 1}
    with pytest.raises(UsageError):
        rr.route([1], None, [], {})
    with pytest.raises(UsageError, match="unknown routing policy"):
        make_router("random")


def _cache_prompt(pool: BlockPool, tokens: list[int], salt: str | None = None) -> None:
    from shmkv import Request

    req = Request("x", tokens, block_hasher=pool.make_block_hasher(), cache_salt=salt)
    n = len(req.block_hashes)
    blocks = pool.get_new_blocks(n)
    pool.cache_full_blocks(req, blocks, 0, n, pool.hash_block_size, 0)
    pool.free_blocks(reversed(blocks))


def test_prefix_aware_on_private_pools():
    """The scheduler whose own pool holds the longest prefix wins, unless it is too loaded;
    a salt makes the same tokens another prefix."""
    pools = [BlockPool.create(unique_pool_name(), 32) for _ in range(3)]
    try:
        prompt = list(range(1, 70))
        _cache_prompt(pools[1], prompt[:32])
        _cache_prompt(pools[2], prompt[:64])
        router = PrefixAware(PrivatePoolsView(pools), balance_slack=2)
        assert router.view.holders(prompt, None, [0, 1, 2]) == {1: 2, 2: 4}
        assert router.route(prompt, None, [0, 1, 2], {}) == 2
        assert router.route(prompt, None, [0, 1], {}) == 1  # 2 is gone
        assert router.route(prompt, None, [0, 1, 2], {0: 0, 1: 0, 2: 3}) == 0  # too loaded
        assert router.route(prompt, "tenant-x", [0, 1, 2], {0: 1, 1: 0, 2: 1}) == 1  # no hit
    finally:
        for p in pools:
            name = p.pool_name
            p.close()
            BlockPool.unlink(name)


def test_shared_pool_view_follows_the_event_log():
    """Ownership of a shared pool's blocks comes from the global event log: who stored the
    deepest cached block of the prompt; an evicted key is forgotten."""
    name = unique_pool_name()
    front = BlockPool.create(name, 16, enable_kv_cache_events=True, label="front-end")
    s0 = BlockPool.attach(name, label="scheduler-0")
    s3 = BlockPool.attach(name, label="scheduler-3")
    try:
        view = SharedPoolView(front)
        prompt = list(range(1, 70))
        _cache_prompt(s0, prompt[:32])
        assert view.holders(prompt, None, [0, 3]) == {0: 2}
        _cache_prompt(s3, prompt[:64])  # blocks 3-4 are new; 1-2 keep scheduler 0's keys
        assert view.holders(prompt, None, [0, 3]) == {3: 4}
        assert view.holders(prompt, None, [0]) == {}  # its holder is not live
        assert view.holders(prompt, "salt", [0, 3]) == {}
        s0.get_new_blocks(15)  # evicts every cached key
        assert view.holders(prompt, None, [0, 3]) == {}
    finally:
        for p in (s3, s0, front):
            p.close()
        BlockPool.unlink(name)


# ---------------------------------------------------------------------------- scheduler


class Recorder:
    """Stands in for the rank's step: records each batch and what the pool had cached
    when the step ran, and answers token ``7 + position`` for every request."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.batches = []
        self.cached_at_step = []

    def __call__(self, step, batch, block_ids):
        self.batches.append([(r.req_id, r.start_position, len(r.token_ids)) for r in batch])
        self.cached_at_step.append(len(self.pool.cached_block_hash_to_block))
        return [7 + r.start_position + len(r.token_ids) for r in batch]


@pytest.fixture
def manager():
    name = unique_pool_name()
    pool = BlockPool.create(name, 24, enable_kv_cache_events=True)
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype="float32")
    config = KVCacheConfig(24, [], [KVCacheGroupSpec(["layers.0"], spec)])
    kvm = KVCacheManager(config, max_model_len=256, scheduler_block_size=16,
                         hash_block_size=16, enable_kv_cache_events=True, block_pool=pool)
    yield pool, kvm
    pool.close()
    BlockPool.unlink(name)


def _scheduler(pool, kvm, **kwargs):
    rec = Recorder(pool)
    kwargs.setdefault("max_num_seqs", 4)
    kwargs.setdefault("max_num_batched_tokens", 64)
    s = Scheduler(kvm, pool.make_block_hasher(), rec, max_model_len=256, **kwargs)
    return s, rec


def _run(s: Scheduler, limit: int = 200) -> list:
    done = []
    for _ in range(limit):
        if not s.has_work:
            return done
        done.extend(s.step())
    raise AssertionError("the scheduler did not finish")


def test_scheduler_chunks_decodes_and_publishes_after_the_step(manager):
    """A 100-token prompt is prefilled in chunks of the token budget, then decodes one
    token a step; its blocks are cached only after the step that computed them; the second
    request with the same prefix hits what the first computed."""
    pool, kvm = manager
    s, rec = _scheduler(pool, kvm)
    prompt = list(range(1, 101))
    s.add_request("a", prompt, max_tokens=3)
    [a] = _run(s)
    assert rec.batches[:2] == [[("a", 0, 64)], [("a", 64, 36)]]
    assert rec.batches[2:] == [[("a", 100, 1)], [("a", 101, 1)]]
    assert rec.cached_at_step[:2] == [0, 4]  # step 1's 4 full blocks appear after step 1
    assert list(a.request.output_token_ids) == [107, 108, 109]
    assert a.num_cached_tokens == 0
    s.add_request("b", prompt + [5, 6], max_tokens=1)
    [b] = _run(s)
    assert b.num_cached_tokens == 96  # 6 full blocks of a's prompt (its last one is partial)
    assert s.counters.num_prompt_tokens == 202 and s.counters.num_cached_tokens == 96
    assert pool.get_num_free_blocks() == 23  # everything freed (and still cached)
    pool.check_invariants()


def test_scheduler_preempts_when_the_pool_is_full(manager):
    """Four requests of 5 blocks each and room for 23 blocks: decode growth preempts the
    newest, which is computed again later (hitting its own cached blocks) and every
    request finishes with the tokens it would have had."""
    pool, kvm = manager
    s, rec = _scheduler(pool, kvm, max_num_batched_tokens=256)
    for i in range(4):
        s.add_request(f"r{i}", [i + 1] * 80, max_tokens=20)
    done = _run(s, 400)
    assert sorted(d.request_id for d in done) == ["r0", "r1", "r2", "r3"]
    assert s.counters.num_preemptions > 0
    for d in done:
        assert list(d.request.output_token_ids) == [7 + 80 + k for k in range(20)]
    assert pool.get_num_free_blocks() == 23
    pool.check_invariants()


def test_scheduler_refuses_what_cannot_fit(manager):
    pool, kvm = manager
    s, _ = _scheduler(pool, kvm)
    with pytest.raises(ShmKVError, match="exceed max_model_len"):
        s.add_request("x", [1] * 250, max_tokens=10)
    with pytest.raises(ShmKVError, match="needs a prompt"):
        s.add_request("y", [], max_tokens=1)
    assert not s.has_work
    assert TraceRequest(request_id="z", prompt_token_ids=[1]).max_tokens == 16


def test_serve_modules_import_one_another_without_cycles():
    """shmkv/serve/'s modules form layers: no import cycle among them, counting the
    imports inside functions (engine is below scheduler; child_setup lives in engine)."""
    import ast
    from pathlib import Path

    serve = Path(__file__).resolve().parents[2] / "shmkv" / "serve"
    names = {p.stem for p in serve.glob("*.py")} - {"__init__"}
    graph = {}
    for name in names:
        deps = set()
        for node in ast.walk(ast.parse((serve / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                parts = node.module.split(".")
                if parts[:2] == ["shmkv", "serve"]:
                    deps.update(parts[2:3] or [a.name for a in node.names])
            elif isinstance(node, ast.Import):
                deps.update(a.name.split(".")[2] for a in node.names
                            if a.name.startswith("shmkv.serve."))
        graph[name] = (deps & names) - {name}

    def reaches(start: str, target: str, seen: set[str]) -> bool:
        return any(d == target or (d not in seen and not seen.add(d)
                                   and reaches(d, target, seen)) for d in graph[start])

    assert [m for m in sorted(names) if reaches(m, m, set())] == []
    assert "scheduler" in graph["runner"] and "engine" in graph["scheduler"]
    assert "scheduler" not in graph["engine"]


# ---------------------------------------------------------------------------- cost model


def test_replay_cost_model_charges_prefill_tokens_and_steps():
    """A step costs decode_ms_per_step plus prefill_ms_per_token per token that is not a
    decode token (a prompt chunk, or a preempted request's tokens again); an empty step
    costs nothing; negative costs are refused."""
    from shmkv import Request
    from shmkv.serve.replay import CostModel
    from shmkv.serve.scheduler import ServingRequest

    def sr(n_prompt: int, n_out: int) -> ServingRequest:
        req = Request(f"r{n_prompt}-{n_out}", list(range(1, n_prompt + 1)))
        for k in range(n_out):
            req.append_output_token_ids(k + 1)
        return ServingRequest(req, 8, 0.0)

    cost = CostModel(prefill_ms_per_token=0.1, decode_ms_per_step=2.0)
    batch = [(sr(100, 0), 100), (sr(10, 3), 1), (sr(20, 2), 1)]
    assert cost.step_s(batch) == pytest.approx((2.0 + 0.1 * 100) / 1e3)
    assert cost.step_s([(sr(30, 2), 32)]) == pytest.approx((2.0 + 3.2) / 1e3)  # recompute
    assert cost.step_s([]) == 0.0
    with pytest.raises(UsageError, match="--decode-ms-per-step"):
        CostModel(0.1, -1.0).validate()


def test_hot_prompts_workload_is_skewed_and_arrives_at_its_rate():
    """Single requests on Zipf-popular system prompts (the first the most used), arrivals a
    Poisson process at the rate asked; deterministic in its seed; bad settings refused."""
    from collections import Counter

    from shmkv.serve.workload import HotPromptsConfig, hot_prompts_workload

    cfg = HotPromptsConfig(num_requests=2000, num_system_prompts=16, request_rate=100.0)
    w = hot_prompts_workload(cfg)
    assert w == hot_prompts_workload(cfg) and len(w) == 2000
    assert all(r.conversation is None and r.cache_salt is None for r in w)
    popular = Counter(int(r.request_id.split("-p")[1]) for r in w)
    # Zipf s=1 over 16: prompt 0 is drawn 1/H(16) = 29.6% of the time, prompt 15 1.8%
    assert 0.25 < popular[0] / 2000 < 0.34 and popular[15] < popular[0] / 8
    same = [r for r in w if r.request_id.endswith("-p0")]
    head = len(same[0].prompt_token_ids) - 40  # at least the system prompt's 96 tokens
    assert all(r.prompt_token_ids[:head] == same[0].prompt_token_ids[:head] for r in same)
    times = [r.arrival_s for r in w]
    assert times == sorted(times) and times[0] == 0.0
    assert 18.0 < times[-1] < 22.0  # 1999 gaps of 1/100 s on average
    with pytest.raises(UsageError, match="--request-rate"):
        hot_prompts_workload(HotPromptsConfig(request_rate=0.0))
    with pytest.raises(UsageError, match="--zipf"):
        hot_prompts_workload(HotPromptsConfig(zipf_s=-1.0))


def test_scheduler_counts_prompt_tokens_computed_twice(manager):
    """Two requests of one 49-token prompt admitted in one step both compute its three full
    blocks (neither could hit the other's yet): the second publishes 48 tokens another
    request has just cached, computed twice. A third, admitted later, hits them instead."""
    pool, kvm = manager
    s, _ = _scheduler(pool, kvm, max_num_batched_tokens=128)
    prompt = list(range(1, 50))
    s.add_request("a", prompt, 2)
    s.add_request("b", prompt, 2)
    _run(s)
    assert s.counters.num_duplicate_tokens == 48
    assert s.counters.num_cached_tokens == 0
    s.add_request("c", prompt, 2)
    _run(s)
    assert s.counters.num_duplicate_tokens == 48 and s.counters.num_cached_tokens == 48
