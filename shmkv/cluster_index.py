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
only if its sequence number is above the stored one, so a replayed or duplicated batch is a
no-op and a crash between two batches loses nothing. A batch from another pool *epoch* (the
pool was re-created, or repaired, on that node) first drops everything the source held.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from shmkv.errors import UsageError
from shmkv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

DEFAULT_KEY_PREFIX = "shmkv"

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

# ARGV: prefix, source, seq, epoch, node, scheduler, then (op, group, hash) triples;
# op is 's' (stored), 'r' (removed) or 'c' (all cleared; group and hash empty).
_APPLY_LUA = _CLEAR_LUA + """
local prefix, source = ARGV[1], ARGV[2]
local seq, epoch = tonumber(ARGV[3]), ARGV[4]
local meta = prefix .. ':s:' .. source
local held = prefix .. ':k:' .. source
local old_epoch = redis.call('HGET', meta, 'epoch')
local last = tonumber(redis.call('HGET', meta, 'seq') or '-1')
if old_epoch and old_epoch ~= epoch then
  clear_source(prefix, source)
  last = -1
end
if seq <= last then return 0 end
for i = 7, #ARGV, 3 do
  local op = ARGV[i]
  if op == 'c' then
    clear_source(prefix, source)
  else
    local key = ARGV[i + 1] .. ':' .. ARGV[i + 2]
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
redis.call('HSET', meta, 'seq', seq, 'epoch', epoch, 'node', ARGV[5], 'scheduler', ARGV[6])
redis.call('SADD', prefix .. ':sources', source)
return 1
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

    # -- feeding

    def apply_batch(self, source: str, seq: int, batch: KVEventBatch, *, epoch: int | str,
                    node: str | None = None, scheduler: int | str | None = None) -> bool:
        """Applies one event batch of ``source``, atomically with its sequence number.

        Returns False (and changes nothing) if ``seq`` is not above the last one applied
        for this source and epoch: a replayed or duplicated batch.
        """
        _check_name("source", source)
        if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
            raise UsageError(f"seq must be a non-negative int, got {seq!r}")
        if scheduler is None:
            scheduler = "" if batch.data_parallel_rank is None else batch.data_parallel_rank
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
        applied = self._apply(args=[self.key_prefix, source, seq, str(epoch), node or source,
                                    str(scheduler), *ops])
        return bool(int(applied))

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
