"""The offload tier's life, top to bottom: how its objects are made, joined, bound, made
again and removed. The rules this follows are stated once, in ``shmkv/pool/lifecycle.py``
(one generation per tier, versions never meet, a table made with its pool, who holds a
tier, removal whole and root first); the objects' formats live beside it: the table in
``tier.py``, the replica lock file in ``replicas.py``, the data region's file in
``region.py``, the identity in ``identity.py``.

    worker start  refuse_foreign_replica  ->  check room  ->  open_pool (the root: made, or
                  attached)  ->  open_tier_table (made with the pool; made again only for an
                  idle pool, which forgets its keys)  ->  ReplicaLocks (the lock file of
                  this generation)  ->  join its replica's row  ->  bind_region (the region
                  of this generation, made if missing: the tier forgets what it described)
    core start    open_pool  ->  open_tier_table  ->  ReplicaLocks  ->  join its row (the
                  row its workers bound; a row no worker bound is cut off: manager.py)
    a refused start takes back what it made (``siblings.discard_unused_tier``)
    core started  one warning naming the other tiers that no process holds, with the /dev/shm
                  memory each keeps and how long it has been idle (``idle_tiers_notice``)
    removal       ``remove_tier``: the pool first, then the table, region and lock file of
                  its generation (``shmkv unlink``, ``shmkv cleanup``: ``siblings.py``)
"""

from __future__ import annotations

import logging
import os
import time
from typing import NamedTuple

import numpy as np

from shmkv.errors import (
    LayoutMismatchError,
    NoSpaceError,
    SegmentError,
    SegmentExistsError,
    SegmentNotFoundError,
)
from shmkv.pool import layout as L
from shmkv.pool import lifecycle as LC
from shmkv.pool.block_pool import BlockPool
from shmkv.pool.segment import Segment
from shmkv.pool.siblings import (
    discard_unused_tier,
    duration_text,
    human_bytes,
    memory_of,
    owner_record,
    plan,
    unlink_pool,
    write_owner,
)
from shmkv.vllm.identity import check_identity
from shmkv.vllm.region import (
    TRAILER_BYTES,
    RegionBinding,
    bound_tag,
    make_file,
    read_tag,
    region_path,
)
from shmkv.vllm.replicas import ReplicaLocks, join, replica_key
from shmkv.vllm.tier import (
    HEADER_BYTES,
    REGION_MIXED,
    TIER_MAGIC,
    TIER_VERSION,
    W_GENERATION_TIER,
    W_LRU_DIRTY,
    W_MAGIC,
    W_REGION_INODE,
    W_REGION_TAG,
    W_VERSION_CHUNKS,
    ReplicaLabel,
    TierTable,
    table_bytes,
    tier_table_name,
)

logger = logging.getLogger(__name__)

STAYS_BY = "vllm tier"  # what `shmkv ls` says keeps the tier's pool (BlockPool.mark_stays)
MEDIUM = "CPU"
ATTACH_TIMEOUT_S = 10.0  # how long an attacher waits for the pool's creator to finish
MAKER_WAIT_S = 120.0  # how long a worker waits for another to make the region


# ------------------------------------------------------------------ joining, as a worker
# (vLLM builds a replica's workers before its scheduler: a worker meets the tier first)

def join_as_worker(pool_name: str, num_chunks: int, max_processes: int, replica_id: str,
                   data_bytes: int, identity: dict | None = None,
                   label: ReplicaLabel | None = None) -> tuple[ReplicaLocks, RegionBinding]:
    """A GPU worker's start: checks its replica's ``identity`` against the tier's (and
    records it if it is the first), joins its replica's row (``replica_id``, one per engine
    start; ``label``: its DP rank and engine id, for the row's label: ``tier.py``), binds
    the data region to the pool (making it if needed) and returns its hold on
    the row (kept until the worker exits) and the region it bound. The pool handle it
    needed is closed again: a worker takes no slot of the pool's process table.

    A worker whose identity differs touches nothing: it is refused before it sizes,
    joins or binds anything (vLLM builds its workers before its scheduler, so the worker
    is the first of a replica to meet the tier).

    Raises:
        LayoutMismatchError: the identity differs from the tier's (every field named).
        SegmentError: a foreign or insecure region file, or no room in /dev/shm.
    """
    process = {"label": "vllm-offload-worker"}
    if identity is not None:
        refuse_foreign_replica(pool_name, identity, process)
    _check_room(pool_name, num_chunks, data_bytes)
    pool, created = open_pool(pool_name, num_chunks, max_processes, None, process)
    generation = pool.generation
    refused = True
    try:
        tier = open_tier_table(pool, pool_name, num_chunks, created)
        locks = None
        try:
            with pool.lock():  # the lock file and the row in one hold: never a gap between
                locks = ReplicaLocks(pool_name, generation)
                if identity is not None:
                    check_identity(tier, pool_name, identity)
                row = join(tier, locks, replica_key(replica_id), pool_name, label)
            binding = bind_region(pool, tier, locks, row, pool_name, data_bytes)
        except BaseException:
            if locks is not None:
                locks.close()
            raise
        finally:
            tier.close()
        refused = False
    finally:
        pool.close()
        if refused and created:  # nothing half made stays behind a refused start
            discard_unused_tier(pool_name, generation, BlockPool.TIERS)
    return locks, binding


def _check_room(pool_name: str, num_chunks: int, data_bytes: int) -> None:
    """Refuses a worker that would make the tier in a /dev/shm without room for its data
    region and table, before it makes anything (a replica joining a tier whose region is
    there needs no room).

    Raises:
        NoSpaceError: naming both sizes and what to do.
    """
    if os.path.lexists(region_path(pool_name)):
        return
    need = data_bytes + TRAILER_BYTES + table_bytes(num_chunks)
    st = os.statvfs(os.path.dirname(region_path(pool_name)))
    free = st.f_bavail * st.f_frsize
    if free < need:
        raise NoSpaceError(
            f"the offload tier {pool_name!r} needs at least {need:,} bytes in /dev/shm (its "
            f"data region and table) and {free:,} are free: lower cpu_bytes_to_use, or give "
            "/dev/shm more room (docker run --shm-size=...); nothing was made")


def refuse_foreign_replica(pool: str, identity: dict, process: dict, *,
                           partial: bool = False) -> None:
    """Checks ``identity`` against the one the tier recorded, if the pool and its table
    exist, BEFORE this process sizes, joins or binds anything: a replica whose chunk
    geometry differs would otherwise be refused only for its chunk count, or (a worker,
    which vLLM builds before its scheduler) replace the data region first. Records nothing.
    ``partial``: ``identity`` holds some of the fields, and only those are compared (the
    engine core's check before its KV cache is sized, when the chunk geometry is unknown).

    Raises:
        LayoutMismatchError: the identities differ (every differing field named).
    """
    try:
        bp = BlockPool.attach(pool, **process)
    except SegmentError:  # missing, or still being made: open_pool decides
        return
    try:
        if bp.medium != MEDIUM or bp.hash_block_size != 1:
            return  # not a tier: open_pool says so
        try:
            seg = Segment.open(tier_table_name(pool))
        except SegmentNotFoundError:
            return
        seg.close()
        tier = open_tier_table(bp, pool, bp.num_gpu_blocks - 1, False)
        try:
            with bp.lock():
                check_identity(tier, pool, identity, record=False, partial=partial)
        finally:
            tier.close()
    finally:
        bp.close()


# ------------------------------------------------------------------ joining, as an engine core

class CoreJoin(NamedTuple):
    """What an engine core holds of the tier once it joined: the pool, the table, its
    descriptor of the replica lock file, and its replica's row."""

    pool: BlockPool
    tier: TierTable
    locks: ReplicaLocks
    row: int


def join_as_core(pool_name: str, num_chunks: int, max_processes: int,
                 event_log_bytes: int | None, replica_id: str, process: dict,
                 label: ReplicaLabel | None = None) -> CoreJoin:
    """An engine core's start: opens (or makes) the pool and its table, opens the replica
    lock file of the tier's generation, joins its replica's row (the row its workers
    joined; ``label`` and this process's pid go into the row's label: ``tier.py``) and
    marks the tier to stay. A start refused after it made the pool takes the tier back
    (unless another process joined it meanwhile).

    Raises:
        LayoutMismatchError: the pool is not an offload tier, holds another number of
            chunks, or an object of the tier belongs to another generation still held.
        SegmentError: the pool belongs to another user, or the replica lock file was
            removed or replaced while the tier was in use.
        PoolFullError: every replica row belongs to a live replica.
    """
    pool, created = open_pool(pool_name, num_chunks, max_processes, event_log_bytes, process)
    try:
        tier = open_tier_table(pool, pool_name, num_chunks, created)
        locks = None
        try:
            with pool.lock():
                locks = ReplicaLocks(pool_name, pool.generation)
                row = join(tier, locks, replica_key(replica_id), pool_name, label,
                           core_pid=os.getpid())
            # The tier is complete (its table, a replica joined): it stays in /dev/shm for
            # restarted replicas until `shmkv unlink` (a maker that died before this line
            # left an orphan, which `shmkv cleanup` removes).
            pool.mark_stays(STAYS_BY)
        except BaseException:
            if locks is not None:
                locks.close()
            tier.close()
            raise
    except BaseException:
        generation = pool.generation
        pool.close()
        if created:  # nothing half made stays behind a refused start
            discard_unused_tier(pool_name, generation, BlockPool.TIERS)
        raise
    _warn_idle_tiers(pool_name)
    return CoreJoin(pool, tier, locks, row)


# ------------------------------------------------------------------ other tiers, at start

def idle_tiers_notice(own_pool: str, prefix: str | None = None) -> str | None:
    """The start-up line naming each other pool meant to stay (vLLM tiers, SGLang page
    stores, ``shmkv create`` pools) of this user that no process holds: the /dev/shm memory
    it keeps (allocated bytes, with what goes with it), how long it has been idle
    (``shmkv/pool/lifecycle.py``, rule 6), and how to remove it. None when there is none.

    Reads only shmkv's objects in /dev/shm (``siblings.plan``: its names, without
    attaching); removes, records and changes nothing. ``prefix``: only pools whose name
    starts with it."""
    now = time.time()
    verdicts = plan(now, prefix=prefix)
    idle = [v for v in verdicts if v.kind == "pool" and v.idle and v.name != own_pool]
    if not idle:
        return None
    items, total = [], 0
    for v in idle:
        memory = memory_of(verdicts, v.name)
        total += memory
        age = max(0.0, now - v.idle_since) if v.idle_since is not None else 0.0
        items.append(f"{v.name} ({v.stays_by}, {human_bytes(memory)}, idle for "
                     f"{'up to ' if v.idle_since_is_lower_bound else ''}{duration_text(age)})")
    return (f"shmkv: {len(idle)} other shmkv tier(s) kept idle in /dev/shm, no process "
            f"holding them, {human_bytes(total)} in all: {', '.join(items)}. `shmkv unlink "
            "NAME` removes one; `shmkv cleanup --idle-for DURATION` removes those idle at "
            "least DURATION (e.g. 1d)")


def _warn_idle_tiers(own_pool: str) -> None:
    """Logs :func:`idle_tiers_notice` as a warning, if there is one. A replica starts
    whatever the look finds or fails at: it is advice."""
    try:
        line = idle_tiers_notice(own_pool)
    except Exception:  # noqa: BLE001  (a look at other tiers never stops a replica's start)
        logger.debug("shmkv: could not look for other idle tiers", exc_info=True)
        return
    if line is not None:
        logger.warning("%s", line)


# ------------------------------------------------------------------ the root: the pool

def open_pool(pool: str, num_chunks: int, max_processes: int, event_log_bytes: int | None,
              process: dict) -> tuple[BlockPool, bool]:
    """Creates the tier's pool (``num_chunks + 1`` blocks, medium CPU, one token per hash),
    or attaches to it; returns (pool, created). ``process``: ``label`` and lock settings.

    Raises:
        LayoutMismatchError: the pool is not an offload tier, or holds another number of
            chunks (both named).
        SegmentError: the pool belongs to another user, or is not READY in time.
    """
    if event_log_bytes is None:
        event_log_bytes = L.DEFAULT_EVENT_LOG_BYTES
    deadline = time.monotonic() + ATTACH_TIMEOUT_S
    while True:
        try:
            return BlockPool.create(
                pool, num_chunks + 1, enable_caching=True, hash_block_size=1,
                enable_kv_cache_events=False, medium=MEDIUM, max_processes=max_processes,
                event_log_bytes=event_log_bytes, **process,
            ), True
        except SegmentExistsError:
            pass
        try:
            bp = BlockPool.attach(pool, **process)
        except SegmentNotFoundError:
            continue  # its creator failed and removed it: create it ourselves
        except SegmentError as exc:
            if _being_made(exc) and time.monotonic() < deadline:
                time.sleep(0.01)
                continue
            raise
        try:
            _check_pool(bp, pool, num_chunks)
        except BaseException:
            bp.close()
            raise
        return bp, False


def _being_made(exc: SegmentError) -> bool:
    """Whether an attach failed because the pool's creator has not finished it: replicas
    start together, and an attacher can map the segment before its creator sized it, wrote
    its header or marked it READY."""
    text = str(exc)
    return ("INITIALIZING" in text or "smaller than a shmkv header" in text
            or "header field magic is '0x0'" in text)


def _check_pool(bp: BlockPool, pool: str, num_chunks: int) -> None:
    if bp.medium != MEDIUM or bp.hash_block_size != 1 or not bp.enable_caching:
        raise LayoutMismatchError(
            f"pool {pool!r} is not an offload tier (medium {bp.medium!r}, hash_block_size "
            f"{bp.hash_block_size}; a tier has medium {MEDIUM!r}, hash_block_size 1)"
        )
    if bp.num_gpu_blocks - 1 != num_chunks:
        raise LayoutMismatchError(
            f"pool {pool!r} holds {bp.num_gpu_blocks - 1} chunks, this replica has "
            f"num_chunks={num_chunks}: every replica must use the same cpu_bytes_to_use and "
            f"KV layout. To start the tier afresh, stop every replica using it and run "
            f"`shmkv unlink {pool}`"
        )


# ------------------------------------------------------------------ the table, made with its pool

def open_tier_table(pool: BlockPool, pool_name: str, num_chunks: int,
                    created: bool) -> TierTable:
    """Opens (or makes) the tier table of ``pool`` under its lock, so that one process
    initialises it; ``created``: this process just made the pool, so any table found is
    of an earlier generation. A table recording another generation than the pool's is
    never used (``shmkv/pool/lifecycle.py``, rules 1 and 3).

    Raises:
        LayoutMismatchError: the table is foreign, of another version or chunk count; or
            the pool lost its table while other processes hold the tier.
    """
    deadline = time.monotonic() + ATTACH_TIMEOUT_S
    while True:
        table = _open_or_make_table(pool, pool_name, num_chunks, created,
                                    may_wait=time.monotonic() < deadline)
        if table is not None:
            return table
        time.sleep(0.01)  # the pool's creator, alive and attached, is making the table


def _creator_making_table(pool: BlockPool) -> bool:
    """Whether the pool's creator, another process, is attached and alive: it makes the
    table right after the pool, so an attacher that finds none waits for it (caller holds
    the pool lock)."""
    creator = int(pool.header_snapshot()["creator_pid"])
    return any(p["pid"] == creator and p["alive"] and not p["self"] for p in pool.processes())


def _open_or_make_table(pool: BlockPool, pool_name: str, num_chunks: int, created: bool,
                        may_wait: bool) -> TierTable | None:
    """:func:`open_tier_table`'s one try, under the pool lock; None: wait for the pool's
    creator to make the table (only while ``may_wait``)."""
    name = tier_table_name(pool_name)
    size = table_bytes(num_chunks)
    generation = pool.generation
    with pool.lock():
        seg = _open_table(name)
        if seg is not None and not created:
            found = _recorded_generation(seg)
            if found is not None and found != generation:  # a removed tier's table
                seg.close()
                seg = None
        if seg is not None and created:  # an earlier generation's: never zeroed in place,
            seg.close()  # where its processes may still map it; made again (a new inode)
            seg = None
        if seg is None:
            if not created:
                if may_wait and _creator_making_table(pool):
                    return None
                _forget_for_new_table(pool, pool_name)
            Segment.unlink(name)  # an earlier generation's, if any (nobody believes it)
            seg = Segment.create(name, size)
            created = True
        try:
            hdr = np.frombuffer(seg.buf, np.int64, 16)
            if len(seg.buf) < size and not created:
                raise LayoutMismatchError(
                    f"tier table {name} is {len(seg.buf)} bytes; {num_chunks} chunks need "
                    f"{size}"
                )
            magic = int(hdr[W_MAGIC]) & 0xFFFF_FFFF_FFFF_FFFF
            if created or magic == 0:  # ours to fill (or its filler died half way)
                seg.buf[:size] = bytes(size)
                write_owner(seg.buf, L.OFFLOAD_TIER_OWNER_OFFSET,
                            owner_record(pool_name, creator=False))
                at = 8 * W_GENERATION_TIER
                seg.buf[at:at + LC.GENERATION_BYTES] = generation
                hdr[W_VERSION_CHUNKS] = (num_chunks << 32) | TIER_VERSION
                hdr[W_LRU_DIRTY] = 1  # the first holder builds the free stack (lru.py)
                hdr[W_MAGIC] = np.int64(TIER_MAGIC)  # last: the table is complete
            elif magic != TIER_MAGIC:
                raise LayoutMismatchError(
                    f"tier table {name}: magic expected {TIER_MAGIC:#x}, found {magic:#x}: "
                    "not a shmkv offload tier table"
                )
            else:
                word = int(hdr[W_VERSION_CHUNKS])
                if word & 0xFFFF_FFFF != TIER_VERSION or word >> 32 != num_chunks:
                    raise LayoutMismatchError(
                        f"tier table {name}: version {word & 0xFFFF_FFFF} with {word >> 32} "
                        f"chunks, expected version {TIER_VERSION} with {num_chunks}"
                    )
            del hdr
            return TierTable(seg, num_chunks)
        except BaseException:
            seg.close()
            raise


def _open_table(name: str) -> Segment | None:
    try:
        return Segment.open(name)
    except SegmentNotFoundError:
        return None


def _recorded_generation(seg: Segment) -> bytes | None:
    """The generation a complete table records; None for one whose filler has not
    finished (or died half way): it is filled again, with the pool's."""
    if len(seg.buf) < HEADER_BYTES or not int.from_bytes(seg.buf[:8], "little"):
        return None
    at = 8 * W_GENERATION_TIER
    return bytes(seg.buf[at:at + LC.GENERATION_BYTES])


def _forget_for_new_table(pool: BlockPool, pool_name: str) -> None:
    """Before a table is made again for a pool that outlived its own (removed alone, by
    hand or a tmp cleaner): refuses while any other process holds the tier, since they keep
    using the old table; else forgets every key of the pool, whose bytes no table vouches
    for now (caller holds the pool lock).

    Raises:
        LayoutMismatchError: other processes hold the tier (each reason named).
    """
    pool.reap_dead()
    others = [p for p in pool.processes() if not p["self"] and p["alive"]]
    reasons = LC.holders(pool_name)
    if others:
        reasons.insert(0, f"{len(others)} process(es) attached to the pool (pid "
                          f"{', '.join(str(p['pid']) for p in others)})")
    if reasons:
        raise LayoutMismatchError(
            f"pool {pool_name!r}: its tier table {tier_table_name(pool_name)} was removed "
            f"while the tier is in use ({'; '.join(reasons)}): the pool's keys name bytes "
            "that no table vouches for. Stop every replica of the tier and start them "
            f"again (`shmkv unlink --force {pool_name}` removes the tier), or use another "
            "shmkv_pool"
        )
    _forget_chunks(pool)


# ------------------------------------------------------------------ binding the data region

def bind_region(pool: BlockPool, tier: TierTable, locks: ReplicaLocks, row: int,
                pool_name: str, data_bytes: int) -> RegionBinding:
    """Makes sure the region file is the one the tier describes, making it if it is
    missing or not bound, and records it as replica row ``row``'s; returns the binding
    (tag, generation, inode), read in the hold that bound it.

    Raises:
        SegmentError: a foreign or insecure file, no room, or another worker took longer
            than MAKER_WAIT_S to make the region.
    """
    path = region_path(pool_name)
    generation = pool.generation
    deadline = time.monotonic() + MAKER_WAIT_S
    while True:
        with pool.lock():
            bound = bound_tag(tier, path, data_bytes, generation)
            if bound:
                _bind_row(tier, row, bound)
                return RegionBinding(bound, generation, int(tier.words[W_REGION_INODE]))
        if locks.try_region_maker():
            try:
                return _make_and_bind(pool, tier, row, path, data_bytes, generation)
            finally:
                locks.release_region_maker()
        if time.monotonic() > deadline:
            raise SegmentError(
                f"waited {MAKER_WAIT_S:.0f} s for another worker to make the offload tier's "
                f"data region {path}"
            )
        time.sleep(0.01)


def _make_and_bind(pool: BlockPool, tier: TierTable, row: int, path: str,
                   data_bytes: int, generation: bytes) -> RegionBinding:
    with pool.lock():  # another maker may have bound it before this one got the byte
        bound = bound_tag(tier, path, data_bytes, generation)
        if bound:
            _bind_row(tier, row, bound)
            return RegionBinding(bound, generation, int(tier.words[W_REGION_INODE]))
    # out of the lock: reserving pages takes time
    tmp, tag = make_file(path, data_bytes, generation)
    try:
        with pool.lock():
            read_tag(path, data_bytes, generation)  # refuses a foreign file planted meanwhile
            os.rename(tmp, path)
            tier.words[W_REGION_INODE] = os.stat(path, follow_symlinks=False).st_ino
            # Whatever the tier described lived in another region (or none): no key of the
            # pool names bytes of this one, whether the table had a region bound or not.
            _forget_chunks(pool)
            if tier.words[W_REGION_TAG]:
                tier.words[W_LRU_DIRTY] = 1  # the next holder rebuilds the free stack (lru.py)
            tier.words[W_REGION_TAG] = tag
            _bind_row(tier, row, tag)
            binding = RegionBinding(tag, generation, int(tier.words[W_REGION_INODE]))
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return binding


def _bind_row(tier: TierTable, row: int, tag: int) -> None:
    """Records that a process of replica row ``row`` maps the region tagged ``tag``. The
    binding is per process: a row whose processes map different regions (one region was
    replaced between two workers' binds, or a worker bound again after a replacement while
    another still maps the old one) becomes REGION_MIXED, never the tier's tag, so the
    replica is lost until all of its processes are gone and it starts again."""
    mine = int(tier.replica_region[row])
    tier.replica_region[row] = tag if mine in (0, tag) else REGION_MIXED


def _forget_chunks(pool: BlockPool) -> None:
    """Drops the key of every chunk the tier described: their bytes were in a region that
    is gone (caller holds the pool lock). A chunk being stored keeps its hold: its storer's
    completion fails, since that replica maps the old region."""
    rows = pool.block_rows()
    keyed = np.flatnonzero(rows["hash_num_tokens"] != L.NO_HASH_TOKENS)
    del rows
    keyed = keyed[keyed > 0].tolist()
    if keyed:
        pool.evict_blocks(keyed)


# ------------------------------------------------------------------ removal

def remove_tier(pool_name: str) -> bool:
    """Removes the tier whole, root first: the pool (with its lock, liveness file and
    siblings), then the table, data region and replica lock file of its generation
    (``shmkv/pool/lifecycle.py``, rule 5). Processes still attached keep their mappings.
    ``shmkv unlink`` refuses a tier in use before it gets here (``--force`` does not).
    Returns whether anything was removed.

    Raises:
        UsageError: a bad pool name.
    """
    found, removed, _ = unlink_pool(pool_name, BlockPool.TIERS)
    return found or bool(removed)
