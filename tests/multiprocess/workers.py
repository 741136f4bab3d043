"""Worker processes for the multi-process tests (module level, so spawn can import them).

Every worker attaches by name, does its work, and reports through its exit code: 0 for
success; anything else is a failure the parent asserts on. Failures print why to stderr.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import time
import traceback

from shmkv import BlockPool
from tests.helpers import FakeRequest

BS = 16
SYSTEM_PROMPTS = [list(range(p * 10_000, p * 10_000 + 96)) for p in range(4)]


def hammer(name: str, seed: int, duration_s: float, kernel: str, lock_enabled: bool) -> None:
    """Serving-like churn: admit requests (lookup + touch + allocate + cache under one hold),
    check that every block a live request holds is still referenced, finish requests."""
    rng = random.Random(seed)
    try:
        pool = BlockPool.attach(name, kernel=kernel, label=f"hammer-{seed}",
                                _lock_enabled=lock_enabled)
        running: list[tuple[FakeRequest, list]] = []
        deadline = time.monotonic() + duration_s
        steps = 0
        while time.monotonic() < deadline:
            steps += 1
            if rng.random() < 0.55 or not running:
                prompt = rng.choice(SYSTEM_PROMPTS)[: rng.choice([32, 64, 96])]
                tokens = prompt + [rng.randrange(50_000) for _ in range(rng.randint(1, 40))]
                req = FakeRequest(tokens)
                with pool.lock():
                    # Alternate the two ways of finding a prefix hit; both must agree.
                    if steps % 2:
                        hits = pool.get_cached_prefix(req.block_hashes)
                    else:
                        hits = []
                        for h in req.block_hashes:
                            found = pool.get_cached_block(h, [0])
                            if found is None:
                                break
                            hits.append(found[0])
                    pool.touch(hits)
                    need = -(-len(tokens) // BS) - len(hits)
                    try:
                        blocks = hits + pool.get_new_blocks(need)
                    except ValueError:
                        pool.free_blocks(reversed(hits))
                        continue
                    pool.cache_full_blocks(req, blocks, len(hits), len(tokens) // BS, BS, 0)
                running.append((req, blocks))
            else:
                req, blocks = running.pop(rng.randrange(len(running)))
                pool.free_blocks(reversed(blocks))
            if steps % 16 == 0:  # what a live request holds must stay held and unchanged
                for req, blocks in running:
                    for i, b in enumerate(blocks):
                        if b.ref_cnt < 1:
                            raise AssertionError(f"held block {b.block_id} has ref_cnt {b.ref_cnt}")
                        if i < len(req.block_hashes) and b.block_hash is not None and (
                            b.block_hash[:32] != req.block_hashes[i]
                        ):
                            raise AssertionError(f"held block {b.block_id} changed its hash")
        for _, blocks in running:
            pool.free_blocks(reversed(blocks))
        pool.close()
    except BaseException:  # noqa: BLE001  (report anything, then fail)
        traceback.print_exc()
        sys.exit(1)


def check_from_fresh_process(name: str, expect_all_free: bool) -> None:
    """Attach, run check_invariants, optionally require every block but the null one free."""
    try:
        pool = BlockPool.attach(name, label="checker")
        pool.check_invariants()
        if expect_all_free:
            free = pool.get_num_free_blocks()
            if free != pool.num_gpu_blocks - 1:
                raise AssertionError(f"{free} of {pool.num_gpu_blocks - 1} blocks free")
        pool.close()
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        sys.exit(1)


def cache_then_wait(name: str, tokens: list[int], cached, release, done) -> None:
    """Process A: cache a prompt, signal, wait, then free it and close."""
    pool = BlockPool.attach(name, label="A")
    req = FakeRequest(tokens)
    blocks = pool.get_new_blocks(len(req.block_hashes))
    pool.cache_full_blocks(req, blocks, 0, len(blocks), BS, 0)
    cached.set()
    if not release.wait(60):
        sys.exit(2)
    pool.free_blocks(reversed(blocks))
    pool.close()
    done.set()


def leave_without_close(name: str, how: str, ready) -> None:
    """Attach, take blocks, then end without close() in the way ``how`` says."""
    pool = BlockPool.attach(name, label=f"leaver-{how}")
    pool.get_new_blocks(6)
    ready.set()
    if how == "return":
        return
    if how == "exception":
        raise RuntimeError("a scheduler crashed with an exception")
    if how == "os_exit":
        os._exit(3)
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError(how)


def attach_expecting(name: str, kwargs: dict, expected_error: str, match: str) -> None:
    """Attach with expectations that do not hold; exit 0 only for the expected error."""
    import shmkv

    try:
        BlockPool.attach(name, **kwargs)
    except getattr(shmkv, expected_error) as exc:
        if match in str(exc):
            return
        print(f"wrong message: {exc}", file=sys.stderr)
        sys.exit(1)
    print("attach succeeded", file=sys.stderr)
    sys.exit(1)


def create_and_wait(name: str, ready, stop) -> None:
    """Create a pool, hold a few blocks, and wait to be killed."""
    pool = BlockPool.create(name, 32, label="creator")
    pool.get_new_blocks(4)
    ready.set()
    stop.wait(60)


def hold_lock_forever(name: str, held) -> None:
    """Attach, take four blocks and the pool lock, and never give the lock back (the parent
    kills us)."""
    pool = BlockPool.attach(name, label="holder")
    pool.get_new_blocks(4)
    pool.lock().acquire()
    held.set()
    time.sleep(120)


def attach_hold_then_call(name: str, kernel: str, ready, go, result) -> None:
    """Attach and take three blocks; once told, make one more call and report what it
    raised (the parent reclaims this process's slot while it is stopped)."""
    from shmkv import FencedError

    pool = BlockPool.attach(name, kernel=kernel, label="frozen")
    pool.get_new_blocks(3)
    ready.set()
    if not go.wait(60):
        raise SystemExit(2)
    try:
        pool.get_new_blocks(1)
    except FencedError as exc:
        result.put(f"FencedError: {exc}")
    else:
        result.put("no error")
    pool.close()


def attach_and_allocate(name: str, num_blocks: int) -> None:
    """Attach and allocate (a fault armed through SHMKV_FAULT may kill us inside)."""
    pool = BlockPool.attach(name, label="doomed")
    pool.get_new_blocks(num_blocks)
    pool.close()


def attach_with_fault(name: str, fault: str, stuck_after_s: float) -> None:
    """Attach with SHMKV_FAULT-style ``fault`` armed (the parent expects SIGKILL), or, with
    no fault, attach and close: exit 0."""
    from shmkv.pool import fault as shmkv_fault

    if fault:
        op, n = fault.split(":")
        shmkv_fault.arm(op, int(n))
    pool = BlockPool.attach(name, label="attacher", stuck_after_s=stuck_after_s,
                            lock_timeout_s=30)
    pool.close()


def take_blocks_then_sigkill(name: str, kernel: str, num_blocks: int, ready) -> None:
    """Attach, take ``num_blocks`` blocks, then die by SIGKILL (no close(), no reap)."""
    pool = BlockPool.attach(name, kernel=kernel, label="taker")
    pool.get_new_blocks(num_blocks)
    ready.set()
    os.kill(os.getpid(), signal.SIGKILL)


def wait_for_a_dead_holder(name: str, kernel: str, ready, go, result) -> None:
    """Attach; once told, take one block (waiting on a holder the parent then kills) and
    report whether this process's acquire was the one that took the lock over."""
    pool = BlockPool.attach(name, kernel=kernel, label="waiter")
    ready.set()
    if not go.wait(60):
        raise SystemExit(2)
    pool.get_new_blocks(1)
    report = pool.last_repair
    result.put((os.getpid(), bool(report is not None and report.took_over)))
    pool.close()
