"""Process bodies for the shared offload-tier tests (importable, for the spawn context)."""

from __future__ import annotations

import os
import random
import signal
import time
import traceback

from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key

from shmkv.vllm import SharedCPUOffloadingManager

CHILD_DEADLINE_S = 90.0


def prompt_key(prompt: int, block: int):
    """The key of block ``block`` of shared system prompt ``prompt``."""
    return make_offload_key(b"P" + prompt.to_bytes(4, "big") + block.to_bytes(4, "big"), 0)


def private_key(pid: int, request: int, block: int):
    return make_offload_key(b"R" + pid.to_bytes(4, "big") + request.to_bytes(4, "big")
                            + block.to_bytes(4, "big"), 0)


def scripted_peer(name: str, num_chunks: int, to_parent, from_parent) -> None:
    """Stores, leaves one store in flight, pins, then waits to be SIGKILLed."""
    manager = SharedCPUOffloadingManager(name, num_chunks, label="peer")
    ctx = ReqContext("peer")
    manager.on_new_request(ctx)
    keys = [prompt_key(0, i) for i in range(3)]
    out = manager.prepare_store(keys, ctx)
    assert out is not None and out.keys_to_store == keys
    manager.complete_store(keys, ctx)
    to_parent.put("stored")
    out = manager.prepare_store([prompt_key(0, 3)], ctx)
    assert out is not None and out.keys_to_store == [prompt_key(0, 3)]
    to_parent.put("pending")
    assert from_parent.get(timeout=60) == "pin"
    manager.prepare_load([prompt_key(0, 0)], ctx)
    to_parent.put("pinned")
    from_parent.get(timeout=60)  # never answered: the parent kills this process
    os._exit(3)


def replica(name: str, num_chunks: int, seed: int, stop) -> None:
    """One replica's scheduler: chat requests over shared system prompts, each admitted
    with its leading tier hits pinned, its other blocks offloaded, pins released after;
    until ``stop`` is set."""
    rng = random.Random(seed)
    manager = SharedCPUOffloadingManager(name, num_chunks, label=f"replica{seed}")
    pid = os.getpid()
    request = 0
    while not stop.is_set():
        request += 1
        ctx = ReqContext(f"{pid}-{request}")
        manager.on_new_request(ctx)
        prompt = rng.randrange(4)
        keys = [prompt_key(prompt, i) for i in range(rng.randint(2, 6))]
        keys += [private_key(pid, request, i) for i in range(rng.randint(0, 3))]
        for position, key in enumerate(keys):
            ctx.set_offload_key_position(key, 16 * (position + 1))
        with manager.lock:  # the connector's pattern: lookup hits and pin them atomically
            hits = []
            for key in keys:
                if manager.lookup(key, ctx) != LookupResult.HIT:
                    break
                hits.append(key)
            if hits:
                manager.prepare_load(hits, ctx)
        out = manager.prepare_store(keys[len(hits):], ctx)
        if rng.random() < 0.3:
            time.sleep(rng.random() * 0.002)  # a transfer in flight
        if out is not None and out.keys_to_store:
            manager.complete_store(out.keys_to_store, ctx, success=rng.random() < 0.9)
        if hits:
            manager.complete_load(hits, ctx)
        manager.on_request_finished(ctx)
    manager.close()


def replica_zygote(name: str, num_chunks: int, seed: int, num_replicas: int, stop,
                   to_parent) -> None:
    """Forks ``num_replicas`` replica processes (importing vLLM once, here, instead of once
    per spawned replica), tells the parent their pids, and reports how each one ended:
    ``"exit:<code>"``, ``"signal:<number>"`` or ``"timeout"`` (then it was killed)."""
    pids = []
    for i in range(num_replicas):
        pid = os.fork()
        if pid == 0:
            try:
                replica(name, num_chunks, seed + i, stop)
            except BaseException:
                traceback.print_exc()
                os._exit(3)
            os._exit(0)
        pids.append(pid)
    to_parent.put(pids)
    deadline = time.monotonic() + CHILD_DEADLINE_S
    ends = {}
    for pid in pids:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                ends[pid] = (f"signal:{os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
                             else f"exit:{os.WEXITSTATUS(status)}")
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                ends[pid] = "timeout"
                break
            time.sleep(0.002)
    to_parent.put(ends)


def step_holder(name: str, num_chunks: int, to_parent, from_parent) -> None:
    """A replica inside its step region (vLLM's connector holding ``manager.lock``) that
    looked up a HIT and has not loaded it yet; leaves the region on command."""
    manager = SharedCPUOffloadingManager(name, num_chunks, label="step-holder")
    ctx = ReqContext("holder")
    with manager.lock:
        assert manager.lookup(prompt_key(0, 0), ctx) == LookupResult.HIT
        to_parent.put("in step")
        assert from_parent.get(timeout=60) == "end step"
    to_parent.put("step over")
    assert from_parent.get(timeout=60) == "exit"
    manager.close()


def start_together(base: str, rounds: int, index: int, barrier, errors) -> None:
    """Round after round, opens a new tier at the same instant as its peers (the first
    creates it, the others attach while it is being made), then closes it."""
    for r in range(rounds):
        barrier.wait(timeout=60)
        try:
            manager = SharedCPUOffloadingManager(f"{base}-{r}", 1 << 17, label=f"start{index}")
        except Exception as exc:  # noqa: BLE001 (reported to the parent)
            errors.put(f"round {r}: {type(exc).__name__}: {exc}")
            manager = None
        barrier.wait(timeout=60)
        if manager is not None:
            manager.close()
        barrier.wait(timeout=60)
        if index == 0:
            SharedCPUOffloadingManager.unlink(f"{base}-{r}")
