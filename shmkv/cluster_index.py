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

Redis Cluster: every script names every key it touches in KEYS, and a key prefix with a
hash tag (``key_prefix="{shmkv}"``) puts them all in one slot. No script walks a whole
source: clearing one (``forget_source``, a snapshot, an ``AllBlocksCleared``) is done by the
client in chunks of ``CLEAR_CHUNK_KEYS`` keys, one short script each, so a large source
never blocks Redis; a batch that clears is applied (with its seq) after its chunks, and a
crash in between only makes the next attempt clear again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from shmkv.core.request import Request
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

logger = logging.getLogger(__name__)

DEFAULT_KEY_PREFIX = "shmkv"
APPLIED, DUPLICATE, OUT_OF_SYNC = 1, 0, -1
_NO_WAIT_S = 0.001  # a subscriber's recv() that only takes what has arrived
_BATCHES_PER_CALL = 256  # batches applied per Redis round trip

# Every script names every key it touches in KEYS (Redis Cluster routes a script by its
# KEYS; with a key prefix holding a hash tag, e.g. "{shmkv}", they all share one slot), and
# none walks a whole source: clearing one is done in bounded chunks (``_clear_source``), so
# a large source never blocks Redis for long.

# Clears one chunk of a source's keys. KEYS: the source's held set, then the block hash key
# of each of the chunk's members; ARGV: the source, then the members (<g>:<h>).
_CLEAR_CHUNK_LUA = """
local held, source = KEYS[1], ARGV[1]
for i = 2, #KEYS do
  redis.call('HDEL', KEYS[i], source)
  redis.call('SREM', held, ARGV[i])
end
return #KEYS - 1
"""

# KEYS: the source's meta hash, its held set, the sources set, then the block key of each
# 's'/'r' op, in op order. ARGV: source, epoch, node, mode, then for each batch: its seq,
# scheduler, number of ops n and n (op, <g>:<h>) pairs, op being 's' (stored) or 'r'
# (removed). Mode 'n' applies each batch only if it is the source's next one of the same
# epoch, skips one already applied, and stops at the first that is neither (the source is
# out of sync: unknown, of another epoch, or a batch is missing). Mode 's' (one snapshot
# batch, the source cleared first by the client) applies it whatever came before. Returns
# {in_sync (1 or 0), batches applied, duplicates skipped}; the batches before a refused one
# stay. An AllBlocksCleared is the client's: it clears the source in chunks, then sends the
# ops after it.
_APPLY_LUA = """
local meta, held, sources = KEYS[1], KEYS[2], KEYS[3]
local source, epoch, node, mode = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local last, scheduler = nil, nil
if mode ~= 's' and redis.call('HGET', meta, 'epoch') == epoch then
  last = tonumber(redis.call('HGET', meta, 'seq'))
end
local applied, duplicates, in_sync = 0, 0, 1
local i, k = 5, 4
while i <= #ARGV do
  local seq, nops = tonumber(ARGV[i]), tonumber(ARGV[i + 2])
  local first, stop = i + 3, i + 2 + 2 * nops
  i = stop + 1
  if mode ~= 's' and last == nil then in_sync = 0; break end
  if mode ~= 's' and seq <= last then
    duplicates = duplicates + 1
    k = k + nops
  elseif mode ~= 's' and seq ~= last + 1 then
    in_sync = 0
    break
  else
    for j = first, stop, 2 do
      local block = KEYS[k]
      local op, key = ARGV[j], ARGV[j + 1]
      k = k + 1
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
    last, scheduler = seq, ARGV[first - 2]
    applied = applied + 1
  end
end
if applied > 0 then
  redis.call('HSET', meta, 'seq', last, 'epoch', epoch, 'node', node, 'scheduler', scheduler)
  redis.call('SADD', sources, source)
end
return {in_sync, applied, duplicates}
"""

# KEYS: the block key of each hash, in prompt order. Returns {source, blocks, ...}.
_LOOKUP_LUA = """
local alive, found = nil, {}
for i = 1, #KEYS do
  local holders = redis.call('HKEYS', KEYS[i])
  local next_alive = {}
  local any = false
  for _, source in ipairs(holders) do
    if alive == nil or alive[source] then
      next_alive[source] = true
      found[source] = i
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

# KEYS: the source's meta hash, the sources set; ARGV: the source (its keys are cleared
# first, in chunks). Drops the source.
_FORGET_LUA = """
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], ARGV[1])
return 1
"""

CLEAR_CHUNK_KEYS = 1000  # keys of a source cleared per script call (bounded Redis time)


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
        self._clear_chunk = client.register_script(_CLEAR_CHUNK_LUA)

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
        encoded = []  # (seq, scheduler, ops, has_clear); ops: [(op, "<g>:<h>")]
        for seq, batch in batches:
            if isinstance(seq, bool) or not isinstance(seq, int) or seq < (
                    -1 if mode == "s" else 0):
                raise UsageError(f"seq must be a non-negative int, got {seq!r}")
            ops: list[tuple[str, str]] = []
            cleared = False
            for event in batch.events:
                if isinstance(event, AllBlocksCleared):
                    ops, cleared = [], True  # what came before it in the batch is moot
                    continue
                if not isinstance(event, (BlockStored, BlockRemoved)):
                    raise UsageError(f"not a KV-cache event: {type(event).__name__}")
                op = "s" if isinstance(event, BlockStored) else "r"
                group = str(event.group_idx or 0)
                for block_hash in event.block_hashes:
                    ops.append((op, f"{group}:{_hash_text(block_hash)}"))
            rank = batch.data_parallel_rank
            encoded.append((seq, "" if rank is None else rank, ops, cleared))
        if not encoded:
            return ApplyResult(True, 0, 0)
        epoch = str(epoch)
        if mode == "s":
            self._clear_source(source)
            return self._apply_run(mode, source, encoded, epoch, node)
        applied = duplicates = 0
        run: list = []
        for item in encoded:
            if not item[3]:
                run.append(item)
                continue
            if run:  # the batches before the clearing one
                result = self._apply_run("n", source, run, epoch, node)
                applied, duplicates = applied + result.applied, duplicates + result.duplicates
                if not result.in_sync:
                    return ApplyResult(False, applied, duplicates)
                run = []
            verdict = self._next_verdict(source, epoch, item[0])
            if verdict == OUT_OF_SYNC:
                return ApplyResult(False, applied, duplicates)
            if verdict == DUPLICATE:
                duplicates += 1
                continue
            self._clear_source(source)  # in chunks, then the ops after the clear
            result = self._apply_run("n", source, [item], epoch, node)
            applied, duplicates = applied + result.applied, duplicates + result.duplicates
            if not result.in_sync:
                return ApplyResult(False, applied, duplicates)
        if run:
            result = self._apply_run("n", source, run, epoch, node)
            return ApplyResult(result.in_sync, applied + result.applied,
                               duplicates + result.duplicates)
        return ApplyResult(True, applied, duplicates)

    def _apply_run(self, mode: str, source: str, encoded: list, epoch: str,
                   node: str | None) -> ApplyResult:
        p = self.key_prefix
        keys = [f"{p}:s:{source}", f"{p}:k:{source}", f"{p}:sources"]
        args: list[object] = [source, epoch, node or source, mode]
        for seq, scheduler, ops, _ in encoded:
            args += [seq, scheduler, len(ops)]
            for op, key in ops:
                args += [op, key]
                keys.append(f"{p}:b:{key}")
        in_sync, applied, duplicates = self._apply(keys=keys, args=args)
        return ApplyResult(bool(int(in_sync)), int(applied), int(duplicates))

    def _next_verdict(self, source: str, epoch: str, seq: int) -> int:
        """Whether batch ``seq`` is the source's next one of ``epoch`` (APPLIED), one it
        has (DUPLICATE), or neither (OUT_OF_SYNC), as the apply script decides it."""
        have_epoch, have_seq = self._redis.hmget(f"{self.key_prefix}:s:{source}",
                                                 ["epoch", "seq"])
        if have_epoch is None or have_seq is None or _text(have_epoch) != epoch:
            return OUT_OF_SYNC
        last = int(_text(have_seq))
        return DUPLICATE if seq <= last else APPLIED if seq == last + 1 else OUT_OF_SYNC

    def _clear_source(self, source: str) -> int:
        """Drops every key ``source`` holds, ``CLEAR_CHUNK_KEYS`` per script call, so that a
        large source never blocks Redis for long; returns how many it held."""
        p = self.key_prefix
        held = f"{p}:k:{source}"
        total = 0
        while True:
            members = [_text(m) for m in self._redis.srandmember(held, CLEAR_CHUNK_KEYS)]
            if not members:
                return total
            total += int(self._clear_chunk(keys=[held, *(f"{p}:b:{m}" for m in members)],
                                           args=[source, *members]))

    def forget_source(self, source: str) -> int:
        """Drops a source and every key it held (in bounded chunks); returns how many keys
        it held."""
        _check_name("source", source)
        n = self._clear_source(source)
        self._forget(keys=[f"{self.key_prefix}:s:{source}", f"{self.key_prefix}:sources"],
                     args=[source])
        return n

    # -- routing

    def longest_prefixes(self, block_hashes: Sequence[int | bytes], group: int = 0
                         ) -> dict[str, int]:
        """For every source holding the first block, how many leading blocks it holds."""
        if not block_hashes:
            return {}
        flat = self._lookup(keys=[f"{self.key_prefix}:b:{group}:{_hash_text(h)}"
                                  for h in block_hashes])
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
    source_errors: int = 0  # requests a source did not answer in time (it is retried)


@dataclass
class _Health:
    """Whether a source answers its replay socket, and when to ask it next."""

    up: bool = False                  # it answered its last request
    identity: str | None = None       # what its last identity answer said
    next_probe: float = 0.0           # when the next identity request goes out
    backoff_s: float = 0.0            # the wait before the next retry while it is down
    down_since: float | None = None   # when it stopped answering (None: up, or never seen)
    probe: object = None              # the DEALER socket of the request in flight
    probe_sent: float = 0.0


class ClusterIndexer:
    """Keeps a :class:`RedisPrefixIndex` equal to the prefix caches of several pools.

    For each source it subscribes to the publisher, then catches up: by replay from the
    index's last sequence number if the index holds this very pool, else from a snapshot.
    Live batches are applied one by one; a batch the index refuses as out of sync (Redis
    lost its data, or events were lost) and a pool whose identity changed (checked every
    ``identity_check_s``) start the source again from a snapshot. So the indexer survives
    its own restart (it keeps no state of its own) and Redis restarts.

    NOTE: one source down never stops the others. The identity check is a request sent
    without waiting (its answer is read in the same poll as the live batches); a source
    that leaves it, or a catch-up request, unanswered for ``replay_timeout_s`` is *down*:
    its live batches are dropped, and it is asked again after a backoff (``retry_min_s``,
    doubling to ``retry_max_s``) until it answers, then caught up as after a restart. A
    catch-up waits at most ``replay_timeout_s`` per frame, and only for a source that has
    just answered. Only Redis errors other than a lost connection leave ``poll()``.

    Use from one thread: ``poll()`` in a loop, or ``run()``.
    """

    def __init__(self, index: RedisPrefixIndex, sources: Sequence[IndexSource], *,
                 identity_check_s: float = 1.0, replay_timeout_s: float = 2.0,
                 retry_min_s: float = 0.5, retry_max_s: float = 30.0) -> None:
        from shmkv.publisher import KVEventSubscriber, require_zmq

        zmq = require_zmq()
        self._zmq = zmq
        names = [src.name for src in sources]
        if not sources or len(set(names)) != len(names):
            raise UsageError(f"sources must be non-empty with distinct names, got {names}")
        for src in sources:
            _check_name("source name", src.name)
        if not (replay_timeout_s > 0 and 0 < retry_min_s <= retry_max_s):
            raise UsageError(f"replay_timeout_s must be > 0 and 0 < retry_min_s <= "
                             f"retry_max_s, got {replay_timeout_s}, {retry_min_s}, "
                             f"{retry_max_s}")
        self.index = index
        self.sources = list(sources)
        self.stats = IndexerStats()
        self._identity_check_s = identity_check_s
        self._timeout_s = replay_timeout_s
        self._retry_min_s, self._retry_max_s = retry_min_s, retry_max_s
        self._subs = {src.name: KVEventSubscriber(src.endpoint, src.replay_endpoint,
                                                  src.topic, replay_timeout_s=replay_timeout_s)
                      for src in sources}
        self._identity: dict[str, str] = {}
        self._in_sync: dict[str, bool] = dict.fromkeys(names, False)
        self._health = {name: _Health() for name in names}
        self._poller = zmq.Poller()
        self._by_socket: dict = {}
        self._by_probe: dict = {}
        for src in sources:
            sock = self._subs[src.name].socket
            self._poller.register(sock, zmq.POLLIN)
            self._by_socket[sock] = src

    def down_sources(self) -> list[str]:
        """The sources that did not answer their last request (being retried)."""
        return [name for name, h in self._health.items() if not h.up]

    # -- the sources' health

    def _probe(self, now: float) -> None:
        """Sends the identity requests that are due; a source that left one unanswered
        for ``replay_timeout_s`` is down."""
        for src in self.sources:
            h = self._health[src.name]
            if h.probe is not None:
                if now - h.probe_sent > self._timeout_s:
                    self._mark_down(src, f"did not answer within {self._timeout_s:g} s", now)
                continue
            if now < h.next_probe:
                continue
            try:
                h.probe = self._subs[src.name].send_identity_request()
            except self._zmq.ZMQError as exc:
                self._mark_down(src, f"refused the request ({exc})", now)
                continue
            h.probe_sent = now
            self._poller.register(h.probe, self._zmq.POLLIN)
            self._by_probe[h.probe] = src

    def _end_probe(self, h: _Health) -> None:
        if h.probe is not None:
            self._poller.unregister(h.probe)
            del self._by_probe[h.probe]
            h.probe.close(linger=0)
            h.probe = None

    def _probe_answered(self, src: IndexSource, now: float) -> None:
        from shmkv.publisher import PublisherError

        h = self._health[src.name]
        try:
            identity = self._subs[src.name].identity_answer(h.probe)
        except (PublisherError, self._zmq.ZMQError) as exc:
            self._end_probe(h)
            self._mark_down(src, str(exc), now)
            return
        self._end_probe(h)
        if not h.up:
            if h.down_since is not None:
                logger.warning("source %s (%s) answers again after %.1f s; catching it up",
                               src.name, src.replay_endpoint, now - h.down_since)
            h.up, h.down_since, h.backoff_s = True, None, 0.0
            self._in_sync[src.name] = False
        h.identity = identity
        h.next_probe = now + self._identity_check_s
        if self._in_sync[src.name] and identity != self._identity.get(src.name):
            self._in_sync[src.name] = False

    def _mark_down(self, src: IndexSource, why: str, now: float) -> None:
        """``src`` did not answer: drop its live batches until it does, and ask it again
        after the backoff."""
        h = self._health[src.name]
        self._end_probe(h)
        self.stats.source_errors += 1
        self._in_sync[src.name] = False
        h.backoff_s = min(self._retry_max_s, max(self._retry_min_s, 2 * h.backoff_s))
        h.next_probe = now + h.backoff_s
        if h.up or h.down_since is None:
            logger.warning("source %s (%s) %s; indexing the other sources, retrying it "
                           "every %g s to %g s", src.name, src.replay_endpoint, why,
                           self._retry_min_s, self._retry_max_s)
            h.down_since = now
        else:
            logger.info("source %s (%s) %s; next try in %g s", src.name, src.replay_endpoint,
                        why, h.backoff_s)
        h.up = False

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
        """Replay or snapshot, for a source that has just answered its identity request;
        one that stops answering half way is down (Redis errors go up)."""
        from shmkv.publisher import PublisherError

        identity = self._health[src.name].identity
        try:
            if self._replay(src, identity):
                self._identity[src.name] = identity
            else:
                self._snapshot(src)
        except (TimeoutError, PublisherError, self._zmq.ZMQError) as exc:
            self._mark_down(src, str(exc), time.monotonic())
            return
        self._in_sync[src.name] = True

    def _apply_live(self, src: IndexSource, batches: list[tuple[int, KVEventBatch]]) -> None:
        result = self.index.apply_batches(src.name, batches, epoch=self._identity[src.name],
                                          node=src.node)
        self.stats.applied += result.applied
        self.stats.duplicates += result.duplicates
        if not result.in_sync:
            self._in_sync[src.name] = False

    def _take_live(self, src: IndexSource) -> None:
        sub = self._subs[src.name]
        lost_before = sub.unfilled
        pending = []
        try:
            while len(pending) < _BATCHES_PER_CALL and (
                    got := sub.recv(timeout_s=_NO_WAIT_S)) is not None:
                pending.append(got)
        except TimeoutError as exc:  # a gap whose replay went unanswered
            self._mark_down(src, str(exc), time.monotonic())
            return
        if sub.unfilled != lost_before:  # events lost for good: resync
            self._in_sync[src.name] = False
        elif pending and self._in_sync[src.name]:
            self._apply_live(src, pending)

    # -- the loop

    def poll(self, timeout_s: float = 0.05) -> int:
        """One turn: asks the sources that are due whether they are still the same pool,
        catches up those that need it and answer, then applies the batches that arrive
        within ``timeout_s``. Returns how many were applied.

        Raises:
            redis.RedisError: other than a lost connection or a timeout (those make every
                source resync once Redis is back).
        """
        import redis

        before = self.stats.applied
        try:
            self._probe(time.monotonic())
            for src in self.sources:
                if self._health[src.name].up and not self._in_sync[src.name]:
                    self._catch_up(src)
            ready = dict(self._poller.poll(int(timeout_s * 1000)))
            while ready:
                for sock in ready:
                    if sock in self._by_probe:
                        self._probe_answered(self._by_probe[sock], time.monotonic())
                    elif sock in self._by_socket:  # (not a probe ended meanwhile)
                        self._take_live(self._by_socket[sock])
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
        for h in self._health.values():
            self._end_probe(h)
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
