"""``shmkv inspect NAME --keys``: what a pool's prefix cache holds, block by block, read
through ``BlockPool.cached_blocks`` (one bounded hold of the pool lock); the process that
cached each block comes from the pool's global event log, when it keeps one."""

from __future__ import annotations

from shmkv.cli.common import EXIT_OK

__all__ = ["print_keys"]


def _cached_by(pool) -> dict[tuple[bytes | int, int], tuple[int, float]]:
    """(hash, group) -> (slot, time) of the BlockStored that last logged it, from the
    pool's global event log (empty without one; keys whose event was overwritten are not
    in it)."""
    from shmkv.events import BlockStored

    if not pool.event_log.capacity:
        return {}
    out: dict = {}
    cursor = pool.event_cursor(from_start=True)
    while True:
        events, _ = pool.read_events(cursor, 4096)
        if not events:
            return out
        for logged in events:
            e = logged.event
            if isinstance(e, BlockStored):
                for h in e.block_hashes:
                    key = h if isinstance(h, int) else bytes(h)
                    out[(key, e.group_idx or 0)] = (logged.slot, logged.ts)


def print_keys(pool, args) -> int:
    """``inspect NAME --keys``: the cached blocks, in eviction order, then the held ones."""
    listing = pool.cached_blocks(args.limit)
    stored = _cached_by(pool)
    procs = {p["slot"]: p for p in pool.processes() if not p["self"]}

    def cached_by(b) -> dict | None:
        found = stored.get((b.block_hash, b.group_id))
        if found is None:  # events published with 64-bit integer hashes
            found = stored.get((int.from_bytes(b.block_hash, "big") & ((1 << 64) - 1),
                                b.group_id))
        if found is None:
            return None
        slot, ts = found
        p = procs.get(slot)
        # the slot's process now is the one that cached the block only if it attached
        # before the event and is still there
        if p is None or p["attach_ns"] > ts * 1e9:
            return {"slot": slot, "pid": None, "label": "", "time": ts}
        return {"slot": slot, "pid": p["pid"], "label": p["label"], "time": ts}

    rows = [{"block_id": b.block_id, "group": b.group_id, "hash": b.block_hash.hex(),
             "num_tokens": b.num_tokens, "ref_cnt": b.ref_cnt,
             "lru_position": b.lru_position, "cached_by": cached_by(b),
             "holders": [{"slot": s, "pid": pid, "references": n} for s, pid, n in b.holders]}
            for b in listing.blocks]
    if args.json:
        import json

        print(json.dumps({"pool": args.name, "num_cached": listing.num_cached,
                          "num_free": listing.num_free, "blocks": rows}, indent=1))
        return EXIT_OK
    print(f"pool {args.name}: {listing.num_cached} cached block(s), {listing.num_free} "
          f"block(s) in the free queue; LRU 0 is evicted first, '-' is held by a request")
    from shmkv.events import short_hash

    print(f"  {'BLOCK':>7} {'GROUP':>5} {'HASH':<16} {'TOKENS':>6} {'REFS':>4} {'LRU':>6}  "
          f"{'CACHED BY':<28} HELD BY")
    for r in rows:
        by = r["cached_by"]
        if by is None:
            by = "? (not in the event log)"
        elif by["pid"] is None:
            by = f"slot {by['slot']} (a process since gone)"
        else:
            by = f"slot {by['slot']} pid {by['pid']} {by['label']}".rstrip()
        held = ", ".join(f"slot {h['slot']} pid {h['pid']} x{h['references']}"
                         for h in r["holders"])
        lru = "-" if r["lru_position"] is None else str(r["lru_position"])
        print(f"  {r['block_id']:>7} {r['group']:>5} {short_hash(bytes.fromhex(r['hash'])):<16} "
              f"{r['num_tokens']:>6} {r['ref_cnt']:>4} {lru:>6}  {by:<28} {held}".rstrip())
    if listing.num_cached > len(rows):
        print(f"  ... {listing.num_cached - len(rows)} more (--limit N)")
    return EXIT_OK
