"""Offload keys in the pool, and vLLM's request-scoped LRU recency, for the tier's manager.

Keys: an ``OffloadKey`` (a block hash of up to 32 bytes, then a 4-byte big-endian group
index) is a pool block's prefix-cache key: the hash padded to 32 bytes, and a group id that
carries the group index (low 16 bits) and the padding length (bits 16..21); the manager adds
its state bit (``PENDING_BIT``).

Recency: exactly the ranks of vLLM 0.33.0's ``LRUCachePolicy``, ``(major, -position)``
packed into one int64 per block in the tier table. A request's positioned keys share one
request rank, so its tail is evicted before its head; ``touch`` and a finished request give
their keys fresh ranks. Every rank given to a ready chunk also goes to the eviction heap
(``lru.py``). A rank is advice, never an invariant: a word left by a killed process still
orders chunks validly.

``RequestRecency`` is a mixin of ``SharedCPUOffloadingManager``: it reads the manager's tier
header words (``_thdr``), ranks (``_ranks``), heap (``_lru``), key memo (``_encoded``) and
``_status``; every method runs under the manager's hold of the pool lock.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field

from vllm.v1.kv_offload.base import OffloadKey, ReqContext, get_offload_group_idx
from vllm.v1.kv_offload.cpu.policies.base import order_request_keys

from shmkv.errors import UsageError
from shmkv.vllm.tier import W_GENERATION, W_NEXT_RANK

_GROUP_MASK = 0xFFFF
_PAD_SHIFT = 16
HASH_BYTES = 32

# vLLM's LRU rank (major, minor) with minor = -position in (-2**26, 0], packed in one int64.
_MINOR_SPAN = 1 << 26
MAX_POSITION = _MINOR_SPAN - 1

ENCODE_CACHE_ENTRIES = 1 << 16
MISS, PENDING, READY = 0, 1, 2  # a key's state (manager.py)


def pack_rank(major: int, minor: int) -> int:
    return major * _MINOR_SPAN + (_MINOR_SPAN - 1 + minor)


@dataclass(slots=True)
class _RequestRank:
    """The LRU rank a request's positioned keys share (vLLM's request-scoped rank)."""

    owner: object
    generation: int
    rank: int


@dataclass(slots=True)
class _RequestAccess:
    """Keys one request touched, grouped in prefix order (as vLLM's manager records)."""

    owner: object
    generation: int
    key_groups: dict[int, list[OffloadKey]] = field(default_factory=dict)
    seen_keys: set[OffloadKey] = field(default_factory=set)
    inserted_keys: set[OffloadKey] = field(default_factory=set)
    reused_keys: set[OffloadKey] = field(default_factory=set)
    store_miss_keys: set[OffloadKey] = field(default_factory=set)
    finished: bool = False


class RequestRecency:
    """Key encoding and vLLM's request-scoped LRU ranks (the module docstring)."""

    def _encode(self, key: OffloadKey) -> tuple[bytes, int]:
        """(pool hash, ready group id) of an offload key (memoised: a scheduler asks
        about the same keys again and again)."""
        enc = self._encoded.get(key)
        if enc is not None:
            return enc
        enc = self._encode_key(key)
        if len(self._encoded) >= ENCODE_CACHE_ENTRIES:
            self._encoded.clear()
        self._encoded[key] = enc
        return enc

    @staticmethod
    def _encode_key(key: OffloadKey) -> tuple[bytes, int]:
        if not isinstance(key, bytes):
            raise UsageError(f"an offload key must be bytes, got {type(key).__name__}")
        num_hash = len(key) - 4
        if not 1 <= num_hash <= HASH_BYTES:
            raise UsageError(
                f"offload key of {len(key)} bytes: the shared tier takes a block hash of 1 to "
                f"{HASH_BYTES} bytes plus the 4-byte group index"
            )
        group = int.from_bytes(key[-4:], "big")
        if group > _GROUP_MASK:
            raise UsageError(f"offload key group index {group} > {_GROUP_MASK}")
        pad = HASH_BYTES - num_hash
        block_hash = key[:-4] + bytes(pad) if pad else key[:-4]
        return block_hash, group | (pad << _PAD_SHIFT)

    @staticmethod
    def _decode(block_hash: bytes, group_id: int) -> OffloadKey:
        pad = (group_id >> _PAD_SHIFT) & 0x3F
        return OffloadKey(block_hash[:HASH_BYTES - pad]
                          + (group_id & _GROUP_MASK).to_bytes(4, "big"))

    def _generation(self) -> int:
        return self._thdr[W_GENERATION]

    def _request_rank(self, req_context: ReqContext) -> int:
        state = req_context.get_state(_RequestRank)
        generation = self._thdr[W_GENERATION]
        if state is None or state.owner is not self or state.generation != generation:
            rank = self._thdr[W_NEXT_RANK] + 1
            self._thdr[W_NEXT_RANK] = rank
            state = _RequestRank(self, generation, rank)
            req_context.set_state(state)
        return state.rank

    def _new_rank(self) -> int:
        rank = self._thdr[W_NEXT_RANK] + 1
        self._thdr[W_NEXT_RANK] = rank
        return pack_rank(rank, 0)

    def _request_access(self, req_context: ReqContext) -> _RequestAccess:
        state = req_context.get_state(_RequestAccess)
        generation = self._thdr[W_GENERATION]
        if state is None or state.owner is not self or state.generation != generation:
            state = _RequestAccess(owner=self, generation=generation)
            req_context.set_state(state)
        return state

    def _check_positions(self, keys: Sequence[OffloadKey], req_context: ReqContext
                         ) -> tuple[list[tuple[bytes, int]], dict[OffloadKey, int]]:
        """The keys' pool forms (``_encode``) and the positions the request gives them
        (keys without one left out), read once per call, before any lock is taken.

        Raises:
            UsageError: a key the tier cannot hold, or a position out of range.
        """
        encoded, encode = self._encoded, self._encode
        get_position = req_context.get_offload_key_position
        encs, positions = [], {}
        for key in keys:
            enc = encoded.get(key)
            encs.append(enc if enc is not None else encode(key))
            position = get_position(key)
            if position is not None:
                if not 0 <= position <= MAX_POSITION:
                    raise UsageError(
                        f"offload key position {position} is not in [0, {MAX_POSITION}]")
                positions[key] = position
        return encs, positions

    def _on_request_access(self, keys: Sequence[OffloadKey], req_context: ReqContext,
                           known: dict[OffloadKey, tuple[int, int]],
                           positions: dict[OffloadKey, int]) -> None:
        """The shared part of vLLM's access record (caller holds the lock): the request
        gets its rank, and each stored or in-flight key with a position gets that rank, if
        it is newer."""
        if not keys:
            return
        ranks, request_rank = self._ranks, self._request_rank(req_context)
        for key in keys:
            position = positions.get(key)
            if position is None:
                continue
            status = known.get(key)
            state, block_id = status if status is not None else self._status(key)
            if state == MISS:
                continue
            rank = pack_rank(request_rank, -position)
            if ranks[block_id] >= rank:
                continue
            ranks[block_id] = rank
            if state == READY:
                self._lru.push(rank, block_id)

    @staticmethod
    def _new_access_keys(access: _RequestAccess, keys: Iterable[OffloadKey]
                         ) -> list[OffloadKey]:
        """The keys the request's access record has not seen (each once), changing
        nothing.

        Raises:
            UsageError: a new key after the request finished.
        """
        seen, new_keys = access.seen_keys, {}
        for key in keys:
            if key not in seen:
                new_keys[key] = None
        if new_keys and access.finished:
            raise UsageError("new offload keys observed after the request finished")
        return list(new_keys)

    @staticmethod
    def _commit_access(access: _RequestAccess, new_keys: list[OffloadKey],
                       reused_keys: Iterable[OffloadKey] = ()) -> None:
        """The private part of the access record (no lock needed): the request's keys by
        group, and those it reused."""
        groups = access.key_groups
        for key in new_keys:
            groups.setdefault(get_offload_group_idx(key), []).append(key)
        access.seen_keys.update(new_keys)
        access.reused_keys.update(k for k in reused_keys if k not in access.inserted_keys)

    def _update_recency(self, keys: Iterable[OffloadKey]) -> None:
        ranks = self._ranks
        for key in keys:
            state, block_id = self._status(key)
            if state != MISS:
                ranks[block_id] = rank = self._new_rank()
                if state == READY:
                    self._lru.push(rank, block_id)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Marks the keys as most recently used, the first key last (vLLM's order); keys
        not in the tier are skipped.

        Args:
            keys: offload keys (a block hash of up to 32 bytes + a 4-byte group index).
            req_context: the request's context (its access record and key positions).

        Raises:
            UsageError: a key the tier cannot hold.
        """
        with self._hold():
            self._update_recency(reversed(list(keys)))

    def on_request_finished(self, req_context: ReqContext) -> None:
        """Commits the request's recency: its keys become most recently used, tail first,
        so its head is evicted last (vLLM's LRU). A second call does nothing.

        Args:
            req_context: the finished request's context.
        """
        with self._hold():
            state = req_context.get_state(_RequestAccess)
            if (state is None or state.owner is not self
                    or state.generation != self._generation() or state.finished):
                return
            state.finished = True
            key_groups = []
            for group_idx in sorted(state.key_groups):
                group_keys = state.key_groups[group_idx]
                positions = {
                    key: position for key in group_keys
                    if (position := req_context.get_offload_key_position(key)) is not None
                }
                if len(positions) == len(group_keys):
                    group_keys = sorted(group_keys, key=positions.__getitem__)
                key_groups.append(tuple(group_keys))
            self._update_recency(reversed(order_request_keys(tuple(key_groups), req_context)))
