"""The front end of ``shmkv run`` and the supervisor of its processes.

Processes (fresh ones, from a fork server that imported torch once, so none inherits the
front end's state; ``SHMKV_RUN_START_METHOD=spawn`` spawns them):

    front end (this process) ──GenerateTokens──> scheduler i ──ExecuteModel──> rank i
              <──TokensGenerated, SchedulerStats──          <──ModelOutput──

- ``shared``: one pool of ``num_blocks`` blocks and one KV store; every scheduler attaches
  to the pool, every rank maps the store.
- ``private``: scheduler ``i`` gets a pool (and a KV store) of ``num_blocks / N`` blocks of
  its own: what vLLM, SGLang and TensorRT-LLM do per data-parallel rank.

Every segment (pools, KV stores, block tables, channels and their doorbells) is made here
and removed in a ``finally``, whatever happened. Children ignore SIGINT (the terminal sends
it to the whole process group: the front end alone decides), end when the front end does
(``engine.child_setup``), and are joined with timeouts, then killed. The front end itself blocks
SIGINT and SIGTERM for the run and takes them in a watcher thread, so a signal never breaks
a semaphore wait (EINTR) in the middle of a pool call; it then stops everything and exits.

At the end the front end drains every scheduler and resets the prefix cache across them
(``DrainScheduler``, ``ResetPrefixCache``), then stops them (``Shutdown``).

A child's death is seen through its process sentinel. A dead scheduler's rank is stopped,
its requests in flight are sent again to the survivors (from scratch: their tokens were
lost with it), and survivors on a shared pool reap its block references (``reap_dead``).
A dead rank takes its scheduler down with it the same way.

Every generated token is checked against the model's no-cache greedy reference, computed
here while the schedulers work (:func:`reference_tokens`: what ``reference_generate`` gives,
in one forward per request).
"""

from __future__ import annotations

import math
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing import resource_tracker

from shmkv.errors import ProtocolError, ShmKVError, UsageError
from shmkv.messages import Channel, Shutdown, create_doorbell, recv_any, unlink_doorbell
from shmkv.pool.block_pool import BlockPool
from shmkv.serve.messages import (
    AttachScheduler,
    DrainScheduler,
    GenerateTokens,
    MessageRejected,
    PrefixCacheReset,
    ResetPrefixCache,
    SchedulerAttached,
    SchedulerConfig,
    SchedulerDrained,
    SchedulerStats,
    SchedulerStopped,
    TokensGenerated,
)
from shmkv.serve.routing import (
    PrivatePoolsView,
    RouterConfig,
    SchedulerMetrics,
    SharedPoolView,
    make_router,
)
from shmkv.serve.token_check import _check_tokens, reference_tokens  # noqa: F401 (re-export)
from shmkv.serve.workload import TraceRequest

__all__ = ["RunConfig", "RunResult", "Runner"]

JOIN_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 30.0  # for every process of the run to exit after Shutdown
# A dead process's partner (its scheduler or rank) gets SIGTERM and this long to close its
# pool and tables before a SIGKILL.
PARTNER_STOP_S = 5.0
CHANNEL_BYTES = 1 << 20
RANK_NICE = 10
# The longest a run waits for a request to arrive (--time-scale times its timestamp): a
# week, longer than any trace replayed in real time; beyond it a timestamp is a mistake.
MAX_ARRIVAL_WAIT_S = 7 * 24 * 3600.0


@dataclass
class RunConfig:
    """Settings of one ``shmkv run`` (the CLI's defaults)."""

    num_schedulers: int = 4
    pool: str = "shared"  # "shared" or "private"
    routing: str = "prefix-aware"
    num_blocks: int = 512  # in all; a private pool gets num_blocks // num_schedulers
    block_size: int = 16
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 512
    max_model_len: int = 512
    # Users waiting for an answer at once: the offered load, a property of the workload,
    # the same whatever the number of schedulers.
    concurrency: int = 16
    # The rank processes run this much nicer than the schedulers: with more busy processes
    # than cores, a rank woken by a step's message would otherwise preempt a scheduler
    # inside its hold of the pool lock, and every other scheduler waits for it.
    rank_nice: int = RANK_NICE
    # The routers' settings (SGLang's thresholds, llm-d's weights, prefix-aware's slack).
    router: RouterConfig = field(default_factory=RouterConfig)
    kill_one: bool = False
    # "one": SIGKILL the highest scheduler half way through and start a fresh one in its
    # place; "rolling": every scheduler in turn, evenly spread over the run. A restarted
    # scheduler of private pools starts with an empty pool (its cache is lost with it); on
    # the shared pool it finds the cache the others keep.
    restart: str = ""
    check_tokens: bool = True
    sample_interval_s: float = 0.1
    timeout_s: float = 300.0
    startup_timeout_s: float = 120.0
    model: object = None  # a TinyModelConfig (default: TinyModelConfig())
    # A replay (shmkv/serve/replay.py): no ranks, no model, no token checks; the KV-cache
    # groups are still the model's.
    model_free: bool = False
    # A replay's step time (shmkv/serve/replay.py's CostModel; default: CostModel()).
    cost: object = None
    # > 0: a request with an arrival_s is sent no sooner than arrival_s * time_scale after
    # the first (0: as fast as the concurrency allows).
    time_scale: float = 0.0
    # Where the ranks compute and the KV cache lives (shmkv/serve/device.py): a RunDevice
    # (default: cpu, the device placement, float32).
    run_device: object = None

    def validate(self) -> None:
        if self.pool not in ("shared", "private"):
            raise UsageError(f"--pool must be 'shared' or 'private', got {self.pool!r}")
        if self.num_schedulers < 1:
            raise UsageError(f"--schedulers must be >= 1, got {self.num_schedulers}")
        per = self.num_blocks // (self.num_schedulers if self.pool == "private" else 1)
        need = -(-self.max_model_len // self.block_size) * 2 + 1
        if per < need:
            raise UsageError(
                f"{per} blocks per pool cannot hold one request of max_model_len "
                f"{self.max_model_len} ({need} blocks with the sliding-window group); "
                "raise --blocks or lower --max-model-len")
        if self.concurrency < 1:
            raise UsageError(f"--concurrency must be >= 1, got {self.concurrency}")
        if self.kill_one and self.num_schedulers < 2:
            raise UsageError("--kill-one needs at least 2 schedulers")
        if self.restart not in ("", "one", "rolling"):
            raise UsageError(f"restart must be '', 'one' or 'rolling', got {self.restart!r}")
        if self.restart and self.num_schedulers < 2:
            raise UsageError("--restart-one and --rolling-restart need at least 2 schedulers "
                             "(the others serve while one restarts)")
        if self.restart and self.kill_one:
            raise UsageError("--kill-one with a restart: give one of them")
        if not (0 <= self.time_scale < math.inf):  # NaN fails it too
            raise UsageError(f"--time-scale must be a finite number >= 0, got "
                             f"{self.time_scale}")
        if not 0 <= self.rank_nice <= 19:
            raise UsageError(f"--rank-nice must be between 0 and 19, got {self.rank_nice}")
        if self.cost is not None:
            self.cost.validate()
        if self.model_free and self.run_device is not None and (
                self.run_device != type(self.run_device)()):
            raise UsageError("a replay (--model none) runs no model: --device, --kv and "
                             "--dtype do not apply")


@dataclass
class RequestRecord:
    trace: TraceRequest
    prompt_token_ids: list[int] = field(default_factory=list)
    scheduler: int = -1
    sent_at: float = 0.0
    num_sends: int = 0
    result: TokensGenerated | None = None
    failed: str = ""  # why it was not served
    mismatch: int = -1  # index of the first wrong token (-1: none / not checked)
    checked: int | None = None
    logit_gap: float | None = None  # at the first wrong token (see _check_tokens)


@dataclass
class RunResult:
    figures: dict
    timeline: list[dict]
    problems: list[str]

    @property
    def interrupted(self) -> bool:
        return any(p.startswith("interrupted") for p in self.problems)

    @property
    def exit_signal(self) -> int | None:
        """The signal that stopped the run (SIGTERM or SIGINT), if one did."""
        for p in self.problems:
            if p.startswith("interrupted (") and p.endswith(")"):
                return int(signal.Signals[p[len("interrupted ("):-1]])
        return None


@dataclass
class _Serving:
    """The state of one run's serving loop (``Runner._serve`` and its steps)."""

    records: dict[str, RequestRecord]
    pending: deque[str]  # request ids to send, in order
    router: object
    model: object | None  # the no-cache reference, when tokens are checked
    t_serve: float
    load: dict[int, int]  # requests in flight per scheduler
    history: dict[str, list[int]] = field(default_factory=dict)  # conversation: its tokens
    busy_conversations: set[str] = field(default_factory=set)  # a turn in flight
    failed_conversations: set[str] = field(default_factory=set)
    in_flight: dict[str, RequestRecord] = field(default_factory=dict)
    stats: dict[int, SchedulerStats] = field(default_factory=dict)
    to_check: deque[RequestRecord] = field(default_factory=deque)
    timeline: list[dict] = field(default_factory=list)
    done: int = 0  # requests answered or failed
    hit_tokens: int = 0
    prompt_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / max(self.prompt_tokens, 1)


class _Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, total: int, enabled: bool, label: str = "") -> None:
        self.total = total
        self.enabled = enabled
        self.label = f"{label} " if label else ""  # "run 3 of 9" in a sweep
        self.last = 0.0

    def update(self, done: int, hit_rate: float, usage: float, elapsed: float,
               force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self.last < 0.2:
            return
        self.last = now
        width = 30
        filled = int(width * done / max(self.total, 1))
        bar = "=" * filled + (">" if filled < width else "") + " " * (width - filled - 1)
        sys.stderr.write(f"\r  {self.label}[{bar[:width]}] {done}/{self.total} requests  "
                         f"hit {hit_rate:5.1%}  pool {usage:5.1%}  {elapsed:5.1f} s ")
        sys.stderr.flush()

    def finish(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


def check_arrivals(workload: list[TraceRequest], time_scale: float) -> None:
    """Refuses a workload whose last arrival, scaled, is more than ``MAX_ARRIVAL_WAIT_S``
    away: the run would wait that long for it (a timestamp of 1e308 ms is 3e297 years).

    Raises:
        UsageError: naming the request, its wait and the two ways out.
    """
    if time_scale <= 0:
        return  # arrivals are not waited for
    late = max(workload, key=lambda t: t.arrival_s or 0.0)
    wait_s = (late.arrival_s or 0.0) * time_scale
    if not wait_s <= MAX_ARRIVAL_WAIT_S:
        raise UsageError(
            f"request {late.request_id} arrives {late.arrival_s:g} s after the first, "
            f"{wait_s:g} s with --time-scale {time_scale:g}, past the longest wait of a run "
            f"({MAX_ARRIVAL_WAIT_S:,.0f} s, a week): lower --time-scale (0 sends at once) or "
            "fix the trace's timestamps")


class Runner:
    """One run: sets up, serves the workload, tears down (see the module docstring)."""

    def __init__(self, cfg: RunConfig, workload: list[TraceRequest], *,
                 progress: bool = False, log=None, progress_label: str = "") -> None:
        from shmkv.serve.config import TinyModelConfig
        from shmkv.serve.device import RunDevice

        cfg.model = cfg.model or TinyModelConfig()
        cfg.run_device = cfg.run_device or RunDevice()
        if cfg.cost is None:
            from shmkv.serve.replay import CostModel

            cfg.cost = CostModel() if cfg.model_free else CostModel(0.0, 0.0)
        if cfg.model_free:
            cfg.check_tokens = False
        cfg.validate()
        vocab = cfg.model.vocab_size
        for t in workload:
            if any(not 0 <= tok < vocab for tok in t.prompt_token_ids):
                raise UsageError(f"request {t.request_id}: a token id is outside the model's "
                                 f"vocabulary [0, {vocab})")
        if not workload:
            raise UsageError("the workload has no requests")
        check_arrivals(workload, cfg.time_scale)
        self.cfg = cfg
        self.workload = workload
        self.log = log or (lambda text: print(text, file=sys.stderr))
        self.name = f"run{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.max_in_flight = cfg.concurrency
        self.progress = _Progress(len(workload), progress, progress_label)
        self.interrupted: str | None = None
        self.problems: list[str] = []  # what went wrong (exit code 1)
        self.notes: list[str] = []  # what happened on purpose (--kill-one)
        self.killed: set[int] = set()
        # Children that died of SIGTERM while this process was not (yet) interrupted: a
        # SIGTERM to the whole process group can reach a child before this process has
        # handled its own, so they are judged at the end (a problem only if this run was
        # not interrupted).
        self.sigterm_deaths: list[str] = []
        self.peak_blocks_held: dict[int, int] = {}  # per scheduler, as its stats said
        self.attached: set[int] = set()  # restarted schedulers that attached
        # Everything made, for the finally.
        self.pools: list[BlockPool] = []
        self.kv_stores: list = []
        self.tables: list = []
        self.table_names: list[str] = []
        self.channel_names: list[str] = []
        self.doorbells: list[str] = []
        self.channels: list[Channel] = []
        self.schedulers: list[mp.Process] = []
        self.ranks: list[mp.Process] = []
        # Every process and block table ever made (a restart makes new ones), for teardown.
        self.old_processes: list[mp.Process] = []
        self.old_tables: list = []
        self.block_tables_name: dict[int, str] = {}

    # ------------------------------------------------------------------ names

    def _pool_name(self, i: int) -> str:
        return self.name if self.cfg.pool == "shared" else f"{self.name}-p{i}"

    # ------------------------------------------------------------------ set up

    def _setup(self) -> None:
        from shmkv.serve import engine

        cfg, n = self.cfg, self.cfg.num_schedulers
        model = cfg.model
        num_pools = 1 if cfg.pool == "shared" else n
        per_pool = cfg.num_blocks // num_pools
        for p in range(num_pools):
            pool_name = self._pool_name(p)
            self.pools.append(BlockPool.create(
                pool_name, per_pool, hash_block_size=cfg.block_size,
                enable_kv_cache_events=True, max_processes=n + 4, label="front-end"))
            if cfg.model_free:
                continue
            from shmkv.serve.placement import PoolKV

            self.kv_stores.append(PoolKV(pool_name, model, per_pool, cfg.block_size,
                                         cfg.run_device, pool=pool_name))
        self.front_bell = self._doorbell(f"{self.name}-fe")
        self.model_dict = engine.model_config_to_dict(model)
        self.inboxes, self.outboxes = [None] * n, [None] * n
        self.schedulers = [None] * n
        self.ranks = [] if cfg.model_free else [None] * n
        self.tables = [] if cfg.model_free else [None] * n
        self.generation = [0] * n
        self.channels = []
        for i in range(n):
            self._make_scheduler(i)
        for p in self.ranks + self.schedulers:
            p.start()
        for i in range(n):
            self._attach(i)

    def _make_scheduler(self, i: int) -> None:
        """Scheduler ``i``'s channels, block tables, rank and process (not started), for its
        incarnation ``self.generation[i]`` (a restarted scheduler gets new ones)."""
        from shmkv.serve import engine

        cfg, model = self.cfg, self.cfg.model
        gen = self.generation[i]
        tag = f"{self.name}-s{i}" + (f"g{gen}" if gen else "")
        bell = self._doorbell(tag)
        p_of_i = 0 if cfg.pool == "shared" else i
        pool_name = self._pool_name(p_of_i)
        names = {
            "inbox": self._channel(f"{tag}-in", bell, pool_name),
            "outbox": self._channel(f"{tag}-out", self.front_bell, pool_name),
            "to_rank": self._channel(f"{tag}-rank", None, pool_name),
            "from_rank": self._channel(f"{tag}-res", bell, pool_name),
        }
        self.inboxes[i] = Channel.open(names["inbox"])
        self.outboxes[i] = Channel.open(names["outbox"])
        self.channels += [self.inboxes[i], self.outboxes[i]]
        if not cfg.model_free:
            self.table_names.append(tag)
            self.tables[i] = engine.create_block_tables(
                tag, model, cfg.max_num_seqs, cfg.max_model_len, cfg.block_size,
                pool=pool_name)
            self.old_tables.append(self.tables[i])
            self.ranks[i] = self.ctx.Process(
                target=engine.rank_main, name=f"rank-{i}", daemon=True,
                args=(tag, self.kv_stores[p_of_i].placement, names["to_rank"],
                      names["from_rank"], self.model_dict, os.getpid(), cfg.rank_nice))
            self.old_processes.append(self.ranks[i])
        self.schedulers[i] = self.ctx.Process(target=_scheduler_entry, name=f"scheduler-{i}",
                                              daemon=True, args=(i, names, os.getpid()))
        self.old_processes.append(self.schedulers[i])
        self.block_tables_name[i] = tag

    def _attach(self, i: int) -> None:
        cfg = self.cfg
        self.inboxes[i].send(AttachScheduler(scheduler=i, config=SchedulerConfig(
            pool_name=self._pool_name(0 if cfg.pool == "shared" else i), model=self.model_dict,
            max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_model_len=cfg.max_model_len, block_tables_name=self.block_tables_name[i],
            model_free=cfg.model_free,
            prefill_ms_per_token=cfg.cost.prefill_ms_per_token if cfg.model_free else 0.0,
            decode_ms_per_step=cfg.cost.decode_ms_per_step if cfg.model_free else 0.0)))

    def _doorbell(self, name: str) -> str:
        bell = create_doorbell(name)
        self.doorbells.append(bell)
        return bell

    def _channel(self, name: str, bell: str | None, pool: str) -> str:
        Channel.create(name, CHANNEL_BYTES, doorbell=bell, pool=pool).close()
        self.channel_names.append(name)
        return name

    def _teardown(self) -> None:
        for ch in self.channels:
            ch.close()
        for p in self.old_processes:
            if p.pid is None:
                continue
            p.join(0)
            if p.is_alive():
                p.kill()
            p.join(JOIN_TIMEOUT_S)
        from shmkv.ranks.block_table import SharedBlockTables

        for t in self.old_tables:
            t.close()
        for name in self.table_names:
            SharedBlockTables.unlink(name)
        for store in self.kv_stores:
            store.close()  # and removes it
        for pool in self.pools:
            name = pool.pool_name
            pool.close()
            BlockPool.unlink(name)
        for name in self.channel_names:
            Channel.unlink(name)
        for bell in self.doorbells:
            unlink_doorbell(bell)

    # ------------------------------------------------------------------ run

    def run(self, signalled: Callable[[], int | None] = lambda: None) -> RunResult:
        """Sets up, serves, tears down. SIGINT and SIGTERM are blocked in this thread for the
        run and taken by a watcher thread (``sigwait``), which only sets ``interrupted``: a
        signal then never interrupts a wait on a semaphore (which fails with EINTR, as
        ``posix_ipc.SignalError``) half way through a pool call or a receive. ``signalled``
        gives the signal the caller's own handler took before this run masked them (a Ctrl-C
        while the front end started), if one did: the run then stops as soon as it can."""
        signals = {signal.SIGINT, signal.SIGTERM}
        self.ctx = _context(self.cfg.model_free)
        # The resource tracker unblocks both once it has started (multiprocessing's own
        # masking): start it first, so the mask below stays. The fork server starts under the
        # mask (a child inherits it), so a Ctrl-C to the process group while it imports torch
        # never kills it half way; its children unblock them (``engine.child_setup``).
        resource_tracker.ensure_running()
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, signals)

        def on_signal(signum, frame):  # a thread made before the mask (torch's) took it
            self.interrupted = self.interrupted or signal.Signals(signum).name  # the first

        old_handlers = {s: signal.signal(s, on_signal) for s in signals}
        if (signum := signalled()) is not None:  # taken before the mask: by the caller
            self.interrupted = signal.Signals(signum).name
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                got = signal.sigtimedwait(signals, 0.1)
                if got is not None:  # a later one changes nothing: the stop goes on
                    self.interrupted = self.interrupted or signal.Signals(got.si_signo).name

        watcher = threading.Thread(target=watch, name="shmkv-run-signals", daemon=True)
        watcher.start()
        try:
            _start_helpers(self.ctx)
            self.t_setup = time.monotonic()
            self._setup()
            return self._serve()
        finally:
            try:
                self._teardown()
            finally:
                stop.set()
                watcher.join(5)
                signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
                for sig, handler in old_handlers.items():
                    signal.signal(sig, handler)

    def _wait_attached(self, live: set[int]) -> None:
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        attached: set[int] = set()
        while attached != live:
            if self.interrupted:
                return
            self._check_children(live, starting=True)
            if time.monotonic() > deadline:
                raise ShmKVError(f"schedulers {sorted(live - attached)} did not attach in "
                                 f"{self.cfg.startup_timeout_s} s")
            _, msg = self._recv(0.1)
            if isinstance(msg, SchedulerAttached):
                attached.add(msg.scheduler)

    def _recv(self, timeout_s: float):
        try:
            return recv_any(self.outboxes, timeout_s)
        except ProtocolError as exc:
            self.problems.append(f"front end: undecodable message ignored: {exc}")
            return None, None

    def _check_children(self, live: set[int], starting: bool = False) -> list[int]:
        """Schedulers that died (or whose rank died) since the last look."""
        sentinels = {}
        for i in live:
            for p in self._processes_of(i):
                sentinels[p.sentinel] = i
        ready = multiprocessing.connection.wait(list(sentinels), timeout=0)
        dead = sorted({sentinels[s] for s in ready})
        for i in dead:
            procs = self._processes_of(i)
            who = next((p for p in procs if not p.is_alive()), procs[0])
            who.join(1)
            if starting:
                raise ShmKVError(f"{who.name} exited with code {who.exitcode} while starting")
            what = f"{who.name} (pid {who.pid}) died, exit code {who.exitcode}"
            if i in self.killed:
                self.notes.append(what + " (--kill-one)")
            elif getattr(self, "restarting", {}).get(i) == "killed":
                self.notes.append(what + " (restart)")
            elif who.exitcode in (128 + signal.SIGTERM, -signal.SIGTERM):
                self.sigterm_deaths.append(what)
            else:
                self.problems.append(what)
            self._stop_partners(procs)
            live.discard(i)
        return dead

    @staticmethod
    def _stop_partners(procs: list) -> None:
        """One of a scheduler / rank pair is dead: the other gets SIGTERM, so that it closes
        its pool handle (a SIGKILL would leave its references for a reap, and a stop of the
        whole run by SIGTERM could then look like a death), and a SIGKILL only if it is still
        there after ``PARTNER_STOP_S``."""
        for p in procs:
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + PARTNER_STOP_S
        for p in procs:
            p.join(max(deadline - time.monotonic(), 0.0))
            if p.is_alive():
                p.kill()
                p.join(JOIN_TIMEOUT_S)

    def _processes_of(self, i: int) -> list:
        """Scheduler ``i`` and its rank (a replay has no ranks)."""
        return [self.schedulers[i]] + ([self.ranks[i]] if self.ranks else [])

    def _serve(self) -> RunResult:
        cfg = self.cfg
        live = set(range(cfg.num_schedulers))
        t_start = self.t_setup
        self.reference = self._reference_model()
        self._wait_attached(live)
        t_serve = time.monotonic()
        if self.interrupted:
            return self._finish(live, t_start, t_serve, [], {})
        st = self._start_serving(t_serve)
        next_sample = t_serve
        # --time-scale: the timeout counts from the last arrival.
        deadline = t_serve + cfg.timeout_s + cfg.time_scale * max(
            (t.arrival_s or 0.0 for t in self.workload), default=0.0)
        while st.done < len(st.records) and live and not self.interrupted:
            now = time.monotonic()
            if now > deadline:
                self.problems.append(f"timed out after {cfg.timeout_s} s with "
                                     f"{len(st.records) - st.done} requests unfinished")
                break
            self._send_pending(st, live)
            self._take_answers(st)
            self._resend_from_the_dead(st, live)
            self._kill_one_if_due(st, live)
            self._restart_if_due(st, live)
            # Reference checks, one per pass, while the schedulers work.
            if st.to_check:
                _check_tokens(st.model, st.to_check.popleft())
            now = time.monotonic()
            if now >= next_sample:  # the pool's lock is the schedulers': look rarely
                usage = self._pool_usage()
                st.timeline.append({"t_s": now - t_serve, "requests_done": st.done,
                                    "prefix_hit_rate": st.hit_rate, "pool_usage": usage,
                                    **self._device_sample()})
                next_sample = now + cfg.sample_interval_s
                self.progress.update(st.done, st.hit_rate, usage, now - t_serve)
        t_end = self._end_serving(st, live)
        self.records = st.records
        return self._finish(live, t_start, t_serve, st.timeline, st.stats, t_end)

    def _reference_model(self):
        """The no-cache reference (``check_tokens``) on the run's device, in its dtype: made
        while the ranks start, so that a big model's making is not in the serving time."""
        if not self.cfg.check_tokens:
            return None
        import torch

        from shmkv.serve.model import TinyTransformer

        torch.set_num_threads(1)
        run = self.cfg.run_device
        return TinyTransformer(self.cfg.model, device=run.device,
                               dtype=getattr(torch, run.dtype))

    def _start_serving(self, t_serve: float) -> _Serving:
        """The pool view, the router, the records."""
        cfg = self.cfg
        model = self.reference
        if cfg.pool == "shared":
            view = SharedPoolView(self.pools[0])
        else:
            view = PrivatePoolsView(self.pools)
        self.view = view
        router = make_router(cfg.routing, view, cfg.router, block_size=cfg.block_size)
        self.failures: list[str] = []
        return _Serving(records={t.request_id: RequestRecord(t) for t in self.workload},
                        pending=deque(t.request_id for t in self.workload), router=router,
                        model=model, t_serve=t_serve,
                        load=dict.fromkeys(range(cfg.num_schedulers), 0))

    def _fail(self, st: _Serving, rec: RequestRecord, reason: str) -> None:
        """``rec`` will not be served; nor will the later turns of its conversation."""
        rec.failed = reason
        st.done += 1
        if rec.trace.conversation is not None:
            st.failed_conversations.add(rec.trace.conversation)
            st.busy_conversations.discard(rec.trace.conversation)
        if len(self.failures) < 5:
            self.problems.append(f"request {rec.trace.request_id} not served: {reason}")
        self.failures.append(rec.trace.request_id)

    def _send_pending(self, st: _Serving, live: set[int]) -> None:
        """Send what may go: conversation turns wait for the previous one's answer."""
        if len(st.in_flight) >= self.max_in_flight or not st.pending:
            return
        cfg = self.cfg
        skipped = []
        due = (time.monotonic() - st.t_serve) / cfg.time_scale if cfg.time_scale > 0 else None
        while st.pending and len(st.in_flight) < self.max_in_flight:
            rid = st.pending.popleft()
            rec = st.records[rid]
            if due is not None and rec.trace.arrival_s is not None and (
                    rec.trace.arrival_s > due and rec.num_sends == 0):
                st.pending.appendleft(rid)  # not arrived yet (the trace is in time order)
                break
            conv = rec.trace.conversation
            if conv is not None and conv in st.busy_conversations and rec.num_sends == 0:
                skipped.append(rid)
                continue
            if conv is not None and conv in st.failed_conversations:
                self._fail(st, rec, "an earlier turn of its conversation failed")
                continue
            if not rec.prompt_token_ids:
                rec.prompt_token_ids = (st.history.get(conv, []) if conv else []) + list(
                    rec.trace.prompt_token_ids)
            too_long = len(rec.prompt_token_ids) + rec.trace.max_tokens
            if too_long > cfg.max_model_len:
                self._fail(st, rec, f"{too_long} prompt + new tokens exceed --max-model-len "
                           f"{cfg.max_model_len}")
                continue
            if conv is not None:
                st.busy_conversations.add(conv)
            s = st.router.route(rec.prompt_token_ids, rec.trace.cache_salt, sorted(live),
                                st.load, self._metrics(st))
            rec.scheduler, rec.sent_at = s, time.monotonic()
            rec.num_sends += 1
            st.load[s] += 1
            st.in_flight[rid] = rec
            self.inboxes[s].send(GenerateTokens(
                request_id=rid, prompt_token_ids=rec.prompt_token_ids,
                max_tokens=rec.trace.max_tokens, cache_salt=rec.trace.cache_salt))
        st.pending.extendleft(reversed(skipped))

    def _metrics(self, st: _Serving) -> dict[int, SchedulerMetrics]:
        """What each scheduler last reported, as a router in front of replicas sees it."""
        out = {}
        for i, stats in st.stats.items():
            total = self.pools[0 if self.cfg.pool == "shared" else i].num_gpu_blocks - 1
            out[i] = SchedulerMetrics(
                num_waiting=stats.num_waiting,
                kv_cache_usage=1.0 - stats.num_free_blocks / total if total else 0.0)
        return out

    def _take_answers(self, st: _Serving) -> None:
        """Every message the schedulers have sent: answers, figures, rejections."""
        _, msg = self._recv(0.002 if st.to_check else 0.05)
        while msg is not None:
            if isinstance(msg, TokensGenerated):
                self._on_tokens(st, msg)
            elif isinstance(msg, SchedulerStats):
                st.stats[msg.scheduler] = msg
                peak = self.peak_blocks_held
                peak[msg.scheduler] = max(peak.get(msg.scheduler, 0), msg.num_blocks_held)
            elif isinstance(msg, MessageRejected):
                rec = st.in_flight.get(msg.request_id) if msg.request_id else None
                if rec is not None and msg.sender == f"scheduler-{rec.scheduler}":
                    del st.in_flight[msg.request_id]
                    st.load[rec.scheduler] -= 1
                    self._fail(st, rec, f"{msg.sender}: {msg.reason}")
                else:
                    self.problems.append(f"{msg.sender} rejected a message: {msg.reason}")
            elif isinstance(msg, SchedulerStopped):
                st.stats[msg.scheduler] = msg.stats
            elif isinstance(msg, SchedulerAttached):  # a restarted scheduler
                self.attached.add(msg.scheduler)
            _, msg = self._recv(0)

    def _on_tokens(self, st: _Serving, msg: TokensGenerated) -> None:
        rec = st.in_flight.get(msg.request_id)
        # (An answer a dead scheduler sent before it died is for a request sent again
        # since: the new scheduler's answer counts.)
        if rec is None or msg.scheduler != rec.scheduler:
            return
        del st.in_flight[msg.request_id]
        rec.result = msg
        st.load[rec.scheduler] -= 1
        st.done += 1
        st.hit_tokens += msg.num_cached_tokens
        st.prompt_tokens += msg.num_prompt_tokens
        conv = rec.trace.conversation
        if conv is not None:
            st.history[conv] = rec.prompt_token_ids + list(msg.output_token_ids)
            st.busy_conversations.discard(conv)
        if st.model is not None:
            st.to_check.append(rec)

    def _resend_from_the_dead(self, st: _Serving, live: set[int]) -> None:
        """A dead scheduler's requests in flight go back to the head of the queue."""
        for i in self._check_children(live):
            lost = [r for r in st.in_flight.values() if r.scheduler == i]
            for rec in lost:
                del st.in_flight[rec.trace.request_id]
                st.pending.appendleft(rec.trace.request_id)
            st.load[i] = 0
            st.router.forget(i)
            if lost:
                self.notes.append(f"scheduler-{i}: {len(lost)} requests in flight sent "
                                  "again to the others")
            if self.cfg.pool == "shared":
                self.pools[0].reap_dead()

    def _kill_one_if_due(self, st: _Serving, live: set[int]) -> None:
        """``--kill-one``: SIGKILL the highest live scheduler once half the requests are done."""
        if (self.cfg.kill_one and not self.killed and st.done >= len(st.records) // 2
                and len(live) > 1):
            victim = max(live)
            self.killed.add(victim)
            os.kill(self.schedulers[victim].pid, signal.SIGKILL)
            self.killed_at = (time.monotonic() - st.t_serve, st.done)
            self.log(f"--kill-one: killed scheduler-{victim} (pid "
                     f"{self.schedulers[victim].pid}) after {st.done} requests")

    def _restart_plan(self, total: int) -> list[tuple[int, int]]:
        """(requests done, scheduler) of each restart: the highest scheduler half way
        through, or every scheduler in turn at evenly spread points."""
        n = self.cfg.num_schedulers
        if self.cfg.restart == "one":
            return [(total // 2, n - 1)]
        if self.cfg.restart == "rolling":
            return [(total * (k + 1) // (n + 1), k) for k in range(n)]
        return []

    def _restart_if_due(self, st: _Serving, live: set[int]) -> None:
        """A restart: SIGKILL the scheduler (its requests in flight go to the others, as for
        any death); once its death is handled, empty its private pool's cache (a fresh
        replica has none) and start a new scheduler (and rank) in its place; it serves again
        when it has attached."""
        if not self.cfg.restart:
            return
        if not hasattr(self, "restart_todo"):
            self.restart_todo = self._restart_plan(len(st.records))
            self.restarting: dict[int, str] = {}
            self.restarts: list[dict] = []
        if self.restart_todo and not self.restarting and st.done >= self.restart_todo[0][0]:
            _, i = self.restart_todo.pop(0)
            if i in live and len(live) > 1:
                self.restarting[i] = "killed"
                self.restarts.append({"scheduler": i, "after_requests": st.done,
                                      "killed_s": time.monotonic() - st.t_serve})
                os.kill(self.schedulers[i].pid, signal.SIGKILL)
                self.log(f"restart: killed scheduler-{i} after {st.done} requests")
        for i, state in list(self.restarting.items()):
            if state == "killed" and i not in live:
                if self.cfg.pool == "private":
                    pool = self.pools[i]
                    pool.reap_dead()
                    if not pool.reset_prefix_cache():
                        self.problems.append(f"scheduler-{i}'s private pool: the prefix "
                                             "cache reset for its restart failed")
                self.generation[i] += 1
                self._make_scheduler(i)
                for p in self._processes_of(i):
                    p.start()
                self._attach(i)
                self.restarting[i] = "starting"
            elif state == "starting" and i in self.attached:
                self.attached.discard(i)
                live.add(i)
                st.load[i] = 0
                del self.restarting[i]
                self.restarts[-1]["serving_again_s"] = time.monotonic() - st.t_serve
                self.notes.append(f"scheduler-{i} restarted after "
                                  f"{self.restarts[-1]['after_requests']} requests"
                                  + (" with an empty pool" if self.cfg.pool == "private"
                                     else " on the shared pool"))

    def _end_serving(self, st: _Serving, live: set[int]) -> float:
        """The last progress line, the remaining reference checks, the drain and reset, the
        last timeline point; returns when serving ended."""
        self.progress.update(st.done, st.hit_rate, self._pool_usage(),
                             time.monotonic() - st.t_serve, force=True)
        self.progress.finish()
        t_end = time.monotonic()
        while st.to_check:
            _check_tokens(st.model, st.to_check.popleft())
        if live and not self.interrupted:
            # Control across all schedulers: drain every one, then reset the prefix cache
            # (every pool's): the run leaves its pools with nothing held and nothing cached.
            self.prefix_cache_reset = self.drain_and_reset(live, st.stats)
            if not self.prefix_cache_reset:
                self.problems.append("drain and prefix-cache reset across the schedulers "
                                     "did not succeed")
        st.timeline.append({"t_s": t_end - st.t_serve, "requests_done": st.done,
                            "prefix_hit_rate": st.hit_rate, "pool_usage": self._pool_usage()})
        return t_end

    def _device_sample(self) -> dict:
        """The GPU memory every process uses (a timeline point's), on a GPU run."""
        from shmkv.serve.device import device_memory_used_bytes

        run = self.cfg.run_device
        used = None if self.cfg.model_free else device_memory_used_bytes(run.device)
        return {} if used is None else {"device_memory_bytes": used}

    def _pool_usage(self) -> float:
        total = sum(p.num_gpu_blocks - 1 for p in self.pools)
        free = sum(p.get_num_free_blocks() for p in self.pools)
        return (total - free) / total if total else 0.0

    def _stop(self, live: set[int], stats: dict) -> None:
        """Shutdown to every live scheduler; their last figures; join everyone."""
        for i in sorted(live):
            try:
                self.inboxes[i].send(Shutdown(reason="run finished"), timeout_s=1.0)
            except ShmKVError as exc:
                self.problems.append(f"scheduler-{i}: shutdown not delivered: {exc}")
        waiting = set(live)
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while waiting and time.monotonic() < deadline:
            _, msg = self._recv(0.1)
            if isinstance(msg, SchedulerStopped):
                stats[msg.scheduler] = msg.stats
                waiting.discard(msg.scheduler)
            elif isinstance(msg, SchedulerStats):
                stats[msg.scheduler] = msg
            for i in list(waiting):
                if not self.schedulers[i].is_alive():
                    waiting.discard(i)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for i in sorted(live):
            for p in self._processes_of(i):
                p.join(max(deadline - time.monotonic(), 0.1))
                if p.is_alive():
                    self.problems.append(f"{p.name} did not exit in {STOP_TIMEOUT_S} s: killed")
                    p.kill()
                    p.join(JOIN_TIMEOUT_S)
                elif p.exitcode == 128 + signal.SIGTERM and self.interrupted:
                    self.notes.append(f"{p.name} stopped by SIGTERM too (exit 143)")
                elif p.exitcode != 0:
                    self.problems.append(f"{p.name} exited with code {p.exitcode}")

    def _finish(self, live, t_start, t_serve, timeline, stats, t_end=None) -> RunResult:
        from shmkv.serve.report import figures

        t_end = t_end or time.monotonic()
        t_stop = time.monotonic()
        self._stop(live, stats)
        self.stop_s = time.monotonic() - t_stop
        pool_checks = []
        for pool in self.pools:
            pool.reap_dead()
            try:
                pool.check_invariants()
                ok = True
            except ShmKVError as exc:
                ok = False
                self.problems.append(f"pool {pool.pool_name}: {exc}")
            in_use = pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()
            pool_checks.append({"pool": pool.pool_name, "invariants_ok": ok,
                                "cached_blocks_after": len(pool.cached_block_hash_to_block),
                                "blocks_in_use_after": in_use})
            if in_use:
                self.problems.append(f"pool {pool.pool_name}: {in_use} blocks still in use "
                                     "after every scheduler stopped")
        if self.interrupted == "SIGTERM":
            self.notes.extend(f"{what}: stopped by SIGTERM too" for what in self.sigterm_deaths)
        else:
            self.problems.extend(self.sigterm_deaths)
        if self.interrupted:
            self.problems.append(f"interrupted ({self.interrupted})")
        figs = figures(self, getattr(self, "records", {}), stats, timeline, pool_checks,
                       wall_s=t_end - t_serve, startup_s=t_serve - t_start)
        return RunResult(figs, timeline, self.problems)

    # ------------------------------------------------------------------ control

    def drain_and_reset(self, live: set[int], stats: dict, timeout_s: float = 30.0) -> bool:
        """Drains every live scheduler, then resets the prefix cache of every pool (one
        reset per pool: on a shared pool, one scheduler's reset clears it for all).
        True if every reset succeeded."""
        for i in sorted(live):
            self.inboxes[i].send(DrainScheduler())
        drained: set[int] = set()
        deadline = time.monotonic() + timeout_s
        while drained != live and time.monotonic() < deadline:
            _, msg = self._recv(0.1)
            if isinstance(msg, SchedulerDrained):
                drained.add(msg.scheduler)
            elif isinstance(msg, SchedulerStats):
                stats[msg.scheduler] = msg
        if drained != live:
            return False
        targets = [min(live)] if self.cfg.pool == "shared" else sorted(live)
        for i in targets:
            self.inboxes[i].send(ResetPrefixCache())
        results = {}
        while len(results) < len(targets) and time.monotonic() < deadline:
            _, msg = self._recv(0.1)
            if isinstance(msg, PrefixCacheReset):
                results[msg.scheduler] = msg.success
            elif isinstance(msg, SchedulerStats):
                stats[msg.scheduler] = msg
        return len(results) == len(targets) and all(results.values())


def _context(model_free: bool = False):
    """Children start from a fork server that imported torch and the serving modules once
    (a fresh process, not a fork of the front end, so they inherit none of its state, as
    with spawn); each child then costs a fork rather than a Python start and a torch import.
    ``SHMKV_RUN_START_METHOD=spawn`` starts them the slow way."""
    method = os.environ.get("SHMKV_RUN_START_METHOD", "forkserver")
    if method not in ("forkserver", "spawn"):
        raise UsageError(f"SHMKV_RUN_START_METHOD must be forkserver or spawn, got {method!r}")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(
            ["shmkv.serve.engine", "shmkv.serve.scheduler", "shmkv.serve.forkserver_signals"]
            if model_free else
            ["torch", "shmkv.ranks.block_table", "shmkv.serve.engine", "shmkv.serve.rank",
             "shmkv.serve.scheduler", "shmkv.serve.forkserver_signals"])
    return ctx


def _start_helpers(ctx) -> None:
    from multiprocessing import forkserver

    if ctx.get_start_method() == "forkserver":
        forkserver.ensure_running()
    else:
        resource_tracker.ensure_running()


def _scheduler_entry(index: int, names: dict[str, str], front_end_pid: int) -> None:
    from shmkv.serve.scheduler import scheduler_main

    scheduler_main(index, names, front_end_pid)
