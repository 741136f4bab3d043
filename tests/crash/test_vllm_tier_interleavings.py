"""Randomized interleavings of everything that can touch one vLLM offload tier, with real
processes: replicas (an engine core and a GPU worker each, ``vllm_tier_soak.py``) serve
random prompts, loading hits (the worker byte-compares every chunk with what its key's
producer wrote) and storing misses, while a seeded driver SIGKILLs cores, workers or both,
starts replicas, runs ``shmkv cleanup``'s code (plain and ``--include-idle``), removes or
replaces one object of the tier (its table, data region or replica lock file), removes the
whole tier (``shmkv unlink --force``), stops every replica, and starts a replica of an
earlier shmkv (its tree from git history) on the same name.

What must hold whatever the interleaving: no load ever reads bytes other than its key's;
every process ends by the driver's hand (0, or SIGKILL) or is refused at start naming why
(exit 3), never with another error; at the end the pool's invariants hold, nothing is left
held, and removing the tier leaves nothing in /dev/shm. A variant whose cores ignore the
region binding shows the test sees wrong KV when the rule is broken."""

from __future__ import annotations

import io
import json
import mmap
import multiprocessing as mp
import os
import random
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.kv_offload.base")

from vllm.v1.kv_offload.base import LookupResult, ReqContext  # noqa: E402

from shmkv import BlockPool  # noqa: E402
from shmkv.errors import ShmKVError  # noqa: E402
from shmkv.pool import siblings  # noqa: E402
from shmkv.pool.segment import Segment  # noqa: E402
from shmkv.vllm import SharedCPUOffloadingManager  # noqa: E402
from shmkv.vllm.lifecycle import join_as_worker  # noqa: E402
from shmkv.vllm.region import region_path  # noqa: E402
from shmkv.vllm.replicas import replica_locks_path  # noqa: E402
from shmkv.vllm.tier import tier_table_name  # noqa: E402
from tests.conftest import unique_pool_name  # noqa: E402
from tests.crash import vllm_tier_soak as soak  # noqa: E402
from tests.multiprocess.conftest import join_processes  # noqa: E402

pytestmark = [pytest.mark.crash, pytest.mark.multiprocess, pytest.mark.long]

ROOT = Path(__file__).resolve().parents[2]
EARLIER_RELEASE = "d1248c4^"  # tier table v2 on a pool of layout v8: no generations
MAX_LIVE = 4
STOP_WAIT_S = 90.0  # a replica still starting (importing vLLM on a busy machine) stops late
ENDED = (0, -signal.SIGKILL, soak.REFUSED)  # by the driver's hand, or refused at start

# An earlier release's replica (worker and core in one process) serving the same prompts on
# the same pool name for a few seconds, byte-checking every load; prints {checked, wrong}.
EARLIER_REPLICA = r"""
import json, sys, time, hashlib, random
import numpy as np
sys.path.insert(0, sys.argv[1])
pool, num_chunks, chunk_bytes = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
seconds = float(sys.argv[5])
from vllm.v1.kv_offload.base import LookupResult, ReqContext
from shmkv.vllm import SharedCPUOffloadingManager
from shmkv.vllm.region import join_as_worker, region_path
def key_bytes(key):
    pattern = np.frombuffer(hashlib.blake2b(key, digest_size=16).digest(), np.uint8)
    return np.tile(pattern, chunk_bytes // 16)
def offload_key(prompt, chunk):
    return hashlib.blake2b(f"p{prompt}-c{chunk}".encode(), digest_size=16).digest() + bytes(4)
locks, _ = join_as_worker(pool, num_chunks, 32, "earlier", num_chunks * chunk_bytes)
region = np.memmap(region_path(pool), np.uint8, "r+", 0, (num_chunks, chunk_bytes))
m = SharedCPUOffloadingManager(pool, num_chunks, replica_id="earlier", max_processes=32)
ctx, rng, checked, wrong = ReqContext("e"), random.Random(7), 0, 0
end = time.monotonic() + seconds
while time.monotonic() < end:
    keys = [offload_key(rng.randrange(10), c) for c in range(4)]
    with m.lock:  # a step: its HITs stay pinned until prepare_load
        hits = [k for k in keys if m.lookup(k, ctx) == LookupResult.HIT]
        spec = m.prepare_load(hits, ctx) if hits else None
    if hits:
        for chunk, k in zip(spec.block_ids.tolist(), hits):
            checked += 1
            wrong += not bool((region[chunk] == key_bytes(k)).all())
        m.complete_load(hits, ctx)
    misses = [k for k in keys if k not in hits]
    with m.lock:
        out = m.prepare_store(misses, ctx) if misses else None
    if out is not None and out.keys_to_store:
        for chunk, k in zip(out.store_spec.block_ids.tolist(), out.keys_to_store):
            region[chunk, :] = key_bytes(k)
        with m.lock:
            m.complete_store(out.keys_to_store, ctx)
print(json.dumps({"checked": checked, "wrong": wrong}), flush=True)
m.close()
locks.close()
"""
EARLIER_UNLINK = r"""
import sys
sys.path.insert(0, sys.argv[1])
from shmkv.vllm import SharedCPUOffloadingManager
SharedCPUOffloadingManager.unlink(sys.argv[2])
"""


class Replica:
    """One replica: its worker, then its engine core (vLLM's order), with a stop of its own."""

    def __init__(self, ctx, pool: str, name: str, seed: int, trust_rows: bool):
        self.name = name
        self.stop = soak.StopFlag(ctx)
        # its core's own counters, written by it alone (no lock a SIGKILL could leave taken):
        # loads checked, wrong, stores, resets, steps
        self.counters = counters = ctx.Array("q", 5, lock=False)
        self.stuck: list[str] = []
        self.joined = ctx.Event()  # its core and worker have both joined the tier
        self.commands, self.acks = ctx.Queue(), ctx.Queue()
        self.core_pid = ctx.Value("i", 0)
        self.worker = ctx.Process(target=soak.worker, args=(
            pool, name, self.core_pid, self.commands, self.acks), name=f"{name}-worker")
        self.worker.start()
        self.core = ctx.Process(target=soak.core, args=(
            pool, name, seed, self.stop, counters, self.commands, self.acks, False,
            self.joined, trust_rows), name=f"{name}-core")
        self.core.start()
        self.core_pid.value = self.core.pid

    def alive(self) -> bool:
        return self.core.is_alive() or self.worker.is_alive()

    def kill(self, which: str) -> None:
        procs = {"core": [self.core], "worker": [self.worker],
                 "both": [self.worker, self.core]}[which]
        for proc in procs:
            if proc.pid and proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)

    def end(self) -> list[int | None]:
        """Stops it (if it still runs) and returns the exit codes: core, worker."""
        self.stop.set()
        if not self.joined.is_set() and self.alive():
            self.kill("both")  # still starting (importing vLLM): nothing of it to wait for
        for proc in (self.core, self.worker):
            proc.join(STOP_WAIT_S)
            if proc.is_alive():  # stuck: its stack to stderr, then the join below kills it
                self.stuck.append(proc.name)
                print(f"{proc.name} still runs {STOP_WAIT_S:.0f} s after its stop",
                      file=sys.stderr)
                os.kill(proc.pid, signal.SIGUSR1)
                time.sleep(1)
        codes = join_processes([self.core, self.worker], 10)
        for q in (self.commands, self.acks):
            q.cancel_join_thread()
            q.close()
        return codes


def _earlier_tree(tmp: Path) -> Path | None:
    """The earlier release's tree, unpacked (None where git history lacks it, or where the
    vLLM installed is not the 0.33 it runs on)."""
    import vllm

    if not vllm.__version__.startswith("0.33."):
        return None
    try:
        data = subprocess.run(["git", "-C", str(ROOT), "archive", EARLIER_RELEASE, "shmkv"],
                              capture_output=True, timeout=60, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    tree = tmp / "earlier"
    tree.mkdir(exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(tree, filter="data")
    return tree


def _cleanup(pool: str, include_idle: bool) -> None:
    """``shmkv cleanup --prefix POOL`` (``--include-idle``): the command's own code path."""
    plan = [v for v in siblings.plan(include_idle=include_idle) if siblings.in_scope(v, pool)]
    siblings.remove(plan)


def _replace_region(pool: str) -> None:
    """A copy of the region, trailer and all, renamed over it."""
    path = region_path(pool)
    try:
        shutil.copyfile(path, path + ".copy")
    except FileNotFoundError:
        return
    os.chmod(path + ".copy", 0o600)
    os.rename(path + ".copy", path)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


PLAN = {"start": 6, "kill core": 3, "kill worker then core": 1, "cleanup": 2,
        "cleanup --include-idle": 2, "remove table": 1, "remove region": 1,
        "replace region": 1, "remove lock file": 1, "unlink --force": 1, "stop all": 0.5,
        "earlier release": 1}
# The race detector's plan: replicas come and go while the region is removed or replaced,
# the one fault whose rule (the region binding) its cores ignore.
DETECTOR_PLAN = {"start": 4, "kill core": 2, "remove region": 1, "replace region": 1}


def run_interleavings(seed: int, seconds: float, tmp: Path, trust_rows: bool = False,
                      earlier: bool = True, plan: dict[str, float] | None = None) -> dict:
    """Runs the driver for ``seconds``, choosing each action by the weights of ``plan``
    (default ``PLAN``); returns what happened (counters, actions, exit codes)."""
    print(f"interleavings seed {seed}")
    rng = random.Random(seed)
    ctx = mp.get_context("spawn")
    pool = unique_pool_name("mix")
    tree = _earlier_tree(tmp) if earlier else None
    replicas: list[Replica] = []
    ended: list[Replica] = []
    earlier_runs: list[subprocess.Popen] = []
    actions: dict[str, int] = {}
    made = 0

    def start() -> None:
        nonlocal made
        made += 1
        replicas.append(Replica(ctx, pool, f"r{made}", rng.randrange(1 << 30), trust_rows))

    def reap() -> None:
        for r in [r for r in replicas if not r.alive()]:
            replicas.remove(r)
            r.codes = r.end()
            ended.append(r)

    weights_of = dict(PLAN if plan is None else plan)
    if tree is None:
        weights_of.pop("earlier release", None)
    names, weights = zip(*weights_of.items(), strict=True)
    for _ in range(2):
        start()
    try:
        for r in replicas:  # the clock starts once the first replicas serve
            r.joined.wait(STOP_WAIT_S)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(rng.uniform(0.2, 0.8))
            reap()
            serving = [r for r in replicas if r.joined.is_set()]
            action = rng.choices(names, weights)[0]
            actions[action] = actions.get(action, 0) + 1
            began = time.monotonic()
            if action == "start" and len(replicas) < MAX_LIVE:
                start()
            elif action == "kill core" and serving:
                rng.choice(serving).kill("core")
            elif action == "kill worker then core" and serving:
                victim = rng.choice(serving)
                victim.kill("worker")
                time.sleep(0.05)
                victim.kill("core")
            elif action.startswith("cleanup"):
                _cleanup(pool, include_idle=action.endswith("idle"))
            elif action == "remove table":
                Segment.unlink(tier_table_name(pool))
            elif action == "remove region":
                _remove(region_path(pool))
            elif action == "replace region":
                _replace_region(pool)
            elif action == "remove lock file":
                _remove(replica_locks_path(pool))
            elif action == "unlink --force":
                SharedCPUOffloadingManager.unlink(pool)
            elif action == "stop all":
                for r in replicas:
                    r.codes = r.end()
                    ended.append(r)
                replicas.clear()
                SharedCPUOffloadingManager.unlink(pool)  # a tier refused for good starts anew
            elif action == "earlier release" and len(earlier_runs) < 2:
                earlier_runs.append(subprocess.Popen(
                    [sys.executable, "-c", EARLIER_REPLICA, str(tree), pool,
                     str(soak.NUM_CHUNKS), str(soak.CHUNK_BYTES), "3"],
                    cwd=tree, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
            took = time.monotonic() - began
            if took > 1:
                print(f"  {action}: {took:.1f} s")
    finally:
        for r in replicas:
            r.codes = r.end()
            ended.append(r)
        earlier_results = []
        for proc in earlier_runs:
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err
            earlier_results.append(json.loads(out.strip().splitlines()[-1]))
        if tree is not None:
            subprocess.run([sys.executable, "-c", EARLIER_UNLINK, str(tree), pool], cwd=tree,
                           timeout=120, check=True)
    final = _final_check(pool)
    SharedCPUOffloadingManager.unlink(pool)
    left = [e for e in os.listdir("/dev/shm") if pool in e]
    checked, wrong, stores, resets, steps = (sum(r.counters[i] for r in ended)
                                             for i in range(5))
    result = {"seed": seed, "checked": checked, "wrong": wrong, "stores": stores,
              "resets": resets, "steps": steps, "replicas": len(ended), "actions": actions,
              "earlier": earlier_results, "final": final, "left": left,
              "ended": [(r.name, r.codes) for r in ended],
              "stuck": [name for r in ended for name in r.stuck]}
    print(json.dumps({k: v for k, v in result.items() if k != "ended"}))
    return result


def _final_check(pool: str) -> str:
    """From a fresh process's view: the pool (if the tier is there) is valid and, once the
    dead are reaped, holds nothing. Returns what was found."""
    try:
        bp = BlockPool.attach(pool)
    except ShmKVError as exc:
        return f"no pool ({type(exc).__name__})"
    try:
        bp.reap_dead()
        bp.check_invariants()
        held = int(bp.block_rows()["ref_cnt"][1:].max(initial=0))
        assert held == 0, f"{held} references left after every process ended"
        return "valid, nothing held"
    finally:
        bp.close()


@pytest.mark.timeout(420)
def test_no_interleaving_loads_wrong_kv(tmp_path):
    """A minute of random interleavings (seed printed): no wrong byte in any load, every
    process ends by the driver's hand or a refusal naming why, nothing held or left."""
    r = run_interleavings(seed=4401, seconds=60, tmp=tmp_path)
    assert r["wrong"] == 0, r
    assert all(e["wrong"] == 0 for e in r["earlier"]), r["earlier"]
    bad = [(name, codes) for name, codes in r["ended"] if any(c not in ENDED for c in codes)]
    assert not bad, bad
    assert r["stuck"] == [], r["stuck"]
    assert r["left"] == [], r["left"]
    assert r["checked"] >= 50 and r["steps"] >= 300, r  # it served while all this happened


def _stale_store_loaded_elsewhere(pool: str, trust_rows: bool) -> bytes | None:
    """The interleaving the region binding exists for, step by step: replica A's worker
    maps the data region; the region is removed; replica B's worker makes a new one; A
    stores a key (its worker writes the old region) and B loads it from the new one.
    ``trust_rows``: A's core ignores the binding, as the race detector's do. Returns the
    bytes B's worker reads for the key, or None if A's store was refused."""
    chunk_bytes = soak.CHUNK_BYTES
    key = soak.offload_key(7, 0)
    written = bytes(range(256)) * (chunk_bytes // 256)
    a_locks, _ = join_as_worker(pool, soak.NUM_CHUNKS, 32, "A",
                                soak.NUM_CHUNKS * chunk_bytes)
    fd = os.open(region_path(pool), os.O_RDWR)
    a_region = mmap.mmap(fd, soak.NUM_CHUNKS * chunk_bytes)
    os.close(fd)
    os.unlink(region_path(pool))
    b_locks, _ = join_as_worker(pool, soak.NUM_CHUNKS, 32, "B",
                                soak.NUM_CHUNKS * chunk_bytes)
    fd = os.open(region_path(pool), os.O_RDONLY)
    b_region = mmap.mmap(fd, soak.NUM_CHUNKS * chunk_bytes, prot=mmap.PROT_READ)
    os.close(fd)
    a = SharedCPUOffloadingManager(pool, soak.NUM_CHUNKS, replica_id="A", max_processes=32)
    b = SharedCPUOffloadingManager(pool, soak.NUM_CHUNKS, replica_id="B", max_processes=32)
    try:
        if trust_rows:
            a._region_lost = lambda: False
        ctx = ReqContext("stale")
        out = a.prepare_store([key], ctx)
        if out is None:
            return None
        chunk = int(out.store_spec.block_ids[0])
        a_region[chunk * chunk_bytes:(chunk + 1) * chunk_bytes] = written
        a.complete_store([key], ctx)
        assert b.lookup(key, ctx) == LookupResult.HIT
        spec = b.prepare_load([key], ctx)
        chunk = int(spec.block_ids[0])
        read = b_region[chunk * chunk_bytes:(chunk + 1) * chunk_bytes]
        b.complete_load([key], ctx)
        assert read == written or trust_rows, "wrong KV loaded with the binding honoured"
        return read
    finally:
        for m in (a, b):
            m.pool.check_invariants()
            m.close()
        a_region.close()
        b_region.close()
        a_locks.close()
        b_locks.close()
        SharedCPUOffloadingManager.unlink(pool)


def test_a_replica_on_a_removed_region_stores_nothing_others_load():
    """The binding honoured: replica A, whose worker maps the removed region, stores
    nothing, so no replica loads a chunk A's worker wrote elsewhere."""
    assert _stale_store_loaded_elsewhere(unique_pool_name("bind"), trust_rows=False) is None


def test_the_interleaving_loads_wrong_kv_when_the_region_binding_is_ignored():
    """The race detector, deterministic: the same steps with A's core trusting its row
    whatever region its worker mapped; B loads the key and reads zeros, not A's bytes."""
    read = _stale_store_loaded_elsewhere(unique_pool_name("bind"), trust_rows=True)
    assert read is not None and read == bytes(len(read)), "the detector saw no wrong KV"


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="with the region binding ignored, a replica whose workers map a "
                   "removed or replaced region stores keys that others load as zeros")
def test_the_interleavings_see_wrong_kv_when_the_region_binding_is_ignored(tmp_path):
    """The random driver as a race detector: every core trusting its replica's row whatever
    region its workers mapped, in minute-long rounds until a wrong load is seen (up to
    five: on a loaded machine a round may serve too few steps to meet the interleaving,
    which the deterministic detector above meets every time)."""
    for seed in range(4401, 4406):
        r = run_interleavings(seed=seed, seconds=60, tmp=tmp_path, trust_rows=True,
                              earlier=False, plan=DETECTOR_PLAN)
        assert r["wrong"] == 0


@pytest.mark.slow
@pytest.mark.timeout(7200)
@pytest.mark.parametrize("seed", range(20))
def test_interleavings_long(tmp_path, seed):
    """The interleavings for ten minutes per seed (``scripts/tier_soak.py`` runs them for
    hours)."""
    r = run_interleavings(seed=seed, seconds=600, tmp=tmp_path)
    assert r["wrong"] == 0 and r["left"] == []
    assert all(e["wrong"] == 0 for e in r["earlier"])
    assert not [c for _, codes in r["ended"] for c in codes if c not in ENDED]
    assert r["stuck"] == []
