"""The node-wide page store: page metadata in a shmkv pool, page bytes in its region.

One pool block per page slot (block 0 is the pool's null block). A page's key is a 32-byte
digest of SGLang's page hash and the rank part that owns it (backend.py). Its states:

    free        no key, ref_cnt 0, in the pool's free queue
    storing     key under group PENDING_GROUP, ref_cnt 1 held by the storing process
    complete    key under group 0; ref_cnt = the readers pinning it; in the LRU queue
                (the pool's free queue, hashed blocks at its tail) when nobody does

- ``exists`` and lookups see group 0 only, so never a page whose bytes are being written;
- a store finds the key ``storing`` in another process and does not store it again;
- a read pins (``touch``) before copying and unpins after, so the pool's eviction, which
  takes ref-0 blocks only, never hands the slot to a writer mid-copy;
- every call checks, under the pool lock, that no other file is the pool's region now
  (``PageRegion.check_current``): one removed and made again by another process, which
  dropped the pool's keys, is a SegmentError, so no page completes in, nor is served from,
  a file the pool's other processes do not read;
- a SIGKILLed process's holds are given back by the pool's reaping (its ledger row); a
  ``storing`` block left with ref_cnt 0 is a half-written page: survivors drop its key
  (:meth:`PageStore.discard_orphans`, run whenever the pool's reap count moves, and by a
  store that meets it), so it is never read and its slot is reused.

Eviction, pins, the lock and crash recovery are the pool's: nothing here keeps a second
copy of any of them.

Events: the pool is made with its own KV events off and an event log on, and the store logs
what a subscriber (``shmkv publish``, the Redis index) may believe, in the same lock hold as
the change: a ``BlockStored`` (group 0) once a page is complete, a ``BlockRemoved`` when a
complete page's key goes (evicted for room, ``clear``, its region replaced). A page being
written, or a dead writer's half page, never appears in the log.
"""

from __future__ import annotations

import os
import time
from itertools import islice
from typing import Any

import numpy as np

from shmkv.errors import (
    LayoutMismatchError,
    SegmentError,
    SegmentExistsError,
    SegmentNotFoundError,
    ShmKVError,
    UsageError,
)
from shmkv.pool import layout as L
from shmkv.pool import tier_counters as TC
from shmkv.pool.block_pool import BlockPool, KVCacheBlock
from shmkv.sglang import identity as ident
from shmkv.sglang.events import MEDIUM, complete_keys, log_removed, log_stored
from shmkv.sglang.region import PageRegion, open_region

PENDING_GROUP = L.PENDING_GROUP_BIT  # a page being written (never a hit, never published)
ATTACH_TIMEOUT_S = 10.0
STAYS_BY = "sglang store"  # what `shmkv ls` says keeps the store's pool (mark_stays)


class _Keys:
    """What ``cache_full_blocks`` reads of a request: its hashes (one per page)."""

    def __init__(self, hashes: list[bytes]) -> None:
        self.block_hashes = hashes
        self.all_token_ids: list[int] = []


def open_pool(pool: str, num_pages: int, max_processes: int, label: str) -> BlockPool:
    """Creates the store's pool (``num_pages + 1`` blocks, medium L3) or attaches to it,
    whatever its size: the identity check (region.py) names what differs.

    Raises:
        LayoutMismatchError: the pool is not an SGLang store.
        SegmentError: the pool is another user's, or not READY in time.
    """
    deadline = time.monotonic() + ATTACH_TIMEOUT_S
    while True:
        try:
            return BlockPool.create(pool, num_pages + 1, enable_caching=True, hash_block_size=1,
                                    enable_kv_cache_events=False,
                                    event_log_bytes=L.DEFAULT_EVENT_LOG_BYTES, medium=MEDIUM,
                                    max_processes=max_processes, label=label)
        except SegmentExistsError:
            pass
        try:
            bp = BlockPool.attach(pool, label=label)
        except SegmentNotFoundError:
            continue
        except SegmentError as exc:
            text = str(exc)
            if time.monotonic() < deadline and (
                    "INITIALIZING" in text or "smaller than a shmkv header" in text
                    or "header field magic is '0x0'" in text):
                time.sleep(0.01)
                continue
            raise
        if bp.medium != MEDIUM or bp.hash_block_size != 1 or bp.enable_kv_cache_events:
            found = (bp.medium, bp.hash_block_size, bp.enable_kv_cache_events)
            bp.close()
            raise LayoutMismatchError(
                f"pool {pool!r} (medium, tokens per hash, pool events) = {found} is not an "
                f"SGLang store (({MEDIUM!r}, 1, False)); pick another shmkv_pool")
        return bp


class PageStore:
    """One process's handle on the node-wide page store."""

    def __init__(self, pool_name: str, store_bytes: int, page_bytes: int,
                 identity: dict[str, Any], max_processes: int, label: str = "sglang") -> None:
        num_pages = store_bytes // page_bytes
        if num_pages < 1:
            raise UsageError(
                f"extra_config: bytes {store_bytes} hold no page of {page_bytes} bytes")
        self.pool_name = pool_name
        self.pool = open_pool(pool_name, num_pages, max_processes, label)
        try:
            self.region: PageRegion = open_region(
                self.pool, pool_name, page_bytes, ident.encode(identity),
                lambda found: ident.compare(found, identity, pool_name))
            if self.pool.num_gpu_blocks - 1 != num_pages:
                raise LayoutMismatchError(
                    f"store {pool_name!r} holds {self.pool.num_gpu_blocks - 1} pages, this "
                    f"instance's bytes give {num_pages}")
            # The store is complete (pool and page region): it stays in /dev/shm for the
            # next SGLang instance until `shmkv unlink` (a maker that died before this line
            # left an orphan, which `shmkv cleanup` removes).
            self.pool.mark_stays(STAYS_BY)
        except BaseException:
            if hasattr(self, "region"):
                self.region.close()
            self.pool.close()
            raise
        self.page_bytes = page_bytes
        self.num_pages = num_pages
        self._reaped_seen = -1
        self._me = self.pool.slot + 1  # this process's counter row and producer mark
        self._counts = self.region.counter_words
        with self.pool.lock():
            TC.reset_row(self._counts, self._me, os.getpid())
        self.discard_orphans()

    # ------------------------------------------------------------------ lookups

    def prefix(self, hashes: list[bytes]) -> int:
        """How many leading pages of ``hashes`` are complete."""
        self._maybe_discard()
        pool = self.pool
        with pool.lock():
            self.region.check_current(pool, self.pool_name)
            return len(pool.get_cached_prefix(hashes, 0))

    def pin(self, hashes: list[bytes]) -> list[KVCacheBlock | None]:
        """Pins each complete page (None for a miss); the caller copies, then unpins."""
        pool = self.pool
        with pool.lock():
            self.region.check_current(pool, self.pool_name)
            blocks = pool.blocks
            found = pool.lookup_block_ids(list(hashes), [0] * len(hashes))
            out = [blocks[b] if b >= 0 else None for b in found]
            hit = [b for b in out if b is not None]
            pool.touch(hit)
            producer, me = self.region.producer_words, self._me
            TC.add(self._counts, me, TC.C_LOADED, len(hit))
            TC.add(self._counts, me, TC.C_CROSS, sum(producer[b] != me for b in found if b >= 0))
        return out

    def unpin(self, blocks: list[KVCacheBlock]) -> None:
        if blocks:
            self.pool.free_blocks(blocks)

    # ------------------------------------------------------------------ stores

    def begin_store(self, hashes: list[bytes]
                    ) -> tuple[list[int], list[KVCacheBlock], list[int]]:
        """Reserves a slot for each page of ``hashes`` not yet complete nor being stored.

        Returns:
            (indices into ``hashes`` to write, their blocks in the same order, indices
            that found no room: the pool had too few unpinned slots).
        """
        self._maybe_discard()
        pool = self.pool
        todo: list[int] = []
        with pool.lock():
            self.region.check_current(pool, self.pool_name)
            seen: set[bytes] = set()
            reaped = False
            words = pool.block_words()
            found = pool.lookup_block_ids(list(hashes), [0] * len(hashes), PENDING_GROUP)
            for i, (h, block) in enumerate(zip(hashes, found, strict=True)):
                if h in seen or block >= 0:  # complete, or met earlier in this call
                    continue
                seen.add(h)
                if block < -1:  # being stored: -2 - the block that holds it
                    ref = (-2 - block) * L.ROW_I32 + L.F_REF
                    if words[ref] > 0 and not reaped:
                        pool.reap_dead()  # its writer may be dead: its hold is then released
                        reaped = True
                    if words[ref] > 0:
                        continue  # another process is storing it right now
                    pool.evict_blocks([-2 - block])  # a dead writer's half page: stored afresh
                todo.append(i)
            room = min(len(todo), pool.get_num_free_blocks())
            todo, no_room = todo[:room], todo[room:]
            if room:
                victims = [b.block_id for b in
                           islice(pool.free_block_queue.iter_blocks_after(None), room)]
                log_removed(pool, complete_keys(pool, victims))
            blocks = pool.get_new_blocks(room) if room else []
            if blocks:
                pool.cache_full_blocks(_Keys([hashes[i] for i in todo]), blocks, 0, room, 1,
                                       PENDING_GROUP)
        return todo, blocks, no_room

    def finish_store(self, hashes: list[bytes], blocks: list[KVCacheBlock],
                     ok: bool = True) -> None:
        """Completes (``ok``) or abandons the stores begun for ``blocks``.

        Raises:
            SegmentError: the region was replaced since this process mapped it; the stores
                are abandoned."""
        if not blocks:
            return
        pool = self.pool
        with pool.lock():
            pool.evict_blocks([b.block_id for b in blocks])
            stale: SegmentError | None = None
            if ok:
                try:  # else the bytes would be in a file the others do not read
                    self.region.check_current(pool, self.pool_name)
                except SegmentError as exc:
                    stale = exc
            if ok and stale is None:
                pool.cache_full_blocks(_Keys(hashes), blocks, 0, len(blocks), 1, 0)
                log_stored(pool, hashes)
                producer, me = self.region.producer_words, self._me
                for block in blocks:
                    producer[block.block_id] = me
                TC.add(self._counts, me, TC.C_STORED, len(blocks))
            pool.free_blocks(blocks)
        if stale is not None:
            raise stale

    # ------------------------------------------------------------------ upkeep

    def _maybe_discard(self) -> None:
        if self.pool.num_reaped() != self._reaped_seen:
            self.discard_orphans()

    def discard_orphans(self) -> int:
        """Drops the key of every page left ``storing`` by a dead writer; returns how many."""
        pool = self.pool
        with pool.lock():
            self._reaped_seen = pool.num_reaped()
            rows = pool.block_rows()
            orphan = np.flatnonzero((rows["ref_cnt"] == 0) & (rows["group_id"] == PENDING_GROUP)
                                    & (rows["hash_num_tokens"] != L.NO_HASH_TOKENS))
            del rows
            ids = [int(b) for b in orphan if b > 0]
            if ids:
                pool.evict_blocks(ids)
        return len(ids)

    # ------------------------------------------------------------------ page copies

    def slots(self, like: np.ndarray) -> np.ndarray:
        """The region's page slots viewed as ``like``'s pages: ``[num_pages, *like.shape[1:]]``
        of its dtype (slot ``s`` is block ``s + 1``'s page); ``like`` is
        ``[num_host_pages, *page_shape]`` and its pages are ``page_bytes`` each."""
        return self.region.pages.view(like.dtype).reshape((self.num_pages,) + like.shape[1:])

    def load(self, hashes: list[bytes], host: np.ndarray, host_pages: list[int],
             slots: np.ndarray | None = None) -> list[bool]:
        """Copies each complete page of ``hashes`` into ``host[host_pages[i]]``, one copy per
        run of pages consecutive in both; its pages are pinned while they are copied, so no
        eviction hands their slots to a writer. Returns whether each page was copied.

        ``host``: ``[num_host_pages, *page_shape]`` (a view: it may be strided); ``slots``:
        ``self.slots(host)``, if the caller keeps it."""
        slots = self.slots(host) if slots is None else slots
        blocks = self.pin(hashes)
        held = [b for b in blocks if b is not None]
        try:
            hit = [i for i, b in enumerate(blocks) if b is not None]
            copy_runs(host, [host_pages[i] for i in hit], slots,
                      [blocks[i].block_id - 1 for i in hit])
        finally:
            self.unpin(held)
        return [b is not None for b in blocks]

    def save(self, hashes: list[bytes], host: np.ndarray, host_pages: list[int],
             slots: np.ndarray | None = None) -> tuple[int, list[int]]:
        """Stores ``host[host_pages[i]]`` as the page of ``hashes[i]``, for each page neither
        complete nor being stored by another process (``begin_store``), one copy per run;
        the pages complete together, or none does if the copy fails.

        Returns:
            (pages stored, indices into ``hashes`` that found no room).
        """
        slots = self.slots(host) if slots is None else slots
        todo, blocks, no_room = self.begin_store(hashes)
        ok = False
        try:
            copy_runs(slots, [b.block_id - 1 for b in blocks], host,
                      [host_pages[i] for i in todo])
            ok = True
        finally:
            self.finish_store([hashes[i] for i in todo], blocks, ok)
        return len(blocks), no_room

    def slot_range(self, block_id: int) -> tuple[int, int]:
        start = (block_id - 1) * self.page_bytes
        return start, start + self.page_bytes

    def clear(self) -> bool:
        """Drops every complete page nobody pins (SGLang's ``clear``); True if all went."""
        pool = self.pool
        with pool.lock():
            rows = pool.block_rows()
            done = (rows["group_id"] == 0) & (rows["hash_num_tokens"] != L.NO_HASH_TOKENS)
            idle = np.flatnonzero(done & (rows["ref_cnt"] == 0))
            pinned = int(np.count_nonzero(done & (rows["ref_cnt"] > 0)))
            del rows, done
            ids = [int(b) for b in idle if b > 0]
            if ids:
                log_removed(pool, complete_keys(pool, ids))
                pool.evict_blocks(ids)
        return pinned == 0

    def close(self) -> None:
        try:
            with self.pool.lock():
                self._counts[self._me * TC.ROW_WORDS + TC.C_LIVE] = 0  # its counts stay
        except ShmKVError:
            pass  # the pool is gone or its lock lost: the row reads live while its pid is
        del self._counts
        self.region.close()
        self.pool.close()


def runs(first: list[int], second: list[int]) -> list[tuple[int, int, int]]:
    """Splits paired indices into maximal runs consecutive in both: (start of first,
    start of second, length)."""
    out: list[tuple[int, int, int]] = []
    for a, b in zip(first, second, strict=True):
        if out and out[-1][0] + out[-1][2] == a and out[-1][1] + out[-1][2] == b:
            s, t, n = out[-1]
            out[-1] = (s, t, n + 1)
        else:
            out.append((a, b, 1))
    return out


def copy_runs(dst: np.ndarray, dst_pages: list[int], src: np.ndarray,
              src_pages: list[int]) -> None:
    """``dst[dst_pages[i]] = src[src_pages[i]]`` for every i, one ``np.copyto`` per run.

    NOTE: numpy, not torch: ``copy_`` splits each copy over torch's intra-op threads, and on
    a loaded host a few pages then wait for a descheduled thread far longer than the copy
    takes (measured: ~0.2 GB/s against ~20 GB/s); ``np.copyto`` is one memcpy-like loop per
    run, with the GIL released."""
    for d, s, n in runs(dst_pages, src_pages):
        np.copyto(dst[d:d + n], src[s:s + n])
