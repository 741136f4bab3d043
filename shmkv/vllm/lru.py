"""The tier's eviction order and free chunks, in the tier table, at O(log chunks) a chunk.

vLLM's ``LRUCachePolicy`` keeps evictable keys in a lazily invalidated min-heap of
``(rank, key)``; this is the same heap in shared memory, over block ids:

- ``heap_rank`` / ``heap_block``: a binary min-heap of (rank, block) entries. An entry is
  pushed whenever a ready chunk gets a rank (its store completes, a request touches it);
  an entry whose rank is no longer the chunk's, or whose chunk is no longer ready, is
  stale and dropped when it reaches the top. A current entry whose chunk is held (a pin,
  a job bit) is set aside and pushed back after the eviction, as vLLM's heap holds only
  evictable keys. When the heap is full it is rebuilt from the ranks of the ready chunks.
- ``free_stack``: chunks that may be free (no key, no hold, no job bit), pushed wherever a
  chunk is freed (a failed store, a reset, a dead storer's orphan, a replica's job bits
  released) and checked when popped; it starts with every chunk, lowest id on top.

Both are derived data, written under the pool lock without a journal: ``W_LRU_DIRTY`` is
set before a change and cleared after it, so a holder that finds it set (its writer died
half way) rebuilds both from the authoritative words (block rows, ranks, job bits), an
O(chunks) pass.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from shmkv.pool import layout as L

try:  # the heap's sifts and the victims' loop in C (the Python below is the reference)
    from shmkv.pool._ckernel import heap_pop as _c_heap_pop
    from shmkv.pool._ckernel import heap_push as _c_heap_push
    from shmkv.pool._ckernel import heap_victims as _c_heap_victims
except ImportError:  # pragma: no cover - the extension is not built
    _c_heap_pop = _c_heap_push = _c_heap_victims = None
from shmkv.vllm.tier import PENDING_BIT, W_FREE_TOP, W_HEAP_SIZE, W_LRU_DIRTY, TierTable


class TierLRU:
    """One process's handle on the tier's heap and free stack (caller holds the pool
    lock for every method)."""

    def __init__(self, tier: TierTable, rows: Callable[[], np.ndarray],
                 words: memoryview) -> None:
        self._tier = tier
        self._rows = rows  # the pool's block rows (a view)
        self._block_words = words  # the same rows as int32 words (BlockPool.block_words)
        self._words = tier.words
        self._hr = tier.heap_rank_words
        self._hb = tier.heap_block_words
        self._free = tier.free_words
        self._cap = len(tier.heap_rank)
        self._c_heap = _c_heap_pop is not None
        self._layout = (L.ROW_I32, L.F_REF, L.F_HASH_TOKENS, L.F_GROUP, L.NO_HASH_TOKENS,
                        PENDING_BIT)

    # ------------------------------------------------------------------ crash safety

    def begin(self) -> None:
        """Marks the structures as being changed; rebuilds them first if a writer died
        changing them."""
        if self._words[W_LRU_DIRTY]:
            self.rebuild()
        self._words[W_LRU_DIRTY] = 1

    def end(self) -> None:
        self._words[W_LRU_DIRTY] = 0

    def rebuild(self) -> None:
        """Both structures from the block rows, ranks and job bits (O(chunks))."""
        tier, rows = self._tier, self._rows()
        keyed = rows["hash_num_tokens"] != L.NO_HASH_TOKENS
        pending = (rows["group_id"] & PENDING_BIT) != 0
        ready = np.flatnonzero(keyed & ~pending)
        ready = ready[ready > 0]
        order = np.argsort(tier.ranks[ready], kind="stable")  # sorted: a valid heap
        size = min(len(ready), self._cap)
        tier.heap_rank[:size] = tier.ranks[ready[order]][:size]
        tier.heap_block[:size] = ready[order][:size]
        self._words[W_HEAP_SIZE] = size
        free = np.flatnonzero(~keyed & (rows["ref_cnt"] == 0) & (tier.jobs == 0))
        free = free[free > 0][::-1]  # lowest id on top
        tier.free_stack[:len(free)] = free
        self._words[W_FREE_TOP] = len(free)
        self._words[W_LRU_DIRTY] = 0

    # ------------------------------------------------------------------ the heap

    def push(self, rank: int, block: int) -> None:
        """Adds an entry (caller between begin and end)."""
        size = self._words[W_HEAP_SIZE]
        if size >= self._cap:
            self.rebuild()
            self._words[W_LRU_DIRTY] = 1
            size = self._words[W_HEAP_SIZE]
            if size >= self._cap:
                return  # every ready chunk is in it already
        if self._c_heap:
            _c_heap_push(self._hr, self._hb, size, rank, block)
        else:
            self._sift_up(size, rank, block)
        self._words[W_HEAP_SIZE] = size + 1

    def push_many(self, ranks, blocks: list[int]) -> None:
        """``push(ranks[b], b)`` for each block (caller between begin and end)."""
        words, cap = self._words, self._cap
        if not self._c_heap or words[W_HEAP_SIZE] + len(blocks) > cap:
            for block in blocks:
                self.push(ranks[block], block)
            return
        hr, hb = self._hr, self._hb
        size = words[W_HEAP_SIZE]
        for block in blocks:
            _c_heap_push(hr, hb, size, ranks[block], block)
            size += 1
        words[W_HEAP_SIZE] = size

    def _sift_up(self, size: int, rank: int, block: int) -> None:
        hr, hb = self._hr, self._hb
        i = size
        while i:  # sift up: entries order by (rank, block)
            parent = (i - 1) >> 1
            pr = hr[parent]
            if pr < rank or (pr == rank and hb[parent] <= block):
                break
            hr[i] = pr
            hb[i] = hb[parent]
            i = parent
        hr[i] = rank
        hb[i] = block

    def _pop(self) -> tuple[int, int]:
        if self._c_heap:
            size = self._words[W_HEAP_SIZE]
            top = _c_heap_pop(self._hr, self._hb, size)
            self._words[W_HEAP_SIZE] = size - 1
            return top
        return self._py_pop()

    def _py_pop(self) -> tuple[int, int]:
        hr, hb = self._hr, self._hb
        size = self._words[W_HEAP_SIZE] - 1
        top = (hr[0], hb[0])
        rank, block = hr[size], hb[size]
        i = 0
        while True:  # sift the last entry down from the root
            child = 2 * i + 1
            if child >= size:
                break
            cr = hr[child]
            if child + 1 < size:
                sr = hr[child + 1]
                if sr < cr or (sr == cr and hb[child + 1] < hb[child]):
                    child += 1
                    cr = sr
            if rank < cr or (rank == cr and block <= hb[child]):
                break
            hr[i] = cr
            hb[i] = hb[child]
            i = child
        if size:
            hr[i] = rank
            hb[i] = block
        self._words[W_HEAP_SIZE] = size
        return top

    def pop_victims(self, num: int, protected: set[int], key_of: Callable[[int], bytes],
                    *, use_c: bool = True) -> list[int] | None:
        """The ``num`` evictable ready chunks of smallest (rank, key), in that order, taken
        out of the heap; None (nothing taken) if there are fewer. A chunk is evictable when
        nobody holds it (no reference, no job bit) and it is not in ``protected``. With the
        C kernel, the loop runs in C up to its first rank tie (``_ckernel.heap_victims``);
        this method's loop is the reference and goes on from there."""
        ranks, words, hr = self._tier.rank_words, self._block_words, self._hr
        jobs = self._tier.job_words
        row, f_ref, f_htok, f_gid = L.ROW_I32, L.F_REF, L.F_HASH_TOKENS, L.F_GROUP
        no_key = L.NO_HASH_TOKENS
        num_blocks = min(len(ranks), len(jobs), len(words) // row)

        def stale(block: int, rank: int) -> bool:  # re-ranked, no longer ready, or no chunk
            if not 0 < block < num_blocks:  # an entry written over: dropped
                return True
            at = block * row
            return (ranks[block] != rank or words[at + f_htok] == no_key
                    or words[at + f_gid] & PENDING_BIT)

        def evictable(block: int) -> bool:
            return words[block * row + f_ref] == 0 and jobs[block] == 0 and block not in protected

        sizes = self._words
        victims: list[int] = []
        aside: list[tuple[int, int]] = []
        tied = None
        if use_c and _c_heap_victims is not None and self._c_heap:
            try:
                size, victims, aside, tied = _c_heap_victims(
                    hr, self._hb, sizes[W_HEAP_SIZE], ranks, words, jobs, protected, num,
                    self._layout)
                sizes[W_HEAP_SIZE] = size
            except ValueError:  # an entry names no chunk (the heap was written over), and
                self.rebuild()  # the C loop stopped half way: the heap again, from the rows
                victims, aside, tied = [], [], None
        seen = set(victims)
        seen.update(block for _, block in aside)
        if tied is not None:
            seen.add(tied[1])
        while len(victims) < num and (tied is not None or sizes[W_HEAP_SIZE]):
            if tied is not None:
                (rank, block), tied = tied, None  # evictable, and the top ties its rank
            else:
                rank, block = self._pop()
                if block in seen or stale(block, rank):
                    continue
                seen.add(block)
                if not evictable(block):
                    aside.append((rank, block))
                    continue
                if not (sizes[W_HEAP_SIZE] and hr[0] == rank):
                    victims.append(block)  # no tie (the usual case)
                    continue
            ties = [block]  # vLLM breaks rank ties by key bytes
            while sizes[W_HEAP_SIZE] and hr[0] == rank:
                _, other = self._pop()
                if other in seen or stale(other, rank):
                    continue
                seen.add(other)
                if evictable(other):
                    ties.append(other)
                else:
                    aside.append((rank, other))
            if len(ties) > 1:
                ties.sort(key=key_of)
            take = ties[:num - len(victims)]
            victims.extend(take)
            aside.extend((rank, b) for b in ties[len(take):])
        for rank, block in aside:
            self.push(rank, block)
        if len(victims) < num:
            for block in victims:
                self.push(ranks[block], block)
            return None
        return victims

    # ------------------------------------------------------------------ free chunks

    def push_free(self, blocks: list[int]) -> None:
        top = self._words[W_FREE_TOP]
        if top + len(blocks) > len(self._free):
            self.rebuild()
            self._words[W_LRU_DIRTY] = 1
            return  # the rebuild found every free chunk
        free = self._free
        for block in blocks:
            free[top] = block
            top += 1
        self._words[W_FREE_TOP] = top

    def pop_free(self, num: int, is_free: Callable[[int], bool]) -> list[int]:
        """Up to ``num`` free chunks, lowest pushed last first (checked: stale ones are
        dropped)."""
        free, out = self._free, []
        top = self._words[W_FREE_TOP]
        seen: set[int] = set()
        while top and len(out) < num:
            top -= 1
            block = free[top]
            if block not in seen and is_free(block):
                out.append(block)
                seen.add(block)
        self._words[W_FREE_TOP] = top
        return out
