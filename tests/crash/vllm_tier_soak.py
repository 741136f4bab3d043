"""The processes of the offload tier's soak (``test_vllm_tier_soak.py``).

A replica is an engine core (:func:`core`: a ``SharedCPUOffloadingManager`` in the
replica's row) and a GPU worker (:func:`worker`: joins the same row as vLLM's worker does,
maps the real data region, and moves bytes on the core's command). The bytes a producer
writes for a key are a function of the key alone, so a reader knows what it must find: a
chunk whose bytes differ from its key's is wrong KV.

The worker finishes the command it is executing even when its core has died (vLLM's workers
finish their step), writing slowly, so that a chunk handed to another replica too early is
overwritten after its new owner wrote it.
"""

from __future__ import annotations

import faulthandler
import hashlib
import queue
import random
import signal
import sys
import time
import traceback

import numpy as np

CHUNK_BYTES = 8192
NUM_CHUNKS = 24
KEYS_PER_PROMPT = 4
NUM_PROMPTS = 10
WRITE_SLICES = 4  # a write is this many slices with a nap between them (a GPU step)
MAX_STORES_IN_FLIGHT = 3


def offload_key(prompt: int, chunk: int) -> bytes:
    return hashlib.blake2b(f"p{prompt}-c{chunk}".encode(), digest_size=16).digest() + bytes(4)


def key_bytes(key: bytes) -> np.ndarray:
    """What every producer of ``key`` writes into its chunk."""
    pattern = np.frombuffer(hashlib.blake2b(key, digest_size=16).digest(), np.uint8)
    return np.tile(pattern, CHUNK_BYTES // 16)


class StopFlag:
    """A stop flag with no lock: an engine core SIGKILLed while it reads the flag leaves
    nothing taken. (A multiprocessing Event takes its condition's lock in ``is_set``; a core
    killed there would leave it held, and the driver's ``set`` would wait forever.)"""

    def __init__(self, ctx) -> None:
        self._flag = ctx.RawValue("b", 0)

    def set(self) -> None:
        self._flag.value = 1

    def is_set(self) -> bool:
        return bool(self._flag.value)


def worker(pool: str, engine_id: str, core_pid_box, commands, acks) -> None:
    """A GPU worker: joins the replica, maps the region; executes its core's jobs in order,
    ("write", job, chunks, keys) -> ("written", job) and ("read", job, chunks, keys) ->
    ("read", job, [ok per chunk]); exits once its core is gone and its queue is empty."""
    faulthandler.register(signal.SIGUSR1)  # a stuck worker's stack, on demand
    from shmkv.vllm.lifecycle import join_as_worker
    from shmkv.vllm.region import region_path

    try:
        locks, _ = join_as_worker(pool, NUM_CHUNKS, 32, engine_id, NUM_CHUNKS * CHUNK_BYTES)
        region = np.memmap(region_path(pool), np.uint8, "r+", 0, (NUM_CHUNKS, CHUNK_BYTES))
    except _refusals() as exc:
        _refused(acks, exc)
    acks.put("ready")
    slice_bytes = CHUNK_BYTES // WRITE_SLICES
    while True:
        try:
            kind, job, chunks, keys = commands.get(timeout=0.1)
        except queue.Empty:
            if _gone(core_pid_box.value):
                break  # its core is gone and every job it sent is done: as vLLM's worker
            continue
        if kind == "write":
            for part in range(WRITE_SLICES):
                lo, hi = part * slice_bytes, (part + 1) * slice_bytes
                for chunk, key in zip(chunks, keys, strict=True):
                    region[chunk, lo:hi] = key_bytes(key)[lo:hi]
                time.sleep(0.005)
            acks.put(("written", job))
        else:
            acks.put(("read", job, [bool((region[c] == key_bytes(k)).all())
                                    for c, k in zip(chunks, keys, strict=True)]))
    del region
    locks.close()
    acks.cancel_join_thread()  # nobody reads them any more: never wait to flush them


def add(counters, i: int, n: int) -> None:
    """Adds ``n`` to ``counters[i]``: under the array's lock where it has one (shared by
    every core), plainly where it has none (one core's own: a core SIGKILLed while holding
    a shared lock would stop every other core at its next count)."""
    lock = getattr(counters, "get_lock", None)
    if lock is None:
        counters[i] += n
        return
    with lock():
        counters[i] += n


REFUSED = 3  # the exit code of a process the tier refused at start, naming why
UNEXPECTED = 4  # the exit code of a process that met an error the tier should never raise


def _refusals() -> tuple[type[BaseException], ...]:
    """The errors the tier may refuse a starting process with, each naming the object and
    what to do."""
    from shmkv.errors import LayoutMismatchError, PoolFullError, SegmentError

    return (LayoutMismatchError, PoolFullError, SegmentError)


def _refused(acks, exc: BaseException) -> None:
    """Reports a refusal to the other process of the replica and exits REFUSED."""
    acks.put(("refused", f"{type(exc).__name__}: {exc}"))
    acks.close()
    acks.join_thread()
    raise SystemExit(REFUSED)


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has died (a zombie counts: its parent may not have joined
    it yet)."""
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] == b"Z"
    except FileNotFoundError:
        return True


class _Jobs:
    """An engine core's jobs in flight on its worker, completed as the worker reports
    them (vLLM's connector: stores run asynchronously; a reset discards the completion of
    the jobs it cut off and calls on_reset_flushed once they are all reported)."""

    def __init__(self, manager, commands, acks, counters) -> None:
        self.manager, self.commands, self.acks, self.counters = (manager, commands, acks,
                                                                  counters)
        self.next_job = 0
        self.stores: dict[int, list[bytes]] = {}
        self.fenced: set[int] = set()
        self.reads: dict[int, list[bool]] = {}

    def send(self, kind: str, chunks: list[int], keys: list[bytes]) -> int:
        job, self.next_job = self.next_job, self.next_job + 1
        if kind == "write":
            self.stores[job] = keys
        self.commands.put((kind, job, chunks, keys))
        return job

    def take_acks(self, block: bool) -> None:
        from vllm.v1.kv_offload.base import ReqContext

        try:
            ack = self.acks.get(timeout=60) if block else self.acks.get_nowait()
        except queue.Empty:
            return
        if ack[0] == "read":
            self.reads[ack[1]] = ack[2]
            return
        job = ack[1]
        if job in self.fenced:
            self.fenced.discard(job)
            if not self.fenced:
                with self.manager.lock:
                    self.manager.on_reset_flushed()
            return
        keys = self.stores.pop(job)
        with self.manager.lock:
            self.manager.complete_store(keys, ReqContext(""))
        add(self.counters, 2, 1)

    def read(self, chunks: list[int], keys: list[bytes]) -> list[bool]:
        job = self.send("read", chunks, keys)
        while job not in self.reads:
            self.take_acks(block=True)
        return self.reads.pop(job)

    def reset(self) -> None:
        with self.manager.lock:
            self.manager.reset_cache()
            if not self.stores and not self.fenced:
                self.manager.on_reset_flushed()
        self.fenced.update(self.stores)
        self.stores.clear()


def core(pool: str, engine_id: str, seed: int, stop, counters, commands, acks,
         guard_off: bool = False, joined=None, trust_rows: bool = False) -> None:
    """An engine core: serves random prompts against the tier, loading hits (its worker
    checks every byte) and storing misses with up to MAX_STORES_IN_FLIGHT stores in flight;
    now and then resets with stores in flight. ``counters``: [loads checked, wrong chunks,
    stores, resets] and, if it has a fifth, steps served. ``joined`` (an Event) is set once
    the core and its worker have both joined the replica's row. ``trust_rows`` (a race
    detector): this core believes its replica's row whatever region its workers mapped
    (the region binding ignored). Exits
    REFUSED if the tier refused it or its worker at start, UNEXPECTED (with the traceback
    on stderr) on any other error."""
    faulthandler.register(signal.SIGUSR1)  # a stuck core's stack, on demand
    from shmkv.vllm import SharedCPUOffloadingManager

    rng = random.Random(seed)
    ready = acks.get(timeout=120)  # vLLM builds a replica's workers before its scheduler
    if ready != "ready":
        raise SystemExit(REFUSED)  # its worker was refused
    try:
        manager = SharedCPUOffloadingManager(pool, NUM_CHUNKS, replica_id=engine_id,
                                             max_processes=32)
    except _refusals() as exc:
        print(f"refused: {type(exc).__name__}: {exc}", file=sys.stderr)
        raise SystemExit(REFUSED) from None
    if guard_off:  # the race detector: this core ignores every replica's job bits
        manager._jobs = memoryview(bytearray(8 * len(manager._jobs))).cast("Q")
    if trust_rows:  # the race detector: this core ignores the region binding
        manager._region_lost = lambda: False
    if joined is not None:
        joined.set()
    try:
        _serve(manager, rng, stop, counters, commands, acks)
    except Exception:  # noqa: BLE001 (reported, and the exit code says it)
        traceback.print_exc()
        raise SystemExit(UNEXPECTED) from None


def _serve(manager, rng, stop, counters, commands, acks) -> None:
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    from shmkv.errors import SegmentError

    jobs = _Jobs(manager, commands, acks, counters)
    ctx = ReqContext("")
    steps = len(counters) > 4  # [4]: the steps served, where the caller counts them
    while not stop.is_set():
        if steps:
            add(counters, 4, 1)
        jobs.take_acks(block=len(jobs.stores) >= MAX_STORES_IN_FLIGHT)
        prompt = rng.randrange(NUM_PROMPTS)
        keys = [offload_key(prompt, c) for c in range(KEYS_PER_PROMPT)]
        with manager.lock:
            states = [manager.lookup(k, ctx) for k in keys]
            hits = [k for k, s in zip(keys, states, strict=True) if s == LookupResult.HIT]
            try:
                spec = manager.prepare_load(hits, ctx) if hits else None
            except SegmentError:  # the region was replaced since the lookups: no load
                spec = None
        if spec is not None:
            oks = jobs.read(spec.block_ids.tolist(), hits)
            add(counters, 0, len(oks))
            add(counters, 1, oks.count(False))
            with manager.lock:
                manager.complete_load(hits, ctx)
        misses = [k for k, s in zip(keys, states, strict=True) if s == LookupResult.MISS]
        if misses:
            with manager.lock:
                out = manager.prepare_store(misses, ctx)
            if out is not None and out.keys_to_store:
                jobs.send("write", out.store_spec.block_ids.tolist(), out.keys_to_store)
        if rng.random() < 0.05:  # a reset while stores are in flight
            jobs.reset()
            add(counters, 3, 1)
    manager.close()
