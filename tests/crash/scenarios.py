"""Deterministic crash scenarios: a survivor, a victim whose last call is killed at a chosen
store, and the two reference outcomes it must match.

Every scenario runs on a fresh 12-block pool with events on and alias rows
(``partial_keys``). The survivor (the test process)
sets up first; then a *victim* process attaches, sets up its own holdings, arms
``shmkv.pool.fault`` for its last call (``OPS[op]``) and makes it. The victim is killed before
its n-th store, or finishes the call and exits without ``close()``.

References, for the same scenario: ``never`` (the victim sets up and dies before its last
call) and ``done`` (it makes the call, then dies). After any kill, once the survivor has
recovered, the pool must be byte-for-byte what one of them gives: ``never`` for a kill before
the hold's commit, ``done`` after it.
"""

from __future__ import annotations

from shmkv import BlockPool
from tests.helpers import make_request

NUM_BLOCKS = 12
STUCK_AFTER_S = 0.1  # lock stuck with no holder: taken over after this long (tests only)


def survivor_request():
    return make_request(32, first_token=0)


def free_cached_request():
    return make_request(32, first_token=1000)


def victim_request():
    return make_request(32, first_token=2000)


def victim_second_request():
    return make_request(32, first_token=3000)


def zombie_request():
    return make_request(32, first_token=4000)


ALL_REQUESTS = (survivor_request, free_cached_request, victim_request, victim_second_request,
                zombie_request)


def survivor_setup(pool: BlockPool, op: str) -> list:
    """The survivor holds 3 blocks (2 cached) and leaves 2 cached blocks free; for ``reset``
    it holds nothing, so that the reset can succeed."""
    if op == "reset":
        blocks = pool.get_new_blocks(2)
        pool.cache_full_blocks(free_cached_request(), blocks, 0, 2, 16, 0)
        pool.free_blocks(reversed(blocks))
        return []
    held = pool.get_new_blocks(3)
    pool.cache_full_blocks(survivor_request(), held, 0, 2, 16, 0)
    freed = pool.get_new_blocks(2)
    pool.cache_full_blocks(free_cached_request(), freed, 0, 2, 16, 0)
    pool.free_blocks(reversed(freed))
    return held


def victim_setup(pool: BlockPool, op: str) -> dict:
    """What the victim holds before its last call."""
    if op == "reset":
        blocks = pool.get_new_blocks(2)
        pool.cache_full_blocks(victim_request(), blocks, 0, 2, 16, 0)
        pool.free_blocks(reversed(blocks))
        return {}
    cached = pool.get_new_blocks(2)
    pool.cache_full_blocks(victim_request(), cached, 0, 2, 16, 0)
    plain = pool.get_new_blocks(2)
    shared = pool.get_cached_prefix(survivor_request().block_hashes[:1])
    pool.touch(shared)  # shares a block the survivor holds: ref_cnt 2
    return {"cached": cached, "plain": plain, "shared": shared}


def victim_last_call(pool: BlockPool, op: str, held: dict) -> None:
    """The call that is killed."""
    if op == "allocate":
        pool.get_new_blocks(3)  # the two unhashed free blocks, then evicts a cached one
    elif op == "allocate-one":
        pool.get_new_blocks(1)  # an unhashed free block: a decode step's allocation
    elif op == "free":
        pool.free_blocks(held["cached"] + held["plain"])
    elif op == "free-one":
        pool.free_blocks(held["plain"][1:])  # an unhashed block, to the queue's head
    elif op == "free-one-hashed":
        pool.free_blocks(held["cached"][:1])  # a block with a key, to the queue's tail
    elif op == "touch":
        free_hit = pool.get_cached_prefix(free_cached_request().block_hashes[:1])
        pool.touch(free_hit + held["shared"])
    elif op == "cache":
        pool.cache_full_blocks(victim_second_request(), held["plain"], 0, 2, 16, 0)
    elif op == "evict":
        free_hit = pool.get_cached_prefix(free_cached_request().block_hashes[:1])
        pool.evict_blocks([held["cached"][0].block_id, free_hit[0].block_id])
    elif op == "partial":
        # A 16-token boundary inside a 32-token block that holds a key: an alias row.
        pool.cache_partial_block(victim_second_request(), held["cached"][1], 16, 0, 32)
    elif op == "move":
        pool.move_block_hashes(held["cached"][1], held["plain"][0])
    elif op == "unpin":
        # HiSparse's release of clean resident pages: a hashed block and an unhashed one reach
        # 0 (both to the tail); the shared one keeps the survivor's reference.
        pool.unpin_blocks([held["cached"][0], held["plain"][1], held["shared"][0]],
                          lambda block: None)
    elif op == "reset":
        assert pool.reset_prefix_cache()
    elif op == "reap":
        assert pool.reap_dead() == 1
    elif op == "close":
        pool.close()
    else:
        raise ValueError(op)


OPS = ("allocate", "allocate-one", "free", "free-one", "free-one-hashed", "touch", "cache",
       "evict", "partial", "move", "reset", "reap", "attach", "close", "unpin")
# The fault-injection operation (``shmkv.pool.fault.OPERATIONS``) a scenario's last call is:
# the one-block calls are scenarios of their own (the Python kernel has a path for them).
FAULT_OP = {"allocate-one": "allocate", "free-one": "free", "free-one-hashed": "free"}


def zombie(name: str, kernel: str) -> None:
    """For ``reap``: a process that takes blocks and dies without close()."""
    pool = BlockPool.attach(name, kernel=kernel, label="zombie")
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(zombie_request(), blocks, 0, 1, 16, 0)


def victim(name: str, kernel: str, op: str, role: str, fault_at: int) -> None:
    """Runs in a forked child. ``role``: "victim" (armed at ``fault_at``), "never" or
    "done". Returns normally when the process should exit without close()."""
    from shmkv.pool import fault

    if op == "attach":
        if role == "never":
            return
        if role == "victim":
            fault.arm("attach", fault_at)
        BlockPool.attach(name, kernel=kernel, label="victim", stuck_after_s=STUCK_AFTER_S)
        return
    pool = BlockPool.attach(name, kernel=kernel, label="victim", stuck_after_s=STUCK_AFTER_S)
    held = victim_setup(pool, op)
    if role == "never":
        return
    if role == "victim":
        fault.arm(FAULT_OP.get(op, op), fault_at)
    victim_last_call(pool, op, held)


def reaper(name: str, kernel: str, fault_at: int) -> None:
    """Attaches and reaps the dead, killed before its ``fault_at``-th store."""
    from shmkv.pool import fault

    pool = BlockPool.attach(name, kernel=kernel, label="reaper", stuck_after_s=STUCK_AFTER_S)
    fault.arm("reap", fault_at)
    pool.reap_dead()


def newcomer(name: str, kernel: str) -> None:
    """Attaches; its fresh slot must hold no reference; closes."""
    pool = BlockPool.attach(name, kernel=kernel, label="newcomer",
                            stuck_after_s=STUCK_AFTER_S)
    held = int(pool._ledger[pool.slot].sum())
    if held:
        raise AssertionError(f"a newcomer's slot {pool.slot} holds {held} reference(s)")
    pool.close()
