"""Reader processes for the block-table tests (module level, so spawn can import them).
Exit code 0 is success; failures print why to stderr."""

from __future__ import annotations

import sys
import time
import traceback

import torch

from shmkv.ranks.block_table import KVStore, SharedBlockTables


def encoded_row_length(step, row, width):
    """How many blocks the race writer puts in ``row`` at ``step`` (every id is ``step``,
    steps start at 1); ``row`` may be a tensor."""
    return (step * 7 + row * 3) % width + 1


def race_reader(name: str, last_step: int, seqlock: bool, ready, results,
                timeout_s: float = 60.0) -> None:
    """Reads snapshots until it sees ``last_step``; checks every accepted one: each row of
    each group holds exactly ``encoded_row_length(step, row)`` ids, all equal to the
    snapshot's step. Reports (accepted, torn)."""
    try:
        tables = SharedBlockTables.attach(name)
        tables._seqlock = seqlock
        ready.set()
        accepted = torn = 0
        deadline = time.monotonic() + timeout_s
        step = -1
        while step < last_step:
            if time.monotonic() > deadline:
                raise AssertionError(f"never saw step {last_step} (last {step})")
            snap = tables.read(min_step=0, timeout_s=timeout_s)
            step = snap.step
            accepted += 1
            ok = True
            for g, table in enumerate(snap.block_tables):
                rows, width = table.shape
                n = encoded_row_length(step, torch.arange(rows), width)
                valid = torch.arange(width)[None, :] < n[:, None]  # add_row leaves the rest
                ok &= torch.equal(snap.num_blocks[g], n.to(torch.int32))
                ok &= bool(((table == step) | ~valid).all())
            torn += not ok
            time.sleep(0.0002)  # leave the writer some CPU on a small machine
        del snap, table
        tables.close()
        results.put((accepted, torn))
    except BaseException:
        traceback.print_exc(file=sys.stderr)
        sys.exit(1)


def zero_copy_rank(name: str, attached, written, results, timeout_s: float = 60.0) -> None:
    """Maps the tables and the KV store once; after the parent's write, sees it through the
    very tensors it held (same data pointers, no re-read), and writes K/V the parent sees."""
    try:
        tables = SharedBlockTables.attach(name)
        kv = KVStore.attach(name)
        view = tables.block_table(1)
        key = kv.key_cache[1]
        start, end = tables.data_address_range()
        ptr = view.data_ptr()
        inside = start <= ptr < end
        before = view[3, :3].tolist()
        attached.set()
        if not written.wait(timeout_s):
            raise AssertionError("the parent never wrote")
        with tables.reading(step=0) as snap:
            same_tensor = snap.block_tables[1] is view
            after = view[3, :3].tolist()
        key[5, 0, 0, :4] = 1.25  # the rank's K write, for the parent to see
        results.put((inside, ptr == view.data_ptr(), same_tensor, before, after))
        del view, key, snap
        tables.close()
        kv.close()
    except BaseException:
        traceback.print_exc(file=sys.stderr)
        sys.exit(1)
