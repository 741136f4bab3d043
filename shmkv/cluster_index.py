"""A cluster-wide prefix index on Redis, fed by the pools' KV-event streams.

Each node runs its own shmkv pool; a *source* is one pool's event stream (a node with a
shared pool is one source; a node with private pools has one source per scheduler). The
index keeps, per block key, which sources hold it and how many blocks of that key each
holds, so a router finds the longest cached prefix of a prompt on every source in one
round trip. It is never on the allocation path: the pools do not know it exists.

Keys (``P`` is the key prefix, ``shmkv`` by default):

| key              | type | holds |
|------------------|------|-------|
| ``P:b:<g>:<h>``  | hash | key ``<h>`` of group ``<g>``: source -> its number of blocks with it |
| ``P:k:<source>`` | set  | every ``<g>:<h>`` the source holds (to clear it in one pass) |
| ``P:s:<source>`` | hash | ``seq`` (last batch applied), ``epoch``, ``node``, ``scheduler`` |
| ``P:sources``    | set  | the source names |

Hashes are kept in the form events carry them (``shmkv.events.external_block_hash``): the
low 64 bits as a decimal integer by default, or the 32-byte digest in hex.

Exactly once: a batch is applied by one Lua script together with its source's ``seq``, and
only if it is the source's next one (its sequence numbers are consecutive: the pool log's),
so a replayed or duplicated batch is a no-op and a missing one is noticed. Each source's
state starts from a *snapshot* of its pool's prefix cache (the publisher's ``snapshot``
request), tagged with the pool's identity (its *epoch* here): a pool re-created on a
node has another identity, and the index drops what the old one held. A pool repaired after
a crash keeps its identity and its stream stays exact: the events of a hold that was rolled
back were never published (the publisher reads the log under the pool lock), and keys a
rebuild drops are logged as ``BlockRemoved``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from shmkv.errors import UsageError
from shmkv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    external_block_hash,
    use_int_block_hashes,
)
from shmkv.hashing import RequestBlockHasher, get_hash_fn_by_name
from shmkv.hashing import none_hash as make_none_hash
from shmkv.core.request import Request

logger = logging.getLogger(__name__)

DEFAULT_KEY_PREFIX = "shmkv"
APPLIED, DUPLICATE, OUT_OF_SYNC = 1, 0, -1
_NO_WAIT_S = 0.001  # a subscriber's recv() that only takes what has arrived
_BATCHES_PER_CALL = 256  # batches applied per Redis round trip

_CLEAR_LUA = """
local function clear_source(prefix, source)
  local held = prefix .. ':k:' .. source
  local members = redis.call('SMEMBERS', held)
  for _, key in ipairs(members) do
    redis.call('HDEL', prefix .. ':b:' .. key, source)
  end
  redis.call('DEL', held)
  return #members
end
"""

# ARGV: prefix, source, epoch, node, mode, then for each batch: its seq, scheduler, number
# of ops n and n (op, group, hash) triples, op being 's' (stored), 'r' (removed) or 'c' (all
# cleared; group and hash empty). Mode 'n' applies each batch only if it is the source's
# next one of the same epoch, skips one already applied, and stops at the first that is
# neither (the source is out of sync: unknown, of another epoch, or a batch is missing).
# Mode 's' (one snapshot batch) first drops whatever the source held. Returns {in_sync
# (1 or 0), batches applied, duplicates skipped}; the batches before a refused one stay.
_APPLY_LUA = _CLEAR_LUA + """
local prefix, source, epoch, node, mode = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local meta = prefix .. ':s:' .. source
local held = prefix .. ':k:' .. source
local last, scheduler = nil, nil
if mode == 's' then
  clear_source(prefix, source)
elseif redis.call('HGET', meta, 'epoch') == epoch then
  last = tonumber(redis.call('HGET', meta, 'seq'))
end
local applied, duplicates, in_sync = 0, 0, 1
local i = 6
while i <= #ARGV do
  local seq, nops = tonumber(ARGV[i]), tonumber(ARGV[i + 2])
  local first, stop = i + 3, i + 2 + 3 * nops
  i = stop + 1
  if mode ~= 's' and last == nil then in_sync = 0; break end
  if mode ~= 's' and seq <= last then
    duplicates = duplicates + 1
  elseif mode ~= 's' and seq ~= last + 1 then
    in_sync = 0
    break
  else
    for j = first, stop, 3 do
      local op = ARGV[j]
      if op == 'c' then
        clear_source(prefix, source)
      else
        local key = ARGV[j + 1] .. ':' .. ARGV[j + 2]
        local block = prefix .. ':b:' .. key
        if op == 's' then
          redis.call('HINCRBY', block, source, 1)
          redis.call('SADD', held, key)
        else
          local left = redis.call('HINCRBY', block, source, -1)
          if left <= 0 then
            redis.call('HDEL', block, source)
            redis.call('SREM', held, key)
          end
        end
      end
    end
    last, scheduler = seq, ARGV[first - 2]
    applied = applied + 1
  end
end
if applied > 0 then
  redis.call('HSET', meta, 'seq', last, 'epoch', epoch, 'node', node, 'scheduler', scheduler)
  redis.call('SADD', prefix .. ':sources', source)
end
return {in_sync, applied, duplicates}
"""

# ARGV: prefix, group, hashes in prompt order. Returns {source, blocks, ...}.
_LOOKUP_LUA = """
local prefix, group = ARGV[1], ARGV[2]
local alive, found = nil, {}
for i = 3, #ARGV do
  local holders = redis.call('HKEYS', prefix .. ':b:' .. group .. ':' .. ARGV[i])
  local next_alive = {}
  local any = false
  for _, source in ipairs(holders) do
    if alive == nil or alive[source] then
      next_alive[source] = true
      found[source] = i - 2
      any = true
    end
  end
  if not any then break end
  alive = next_alive
end
local out = {}
for source, blocks in pairs(found) do
  out[#out + 1] = source
  out[#out + 1] = blocks
end
return out
"""

# ARGV: prefix, source. Drops the source and everything it held.
_FORGET_LUA = _CLEAR_LUA + """
local n = clear_source(ARGV[1], ARGV[2])
redis.call('DEL', ARGV[1] .. ':s:' .. ARGV[2])
redis.call('SREM', ARGV[1] .. ':sources', ARGV[2])
return n
"""


@dataclass(frozen=True)
class ApplyResult:
    """What ``apply_batches`` did: whether the source is still in sync, and how many
    batches it applied and skipped as duplicates."""

    in_sync: bool
    applied: int
    duplicates: int


@dataclass(frozen=True)
class SourceState:
    """What the index knows of one source."""

    source: str
    node: str
    scheduler: str
    seq: int
    epoch: str
    num_keys: int


def _hash_text(block_hash: int | bytes) -> str:
    if isinstance(block_hash, bool) or not isinstance(block_hash, (int, bytes)):
        raise UsageError(f"a block hash is an int or bytes, got {type(block_hash).__name__}")
    return str(block_hash) if isinstance(block_hash, int) else block_hash.hex()


def _check_name(what: str, value: object) -> str:
    if not isinstance(value, str) or not value or ":" in value:
        raise UsageError(f"{what} must be a non-empty str without ':', got {value!r}")
    return value


class RedisPrefixIndex:
    """The index over one Redis database; every method is one round trip.

    Args:
        client: a ``redis.Redis`` client (``decode_responses`` either way).
        key_prefix: the prefix of every key, so several clusters can share one Redis.
    """

    def __init__(self, client, key_prefix: str = DEFAULT_KEY_PREFIX) -> None:
        self._redis = client
        self.key_prefix = _check_name("key_prefix", key_prefix)
        self._apply = client.register_script(_APPLY_LUA)
        self._lookup = client.register_script(_LOOKUP_LUA)
        self._forget = client.register_script(_FORGET_LUA)

    @classmethod
    def from_url(cls, url: str, key_prefix: str = DEFAULT_KEY_PREFIX) -> RedisPrefixIndex:
        """Connects to ``redis://host:port/db``."""
        import redis

        return cls(redis.Redis.from_url(url, decode_responses=True), key_prefix)

    def ping(self) -> None:
        """Raises redis.RedisError if Redis cannot be reached."""
        self._redis.ping()

    # -- feeding

    def apply_batches(self, source: str, batches: Sequence[tuple[int, KVEventBatch]], *,
                      epoch: int | str, node: str | None = None) -> ApplyResult:
        """Applies ``source``'s consecutive ``(seq, batch)`` pairs in one round trip, each
        atomically with its sequence number: a batch applied already is skipped, and the
        first that is not the source's next one of this epoch stops the call (the index
        never heard of the source, lost it in a Redis restart, holds another epoch, or a
        batch is missing); the source must then start again from a snapshot."""
        return self._run_apply("n", source, batches, epoch, node)

    def apply_batch(self, source: str, seq: int, batch: KVEventBatch, *, epoch: int | str,
                    node: str | None = None) -> int:
        """One batch: ``APPLIED``, ``DUPLICATE`` (nothing changed) or ``OUT_OF_SYNC``
        (nothing changed), as :meth:`apply_batches`."""
        result = self._run_apply("n", source, [(seq, batch)], epoch, node)
        return APPLIED if result.applied else DUPLICATE if result.in_sync else OUT_OF_SYNC

    def apply_snapshot(self, source: str, seq: int, batch: KVEventBatch, *,
                       epoch: int | str, node: str | None = None) -> int:
        """Replaces everything ``source`` holds by the snapshot ``batch``, the source's
        cache as of its event ``seq`` (-1: before any). Returns ``APPLIED``."""
        self._run_apply("s", source, [(seq, batch)], epoch, node)
        return APPLIED

    def _run_apply(self, mode: str, source: str, batches: Sequence[tuple[int, KVEventBatch]],
                   epoch: int | str, node: str | None) -> ApplyResult:
        _check_name("source", source)
        args: list[object] = [self.key_prefix, source, str(epoch), node or source, mode]
        for seq, batch in batches:
            if isinstance(seq, bool) or not isinstance(seq, int) or seq < (
                    -1 if mode == "s" else 0):
                raise UsageError(f"seq must be a non-negative int, got {seq!r}")
            ops: list[str] = []
            for event in batch.events:
                if isinstance(event, AllBlocksCleared):
                    ops += ["c", "", ""]
                    continue
                if not isinstance(event, (BlockStored, BlockRemoved)):
                    raise UsageError(f"not a KV-cache event: {type(event).__name__}")
                op = "s" if isinstance(event, BlockStored) else "r"
                group = str(event.group_idx or 0)
                for block_hash in event.block_hashes:
                    ops += [op, group, _hash_text(block_hash)]
            rank = batch.data_parallel_rank
            args += [seq, "" if rank is None else rank, len(ops) // 3, *ops]
        if len(args) == 5:
            return ApplyResult(True, 0, 0)
        in_sync, applied, duplicates = self._apply(args=args)
        return ApplyResult(bool(int(in_sync)), int(applied), int(duplicates))

    def forget_source(self, source: str) -> int:
        """Drops a source and every key it held; returns how many keys it held."""
        return int(self._forget(args=[self.key_prefix, _check_name("source", source)]))

    # -- routing

    def longest_prefixes(self, block_hashes: Sequence[int | bytes], group: int = 0
                         ) -> dict[str, int]:
        """For every source holding the first block, how many leading blocks it holds."""
        if not block_hashes:
            return {}
        flat = self._lookup(args=[self.key_prefix, str(group),
                                  *(_hash_text(h) for h in block_hashes)])
        return {_text(flat[i]): int(flat[i + 1]) for i in range(0, len(flat), 2)}

    # -- inspection

    def sources(self) -> list[SourceState]:
        """Every source the index has heard of, sorted by name."""
        r, p = self._redis, self.key_prefix
        names = sorted(_text(n) for n in r.smembers(f"{p}:sources"))
        pipe = r.pipeline(transaction=False)
        for name in names:
            pipe.hgetall(f"{p}:s:{name}")
            pipe.scard(f"{p}:k:{name}")
        replies = pipe.execute()
        out = []
        for i, name in enumerate(names):
            meta = {_text(k): _text(v) for k, v in replies[2 * i].items()}
            out.append(SourceState(name, meta.get("node", name), meta.get("scheduler", ""),
                                   int(meta.get("seq", -1)), meta.get("epoch", ""),
                                   int(replies[2 * i + 1])))
        return out

    def source_keys(self, source: str) -> set[str]:
        """The ``<group>:<hash>`` keys a source holds (for checks and tests)."""
        members = self._redis.smembers(f"{self.key_prefix}:k:{_check_name('source', source)}")
        return {_text(m) for m in members}


def block_keys(block_hashes: Iterable[int | bytes], group: int = 0) -> set[str]:
    """The index's ``<group>:<hash>`` keys of some hashes (as ``source_keys`` returns them)."""
    return {f"{group}:{_hash_text(h)}" for h in block_hashes}


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


# ------------------------------------------------------------------------ the indexer


@dataclass(frozen=True)
class IndexSource:
    """One pool's event stream: its publisher's PUB and replay (ROUTER) endpoints."""

    name: str
    endpoint: str
    replay_endpoint: str
    topic: str = ""
    node: str | None = None


@dataclass
class IndexerStats:
    applied: int = 0       # batches applied live
    duplicates: int = 0    # batches the index had already
    snapshots: int = 0     # sources (re)started from a snapshot
    replayed: int = 0      # batches applied from a replay on start
    redis_errors: int = 0  # Redis calls that failed (the source resyncs afterwards)


class ClusterIndexer:
    """Keeps a :class:`RedisPrefixIndex` equal to the prefix caches of several pools.

    For each source it subscribes to the publisher, then catches up: by replay from the
    index's last sequence number if the index holds this very pool, else from a snapshot.
    Live batches are applied one by one; a batch the index refuses as out of sync (Redis
    lost its data, or events were lost) and a pool whose identity changed (checked every
    ``identity_check_s``) start the source again from a snapshot. So the indexer survives
    its own restart (it keeps no state of its own) and Redis restarts.

    Use from one thread: ``poll()`` in a loop, or ``run()``.
    """

    def __init__(self, index: RedisPrefixIndex, sources: Sequence[IndexSource], *,
                 identity_check_s: float = 1.0, replay_timeout_s: float = 10.0) -> None:
        from shmkv.publisher import KVEventSubscriber, require_zmq

        zmq = require_zmq()
        names = [src.name for src in sources]
        if not sources or len(set(names)) != len(names):
            raise UsageError(f"sources must be non-empty with distinct names, got {names}")
        for src in sources:
            _check_name("source name", src.name)
        self.index = index
        self.sources = list(sources)
        self.stats = IndexerStats()
        self._identity_check_s = identity_check_s
        self._subs = {src.name: KVEventSubscriber(src.endpoint, src.replay_endpoint,
                                                  src.topic, replay_timeout_s=replay_timeout_s)
                      for src in sources}
        self._identity: dict[str, str] = {}
        self._in_sync: dict[str, bool] = dict.fromkeys(names, False)
        self._next_identity_check = 0.0
        self._poller = zmq.Poller()
        self._by_socket = {}
        for src in sources:
            sock = self._subs[src.name].socket
            self._poller.register(sock, zmq.POLLIN)
            self._by_socket[sock] = src

    # -- catching up

    def _snapshot(self, src: IndexSource) -> None:
        seq, batch, identity = self._subs[src.name].snapshot()
        self.index.apply_snapshot(src.name, seq, batch, epoch=identity, node=src.node)
        self._identity[src.name] = identity
        self.stats.snapshots += 1

    def _replay(self, src: IndexSource, identity: str) -> bool:
        """Catches up by replay from where the index stands; False if it cannot (the
        index holds another pool, or the log no longer has what is missing)."""
        sub = self._subs[src.name]
        state = next((st for st in self.index.sources() if st.source == src.name), None)
        if state is None or state.epoch != identity:
            return False
        replayed = sub.replay(state.seq + 1)
        if replayed and replayed[0][0] != state.seq + 1:
            return False
        for start in range(0, len(replayed), _BATCHES_PER_CALL):
            chunk = [(seq, decode_batch(payload))
                     for seq, payload in replayed[start:start + _BATCHES_PER_CALL]]
            result = self.index.apply_batches(src.name, chunk, epoch=identity, node=src.node)
            self.stats.replayed += result.applied
            if not result.in_sync:
                return False
        sub.expected = (replayed[-1][0] if replayed else state.seq) + 1
        return True

    def _catch_up(self, src: IndexSource) -> None:
        identity = self._subs[src.name].identity()
        if self._replay(src, identity):
            self._identity[src.name] = identity
        else:
            self._snapshot(src)
        self._in_sync[src.name] = True

    def _apply_live(self, src: IndexSource, batches: list[tuple[int, KVEventBatch]]) -> None:
        result = self.index.apply_batches(src.name, batches, epoch=self._identity[src.name],
                                          node=src.node)
        self.stats.applied += result.applied
        self.stats.duplicates += result.duplicates
        if not result.in_sync:
            self._in_sync[src.name] = False

    # -- the loop

    def poll(self, timeout_s: float = 0.05) -> int:
        """One turn: resyncs the sources that need it, then applies the batches that
        arrive within ``timeout_s``. Returns how many were applied."""
        import redis

        before = self.stats.applied
        try:
            now = time.monotonic()
            if now >= self._next_identity_check:
                self._next_identity_check = now + self._identity_check_s
                for src in self.sources:
                    if (self._in_sync[src.name]
                            and self._subs[src.name].identity() != self._identity[src.name]):
                        self._in_sync[src.name] = False
            for src in self.sources:
                if not self._in_sync[src.name]:
                    self._catch_up(src)
            ready = dict(self._poller.poll(int(timeout_s * 1000)))
            while ready:
                for sock in ready:
                    src = self._by_socket[sock]
                    sub = self._subs[src.name]
                    lost_before = sub.unfilled
                    pending = []
                    while len(pending) < _BATCHES_PER_CALL and (
                            got := sub.recv(timeout_s=_NO_WAIT_S)) is not None:
                        pending.append(got)
                    if sub.unfilled != lost_before:  # events lost for good: resync
                        self._in_sync[src.name] = False
                    elif pending and self._in_sync[src.name]:
                        self._apply_live(src, pending)
                ready = dict(self._poller.poll(0))
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            self.stats.redis_errors += 1
            self._in_sync = dict.fromkeys(self._in_sync, False)
            logger.warning("Redis unreachable (%s); every source resyncs when it is back", exc)
            time.sleep(min(timeout_s, 0.2))
        return self.stats.applied - before

    def run(self, stop: threading.Event | None = None, duration_s: float | None = None) -> None:
        """Polls until ``stop`` is set or ``duration_s`` has passed."""
        deadline = None if duration_s is None else time.monotonic() + duration_s
        while not (stop is not None and stop.is_set()) and (
                deadline is None or time.monotonic() < deadline):
            self.poll()

    def close(self) -> None:
        for sub in self._subs.values():
            sub.close()
        self._subs = {}

    def __enter__(self) -> ClusterIndexer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------------ the router


class PrefixRouter:
    """Answers "how much of this prompt is cached where" from the index, one round trip.

    Hashes prompts as the pools do (vLLM's chained block hashes over ``hash_block_size``
    tokens, with ``cache_salt`` on the first block), so it must be given the pools' hash
    settings: their ``hash_block_size``, ``hash_fn_name`` and NONE_HASH (shmkv's default,
    sha256 of vLLM's default seed, unless the pools were made with another).
    """

    def __init__(self, index: RedisPrefixIndex, hash_block_size: int = 16,
                 hash_fn_name: str = "sha256", none_hash: bytes | None = None) -> None:
        hash_fn = get_hash_fn_by_name(hash_fn_name)
        self.index = index
        self.hash_block_size = hash_block_size
        self._hasher = RequestBlockHasher(hash_block_size, hash_fn,
                                          none_hash if none_hash is not None
                                          else make_none_hash(hash_fn))
        self._as_int = use_int_block_hashes()

    def block_hashes(self, prompt_token_ids: Sequence[int], cache_salt: str | None = None
                     ) -> list[bytes]:
        return list(Request("route", list(prompt_token_ids), block_hasher=self._hasher,
                            cache_salt=cache_salt).block_hashes)

    def cached_tokens(self, prompt_token_ids: Sequence[int], cache_salt: str | None = None,
                      group: int = 0) -> dict[str, int]:
        """Source -> leading prompt tokens cached there (sources with none are left out)."""
        hashes = [external_block_hash(h, self._as_int)
                  for h in self.block_hashes(prompt_token_ids, cache_salt)]
        return {source: blocks * self.hash_block_size
                for source, blocks in self.index.longest_prefixes(hashes, group).items()}

    def route(self, prompt_token_ids: Sequence[int], candidates: Sequence[str],
              cache_salt: str | None = None) -> tuple[str, int]:
        """The candidate with the longest cached prefix (the first on ties) and its
        cached tokens."""
        if not candidates:
            raise UsageError("route() needs at least one candidate source")
        cached = self.cached_tokens(prompt_token_ids, cache_salt)
        best = max(candidates, key=lambda c: cached.get(c, 0))
        return best, cached.get(best, 0)
