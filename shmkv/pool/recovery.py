"""The invariants of a shared pool, named once here, and ``check_invariants``.

Catalogue (error messages and tests quote the ids):

- **INV-HDR**: magic, layout version, format flags and the config echo are what this process
  attached to, and ``state`` is READY.
- **INV-FREE**: following ``next`` from ``free_head`` reaches ``free_tail`` in exactly
  ``num_free_blocks`` steps, visiting no row twice and no sentinel or out-of-range row; ``prev``
  is the exact inverse; the null block is never queued; a row that is not queued has
  ``prev == next == NO_BLOCK``.
- **INV-QKEY**: ``queue_key`` strictly increases from head to tail and stays within the
  header's ``[queue_head_key, queue_tail_key]``, so sorting by key rebuilds the queue.
- **INV-REF**: ``ref_cnt >= 0`` everywhere; a block other than the null block is in the free
  queue exactly when its ``ref_cnt`` is 0; the null block's count stays 0.
- **INV-CONSERVE**: ``num_free_blocks + blocks in use == num_blocks - 1`` (the null block
  is neither), counting in-use blocks by ``ref_cnt > 0``.
- **INV-HASH**: every chained key row (a block's own row or its alias row) holds a key that
  hashes to its bucket; every key row holding a key is in exactly one chain, once; chains
  have no cycles and link only key rows; key rows without a key have
  ``index_next == NO_BLOCK`` and group 0; the null block holds no key.
- **INV-ALIAS**: a block's alias row holds a key only while the block's own row holds one,
  and a different one (``shmkv/pool/layout.py``, "Alias rows").
- **INV-LEDGER**: for every block but the null block, ``ref_cnt`` equals the sum of the
  ledger column over the active process slots; ledger entries are ``>= 0``; a free slot's row
  and the null block's column are all zero.
- **INV-PROC**: an active slot has a pid and a non-zero incarnation; a free slot has neither.
- **INV-JOURNAL**: ``journal_len`` is in ``[0, journal_entries]`` or ``JOURNAL_OVERFLOWED``;
  each counted entry names an aligned 4- or 8-byte word inside the segment, past the
  header's immutable part; every process row's ``lock_phase`` is IDLE, ACQUIRING, HOLDING,
  RELEASING or ABANDONED.
  (Outside any hold ``journal_len`` is 0; checks run inside one, where it may not be.)
- **INV-LOG**: the event ring's pointers are ordered (``oldest_pos <= write_pos <= oldest_pos
  + capacity``, ``oldest_seq <= next_seq``) and the records between them carry consecutive
  sequence numbers, ``next_seq - oldest_seq`` of them.

``check_invariants`` collects every violation and raises one ``InvariantViolation``. It is
O(num_blocks) and never on a hot path. ``rebuild`` rewrites every derived structure
(``ref_cnt``, the free queue, the index chains) from the authoritative ones (the ledger, the
hash fields, ``queue_key``): the fallback repair of the crash-safety plan
(``docs/crash-safety.md``).
"""

from __future__ import annotations

import dataclasses
import functools
import mmap
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from shmkv.errors import InvariantViolation
from shmkv.pool import layout as L
from shmkv.pool.event_log import EventCursor, EventLog
from shmkv.pool.prefix_index import BlockHashToBlockMap


@dataclass(frozen=True, repr=False)  # a repr would read the arrays, maybe unmapped by now
class SegmentViews:
    """The views of one attached segment that the checks and the rebuild read and write.

    Recovery works on these, not on a ``BlockPool``, so that the pool can import recovery
    (it repairs itself with it) without recovery importing the pool back. A ``BlockPool``
    hands its own out as ``pool.segment_views``.
    """

    buf: mmap.mmap
    layout: L.Layout
    hdr64: memoryview  # the header as flat int64 words (``L.H_*`` indices)
    blocks: np.ndarray  # region block_meta, sentinel rows included
    key_rows: np.ndarray  # block_meta then block_alias: every row a key can sit in
    index: BlockHashToBlockMap
    procs: np.ndarray  # region proc_table
    ledger: np.ndarray  # region ledger, one row per slot
    log: EventLog

    @property
    def num_blocks(self) -> int:
        return self.layout.config.num_blocks

    def __repr__(self) -> str:
        return f"SegmentViews(<{self.num_blocks} blocks>)"


def _views_of(pool: Any) -> SegmentViews:
    """``pool``'s views: a ``BlockPool`` (anything with ``segment_views``), or views."""
    return pool if isinstance(pool, SegmentViews) else pool.segment_views


def _check_header(views: SegmentViews, out: list[str]) -> None:
    hdr = views.layout.view(views.buf, "header")[0]
    cfg = views.layout.config
    expected = {
        "magic": L.MAGIC,
        "layout_version": L.LAYOUT_VERSION,
        "format_flags": cfg.format_flags,
        "header_bytes": L.HEADER_DTYPE.itemsize,
        "total_bytes": views.layout.total_bytes,
        "num_blocks": cfg.num_blocks,
        "hash_block_size": cfg.hash_block_size,
        "num_index_buckets": cfg.num_index_buckets,
        "block_hash_bytes": L.BLOCK_HASH_BYTES,
        "max_processes": cfg.max_processes,
        "event_log_bytes": cfg.event_log_bytes,
        "num_hash_lookahead_tokens": cfg.num_hash_lookahead_tokens,
    }
    for field, want in expected.items():
        found = int(hdr[field])
        if found != want:
            out.append(f"INV-HDR: header {field} is {found}, attached as {want}")
    for field in ("medium", "hash_fn_name"):
        found_text = bytes(hdr[field]).decode(errors="replace")
        if found_text != getattr(cfg, field):
            out.append(
                f"INV-HDR: header {field} is {found_text!r}, attached as {getattr(cfg, field)!r}"
            )
    state = int(hdr["state"])
    if state != L.STATE_READY:
        out.append(f"INV-HDR: state is {L.STATE_NAMES.get(state, state)}, not READY")


def _check_free_queue(views: SegmentViews, out: list[str]) -> np.ndarray:
    """Checks INV-FREE and INV-QKEY; returns a bool mask of the rows reached by the walk."""
    lay = views.layout
    n = lay.config.num_blocks
    head, tail = lay.free_head, lay.free_tail
    blocks = views.blocks
    prev, nxt, keys = blocks["prev"], blocks["next"], blocks["queue_key"]
    num_free = int(views.hdr64[L.H_NUM_FREE])
    queued = np.zeros(n + 2, dtype=bool)
    order: list[int] = []
    cur, before = int(nxt[head]), head
    while cur != tail:
        if not 0 <= cur < n:
            out.append(f"INV-FREE: row {before}.next is {cur}, not a block or the tail sentinel")
            break
        if queued[cur]:
            out.append(f"INV-FREE: block {cur} is reached twice (a cycle after row {before})")
            break
        if int(prev[cur]) != before:
            out.append(f"INV-FREE: block {cur}.prev is {int(prev[cur])}, expected {before}")
        queued[cur] = True
        order.append(cur)
        before, cur = cur, int(nxt[cur])
    else:
        if int(prev[tail]) != before:
            out.append(f"INV-FREE: tail sentinel .prev is {int(prev[tail])}, expected {before}")
    if len(order) != num_free:
        out.append(
            f"INV-FREE: walking the queue finds {len(order)} blocks, "
            f"num_free_blocks says {num_free}"
        )
    if queued[L.NULL_BLOCK_ID]:
        out.append("INV-FREE: the null block (0) is in the free queue")
    loose = np.flatnonzero(~queued[:n] & ((prev[:n] != L.NO_BLOCK) | (nxt[:n] != L.NO_BLOCK)))
    if len(loose):
        out.append(
            f"INV-FREE: {len(loose)} block(s) not in the queue still have links, "
            f"e.g. block {int(loose[0])} (prev {int(prev[loose[0]])}, next {int(nxt[loose[0]])})"
        )
    if order:
        k = keys[np.array(order)]
        bad = np.flatnonzero(np.diff(k) <= 0)
        if len(bad):
            i = int(bad[0])
            out.append(
                f"INV-QKEY: queue_key does not increase from block {order[i]} ({int(k[i])}) "
                f"to block {order[i + 1]} ({int(k[i + 1])})"
            )
        lo, hi = int(views.hdr64[L.H_QUEUE_HEAD_KEY]), int(views.hdr64[L.H_QUEUE_TAIL_KEY])
        if int(k.min()) < lo or int(k.max()) > hi:
            out.append(
                f"INV-QKEY: queue keys span [{int(k.min())}, {int(k.max())}], outside the "
                f"header's [{lo}, {hi}]"
            )
    return queued


def _check_refs(views: SegmentViews, queued: np.ndarray, out: list[str]) -> None:
    n = views.num_blocks
    ref = views.blocks["ref_cnt"][:n]
    negative = np.flatnonzero(ref < 0)
    if len(negative):
        b = int(negative[0])
        out.append(f"INV-REF: {len(negative)} block(s) have ref_cnt < 0, e.g. block {b} ({ref[b]})")
    real = np.arange(n) != L.NULL_BLOCK_ID
    zero_not_queued = np.flatnonzero(real & (ref == 0) & ~queued[:n])
    if len(zero_not_queued):
        b = int(zero_not_queued[0])
        out.append(
            f"INV-REF: {len(zero_not_queued)} block(s) have ref_cnt 0 but are not in the free "
            f"queue (leaked), e.g. block {b}"
        )
    held_and_queued = np.flatnonzero(real & (ref != 0) & queued[:n])
    if len(held_and_queued):
        b = int(held_and_queued[0])
        out.append(
            f"INV-REF: {len(held_and_queued)} block(s) are in the free queue with ref_cnt != 0, "
            f"e.g. block {b} (ref_cnt {int(ref[b])})"
        )
    if n and int(ref[L.NULL_BLOCK_ID]) != 0:
        out.append(f"INV-REF: the null block's ref_cnt is {int(ref[0])}, expected 0")
    in_use = int(np.count_nonzero(real & (ref > 0)))
    num_free = int(views.hdr64[L.H_NUM_FREE])
    if num_free + in_use != n - 1:
        out.append(
            f"INV-CONSERVE: num_free_blocks ({num_free}) + blocks in use ({in_use}) != "
            f"num_blocks - 1 ({n - 1})"
        )


def _check_index(views: SegmentViews, out: list[str]) -> None:
    n = views.num_blocks
    lay = views.layout
    rows = views.key_rows  # block rows, the two sentinels, then the alias rows
    alias0 = lay.alias_row(0)
    index = views.index
    buckets = lay.view(views.buf, "index_buckets")
    def name(row: int) -> str:
        return f"block {row}" if row < n else f"the alias row of block {row - alias0}"

    is_key_row = np.ones(len(rows), dtype=bool)
    is_key_row[n:alias0] = False
    htok = rows["hash_num_tokens"]
    hashed = (htok != L.NO_HASH_TOKENS) & is_key_row
    if (htok[is_key_row] < 0).any():
        out.append("INV-HASH: a block has hash_num_tokens < 0")
    if n and hashed[L.NULL_BLOCK_ID]:
        out.append("INV-HASH: the null block (0) holds a prefix-cache key")
    linked = ((rows["index_next"] != L.NO_BLOCK) | (rows["group_id"] != 0)) & is_key_row
    stray = np.flatnonzero(~hashed & linked)
    if len(stray):
        out.append(
            f"INV-HASH: {len(stray)} block(s) without a key have index_next or group_id set, "
            f"e.g. {name(int(stray[0]))}"
        )
    seen = np.zeros(len(rows), dtype=np.int64)
    for bucket in np.flatnonzero(buckets != L.NO_BLOCK).tolist():
        cur = int(buckets[bucket])
        steps = 0
        while cur != L.NO_BLOCK:
            if not (0 <= cur < len(rows) and is_key_row[cur]):
                out.append(f"INV-HASH: bucket {bucket} links to row {cur}, not a block")
                break
            steps += 1
            if steps > len(rows):
                out.append(f"INV-HASH: bucket {bucket}'s chain has a cycle")
                break
            seen[cur] += 1
            key = index.block_key(cur)
            if key is None:
                out.append(f"INV-HASH: {name(cur)} is in bucket {bucket}'s chain without a key")
            elif index.bucket_of(*key) != bucket:
                out.append(
                    f"INV-HASH: {name(cur)} is chained in bucket {bucket}, its key hashes to "
                    f"bucket {index.bucket_of(*key)}"
                )
            cur = int(rows["index_next"][cur])
    twice = np.flatnonzero(seen > 1)
    if len(twice):
        out.append(f"INV-HASH: {name(int(twice[0]))} appears {int(seen[twice[0]])} times in "
                   "chains")
    unreachable = np.flatnonzero(hashed & (seen == 0))
    if len(unreachable):
        out.append(
            f"INV-HASH: {len(unreachable)} block(s) hold a key but are in no chain, "
            f"e.g. {name(int(unreachable[0]))}"
        )
    if not lay.config.partial_keys:
        return
    has_alias = hashed[alias0:]
    orphans = np.flatnonzero(has_alias & ~hashed[:n])
    if len(orphans):
        out.append(
            f"INV-ALIAS: {len(orphans)} block(s) hold an alias key but no key of their own, "
            f"e.g. block {int(orphans[0])}"
        )
    both = np.flatnonzero(has_alias & hashed[:n])
    if len(both):
        own, alias = rows[both], rows[alias0 + both]
        same = np.flatnonzero((own["block_hash"] == alias["block_hash"])
                              & (own["group_id"] == alias["group_id"]))
        if len(same):
            out.append(
                f"INV-ALIAS: {len(same)} block(s) hold the same key twice, e.g. block "
                f"{int(both[same[0]])}"
            )


def _check_ledger_and_procs(views: SegmentViews, out: list[str]) -> None:
    n = views.num_blocks
    procs = views.procs
    ledger = views.ledger
    active = procs["state"] == L.SLOT_ACTIVE
    bad_state = np.flatnonzero((procs["state"] != L.SLOT_ACTIVE) & (procs["state"] != L.SLOT_FREE))
    for slot in bad_state.tolist():
        out.append(f"INV-PROC: slot {slot} has state {int(procs['state'][slot])}")
    for slot in np.flatnonzero(active).tolist():
        if procs["pid"][slot] <= 0 or procs["incarnation"][slot] == 0:
            out.append(
                f"INV-PROC: active slot {slot} has pid {int(procs['pid'][slot])}, "
                f"incarnation {int(procs['incarnation'][slot])}"
            )
    for slot in np.flatnonzero(procs["state"] == L.SLOT_FREE).tolist():
        if procs["pid"][slot] != 0 or procs["incarnation"][slot] != 0:
            out.append(f"INV-PROC: free slot {slot} still names pid {int(procs['pid'][slot])}")
        if ledger[slot].any():
            out.append(
                f"INV-LEDGER: free slot {slot} still holds {int(ledger[slot].sum())} "
                "reference(s)"
            )
    if (ledger < 0).any():
        slot, block = (int(x[0]) for x in np.nonzero(ledger < 0))
        out.append(f"INV-LEDGER: slot {slot} holds {int(ledger[slot, block])} references to "
                   f"block {block}")
    if n and ledger[:, L.NULL_BLOCK_ID].any():
        out.append("INV-LEDGER: a process holds references to the null block")
    held = ledger[active].sum(axis=0, dtype=np.int64)
    ref = views.blocks["ref_cnt"][:n].astype(np.int64)
    differ = np.flatnonzero(held != ref)
    differ = differ[differ != L.NULL_BLOCK_ID]
    if len(differ):
        b = int(differ[0])
        out.append(
            f"INV-LEDGER: {len(differ)} block(s) have ref_cnt != the references live "
            f"processes hold, e.g. block {b}: ref_cnt {int(ref[b])}, ledger {int(held[b])}"
        )


def _check_event_log(views: SegmentViews, out: list[str]) -> None:
    log = views.log
    cap = log.capacity
    hdr = views.hdr64
    oldest_pos, write_pos = int(hdr[L.H_LOG_OLDEST_POS]), int(hdr[L.H_LOG_WRITE_POS])
    oldest_seq, next_seq = int(hdr[L.H_LOG_OLDEST_SEQ]), int(hdr[L.H_NEXT_EVENT_SEQ])
    if not (0 <= oldest_pos <= write_pos <= oldest_pos + cap) or oldest_seq > next_seq:
        out.append(
            f"INV-LOG: pointers out of order: oldest ({oldest_seq}, @{oldest_pos}), "
            f"next ({next_seq}, @{write_pos}), capacity {cap}"
        )
        return
    if not cap:
        return
    try:
        events, lost = log.read(EventCursor(oldest_seq, oldest_pos))
    except Exception as exc:  # noqa: BLE001  (a torn record: report it, whatever it raised)
        out.append(f"INV-LOG: a record between the pointers does not decode: {exc}")
        return
    seqs = [e.seq for e in events]
    if lost or seqs != list(range(oldest_seq, next_seq)):
        out.append(
            f"INV-LOG: records carry sequence numbers {seqs[:3]}...{seqs[-3:]} "
            f"({len(seqs)} records), expected {oldest_seq}..{next_seq - 1}"
        )


def _check_journal(views: SegmentViews, out: list[str]) -> None:
    lay = views.layout
    cap = lay.config.journal_entries
    length = int(views.hdr64[L.H_JOURNAL_LEN])
    if length == L.JOURNAL_OVERFLOWED:
        pass
    elif not 0 <= length <= cap:
        out.append(f"INV-JOURNAL: journal_len is {length}, outside [0, {cap}] and not -1")
        return
    else:
        where = lay.view(views.buf, "journal")["where"][:length]
        offsets, widths = where >> 4, where & 15
        first_mutable = L.HEADER_DTYPE.fields["epoch"][1]
        bad = ((widths != 4) & (widths != 8)) | (offsets % widths != 0) | (
            offsets < first_mutable) | (offsets + widths > lay.total_bytes)
        if bad.any():
            i = int(np.argmax(bad))
            out.append(f"INV-JOURNAL: entry {i} names {int(widths[i])} byte(s) at offset "
                       f"{int(offsets[i])}: not an aligned word of the segment's mutable part")
    phases = views.procs["lock_phase"]
    odd = np.flatnonzero((phases < L.PHASE_IDLE) | (phases > L.PHASE_ABANDONED))
    if len(odd):
        slot = int(odd[0])
        out.append(f"INV-JOURNAL: slot {slot} has lock_phase {int(phases[slot])}")


def collect_violations(pool: Any) -> list[str]:
    """Every broken invariant of a pool, each message starting with its id.

    Args:
        pool: a ``BlockPool`` or its ``SegmentViews``; the caller holds the pool lock.

    Returns:
        one message per broken invariant, [] for a sound pool.
    """
    views = _views_of(pool)
    out: list[str] = []
    _check_header(views, out)
    queued = _check_free_queue(views, out)
    _check_refs(views, queued, out)
    _check_index(views, out)
    _check_ledger_and_procs(views, out)
    _check_event_log(views, out)
    _check_journal(views, out)
    return out


def check_invariants(pool: Any) -> None:
    """Raises InvariantViolation listing every broken invariant; marks the segment POISONED.

    Args:
        pool: a ``BlockPool`` or its ``SegmentViews``; the caller holds the pool lock.

    Raises:
        InvariantViolation: with ``.violations``, one string per broken invariant.
    """
    views = _views_of(pool)
    violations = collect_violations(views)
    if violations:
        views.layout.view(views.buf, "header")["state"] = L.STATE_POISONED
        raise InvariantViolation(violations)


@dataclass(frozen=True)
class RebuildReport:
    """What ``rebuild`` found and fixed."""

    ref_cnt_fixed: int  # blocks whose ref_cnt disagreed with the ledger
    num_free_blocks: int
    num_cached_blocks: int
    hashes_dropped: int  # keys whose fields were invalid, or aliases orphaned (cleared)
    seconds: float
    # (hash, group) of each cleared key, for the BlockRemoved events the repair logs
    dropped_keys: list[tuple[bytes, int]] = dataclasses.field(default_factory=list)


def rebuild(pool: Any) -> RebuildReport:
    """Rebuilds every derived structure from the authoritative ones, in vectorised passes.
    The caller holds the pool lock.

    Authoritative: the ledger rows of active slots (references), each block's hash fields
    and each free block's ``queue_key`` (LRU order). Derived, and rewritten: ``ref_cnt``,
    the free queue's links and counters, and the prefix index's chains. Blocks holding the
    same key are chained in block-id order (the original insertion order is not recorded);
    free blocks with equal queue keys, which only a damaged pool has, queue in block-id order.
    Bumps ``epoch``. Its writes are not journaled: it marks the undo journal overflowed
    first, so that a rebuild cut short by a kill is done again by whoever takes the lock
    over, and empties the journal when it is done (what the caller's hold wrote before it
    can no longer be undone: the rebuilt pool is the new starting point).

    Cost: a 64-byte row is one cache line, so touching one field of every row costs as much
    as touching the whole region. The rows are read in two passes into one private buffer
    (``_read_fields``): the authoritative fields first, then the derived ones, and only the
    derived values that changed are written back (``_store_changed``): a sane pool gets
    almost no writes. Fresh memory is the other cost (a page fault per page, often more
    than the work on it), hence the reused buffers.

    Args:
        pool: a ``BlockPool`` or its ``SegmentViews``.

    Returns:
        what it fixed, and the keys it dropped (for ``BlockRemoved`` events).
    """
    t0 = time.perf_counter()
    views = _views_of(pool)
    lay = views.layout
    n = lay.config.num_blocks
    blocks = views.blocks
    hdr = views.hdr64
    hdr[L.H_JOURNAL_LEN] = L.JOURNAL_OVERFLOWED
    row_bytes = np.empty(n + 2, dtype="V16")  # bytes 16..32 of each row, then bytes 0..16
    column = np.empty(n + 2, dtype=np.int32)  # ref, then each rebuilt int32 column in turn

    # The authoritative side: references (the ledger), queue keys and hash fields.
    ref = _ledger_refs(views, out=column[:n])
    is_free = ref == 0
    is_free[L.NULL_BLOCK_ID] = False
    free = np.flatnonzero(is_free)
    attrs = _read_fields(views, 16, 16, row_bytes)  # group_id, hash_num_tokens, queue_key
    keys = np.compress(is_free, attrs["queue_key"][:n])
    hashed, dropped = _clean_hash_fields(views, attrs)
    groups = attrs["group_id"][hashed]
    aliases, alias_links = _clean_alias_rows(views, hashed, dropped)

    # The derived side, compared with what the rows hold.
    links = _read_fields(views, 0, 16, row_bytes)  # ref_cnt, prev, next, index_next; attrs gone
    ref_fixed = _store_changed(blocks["ref_cnt"][:n], links["ref_cnt"][:n], ref)

    # Free queue: every block but the null one with no reference, in queue_key order, the
    # keys renumbered 0..k-1 in that order.
    order, numbered = _sort_by_key(free, keys)
    _relink_free_queue(views, links, order, column)
    if not numbered:
        blocks["queue_key"][order] = np.arange(len(order), dtype=np.int64)
    hdr[L.H_NUM_FREE] = len(order)
    hdr[L.H_QUEUE_HEAD_KEY] = 0
    hdr[L.H_QUEUE_TAIL_KEY] = len(order) - 1

    # Prefix index: chain every block that holds a key into the bucket its key hashes to.
    _rechain_index(views, links, hashed, groups, column, aliases, alias_links)
    hdr[L.H_EPOCH] += 1
    hdr[L.H_JOURNAL_LEN] = 0
    return RebuildReport(
        ref_cnt_fixed=ref_fixed,
        num_free_blocks=len(order),
        num_cached_blocks=len(hashed),  # blocks with a key (aliases not counted)
        hashes_dropped=len(dropped),
        seconds=time.perf_counter() - t0,
        dropped_keys=dropped,
    )


def _read_fields(views: SegmentViews, start: int, nbytes: int, out: np.ndarray) -> np.ndarray:
    """The ``block_meta`` fields in bytes ``[start, start + nbytes)`` of every row (sentinel
    rows included), copied into ``out`` (``V{nbytes}`` items), returned as a structured
    array with those fields.

    The copy goes through a 1-D array of ``V{nbytes}`` items: numpy copies that in one tight
    loop, about as fast as a single field, while a 2-D slice or a structured dtype is copied
    row by row, field by field (two to four times slower). 16 bytes is the widest item that
    stays on the fast loop.
    """
    rows = np.ndarray(
        (views.layout.config.num_blocks + 2,), dtype=f"V{nbytes}", buffer=views.buf,
        offset=views.layout.offsets["block_meta"] + start, strides=(L.BLOCK_DTYPE.itemsize,),
    )
    np.copyto(out, rows)
    return out.view(_compact_dtype(start, nbytes))


@functools.cache
def _compact_dtype(start: int, nbytes: int) -> np.dtype:
    """The ``BLOCK_DTYPE`` fields in bytes ``[start, start + nbytes)`` of a row, as a dtype of
    ``nbytes``-byte items."""
    fields = L.BLOCK_DTYPE.fields
    names = [f for f, (dt, off) in fields.items()
             if start <= off and off + dt.itemsize <= start + nbytes]
    return np.dtype({
        "names": names,
        "formats": [fields[f][0] for f in names],
        "offsets": [fields[f][1] - start for f in names],
        "itemsize": nbytes,
    })


def _store_changed(column: np.ndarray, old: np.ndarray, new: np.ndarray) -> int:
    """Sets ``column`` to ``new``, writing only the entries where ``old``, its current
    values, differ; returns how many.

    Why: a write to one field of a row costs its whole cache line, read and written back,
    and after a kill most of the pool is still right.
    """
    changed = np.flatnonzero(old != new)
    if len(changed):
        column[changed] = new[changed]
    return len(changed)


def _ledger_refs(views: SegmentViews, out: np.ndarray) -> np.ndarray:
    """Each block's references, into ``out``: the sum of its ledger column over the active
    slots (the null block's count is 0). Adds the rows one at a time: indexing the active
    rows first would copy them all."""
    slots = np.flatnonzero(views.procs["state"] == L.SLOT_ACTIVE).tolist()
    if slots:
        np.copyto(out, views.ledger[slots[0]])
    else:
        out.fill(0)
    for slot in slots[1:]:
        out += views.ledger[slot]
    out[L.NULL_BLOCK_ID] = 0
    return out


def _sort_by_key(ids: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, bool]:
    """``ids`` (ascending block ids, not the null block) sorted by their ``keys``; equal
    keys, found only in a damaged pool, in block-id order. Also says whether the keys
    already are ``0..len(ids) - 1`` (a pool rebuilt before and not used since), when the
    renumbering has nothing to write. Consumes ``keys``.

    Three ways to the same order, cheapest first: placing each id at its key's slot when
    the keys span a range not much wider than their number (a pool fresh from ``rebuild``
    or creation, or lightly used since); one integer sort of ``(key - min key) << id_bits
    | id`` when the span fits the high bits (any pool not damaged: keys move by one per
    append or prepend); a stable argsort otherwise.
    """
    if not len(ids):
        return ids, True
    lo, hi = int(keys.min()), int(keys.max())
    if hi - lo < 2 * len(ids):
        order = _place_by_key(ids, keys, lo, hi - lo + 1)
        if order is not None:
            return order, lo == 0 and hi == len(ids) - 1
    id_bits = int(ids[-1]).bit_length()
    if (hi - lo) >> (63 - id_bits) == 0:
        return _packed_sort(ids, keys, lo, id_bits), False
    return ids[np.argsort(keys, kind="stable")], False


def _place_by_key(ids: np.ndarray, keys: np.ndarray, lo: int, span: int) -> np.ndarray | None:
    """Sorts by placing: id ``i`` goes to slot ``keys[i] - lo`` of a table of ``span`` slots,
    and the filled slots, read in order, are the ids sorted by key. O(span), no sort. None
    when two ids claim one slot (equal keys); ``keys`` is then as given."""
    slots = np.full(span, L.NO_BLOCK, dtype=np.int32)
    keys -= lo
    slots[keys] = ids
    keys += lo
    if span == len(ids):  # keys dense: every slot filled unless two keys collided
        return slots if slots.min() != L.NO_BLOCK else None
    order = np.compress(slots != L.NO_BLOCK, slots)
    return order if len(order) == len(ids) else None


def _packed_sort(ids: np.ndarray, keys: np.ndarray, lo: int, id_bits: int) -> np.ndarray:
    """Sorts by one in-place sort of ``(key - lo) << id_bits | id``: numpy sorts plain integers
    with SIMD, several times faster than an argsort, and the id in the low bits breaks ties
    by block id. The caller checked that the packed values fit 63 bits."""
    packed = keys
    packed -= lo
    packed <<= id_bits
    packed |= ids
    packed.sort()
    packed &= (1 << id_bits) - 1
    return packed


def _relink_free_queue(views: SegmentViews, links: np.ndarray, order: np.ndarray,
                       column: np.ndarray) -> None:
    """Links ``order`` between the sentinels; every other row gets ``NO_BLOCK`` links.
    ``links`` holds the rows' current ``prev`` and ``next``; ``column`` is scratch space."""
    lay = views.layout
    chain = np.empty(len(order) + 2, dtype=np.intp)
    chain[0], chain[1:-1], chain[-1] = lay.free_head, order, lay.free_tail
    for field, src, dst in (("next", chain[:-1], chain[1:]), ("prev", chain[1:], chain[:-1])):
        column.fill(L.NO_BLOCK)
        column[src] = dst
        _store_changed(views.blocks[field], links[field], column)


def _clean_hash_fields(views: SegmentViews,
                       attrs: np.ndarray) -> tuple[np.ndarray, list[tuple[bytes, int]]]:
    """Clears invalid hash fields (``hash_num_tokens < 0``, or any key on the null block) and
    the ``group_id`` of blocks without a key. Returns the ids of the blocks holding a key and
    the (hash, group) of each key cleared. ``attrs`` holds the rows' current fields."""
    n = views.layout.config.num_blocks
    htok = attrs["hash_num_tokens"][:n]
    hashed = htok > 0
    hashed[L.NULL_BLOCK_ID] = False
    ids = np.flatnonzero(hashed)
    # A block without a key has group_id and hash_num_tokens both 0: the 8 bytes of the two
    # fields (the row's bytes 16..24, the first word of attrs), read as one word, are 0.
    # When every nonzero word belongs to a block with a key there is nothing to clear, and
    # one count tells it.
    group_and_htok = attrs.view(np.int64)[0::2][:n]
    if np.count_nonzero(group_and_htok) == len(ids):
        return ids, []
    blocks = views.blocks
    invalid = np.flatnonzero(~hashed & (htok != L.NO_HASH_TOKENS))
    dropped = [(bytes(blocks["block_hash"][b]), int(blocks["group_id"][b]))
               for b in invalid.tolist()]
    blocks["hash_num_tokens"][invalid] = L.NO_HASH_TOKENS
    stray_group = np.flatnonzero(~hashed & (attrs["group_id"][:n] != 0))
    blocks["group_id"][stray_group] = 0
    return ids, dropped


def _clean_alias_rows(views: SegmentViews, hashed: np.ndarray,
                      dropped: list[tuple[bytes, int]]) -> tuple[np.ndarray, np.ndarray | None]:
    """Clears alias rows that break INV-ALIAS or hold invalid fields (their keys go to
    ``dropped``) and the ``group_id`` of alias rows without a key. Returns the key rows of
    the aliases kept (ascending) and the alias rows' current ``index_next`` (None when no
    alias row holds anything: the usual case, found with one read of the rows).
    ``hashed``: the blocks keeping a key of their own."""
    lay = views.layout
    n = lay.config.num_blocks
    alias0 = lay.alias_row(0)
    if not lay.config.partial_keys:
        return np.zeros(0, dtype=np.intp), None
    raw = np.ndarray(  # bytes 8..24 of each alias row: next, index_next, group_id, htok
        (n,), dtype="V16", buffer=views.buf,
        offset=lay.offsets["block_alias"] + 8, strides=(L.BLOCK_DTYPE.itemsize,),
    )
    attrs = raw.copy().view(_compact_dtype(8, 16))
    htok, group, inext = attrs["hash_num_tokens"], attrs["group_id"], attrs["index_next"]
    present = htok != L.NO_HASH_TOKENS
    if not present.any() and not group.any() and (inext == L.NO_BLOCK).all():
        return np.zeros(0, dtype=np.intp), None
    rows = views.key_rows
    own = np.zeros(n, dtype=bool)
    own[hashed] = True
    keep = (htok > 0) & own
    ids = np.flatnonzero(keep)
    if len(ids):
        # An alias equal to its block's own key breaks INV-ALIAS. The first 8 hash bytes
        # and the group tell almost all apart; only those that agree are compared whole.
        word = np.ndarray((lay.num_key_rows,), dtype="<u8", buffer=views.buf,
                          offset=lay.offsets["block_meta"] + L.HASH_BYTE_OFFSET,
                          strides=(L.BLOCK_DTYPE.itemsize,))
        maybe = ids[(word[ids] == word[alias0 + ids]) & (rows["group_id"][ids] == group[ids])]
        if len(maybe):
            same = rows["block_hash"][maybe] == rows["block_hash"][alias0 + maybe]
            keep[maybe[same]] = False
    bad = np.flatnonzero(present & ~keep)
    dropped.extend((bytes(rows["block_hash"][alias0 + b]), int(group[b]))
                   for b in bad.tolist() if htok[b] > 0)
    rows["hash_num_tokens"][alias0 + bad] = L.NO_HASH_TOKENS
    rows["group_id"][alias0 + np.flatnonzero(~keep & (group != 0))] = 0
    return alias0 + np.flatnonzero(keep), inext


def _rechain_index(views: SegmentViews, links: np.ndarray, hashed: np.ndarray, groups: np.ndarray,
                   column: np.ndarray, aliases: np.ndarray,
                   alias_links: np.ndarray | None) -> None:
    """Rewrites the bucket array and ``index_next``: the blocks ``hashed`` (with their
    ``groups``), then the alias rows ``aliases``, chained per bucket in key-row order.
    ``links`` holds the block rows' current ``index_next``, ``alias_links`` the alias rows'
    (None: all ``NO_BLOCK``); ``column`` is scratch space."""
    lay = views.layout
    buckets = lay.view(views.buf, "index_buckets")
    buckets.fill(L.NO_BLOCK)
    rows = hashed
    if len(aliases):  # rare: the key rows of both regions, in one sort
        rows = np.concatenate((hashed, aliases))
        groups = np.concatenate((groups, views.key_rows["group_id"][aliases]))
        chain_next = np.full(lay.num_key_rows, L.NO_BLOCK, dtype=np.int32)
    else:
        chain_next = column
        chain_next.fill(L.NO_BLOCK)
    if len(rows):
        ids, bucket = _by_bucket(views, rows, groups)
        same = bucket[1:] == bucket[:-1]
        chain_next[np.compress(same, ids[:-1])] = np.compress(same, ids[1:])
        heads = np.concatenate(([True], ~same))
        buckets[np.compress(heads, bucket)] = np.compress(heads, ids)
    n2 = lay.config.num_blocks + 2
    _store_changed(views.blocks["index_next"], links["index_next"], chain_next[:n2])
    if alias_links is not None:
        new_links = chain_next[n2:] if len(aliases) else np.full_like(alias_links, L.NO_BLOCK)
        _store_changed(views.key_rows["index_next"][n2:], alias_links, new_links)


def _by_bucket(views: SegmentViews, hashed: np.ndarray,
               groups: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The key rows ``hashed`` (ascending) sorted by bucket, then row, and their buckets.

    One in-place integer sort, as in ``_packed_sort``: the bucket (below 2**32) over the
    key row (below 2**32).
    """
    lay = views.layout
    word = np.ndarray(  # the first 8 bytes of each key row's block_hash
        (lay.num_key_rows,), dtype="<u8", buffer=views.buf,
        offset=lay.offsets["block_meta"] + L.HASH_BYTE_OFFSET, strides=(L.BLOCK_DTYPE.itemsize,),
    )[hashed]
    if groups.any():  # a single-group model has only group 0
        with np.errstate(over="ignore"):
            word ^= groups.astype(np.uint64) * np.uint64(L.GROUP_MIX)
    id_bits = int(hashed[-1]).bit_length()
    word &= np.uint64(lay.config.num_index_buckets - 1)
    word <<= np.uint64(id_bits)
    word |= hashed.astype(np.uint64)
    word.sort()
    ids = (word & np.uint64((1 << id_bits) - 1)).astype(np.intp)
    word >>= np.uint64(id_bits)
    return ids, word.view(np.int64)
