"""Real vLLM OpenAI servers (vLLM's CPU build) behind SGLang's router ``smg`` (from
``sglang-router``): private offload tiers against one shared tier, per routing policy, in the
moments a shared tier is for. Every configuration of a scenario serves the same arrivals.

Set-ups (tier x router):

- tiers: ``none``; ``private`` (one shmkv tier per server of 1/N the bytes, each its own
  ``shmkv_pool``: what vLLM's own offloading gives each replica, so a restarted server's
  private tier starts empty, as vLLM's in-process CPU cache would); ``shared`` (one tier of
  the same total bytes for every server);
- routers: ``smg`` with ``cache_aware`` (its defaults), ``cache_aware-bal`` (cache_aware
  with a balancing setting: ``--balance-abs-threshold 2 --balance-rel-threshold 1.2``, so it
  moves a request off a loaded server), ``power_of_two``, ``round_robin``; and ``vllm-dp``:
  one server with ``--data-parallel-size N`` and vLLM's own balancer, no smg (its ranks take
  one ``--kv-transfer-config``, so ``private`` is not expressible there: none and shared).

Scenarios, each its own arrivals: ``steady`` (Zipf over shared documents), ``surge`` (a hot
document takes 80% of the traffic in the middle third), ``restart`` (server 0 leaves the
router, stops, starts again and rejoins while traffic goes on), ``rolling`` (every server in
turn), ``scale-out`` (a server joins the router mid-run), ``small-tier`` (a working set
larger than the shared tier), ``multi-turn`` (LMBenchmark's synthetic multi-round QA shape:
users x rounds, one shared system prompt, a history that grows by each question and answer,
a round sent when the user's previous answer is in).

Measured per run, from vLLM itself: prompt tokens computed (prompt tokens minus the cached
ones of each streamed response's usage; per server from vLLM's
``prompt_tokens_by_source{source="local_compute"}``), time to first token p50/p99 (client
side, streaming), per-server load imbalance (max / mean of the requests each served), and
the generated text (greedy; every configuration must give the same text). Between runs the
servers stay up; their prefix caches and tiers are emptied (vLLM's dev endpoint
``/reset_prefix_cache?reset_external=true``) and a fresh ``smg`` is started.

    python benchmarks/bench_vllm_router.py [--quick | --all] [--scenarios a,b] [--servers 2]
        [--python PATH] [--plot FILE] [--json FILE]

By default (32 runs: 14 to 26 minutes on a 2-core machine other jobs shared, most of it
starting servers and restarting them) each scenario runs a subset (``DEFAULT_RUNS``):
private and shared tiers with cache_aware everywhere; round_robin too where stickiness is
the question (steady, surge, small-tier, multi-turn); cache_aware-bal and power_of_two in
steady and surge (power_of_two in steady only); the no-tier baseline in steady (cache_aware,
round_robin); vllm-dp on the shared tier in steady and multi-turn; restarts and scale-out
with cache_aware only. ``--all`` runs every tier with every router in every scenario (about
an hour on 2 cores). ``--quick``: the restart scenario with fewer requests, private and
shared tiers, round_robin (the engine test runs it; ``--quick --scenarios ...`` for others).
``--python``: vLLM's environment (default ``SHMKV_VLLM_PYTHON`` or
``.venv-vllm-cpu/bin/python``); ``smg`` is looked up beside it, then on PATH. Logs of every
server and router go to a temporary directory the first line names. Ctrl-C stops every
server and router and removes every tier the run made.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

BLOCK = 32
VOCAB = 1024  # word-level: "<unk>", "<s>", "</s>", then w3 .. w1023, one token each
ROUTERS = ("cache_aware", "cache_aware-bal", "power_of_two", "round_robin", "vllm-dp")
TIERS = ("none", "private", "shared")
SCENARIOS = ("steady", "surge", "restart", "rolling", "scale-out", "small-tier", "multi-turn")
BALANCED = ["--balance-abs-threshold", "2", "--balance-rel-threshold", "1.2"]
# The default subset: (tiers, routers) per scenario. --all: every tier x router.
# vllm-dp runs on the shared tier only by default (its set of servers takes a minute to
# start), and the restarts with cache_aware only (each restart takes about 30 s).
DEFAULT_RUNS = {
    "steady": (TIERS, ("cache_aware", "cache_aware-bal", "power_of_two", "round_robin",
                       "vllm-dp")),
    "surge": (("private", "shared"), ("cache_aware", "cache_aware-bal", "round_robin")),
    "restart": (("private", "shared"), ("cache_aware",)),
    "rolling": (("private", "shared"), ("cache_aware",)),
    "scale-out": (("private", "shared"), ("cache_aware",)),
    "small-tier": (("private", "shared"), ("cache_aware", "round_robin")),
    "multi-turn": (("private", "shared"), ("cache_aware", "round_robin", "vllm-dp")),
}
DEFAULT_NONE_ROUTERS = ("cache_aware", "round_robin")  # the no-tier baseline, steady only
DEFAULT_DP_TIERS = ("shared",)
# --quick (and the engine test): round_robin, which sends the restarted server its share
# of every prefix at once (cache_aware sends it mostly prefixes no server has seen).
QUICK_RUNS = dict.fromkeys(SCENARIOS, (("private", "shared"), ("round_robin",)))
# Per server, from its /metrics: requests served, prompt tokens, prompt tokens computed,
# prompt tokens loaded from the tier, seconds its processes waited for the tier's lock.
COUNTERS = ("requests", "prompt_tokens", "computed", "loaded", "lock_wait_s")


# -- the model (run inside vLLM's environment) ------------------------------------------

def make_model_with_tokenizer(path: str, hidden: int, layers: int) -> int:
    """A random Llama (``vllm_engine_driver.make_model``) and a word-level tokenizer, so a
    router can match prefixes on the request text: word ``w<i>`` is token ``i``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from vllm_engine_driver import make_model

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    params = make_model(path, hidden, layers, VOCAB)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)
    return params


# -- processes: everything started is registered and ended on the way out --------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(method: str, url: str, body: dict | None = None, timeout: float = 10.0):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read()
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


class Proc:
    """A process in its own session (its children die with it), logged to a file."""

    live: list[Proc] = []
    stopping = False  # set on the way out: a restart thread starts nothing more

    def __init__(self, argv: list[str], env: dict, log_path: Path) -> None:
        if Proc.stopping:
            raise RuntimeError("stopping")
        self.log_path = log_path
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=env, cwd=str(ROOT), start_new_session=True)
        Proc.live.append(self)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        self._log.flush()
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(line[:300] for line in text[-lines:])

    def stop(self, grace_s: float = 30.0) -> None:
        from tests.vllm_engine.engines import end_process_group

        if self.alive():
            try:
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(timeout=grace_s)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                pass
        end_process_group(self.proc, grace_s=5.0)
        if not self._log.closed:
            self._log.close()
        if self in Proc.live:
            Proc.live.remove(self)


class Server:
    """One vLLM OpenAI server (``dp`` data-parallel ranks), tier ``pool`` or none."""

    def __init__(self, ctx: Context, name: str, pool: str | None, tier_bytes: int,
                 dp: int = 1, index: int = 0) -> None:
        self.ctx, self.name, self.pool, self.tier_bytes, self.dp = ctx, name, pool, tier_bytes, dp
        # vLLM's CPU build gives a server's worker every core (one OpenMP thread each, bound,
        # spinning while it waits): two busy servers then fight over every core. Each
        # server (each DP rank) gets cores of its own, as on a real CPU node.
        cpus = sorted(os.sched_getaffinity(0))
        if dp > 1:
            self.cores = "|".join(str(cpus[r % len(cpus)]) for r in range(dp))
        else:
            self.cores = str(cpus[index % len(cpus)])
        self.proc: Proc | None = None
        self.port = 0
        self.offset: dict[str, float] = {}  # counters of earlier lives (restarts)
        self.restarted_at: dict[str, float] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        from tests.vllm_engine.engines import engine_env

        a = self.ctx.args
        self.port = _free_port()
        argv = [a.python, "-m", "vllm.entrypoints.openai.api_server", "--model",
                self.ctx.model, "--host", "127.0.0.1", "--port", str(self.port),
                "--dtype", "float32", "--block-size", str(BLOCK), "--max-model-len",
                str(a.max_model_len), "--num-gpu-blocks-override", str(a.gpu_blocks),
                "--enforce-eager", "--enable-prompt-tokens-details", "--max-num-seqs", "8",
                "--seed", "0", "--disable-uvicorn-access-log"]
        if a.gpu_memory_utilization:
            argv += ["--gpu-memory-utilization", str(a.gpu_memory_utilization)]
        if self.dp > 1:
            argv += ["--data-parallel-size", str(self.dp)]
        if self.pool:
            extra = {"spec_name": "SharedCPUOffloadingSpec", "spec_module_path": "shmkv.vllm",
                     "cpu_bytes_to_use": self.tier_bytes, "shmkv_pool": self.pool}
            argv += ["--kv-transfer-config", json.dumps(
                {"kv_connector": "SharedOffloadingConnector",
                 "kv_connector_module_path": "shmkv.vllm", "kv_role": "kv_both",
                 "kv_connector_extra_config": extra})]
            self.ctx.pools.add(self.pool)
        env = {**engine_env(), "VLLM_SERVER_DEV_MODE": "1",
               "VLLM_CPU_OMP_THREADS_BIND": self.cores}
        self.proc = Proc(argv, env, self.ctx.log_dir / f"{self.name}.log")

    def wait_healthy(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.proc.alive():
                raise RuntimeError(f"server {self.name} exited:\n{self.proc.log_tail()}")
            try:
                _http("GET", self.url + "/health", timeout=2)
                return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                time.sleep(0.5)
        raise TimeoutError(f"server {self.name} not healthy in {timeout_s:.0f} s")

    def warm_up(self) -> None:
        """One request no workload shares a prefix with (a server's first request pays
        one-time costs); not counted."""
        for _ in range(2):
            stream_one(self.url, self.ctx.model, " ".join(["w3"] * 64), 4)

    def metrics(self) -> dict[str, float]:
        """This life's counters, summed over ranks: requests, prompt tokens, computed."""
        text = _http("GET", self.url + "/metrics", timeout=10)
        out = {"requests": 0.0, "prompt_tokens": 0.0, "computed": 0.0, "running": 0.0,
               "loaded": 0.0, "lock_wait_s": 0.0}
        for line in text.splitlines():
            if line.startswith("vllm:request_success_total"):
                out["requests"] += float(line.rsplit(" ", 1)[1])
            elif line.startswith("vllm:prompt_tokens_total"):
                out["prompt_tokens"] += float(line.rsplit(" ", 1)[1])
            elif line.startswith("vllm:prompt_tokens_by_source_total") and \
                    'source="local_compute"' in line:
                out["computed"] += float(line.rsplit(" ", 1)[1])
            elif line.startswith("vllm:prompt_tokens_by_source_total") and \
                    'source="external_kv_transfer"' in line:
                out["loaded"] += float(line.rsplit(" ", 1)[1])
            elif line.startswith("shmkv_pool_lock_wait_seconds_total"):
                out["lock_wait_s"] += float(line.rsplit(" ", 1)[1])
            elif line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting{")):
                out["running"] += float(line.rsplit(" ", 1)[1])
        return out

    def per_rank(self) -> list[dict[str, float]]:
        """Requests and computed tokens per data-parallel rank (label ``engine``)."""
        text = _http("GET", self.url + "/metrics", timeout=10)
        ranks: dict[str, dict[str, float]] = {}
        for line in text.splitlines():
            if not line.startswith(("vllm:request_success_total",
                                    "vllm:prompt_tokens_by_source_total")):
                continue
            engine = line.split('engine="', 1)[1].split('"', 1)[0]
            r = ranks.setdefault(engine, {"requests": 0.0, "computed": 0.0})
            if line.startswith("vllm:request_success_total"):
                r["requests"] += float(line.rsplit(" ", 1)[1])
            elif 'source="local_compute"' in line:
                r["computed"] += float(line.rsplit(" ", 1)[1])
        return [ranks[k] for k in sorted(ranks)]

    def counters(self) -> dict[str, float]:
        now = self.metrics()
        return {k: now[k] + self.offset.get(k, 0.0) for k in COUNTERS}

    def wait_idle(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.metrics()["running"] > 0:
            time.sleep(0.2)

    def reset(self) -> None:
        """Empties vLLM's prefix cache and the tier (what no other process holds)."""
        self.wait_idle()
        for _ in range(50):
            got = _http("POST", self.url + "/reset_prefix_cache?reset_external=true",
                        timeout=30)
            if isinstance(got, dict) and got.get("success"):
                return
            time.sleep(0.2)
        print(f"    note: {self.name}'s prefix cache did not reset", file=sys.stderr)

    def restart(self) -> None:
        """Stops the server (SIGTERM), and starts it again; a private tier starts empty (it
        stands for vLLM's in-process CPU cache), the shared one stays."""
        time.sleep(1.0)  # a request the router sent just before the removal reaches vLLM
        self.wait_idle()
        self.offset = self.counters()
        self.proc.stop(grace_s=3.0)
        if self.ctx.tier == "private" and self.pool:
            self.ctx.unlink(self.pool)
        self.start()
        self.wait_healthy()
        self.warm_up()
        self.restarted_at = self.counters()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


class Router:
    """``smg launch`` over some servers; workers added and removed at run time."""

    def __init__(self, ctx: Context, policy: str, urls: list[str]) -> None:
        self.ctx = ctx
        self.port = _free_port()
        name = "cache_aware" if policy == "cache_aware-bal" else policy
        argv = [ctx.smg, "launch", "--host", "127.0.0.1", "--port", str(self.port),
                "--worker-urls", *urls, "--policy", name, "--log-level", "warn",
                "--request-timeout-secs", "600", "--prometheus-host", "127.0.0.1",
                "--prometheus-port", str(_free_port())]
        if policy == "cache_aware-bal":
            argv += BALANCED
        self.proc = Proc(argv, dict(os.environ), ctx.log_dir / f"smg-{policy}.log")
        self.wait_workers(len(urls))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def workers(self) -> list[dict]:
        got = _http("GET", self.url + "/workers", timeout=5)
        return got.get("workers", []) if isinstance(got, dict) else []

    def wait_workers(self, n: int, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.proc.alive():
                raise RuntimeError(f"smg exited:\n{self.proc.log_tail()}")
            try:
                if len(self.workers()) == n:
                    return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.2)
        raise TimeoutError(f"smg did not list {n} workers in {timeout_s:.0f} s")

    def add(self, url: str) -> None:
        n = len(self.workers())
        _http("POST", self.url + "/workers", {"url": url}, timeout=30)
        self.wait_workers(n + 1)

    def remove(self, url: str) -> None:
        n = len(self.workers())
        for w in self.workers():
            if w.get("url") == url:
                _http("DELETE", f"{self.url}/workers/{w.get('id') or w.get('worker_id')}",
                      timeout=30)
        self.wait_workers(n - 1)

    def stop(self) -> None:
        self.proc.stop(grace_s=5.0)


# -- workloads --------------------------------------------------------------------------

@dataclass
class Workload:
    """Open-loop requests (``t`` seconds after the start, text prompt) and events at request
    indices; or, when ``users`` is set, multi-round conversations."""
    name: str
    requests: list[dict] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)  # {"at", "back_by", "kind", "server"}
    users: list[dict] = field(default_factory=list)  # {"start", "system", "questions"}
    max_tokens: int = 8
    think_s: float = 0.3


def _words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(3, VOCAB)}" for _ in range(n))


def _zipf(rng: random.Random, n: int, s: float = 1.1):
    weights = [1.0 / (i + 1) ** s for i in range(n)]
    return lambda: rng.choices(range(n), weights)[0]


def make_workload(name: str, args, seed: int) -> Workload:
    rng = random.Random(f"{seed}-{name}")
    q = args.quick
    n_req = 36 if q else 48
    rate = args.rate
    if name == "multi-turn":
        users, rounds = (6, 3) if q else (12, 4)
        system = _words(rng, 192)
        return Workload(name, users=[
            {"start": u * 0.6, "system": system,
             "questions": [_words(rng, 48) for _ in range(rounds)]} for u in range(users)],
            max_tokens=16)
    # small-tier: 40 documents of 16 blocks under a flatter Zipf, so that the documents a
    # run touches (about 25: 400 blocks) overflow the shared tier (384 blocks by default)
    docs_n, doc_tokens, skew = (40, 512, 0.8) if name == "small-tier" else (20, 256, 1.1)
    docs = [_words(rng, doc_tokens) for _ in range(docs_n)]
    hot = _words(rng, doc_tokens)
    pick = _zipf(rng, docs_n, skew)
    if name in ("restart", "rolling"):
        n_req = int(n_req * (1.5 if name == "restart" else 2))
    t, reqs = 0.0, []
    for i in range(n_req):
        t += rng.expovariate(rate)
        in_surge = name == "surge" and n_req // 3 <= i < 2 * n_req // 3
        doc = hot if in_surge and rng.random() < 0.8 else docs[pick()]
        reqs.append({"id": i, "t": t, "prompt": doc + " " + _words(rng, 32)})
    w = Workload(name, reqs)
    if name == "restart":
        w.events = [{"at": n_req // 3, "back_by": n_req // 2, "kind": "restart", "server": 0}]
    elif name == "rolling":
        step = n_req // (args.servers + 1)
        w.events = [{"at": step * (s + 1) - step // 2, "back_by": step * (s + 1),
                     "kind": "restart", "server": s} for s in range(args.servers)]
    elif name == "scale-out":
        w.events = [{"at": n_req // 3, "back_by": n_req // 3, "kind": "add",
                     "server": args.servers}]
    return w


# -- the client ---------------------------------------------------------------------------

def stream_one(base_url: str, model: str, prompt: str, max_tokens: int) -> dict:
    """One streamed /v1/completions: time to first token, usage, text."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0.0, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    host, port = base_url.rsplit("/", 1)[1].split(":")
    start = time.perf_counter()
    first, text, usage, error = None, [], None, None
    attempts = 0
    for _ in range(3):
        attempts += 1
        first, text, usage = None, [], None
        conn = http.client.HTTPConnection(host, int(port), timeout=600)
        try:
            conn.request("POST", "/v1/completions", body,
                         {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                error = f"HTTP {resp.status}: {resp.read()[:200]!r}"
                time.sleep(0.5)
                continue
            while True:
                line = resp.readline()
                if not line:
                    break
                line = line.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices") or []:
                    if first is None:
                        first = time.perf_counter()
                    text.append(choice.get("text") or "")
                if chunk.get("usage"):
                    usage = chunk["usage"]
            if usage is not None:
                error = None
                break
            error = "no usage in the stream"
        except (OSError, http.client.HTTPException, ValueError) as e:
            error = repr(e)
            time.sleep(0.5)
        finally:
            conn.close()
    cached = int(((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    prompt_tokens = int((usage or {}).get("prompt_tokens") or 0)
    return {"ttft_s": None if first is None else first - start, "text": "".join(text),
            "prompt_tokens": prompt_tokens, "computed": prompt_tokens - cached,
            "error": error, "attempts": attempts}


def drive(ctx: Context, w: Workload, base_url: str, servers: list[Server],
          router: Router | None) -> tuple[list[dict], list[tuple[float, float, str]]]:
    """Sends the workload; returns the per-request records and the events' spans
    (start, end, label) on the run's clock."""
    records: dict = {}
    threads: list[threading.Thread] = []
    spans: list[tuple[float, float, str]] = []
    t0 = time.perf_counter()

    def one(key, prompt: str, sent: float):
        r = stream_one(base_url, ctx.model, prompt, w.max_tokens)
        r.update(key=key, sent_s=sent)
        records[key] = r
        return r

    if w.users:
        def user(u: int, spec: dict):
            time.sleep(spec["start"])
            history = spec["system"]
            for k, question in enumerate(spec["questions"]):
                ask = history + " " + question
                r = one(f"u{u}r{k}", ask, time.perf_counter() - t0)
                history = ask + " " + r["text"].strip()
                time.sleep(w.think_s)

        for u, spec in enumerate(w.users):
            th = threading.Thread(target=user, args=(u, spec), daemon=True)
            th.start()
            threads.append(th)
    else:
        shift, pending = 0.0, {}
        events = {e["at"]: e for e in w.events}
        backs = {e["back_by"]: e for e in w.events}
        for i, req in enumerate(w.requests):
            if i in backs and backs[i]["kind"] == "restart":
                th, began = pending.pop(backs[i]["server"])
                waited = time.perf_counter()
                th.join()
                shift += time.perf_counter() - waited
                spans.append((began, time.perf_counter() - t0,
                              f"server {backs[i]['server']} restarted"))
            if i in events:
                e, s = events[i], servers[events[i]["server"]]
                if e["kind"] == "add":
                    router.add(s.url)
                    spans.append((time.perf_counter() - t0,) * 2 + (f"server {e['server']} "
                                                                    "added",))
                else:
                    def restart(s=s):
                        router.remove(s.url)
                        s.restart()
                        router.add(s.url)
                    th = threading.Thread(target=restart, daemon=True)
                    th.start()
                    pending[e["server"]] = (th, time.perf_counter() - t0)
            delay = t0 + shift + req["t"] - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            th = threading.Thread(target=one, args=(req["id"], req["prompt"],
                                                    time.perf_counter() - t0), daemon=True)
            th.start()
            threads.append(th)
        for th, _ in pending.values():
            th.join()
    for th in threads:
        th.join()
    return [records[k] for k in sorted(records, key=str)], spans


# -- one set of servers per tier (and vllm-dp), runs over it -----------------------------

class Context:
    def __init__(self, args, model: str, log_dir: Path) -> None:
        self.args, self.model, self.log_dir = args, model, log_dir
        self.pools: set[str] = set()
        self.tier = "none"
        self.smg = args.smg

    def unlink(self, pool: str) -> None:
        from tests.vllm_engine.engines import engine_env

        subprocess.run([self.args.python, "-m", "shmkv", "unlink", pool], env=engine_env(),
                       capture_output=True, timeout=120)

    def start_set(self, tier: str, dp: bool, extra: bool) -> list[Server]:
        a = self.args
        self.tier = tier
        tag = uuid.uuid4().hex[:8]
        total = a.tier_mib << 20
        if dp:
            pool = f"bench-router-{tag}" if tier == "shared" else None
            servers = [Server(self, f"dp-{tier}", pool, total, dp=a.servers)]
        else:
            n = a.servers + (1 if extra else 0)
            servers = []
            for s in range(n):
                pool = {"none": None, "private": f"bench-router-{tag}-{s}",
                        "shared": f"bench-router-{tag}"}[tier]
                size = total // a.servers if tier == "private" else total
                servers.append(Server(self, f"{tier}-{s}", pool, size, index=s))
        try:
            for s in servers:
                s.start()
            for s in servers:
                s.wait_healthy()
                s.warm_up()
        except BaseException:
            self.stop_set(servers)
            raise
        return servers

    def stop_set(self, servers: list[Server]) -> None:
        for s in servers:
            s.stop()
        for pool in {s.pool for s in servers if s.pool}:
            self.unlink(pool)
            self.pools.discard(pool)

    def run(self, w: Workload, tier: str, router_name: str, servers: list[Server]) -> dict:
        for s in servers:
            s.reset()
            s.restarted_at = None
        active = servers[:self.args.servers] if router_name != "vllm-dp" else servers
        router = None
        if router_name != "vllm-dp":
            router = Router(self, router_name, [s.url for s in active])
            base = router.url
        else:
            base = servers[0].url
        try:
            before = [s.counters() for s in servers]
            ranks_before = servers[0].per_rank() if router_name == "vllm-dp" else None
            start = time.perf_counter()
            records, spans = drive(self, w, base, servers, router)
            wall = time.perf_counter() - start
            for s in servers:
                s.wait_idle()
            after = [s.counters() for s in servers]
            if router_name == "vllm-dp":
                ranks_after = servers[0].per_rank()
                per_server = [{k: a[k] - b[k] for k in ("requests", "computed")}
                              for a, b in zip(ranks_after, ranks_before, strict=False)]
            else:
                per_server = [{k: a[k] - b[k] for k in ("requests", "computed")}
                              for a, b in zip(after, before, strict=True)]
            restarted = [(s.counters()["computed"] - s.restarted_at["computed"],
                          s.counters()["prompt_tokens"] - s.restarted_at["prompt_tokens"])
                         for s in servers if s.restarted_at is not None]
        finally:
            if router is not None:
                router.stop()
        done = [r for r in records if r["error"] is None]
        ttfts = sorted(r["ttft_s"] for r in done if r["ttft_s"] is not None)
        loads = [p["requests"] for p in per_server]
        # the servers the router had: N, and the one a scale-out added (a server it never
        # had is not counted; one it had and sent nothing counts as 0)
        had = len(loads) if router_name == "vllm-dp" or any(
            e["kind"] == "add" for e in w.events) else self.args.servers
        busy = loads[:had] or [1]
        expected = len(w.requests) or sum(len(u["questions"]) for u in w.users)
        return {
            "scenario": w.name, "tier": tier, "router": router_name,
            "requests": expected, "completed": len(done),
            "errors": sorted({r["error"] for r in records if r["error"]})[:3],
            "prompt_tokens": sum(r["prompt_tokens"] for r in done),
            "prompt_tokens_computed": sum(r["computed"] for r in done),
            "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
            "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else None,
            "imbalance": max(loads) / statistics.mean(busy) if loads else None,
            "per_server_requests": [int(x) for x in loads],
            "per_server_computed": [int(p["computed"]) for p in per_server],
            "tier_loaded_tokens": int(sum(a["loaded"] - b["loaded"]
                                          for a, b in zip(after, before, strict=True))),
            "lock_wait_s": sum(a["lock_wait_s"] - b["lock_wait_s"]
                               for a, b in zip(after, before, strict=True)),
            "restarted_computed": int(sum(c for c, _ in restarted)) if restarted else None,
            "restarted_prompt_tokens": int(sum(p for _, p in restarted)) if restarted else None,
            "retried": sum(r["attempts"] > 1 for r in records),
            "wall_s": wall, "spans": spans,
            "ttft_series": [[round(r["sent_s"], 3), round(r["ttft_s"], 4), r["computed"],
                             r["prompt_tokens"], str(r["key"])] for r in done],
            "_texts": {r["key"]: r["text"] for r in records},
        }


# -- the plan, the report ---------------------------------------------------------------

def plan(args) -> list[tuple[str, str, str]]:
    """(scenario, tier, router) in the order the runs go: grouped by server set."""
    runs = []
    table = QUICK_RUNS if args.quick else DEFAULT_RUNS
    for scenario in args.scenarios:
        tiers, routers = (TIERS, ROUTERS) if args.all else table.get(scenario, ((), ()))
        tiers = [t for t in tiers if not args.tiers or t in args.tiers]
        routers = [r for r in routers if not args.routers or r in args.routers]
        for router in routers:
            if router == "vllm-dp" and (scenario in ("restart", "rolling", "scale-out")):
                continue  # no per-replica restart or scale-out for one DP server
            for tier in tiers:
                if router == "vllm-dp" and tier == "private":
                    continue  # one --kv-transfer-config for every rank: no private tiers
                if router == "vllm-dp" and not args.all and tier not in DEFAULT_DP_TIERS:
                    continue
                if tier == "none" and not (args.all or args.quick) and \
                        router not in DEFAULT_NONE_ROUTERS:
                    continue
                runs.append((scenario, tier, router))
    order = {("none", False): 0, ("private", False): 1, ("shared", False): 2,
             ("none", True): 3, ("shared", True): 4}
    return sorted(runs, key=lambda r: order[(r[1], r[2] == "vllm-dp")])


def verdict(private: float, shared: float, lower_is_better: bool = True,
            tie: float = 0.02) -> str:
    if private == shared or abs(private - shared) <= tie * max(private, shared):
        return "a tie"
    better = shared < private if lower_is_better else shared > private
    return "a gain" if better else "a loss"


def summarize(results: list[dict]) -> list[dict]:
    out = []
    for scenario in dict.fromkeys(r["scenario"] for r in results):
        rows = [r for r in results if r["scenario"] == scenario]
        priv = [r for r in rows if r["tier"] == "private"]
        shar = [r for r in rows if r["tier"] == "shared"]
        if not priv or not shar:
            continue
        bp = min(priv, key=lambda r: (r["prompt_tokens_computed"], r["ttft_p99_s"] or 0))
        bs = min(shar, key=lambda r: (r["prompt_tokens_computed"], r["ttft_p99_s"] or 0))
        s = {"scenario": scenario, "best_private": bp["router"], "best_shared": bs["router"],
             "computed_private": bp["prompt_tokens_computed"],
             "computed_shared": bs["prompt_tokens_computed"],
             "computed_verdict": verdict(bp["prompt_tokens_computed"],
                                         bs["prompt_tokens_computed"]),
             "ttft_p99_private_s": bp["ttft_p99_s"], "ttft_p99_shared_s": bs["ttft_p99_s"],
             "ttft_p99_verdict": verdict(bp["ttft_p99_s"], bs["ttft_p99_s"], tie=0.10)}
        rp = [r for r in priv if r["restarted_computed"] is not None]
        rs = [r for r in shar if r["restarted_computed"] is not None]
        if rp and rs:
            s["restarted_computed_private"] = min(r["restarted_computed"] for r in rp)
            s["restarted_computed_shared"] = min(r["restarted_computed"] for r in rs)
        out.append(s)
    return out


def print_tables(results: list[dict], summary: list[dict], args) -> None:
    def ms(x):
        return "-" if x is None else f"{x * 1000:.0f}"

    for scenario in dict.fromkeys(r["scenario"] for r in results):
        rows = [r for r in results if r["scenario"] == scenario]
        print(f"\n{scenario}: {rows[0]['requests']} requests, {args.servers} servers")
        print(f"  {'tier':<8} {'router':<16} {'done':>7} {'tokens computed':>20} "
              f"{'TTFT p50/p99 ms':>16} {'imbalance':>9} {'restarted srv':>13} "
              f"{'text differs':>12}")
        for r in rows:
            rc = "-" if r["restarted_computed"] is None else f"{r['restarted_computed']:,}"
            # tokens loaded from the tier and seconds waited for its lock, in the JSON
            print(f"  {r['tier']:<8} {r['router']:<16} {r['completed']:>3}/{r['requests']:<3} "
                  f"{r['prompt_tokens_computed']:>8,} of {r['prompt_tokens']:>8,} "
                  f"{ms(r['ttft_p50_s']):>7} / {ms(r['ttft_p99_s']):<6} "
                  f"{r['imbalance'] or 0:>8.2f}x {rc:>13} {r['text_differs']:>12}")
        for s in summary:
            if s["scenario"] != scenario:
                continue
            line = (f"  best shared ({s['best_shared']}) against best private "
                    f"({s['best_private']}): tokens computed {s['computed_shared']:,} against "
                    f"{s['computed_private']:,} ({s['computed_verdict']}); TTFT p99 "
                    f"{ms(s['ttft_p99_shared_s'])} against {ms(s['ttft_p99_private_s'])} ms "
                    f"({s['ttft_p99_verdict']})")
            if "restarted_computed_shared" in s:
                line += (f"; restarted server computed {s['restarted_computed_shared']:,} "
                         f"(shared) against {s['restarted_computed_private']:,} (private)")
            print(line)


def plot(results: list[dict], path: str) -> None:
    """TTFT by send time around the restarts (one panel per restart scenario, a line per
    configuration, grey spans where a server was out of the router), drawn with
    ``shmkv.plot``; one line instead of the plot without matplotlib."""
    from shmkv.plot import PlotUnavailable, draw_lines, figure, save

    rows = [r for r in results if r["scenario"] in ("restart", "rolling") and r["ttft_series"]]
    scenarios = list(dict.fromkeys(r["scenario"] for r in rows))
    if not scenarios:
        return
    try:
        fig, axes = figure(len(scenarios), width=560 * len(scenarios), height=420)
    except PlotUnavailable as e:
        print(f"plot skipped: {e}", file=sys.stderr)
        return
    for ax, scenario in zip(axes, scenarios, strict=True):
        series, spans = {}, set()
        for r in (r for r in rows if r["scenario"] == scenario):
            xs, ys = zip(*sorted((x[0], x[1] * 1000) for x in r["ttft_series"]), strict=True)
            series[f"{r['tier']}, {r['router']}"] = (xs, ys)
            spans.update((a, b) for a, b, _ in r["spans"])
        draw_lines(ax, series, x_label="seconds since the run's start", y_label="TTFT ms",
                   title=f"{scenario}: TTFT by send time (grey: a server out of the router)")
        for a, b in spans:
            ax.axvspan(a, b, color="grey", alpha=0.1)
    save(fig, path)
    print(f"plot: {path}", file=sys.stderr)


def find_smg(python: str) -> str | None:
    beside = Path(python).parent / "smg"
    return str(beside) if os.access(beside, os.X_OK) else shutil.which("smg")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--make-model":
        print(json.dumps({"parameters": make_model_with_tokenizer(
            sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))}))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--all", action="store_true")
    p.add_argument("--scenarios", default=None, help="comma-separated; default: all of them")
    p.add_argument("--tiers", default=None, help="only these tiers (comma-separated)")
    p.add_argument("--routers", default=None, help="only these routers (comma-separated)")
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--gpu-blocks", type=int, default=48)
    p.add_argument("--tier-mib", type=int, default=24, help="the shared tier's size; a "
                   "private tier gets 1/N of it")
    p.add_argument("--rate", type=float, default=5.0, help="requests per second")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="each server's share of the GPU (default on a GPU: 0.8 / (N + 1), "
                   "the servers share it)")
    p.add_argument("--python", default=os.environ.get("SHMKV_VLLM_PYTHON")
                   or str(ROOT / ".venv-vllm-cpu/bin/python"))
    p.add_argument("--plot", default="bench-vllm-router.png")
    p.add_argument("--json", default=None, help="also write the JSON lines here")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if not os.access(args.python, os.X_OK):
        sys.exit(f"vLLM's environment is missing ({args.python}): "
                 "bash scripts/install_vllm_cpu.sh")
    args.smg = find_smg(args.python)
    if args.smg is None:
        sys.exit("smg is missing: pip install sglang-router==0.3.2 (in vLLM's environment)")
    if args.gpu_memory_utilization is None and subprocess.run(
            [args.python, "-c", "import sys, torch; sys.exit(not torch.cuda.is_available())"],
            capture_output=True, timeout=120).returncode == 0:
        args.gpu_memory_utilization = round(0.8 / (args.servers + 1), 2)  # one GPU for all
    default = ("restart",) if args.quick else SCENARIOS
    args.tiers = args.tiers.split(",") if args.tiers else None
    args.routers = args.routers.split(",") if args.routers else None
    args.scenarios = args.scenarios.split(",") if args.scenarios else list(default)
    args.max_model_len = 1024
    runs = plan(args)
    workloads = {s: make_workload(s, args, args.seed) for s in args.scenarios}

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    from tests.vllm_engine.engines import engine_env

    tmp = tempfile.mkdtemp(prefix="bench-vllm-router-")
    log_dir = Path(tmp) / "logs"
    log_dir.mkdir()
    model = str(Path(tmp) / "model")
    made = subprocess.run([args.python, str(Path(__file__)), "--make-model", model,
                           str(args.hidden), str(args.layers)], env=engine_env(),
                          cwd=str(ROOT / "benchmarks"), check=True, capture_output=True,
                          text=True, timeout=600)
    params = json.loads(made.stdout.strip().splitlines()[-1])["parameters"]
    print(f"model: random Llama, {params / 1e6:.1f}M parameters (hidden {args.hidden}, "
          f"{args.layers} layers, word-level vocabulary of {VOCAB}); {args.servers} vLLM "
          f"servers (CPU build), {args.gpu_blocks} KV blocks of {BLOCK} tokens each; tier "
          f"{args.tier_mib} MiB shared or {args.servers} x {args.tier_mib / args.servers:g} "
          f"MiB private; {len(runs)} runs; logs {log_dir}", file=sys.stderr)
    ctx = Context(args, model, log_dir)
    results: list[dict] = []
    failed: list[dict] = []
    interrupted = False
    servers: list[Server] = []
    current = None
    began = time.perf_counter()
    try:
        for k, (scenario, tier, router) in enumerate(runs):
            key = (tier, router == "vllm-dp")
            if key == current and not servers:
                continue  # this set failed to start
            if key != current:
                ctx.stop_set(servers)
                servers = []
                t = time.perf_counter()
                extra = any(s == "scale-out" and (t_, r_ == "vllm-dp") == key
                            for s, t_, r_ in runs)
                current = key
                try:
                    servers = ctx.start_set(tier, dp=key[1], extra=extra)
                except (RuntimeError, TimeoutError, OSError) as e:
                    print(f"  servers ({tier}{', vllm-dp' if key[1] else ''}) FAILED to "
                          f"start: {e}", file=sys.stderr, flush=True)
                    failed.append({"scenario": scenario, "tier": tier, "router": router,
                                   "error": str(e)[:2000]})
                    servers = []
                    continue
                print(f"  servers up ({tier}{', vllm-dp' if key[1] else ''}): "
                      f"{time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
            try:
                r = ctx.run(workloads[scenario], tier, router, servers)
            except (RuntimeError, TimeoutError, OSError) as e:
                print(f"  run {k + 1} of {len(runs)}: {scenario}, {tier} tier, {router}: "
                      f"FAILED: {e}", file=sys.stderr, flush=True)
                failed.append({"scenario": scenario, "tier": tier, "router": router,
                               "error": str(e)[:2000]})
                continue
            results.append(r)
            print(f"  run {k + 1} of {len(runs)}: {scenario}, {tier} tier, {router}: "
                  f"{r['completed']}/{r['requests']} requests, {r['prompt_tokens_computed']:,} "
                  f"tokens computed, TTFT p99 {(r['ttft_p99_s'] or 0) * 1000:.0f} ms, "
                  f"{r['wall_s']:.0f} s", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        print("interrupted: stopping servers, removing tiers", file=sys.stderr)
        interrupted = True
    finally:
        Proc.stopping = True
        for _ in range(2):  # again for one a restart thread started meanwhile
            for proc in list(Proc.live):
                proc.stop(grace_s=10.0)
            time.sleep(0.5)
        for pool in list(ctx.pools):
            ctx.unlink(pool)
        shutil.rmtree(Path(tmp) / "model", ignore_errors=True)
    if interrupted:
        return 130
    results.sort(key=lambda r: (args.scenarios.index(r["scenario"]), TIERS.index(r["tier"]),
                                ROUTERS.index(r["router"])))
    for scenario in args.scenarios:
        rows = [r for r in results if r["scenario"] == scenario]
        ref = rows[0]["_texts"] if rows else {}
        for r in rows:
            r["text_differs"] = sum(r["_texts"].get(k) != v for k, v in ref.items())
    summary = summarize(results)
    lines = []
    for r in results:
        row = {k: v for k, v in r.items() if not k.startswith("_")}
        row.update(model_parameters=params, servers=args.servers, tier_mib=args.tier_mib,
                   gpu_blocks=args.gpu_blocks)
        lines.append(json.dumps(row))
    lines += [json.dumps({"summary": s}) for s in summary]
    lines += [json.dumps({"failed": f}) for f in failed]
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text("\n".join(lines) + "\n")
    print_tables(results, summary, args)
    print(f"\n{len(results)} runs in {time.perf_counter() - began:.0f} s")
    if args.plot:
        plot(results, args.plot)
    for f in failed:
        print(f"FAILED: {f['scenario']}, {f['tier']} tier, {f['router']}: "
              f"{f['error'].splitlines()[0]}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
