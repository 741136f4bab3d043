"""The shared-memory layout of a shmkv pool: the single source of truth.

One POSIX shared-memory object per pool, named ``/shmkv-<pool name>-v<LAYOUT_VERSION>``,
plus two siblings: the pool lock, a POSIX semaphore named ``<segment name>.lock``, and the
liveness lock file ``/dev/shm<segment name>.alive`` (see ``shmkv/pool/liveness.py``). The segment
holds a fixed header followed by regions at 64-byte aligned offsets. ``REGIONS`` below is the
table in code; this docstring renders the same table, and a unit test checks that every
region and every field named in the code appears here.

Regions
-------

| # | region          | dtype         | shape                        | written by | guarded by | invariants |
|---|-----------------|---------------|------------------------------|------------|------------|------------|
| 0 | `header`        | HEADER_DTYPE  | `[1]` (320 B)                | creator; then the lock holder | pool lock (mutable part) | INV-HDR, INV-CONSERVE |
| 1 | `block_meta`    | BLOCK_DTYPE   | `[num_blocks + 2]`           | the kernels: `FreeKVCacheBlockQueue` (links), `BlockHashToBlockMap` (`index_next`, hash fields), ref counts | pool lock | INV-FREE, INV-QKEY, INV-REF, INV-HASH |
| 2 | `block_alias`   | BLOCK_DTYPE   | `[num_blocks]` with ``FLAG_PARTIAL_KEYS``, else `[0]` | `BlockHashToBlockMap` (key fields only) | pool lock | INV-HASH, INV-ALIAS |
| 3 | `index_buckets` | int32         | `[num_index_buckets]`        | `BlockHashToBlockMap` | pool lock | INV-HASH |
| 4 | `proc_table`    | PROC_DTYPE    | `[max_processes]`            | attach, close, reap_dead | pool lock | INV-PROC |
| 5 | `ledger`        | int32         | `[max_processes, num_blocks]`| the kernels (the caller's row); reap_dead | pool lock | INV-LEDGER |
| 6 | `event_log`     | uint8         | `[event_log_bytes]`          | `EventLog.append` | pool lock | INV-LOG |
| 7 | `journal`       | JOURNAL_DTYPE | `[journal_entries]`          | every journaled write (`shmkv/pool/journal.py`, `_ckernel.c`) | pool lock | INV-JOURNAL |

Header (little-endian; offsets in bytes)
----------------------------------------

Immutable after creation (the "config echo", validated by every attach, in this order):

- `magic` (u64, 0): ``MAGIC``; its bytes are all different, so a byte-swapped or foreign
  segment never passes. Written once by the creator.
- `layout_version` (u32, 8): ``LAYOUT_VERSION``; bumped on any change to this file's tables.
- `format_flags` (u32, 12): feature bits that change what the regions mean
  (``FLAG_PREFIX_CACHING``, ``FLAG_KV_EVENTS``, ``FLAG_PARTIAL_KEYS``: the pool has alias
  rows, region 2 is ``[num_blocks]`` rather than empty).
- `header_bytes` (u32, 16): ``HEADER_DTYPE.itemsize``.
- `state` (u32, 20): ``STATE_INITIALIZING`` while the creator fills the segment, then
  ``STATE_READY``; ``STATE_POISONED`` once ``check_invariants`` has found corruption. Read
  right after `magic`: the creator writes `magic` first, so a header in state 0 or
  INITIALIZING is still being written and its other fields are not compared yet.
- `total_bytes` (u64, 24): the size the layout formula gives; the segment must be that big.
- `num_blocks` (u32, 32): ``num_gpu_blocks``; block 0 is the null block.
- `hash_block_size` (u32, 36): tokens per hash unit of ``request.block_hashes``.
- `num_index_buckets` (u32, 40): size of region 3, a power of two >= 2 * num_blocks.
- `block_hash_bytes` (u32, 44): ``BLOCK_HASH_BYTES`` (32: sha256 and sha256_cbor digests).
- `creator_pid` (u32, 48): the pid that created the segment.
- `max_processes` (u32, 52): slots in the process table and rows in the ledger.
- `medium` (S8, 56): the storage medium named in KV events (``"GPU"`` by default).
- `event_log_bytes` (u64, 64): size of the event ring (0: no global log).
- `hash_fn_name` (S16, 72): the block-hash function every process must use.
- `none_hash` (V32, 88): the NONE_HASH seed digest every process chains its first block on.
- `journal_entries` (u64, 120): size of region 7, the undo journal.
- `pool_id` (V16, 256, after the mutable part): 16 random bytes drawn when the pool is
  created: the identity of this pool, never of another one made under the same name or by
  a reused pid (the publisher's identity and saved position are keyed on it).
- `num_hash_lookahead_tokens` (u4, 272): vLLM's ``num_hash_lookahead_tokens``: each block
  hash also covers that many tokens after its block, so it is part of what a key means and
  every process must hash the same way (it also shapes the KV events' lookahead token ids).
- `cache_geometry` (i64, 280): 0 until the first prefix-caching KV-cache coordinator binds
  the pool, then a 63-bit digest of how its blocks hold KV (each group's kind, block size and
  page size, the hash block size, decode/prefill context parallelism;
  ``BlockPool.claim_cache_geometry``). A coordinator of another geometry is refused: its
  hits would read KV laid out for another configuration. Written once, from 0, in one
  aligned store under the lock and outside the journal (a holder that dies after it leaves
  the pool bound, which is what it was about to use it for).
- `tier_of` (V16, 288): zeros for a pool of its own; for a tier (``BlockPool.tier``: the
  pool ``<name>.<tier>``, HiSparse's host pages), the ``pool_id`` of the pool that made it,
  written by its creator before ``READY``. Removing a pool removes ``<name>.<tier>`` only
  when this field says it is a tier: a pool of its own that merely has such a name stays.
- `retention` (u4, 304): whether the pool is meant to outlive the processes that use it,
  for ``shmkv cleanup`` (``shmkv/pool/siblings.py``). ``RETENTION_SCOPED`` (1), written by
  the creator before ``READY``: the pool lives while a process holds it, and is an orphan
  once none does and its creator is dead. ``RETENTION_STAYS`` (2), written once by
  ``BlockPool.mark_stays`` when whatever the pool is part of is complete (``shmkv create``,
  the vLLM offload tier, the SGLang page store): cleanup keeps it until it is removed by
  name. ``RETENTION_UNRECORDED`` (0): a pool made by a shmkv that did not record this; it
  is kept, as if it stays. Never goes back from 2.
- `stays_by` (S12, 308): what marked the pool to stay (``"shmkv create"``, ``"vllm tier"``,
  ``"sglang store"``, or the label a caller of ``mark_stays`` gave); written before
  `retention` turns ``RETENTION_STAYS``.

Mutable, written only under the pool lock:

- `epoch` (u64, 128): bumped whenever the pool is re-initialised or repaired.
- `num_free_blocks` (i64, 136): length of the free queue.
- `queue_head_key` (i64, 144): the smallest queue key handed out so far (``prepend_n``).
- `queue_tail_key` (i64, 152): the largest queue key handed out so far (``append_n``).
- `holder` (i64, 160): the lock holder, ``slot + 1`` in the low 32 bits and its pid in the
  high 32; 0 when the lock is free. Written right after the semaphore is taken, cleared
  right before it is posted. In a process's ``attach()`` hold the low half is its attach
  mark byte + 1 instead, a number past every slot (``shmkv/pool/liveness.py``).
- `holder_incarnation` (u64, 168) and `holder_since_ns` (i64, 176, CLOCK_MONOTONIC): the
  rest of the holder record.
- `next_event_seq` (i64, 184): the sequence number of the next logged event.
- `log_write_pos` (i64, 192), `log_oldest_seq` (i64, 200), `log_oldest_pos` (i64, 208):
  the event ring's monotonic byte position of the next record, and the sequence number and
  position of the oldest record still intact (see ``shmkv/pool/event_log.py``).
- `num_reaped` (i64, 216): processes reaped after dying without ``close()``.
- `num_events_dropped` (i64, 224): events too large for the ring, not logged.
- `journal_len` (i64, 232): undo-journal entries of the current hold; 0 when no mutation is
  in flight (the holder zeroes it right before clearing `holder`), ``JOURNAL_OVERFLOWED``
  (-1) when the hold wrote more than the journal holds (repair then rebuilds).
- `lock_seq` (u64, 240): holds taken so far; a waiter that sees it stand still with no
  holder recorded and the semaphore taken knows the lock is stuck.
- `num_takeovers` (u64, 248): locks taken over from a dead holder.

Block rows (``BLOCK_DTYPE``, 64 bytes, one per block plus two sentinel rows)
----------------------------------------------------------------------------

| field             | type | meaning |
|-------------------|------|---------|
| `ref_cnt`         | i32  | references held by requests of all processes (the sum of the block's ledger column); 0 means the block is in the free queue (except the null block, whose count is never maintained) |
| `prev`, `next`    | i32  | free-queue links: row indices, ``NO_BLOCK`` (-1) when the block is not queued. Only the free queue writes them. |
| `index_next`      | i32  | next block in the same prefix-index bucket chain, ``NO_BLOCK`` at the end. Only the index writes it. |
| `group_id`        | u32  | KV-cache group of `block_hash` |
| `hash_num_tokens` | i32  | prefix tokens the hash covers; ``NO_HASH_TOKENS`` (0) means "no hash" |
| `queue_key`       | i64  | order key in the free queue: strictly increasing from head to tail, so the LRU order can be rebuilt by sorting |
| `block_hash`      | V32  | the 32-byte chained block hash (without the group id) |

Rows ``0 .. num_blocks - 1`` are blocks (row = block id). Row ``free_head = num_blocks`` and
row ``free_tail = num_blocks + 1`` are the free queue's sentinels: ``block_meta[free_head].next``
is the first free block and ``block_meta[free_tail].prev`` the last. An empty queue links the
two sentinels to each other.

Process table rows (``PROC_DTYPE``, 72 bytes)
---------------------------------------------

| field         | type | meaning |
|---------------|------|---------|
| `state`       | i32  | ``SLOT_FREE`` or ``SLOT_ACTIVE`` |
| `pid`         | i32  | the attached process |
| `incarnation` | u64  | a random id drawn at attach; a process whose slot no longer carries it is fenced |
| `start_ticks` | u64  | the process's start time (``/proc/<pid>/stat`` field 22), to tell a reused pid |
| `attach_ns`   | i64  | wall-clock time of the attach (ns since the epoch) |
| `label`       | S24  | a name the process gave itself (``attach(label=...)``), for inspection; kept after release until the slot is reused |
| `pid_ns`      | u64  | the inode of the process's pid namespace (``/proc/self/ns/pid``), 0 if unknown: `pid` and `start_ticks` mean something only to a reader in the same namespace |
| `lock_phase`  | i64  | ``PHASE_IDLE``; ``PHASE_ACQUIRING`` (from before its semaphore wait); ``PHASE_HOLDING`` (the first store once it has the semaphore, before the holder record, to its release); ``PHASE_RELEASING`` (from before it clears `holder` to after the post); ``PHASE_ABANDONED`` (an exception cut its acquire short just as the semaphore call returned: it may hold the semaphore; kept through its later waits until it holds the lock again): how a waiter finds who died holding the semaphore with no `holder` recorded (``shmkv/pool/takeover.py``). Written by the slot's owner, outside the journal. |

A slot is live while its process holds the OFD lock on byte ``slot`` of the ``.alive`` file
and, to a reader in the row's pid namespace, `pid` runs (not a zombie) with `start_ticks`
(the liveness rule, ``shmkv/pool/liveness.py``: a forked child holding the inherited lock, or a reused
pid, does not keep a dead process alive);
``ledger[slot, b]`` counts the references that process holds on block ``b``.

The undo journal (region 7, ``JOURNAL_DTYPE``, 16 bytes per entry)
-------------------------------------------------------------------

| field   | type | meaning |
|---------|------|---------|
| `where` | i64  | byte offset of the written word in the segment, times 16, plus its width (4 or 8) |
| `old`   | i64  | the word's value before the write (an i32 sign-extended) |

Before every write under the lock, the writer appends the word's old value at
``journal[journal_len]`` and then bumps ``journal_len``; the write itself comes last. So at
any instant the entries ``[0, journal_len)`` restore every word the hold has changed, and a
process that takes the lock over from a dead holder restores them (earliest entry of each
word wins) and gets the pool exactly as it was before the dead holder's hold began. A hold
that overflows the journal sets ``journal_len`` to -1 and goes on unjournaled; its repair is
a rebuild (``shmkv/pool/recovery.py``). Writes of 8 bytes and more (hashes, event records, process
rows) are journaled as aligned 8-byte words; every word is always journaled with one width.

Alias rows (region 2, ``BLOCK_DTYPE``, one per block with ``FLAG_PARTIAL_KEYS``)
-------------------------------------------------------------------------------

vLLM lets a block own a second prefix-cache key besides its own (``block_hash``): a
*partial* key, registered by ``cache_partial_block`` at a hash boundary inside the block
(a prompt whose last ``hash_block_size`` boundary falls inside its last full block). Row
``b`` of ``block_alias`` holds block ``b``'s alias key in the same four key fields as a
block row (`index_next`, `group_id`, `hash_num_tokens`, `block_hash`); its other fields
stay 0 and mean nothing. `hash_num_tokens` is ``NO_HASH_TOKENS`` when the block has no
alias. A block holds an alias only while it holds its own key too, and the two keys differ
(INV-ALIAS). One alias per block: ``cache_partial_block`` only adds one to a block that
already holds a longer key, which the managers do for the request that filled the block, at
its last prompt boundary. A second request keys the same block only if the block is in its
table as a whole-block hit with its own boundary inside it, which a new request's hit never
is (its boundary lies at or past its hit); a preempted request that resumes with outputs
repeating the block's tokens could. vLLM then keeps both aliases; shmkv keeps the newer
(see ``BlockPool.cache_partial_block``), so the older boundary is no longer a hit.

The region costs 64 bytes per block, as much again as ``block_meta``, and only models whose
KV-cache groups have blocks bigger than ``hash_block_size`` (hybrid models) ever key a block
twice, so it is opt-in: ``BlockPool.create(..., partial_keys=True)`` sets
``FLAG_PARTIAL_KEYS``. Without it the region is empty, every block still takes a partial key
as its own key (and gives it up for the full one), and an alias that would be needed is not
kept (``cache_partial_block`` says so in a warning, once per pool).

Because ``block_alias`` follows ``block_meta`` with no gap (64-byte rows, both 64-byte
aligned), the two regions form one array of *key rows*: rows ``0 .. num_blocks + 1`` are
``block_meta``'s, and key row ``num_blocks + 2 + b`` is block ``b``'s alias
(``Layout.alias_row``). The prefix index links key rows, so its code is the same for both.

The prefix-cache index (regions 1, 2 and 3)
-------------------------------------------

A chained hash table keyed by ``(block_hash, group_id)``: ``index_buckets[b]`` is the first
key row of bucket ``b`` and ``index_next`` links the rest. Several blocks may share one key
(vLLM never de-duplicates, so block tables stay append-only); a new key row joins at the tail
of its chain, so the first block found for a key is the first inserted, which is vLLM's rule.
A lookup that finds an alias row answers with the block it belongs to.
Bucket of a key: the first 8 hash bytes as a little-endian u64, xor ``group_id * GROUP_MIX``,
masked to the table size.

Write order
-----------

Every write but those of the lock itself (``lock_phase``, the holder record, ``lock_seq``,
``journal_len``) happens under the pool lock and is journaled first, so no reader sees a
half-done mutation while the holder lives, and none survives its death. Within a mutation the order is: unlink from the free queue, then change
``ref_cnt`` and the ledger; set a block's hash fields, then link it into its bucket chain;
unlink from the chain, then clear the hash fields. ``state`` turns ``READY`` only after
everything else of a new segment is written. A process's ledger row is zero whenever its
slot is ``SLOT_FREE``.

Crash caveats
-------------

A process killed outside the lock leaves its slot ``SLOT_ACTIVE`` with a dead OFD lock:
``BlockPool.reap_dead()`` in any survivor releases its ledger references and its slot
(allocation failures and a full process table reap first). A process killed inside the lock
leaves the semaphore taken and, maybe, a mutation half done: a waiter takes the lock over
and rolls the hold back from the journal (see ``docs/crash-safety.md``). A creator killed before ``state`` turns ``READY`` leaves a segment
that ``attach`` refuses with ``SegmentError``; ``BlockPool.unlink(name)`` removes it.

Sibling segments
----------------

Other shared-memory objects of shmkv are named ``/shmkv_<kind>-<name>-v<version>`` by
``sibling_segment_name``: the underscore keeps them apart from pool segments, which the
pool tools (``shmkv cleanup``) parse as ``shmkv-<pool name>-v<LAYOUT_VERSION>``. Each starts
with its own small header and is versioned on its own.

Kinds: ``ch`` (a message channel, below), ``bt`` (a scheduler's shared block tables), ``kv``
(a pool's KV store), ``stats`` (a pool's per-process counters, ``shmkv/stats.py``) and
``pub`` (a pool's saved publisher position, ``shmkv/publisher.py``) and ``offload`` (the
vLLM offload tier's rank table beside its pool, ``shmkv/vllm.py``); ``bt`` and ``kv`` are
laid out in the docstrings of ``shmkv/ranks/tables.py`` and ``shmkv/ranks/kv_store.py``.
Besides these, a channel's doorbell is a POSIX semaphore ``/shmkv_bell-<name>`` named in the
channel's header (it has no header of its own), and a pool has its lock semaphore and
``.alive`` file (above).

Every sibling segment starts with `magic` (u64, 0) and `version` (u32, 8), and holds an
*owner record* (``OWNER_DTYPE``, 120 bytes) at the offset ``SIBLING_KINDS`` gives for its kind;
``shmkv cleanup`` (``shmkv/pool/siblings.py``) reads only these to decide whose a sibling is:

| field                 | type | meaning |
|-----------------------|------|---------|
| `owner_magic`         | u64  | ``OWNER_MAGIC`` once the record is written (before the segment's own `magic`) |
| `creator_pid`         | i32  | the process that made the segment and unlinks it; 0: none (it lives as long as its pool: stats, publisher position) |
| `pool_creator_pid`    | u32  | with `pool_ino`, which pool `pool_name` was when the segment was made (0: no pool) |
| `creator_start_ticks` | u64  | the creator's start time (``/proc/<pid>/stat`` field 22), so a reused pid is not taken for it |
| `pool_ino`            | u64  | inode of the pool segment in /dev/shm when the segment was made: a pool re-created under the same name is another pool |
| `pool_name`           | S64  | the pool the segment belongs to; empty: none |
| `pool_id`             | V16  | that pool's header `pool_id` when the segment was made: the pool itself, whatever its name, creator pid or inode |
| `creator_pid_ns`      | u64  | the inode of the creator's pid namespace (``/proc/self/ns/pid``), 0 if unknown: `creator_pid` and `creator_start_ticks` mean something only to a reader in the same namespace; a creator of another (or an unknown) namespace counts as alive |

A sibling is its creator's while the creator lives, and its pool's while that very pool is in
use; when both are gone (or the pool is being removed as orphaned) cleanup removes it, and a
channel takes its doorbell with it (when no other channel names it).

A message channel (kind ``ch``, ``shmkv/messages.py``, version ``CHANNEL_LAYOUT_VERSION``) is
a single-producer single-consumer byte ring: a 256-byte ``CHANNEL_HEADER_DTYPE`` header, then
``capacity_bytes`` of frames. Its doorbell is a POSIX semaphore named in the header.

| field            | type | meaning |
|------------------|------|---------|
| `magic`          | u64  | ``CHANNEL_MAGIC`` |
| `version`        | u32  | ``CHANNEL_LAYOUT_VERSION`` |
| `capacity_bytes` | u32  | size of the frame ring, a multiple of 8 |
| `head`           | u64  | monotonic byte position of the next frame to read; written only by the consumer |
| `tail`           | u64  | monotonic byte position after the last complete frame; written only by the producer, after the frame's bytes |
| `producer_pid`   | i32  | the last process that sent (0: none yet), for error messages |
| `consumer_pid`   | i32  | the last process that received (0: none yet) |
| `doorbell`       | S88  | name of the semaphore posted once per frame sent |
| `owner`          | V128 | the owner record (``OWNER_DTYPE``, at ``CHANNEL_OWNER_OFFSET`` = 128), then padding |

A frame is a u32 length, then that many bytes of msgpack, padded to 8 bytes; a length of
``CHANNEL_WRAP`` means "the rest of this lap is empty, go on at the ring's start". A producer
killed in the middle of a frame never advanced `tail`, so no reader sees half a frame.

Memory ordering: which store publishes which
--------------------------------------------

Correct on weakly ordered CPUs (aarch64, GH200 nodes) as well as on x86-64 (TSO). In C
(``_ckernel.c``): ``STORE_REL`` is a release store, ``COMPILER_BARRIER`` a compiler-only
barrier; in Python, ``shmkv.pool.barriers.fence()`` is a full barrier (the C kernel's; a no-op
without it, x86-64 only).

- Undo journal: the entry's two words, then `journal_len` (release) publishes it, then a
  compiler barrier, then the data store it undoes. Only a compiler barrier is needed before
  the data: what a SIGKILLed holder leaves is a program-order prefix of its stores, and no
  other process reads these words while the holder is alive (they are under the lock).
- The commit: `journal_len = 0` (release) publishes the hold's writes as final; then the
  holder record is cleared (release stores) and the semaphore posted (a full barrier).
- Lock marks: `lock_phase` stores are release stores; HOLDING is stored before `holder`
  (both release), RELEASING before `holder` is cleared, IDLE after the post.
- Channel ring (``shmkv/messages.py``): the producer's frame bytes, fence, `tail` publishes
  them; the consumer reads `tail`, fence, the frame, fence, `head` gives the space back; the
  producer reads `head`, fence, then overwrites.
- Block-table seqlock (``shmkv/ranks/tables.py``): odd `seq`, fence, rows, fence, `step`,
  fence, even `seq` publishes them; a reader reads an even `seq`, fence, the rows, fence, and
  re-reads `seq` to validate the copy.

Changelog
---------

- v1: initial layout (header, block_meta, index_buckets).
- v2: multi-process: a 256-byte header (holder record, event-log pointers, max_processes,
  event_log_bytes, hash_fn_name, none_hash), and the proc_table, ledger and event_log
  regions.
- v3: crash safety: the undo journal (region 6; header `journal_entries`, `journal_len`),
  `lock_seq`, `num_takeovers`; process rows gain `lock_phase` (labels shrink to 24 bytes).
- v4: partial-block keys: the `block_alias` region (region 2; a block's second, partial
  key), so the regions after it move; the prefix index links key rows of both regions.
- v5: hardening (issue 15): `lock_phase` gains ``PHASE_ABANDONED`` (4); the header grows to
  320 bytes with `pool_id` (16 random bytes at creation), so the regions after it move.
- v6: `num_hash_lookahead_tokens` (header offset 272, in the padding: no region moves).
- v7: process rows grow to 72 bytes with `pid_ns`, so liveness can also check `pid` and
  `start_ticks` (issue 15, item 3); header `cache_geometry` (offset 280, in the padding).
- v8: header `tier_of` (offset 288, in the padding: no region moves): a pool's tiers are
  known by it, never by their names alone. The holder word of a process inside ``attach``
  names its attach mark (a byte of the ``.alive`` file past the slots), not a slot.
  Later, with no version bump (the fields sit in padding that every v8 pool has as zeros,
  and no reader of v8 reads them): header `retention` (offset 304) and `stays_by` (308).
  A v8 pool whose `retention` is 0 was made before them and is kept, as a pool that stays.
- v9: no field moves. A pool's `pool_id` is the generation of the tier made with it: every
  other object of the tier records it and is never believed without it
  (``shmkv/pool/lifecycle.py``). The version is in the pool's name, so a release that did not
  record generations (v8) never opens a v9 tier, nor v9 its: each makes its own.
- v10: no field moves. The version follows the vLLM offload tier's v5 (a tier's root is its
  pool, and a tier's objects share it by name alone): a release of tier v4 never opens a
  tier v5 pool, nor v5 its, so neither loads the other's keys from its own data region.

Sibling segments (versioned on their own): ch v2, bt v2, kv v2, stats v2, pub v2: the owner
record (channel header 128 -> 256 bytes; stats header 64 -> 192 bytes; publisher state 128 ->
256 bytes; block tables and KV store in their headers' padding). pub v3: the saved position
is keyed on the pool's `pool_id` (was its creator pid and 8 bytes of NONE_HASH). ch v3, bt v3,
kv v3, stats v3, pub v3: the owner record grows to 112 bytes with the pool's `pool_id`, which
cleanup compares (a pool re-created under the name, even by a reused pid on a reused inode, is
another pool). kv v4: the KV store's header names its data layout (`layout`, in former
padding): layer-major as before, or block-major (``shmkv/ranks/kv_store.py``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from shmkv.errors import UsageError

LAYOUT_VERSION = 10
# Eight different bytes: a byte-swapped reader, or any other segment, never sees this value.
MAGIC = 0x1A5E_4B76_6D68_73F0
ALIGN_BYTES = 64
BLOCK_HASH_BYTES = 32

STATE_INITIALIZING = 1
STATE_READY = 2
STATE_POISONED = 3
STATE_NAMES = {
    STATE_INITIALIZING: "INITIALIZING",
    STATE_READY: "READY",
    STATE_POISONED: "POISONED",
}

# Whether a pool outlives the processes that use it (header `retention`).
RETENTION_UNRECORDED = 0  # made before pools recorded it: kept, as a pool that stays
RETENTION_SCOPED = 1  # lives while a process holds it
RETENTION_STAYS = 2  # stays until removed by name (BlockPool.mark_stays)
MAX_STAYS_BY_BYTES = 12

FLAG_PREFIX_CACHING = 1 << 0
FLAG_KV_EVENTS = 1 << 1
FLAG_PARTIAL_KEYS = 1 << 2

NULL_BLOCK_ID = 0
NO_BLOCK = -1
NO_HASH_TOKENS = 0
# A group id with this bit set keys a block whose bytes are still being written: the
# offload tiers (shmkv.vllm, shmkv.sglang) key an in-flight store so that no other process
# stores it again, and turn it into the real group once the bytes are there. Such keys are
# never a hit for a real group and never reach a subscriber (cached_key_snapshot).
PENDING_GROUP_BIT = 1 << 30
GROUP_MIX = 0x9E37_79B9_7F4A_7C15
MAX_POOL_NAME_CHARS = 64
MAX_NUM_BLOCKS = (1 << 31) - 3  # row indices, sentinels included, must fit an int32
MAX_PROCESSES = 1024
MIN_EVENT_LOG_BYTES = 4096
DEFAULT_EVENT_LOG_BYTES = 4 << 20
MIN_JOURNAL_ENTRIES = 64
MAX_JOURNAL_ENTRIES = 1 << 28
JOURNAL_OVERFLOWED = -1
MAX_LABEL_BYTES = 24
MAX_HASH_LOOKAHEAD_TOKENS = 1 << 16  # speculative tokens per step are a handful

HEADER_DTYPE = np.dtype(
    {
        "names": [
            # immutable: the config echo
            "magic", "layout_version", "format_flags", "header_bytes", "state",
            "total_bytes", "num_blocks", "hash_block_size", "num_index_buckets",
            "block_hash_bytes", "creator_pid", "max_processes", "medium", "event_log_bytes",
            "hash_fn_name", "none_hash", "journal_entries",
            # mutable, under the pool lock
            "epoch", "num_free_blocks", "queue_head_key", "queue_tail_key",
            "holder", "holder_incarnation", "holder_since_ns",
            "next_event_seq", "log_write_pos", "log_oldest_seq", "log_oldest_pos",
            "num_reaped", "num_events_dropped", "journal_len", "lock_seq", "num_takeovers",
            # immutable again: the identity, drawn at creation; then more config echo
            "pool_id", "num_hash_lookahead_tokens",
            # written once, by the first KV-cache coordinator (``claim_cache_geometry``)
            "cache_geometry",
            # immutable: the pool whose tier this is (zeros: none)
            "tier_of",
            # written by the creator, then once by mark_stays: whether the pool stays
            "retention", "stays_by",
        ],
        "formats": [
            "<u8", "<u4", "<u4", "<u4", "<u4",
            "<u8", "<u4", "<u4", "<u4",
            "<u4", "<u4", "<u4", "S8", "<u8",
            "S16", "V32", "<u8",
            "<u8", "<i8", "<i8", "<i8",
            "<i8", "<u8", "<i8",
            "<i8", "<i8", "<i8", "<i8",
            "<i8", "<i8", "<i8", "<u8", "<u8",
            "V16", "<u4",
            "<i8",
            "V16",
            "<u4", "S12",
        ],
        "offsets": [
            0, 8, 12, 16, 20,
            24, 32, 36, 40,
            44, 48, 52, 56, 64,
            72, 88, 120,
            128, 136, 144, 152,
            160, 168, 176,
            184, 192, 200, 208,
            216, 224, 232, 240, 248,
            256, 272,
            280,
            288,
            304, 308,
        ],
        "itemsize": 320,
    }
)

BLOCK_DTYPE = np.dtype(
    {
        "names": [
            "ref_cnt", "prev", "next", "index_next", "group_id", "hash_num_tokens",
            "queue_key", "block_hash",
        ],
        "formats": ["<i4", "<i4", "<i4", "<i4", "<u4", "<i4", "<i8", "V32"],
        "offsets": [0, 4, 8, 12, 16, 20, 24, 32],
        "itemsize": 64,
    }
)

# The hot paths read single fields through memoryviews over the block_meta region (flat, or
# strided per field) instead of numpy scalars. These are the field positions in those views.
ROW_I32 = BLOCK_DTYPE.itemsize // 4  # int32 words per row
ROW_I64 = BLOCK_DTYPE.itemsize // 8  # int64 words per row
F_REF = BLOCK_DTYPE.fields["ref_cnt"][1] // 4
F_PREV = BLOCK_DTYPE.fields["prev"][1] // 4
F_NEXT = BLOCK_DTYPE.fields["next"][1] // 4
F_INDEX_NEXT = BLOCK_DTYPE.fields["index_next"][1] // 4
F_GROUP = BLOCK_DTYPE.fields["group_id"][1] // 4
F_HASH_TOKENS = BLOCK_DTYPE.fields["hash_num_tokens"][1] // 4
F_QUEUE_KEY = BLOCK_DTYPE.fields["queue_key"][1] // 8
HASH_BYTE_OFFSET = BLOCK_DTYPE.fields["block_hash"][1]
# Header int64 words, for the same flat-view access.
H_EPOCH = HEADER_DTYPE.fields["epoch"][1] // 8
H_NUM_FREE = HEADER_DTYPE.fields["num_free_blocks"][1] // 8
H_QUEUE_HEAD_KEY = HEADER_DTYPE.fields["queue_head_key"][1] // 8
H_QUEUE_TAIL_KEY = HEADER_DTYPE.fields["queue_tail_key"][1] // 8
H_HOLDER = HEADER_DTYPE.fields["holder"][1] // 8
H_HOLDER_INCARNATION = HEADER_DTYPE.fields["holder_incarnation"][1] // 8
H_HOLDER_SINCE_NS = HEADER_DTYPE.fields["holder_since_ns"][1] // 8
H_NEXT_EVENT_SEQ = HEADER_DTYPE.fields["next_event_seq"][1] // 8
H_LOG_WRITE_POS = HEADER_DTYPE.fields["log_write_pos"][1] // 8
H_LOG_OLDEST_SEQ = HEADER_DTYPE.fields["log_oldest_seq"][1] // 8
H_LOG_OLDEST_POS = HEADER_DTYPE.fields["log_oldest_pos"][1] // 8
H_NUM_REAPED = HEADER_DTYPE.fields["num_reaped"][1] // 8
H_NUM_EVENTS_DROPPED = HEADER_DTYPE.fields["num_events_dropped"][1] // 8
H_JOURNAL_LEN = HEADER_DTYPE.fields["journal_len"][1] // 8
H_LOCK_SEQ = HEADER_DTYPE.fields["lock_seq"][1] // 8
H_NUM_TAKEOVERS = HEADER_DTYPE.fields["num_takeovers"][1] // 8
H_CACHE_GEOMETRY = HEADER_DTYPE.fields["cache_geometry"][1] // 8

# One row per process-table slot (72 bytes).
PROC_DTYPE = np.dtype(
    {
        "names": ["state", "pid", "incarnation", "start_ticks", "attach_ns", "label",
                  "pid_ns", "lock_phase"],
        "formats": ["<i4", "<i4", "<u8", "<u8", "<i8", "S24", "<u8", "<i8"],
        "offsets": [0, 4, 8, 16, 24, 32, 56, 64],
        "itemsize": 72,
    }
)
SLOT_FREE = 0
SLOT_ACTIVE = 1
PHASE_IDLE = 0
PHASE_ACQUIRING = 1
PHASE_RELEASING = 2
PHASE_HOLDING = 3
PHASE_ABANDONED = 4  # an exception cut its acquire short: it may hold the unit (lock.py)
# int64 words of a process row, for the locks' flat-view access.
P_INCARNATION = PROC_DTYPE.fields["incarnation"][1] // 8
P_LOCK_PHASE = PROC_DTYPE.fields["lock_phase"][1] // 8
PROC_I64 = PROC_DTYPE.itemsize // 8

# One undo-journal entry: where (byte offset * 16 + width) and the old value.
JOURNAL_DTYPE = np.dtype([("where", "<i8"), ("old", "<i8")])

_POOL_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclass(frozen=True)
class PoolConfig:
    """Everything that fixes a pool's layout; echoed in the header and checked on attach."""

    num_blocks: int
    hash_block_size: int
    enable_caching: bool = True
    enable_kv_cache_events: bool = False
    medium: str = "GPU"
    max_processes: int = 16
    event_log_bytes: int = 0
    hash_fn_name: str = "sha256"
    journal_entries: int = 0  # 0: default_journal_entries(num_blocks, partial_keys)
    partial_keys: bool = False  # the block_alias region (a block's second, partial key)
    num_hash_lookahead_tokens: int = 0  # tokens after each block its hash covers

    def __post_init__(self) -> None:
        if self.journal_entries == 0 and isinstance(self.num_blocks, int):
            object.__setattr__(self, "journal_entries",
                               default_journal_entries(self.num_blocks, self.partial_keys))

    @property
    def format_flags(self) -> int:
        return (
            (FLAG_PREFIX_CACHING if self.enable_caching else 0)
            | (FLAG_KV_EVENTS if self.enable_kv_cache_events else 0)
            | (FLAG_PARTIAL_KEYS if self.partial_keys else 0)
        )

    @property
    def num_alias_rows(self) -> int:
        """Rows of the block_alias region: one per block with partial keys, else none."""
        return self.num_blocks if self.partial_keys else 0

    @property
    def num_index_buckets(self) -> int:
        return max(16, 1 << (2 * self.num_blocks - 1).bit_length())

    def validate(self) -> None:
        """Raises UsageError naming the first bad value."""
        if isinstance(self.num_blocks, bool) or not isinstance(self.num_blocks, int):
            raise UsageError(f"num_gpu_blocks must be an int, got {self.num_blocks!r}")
        if not 0 < self.num_blocks <= MAX_NUM_BLOCKS:
            raise UsageError(
                f"num_gpu_blocks must be in [1, {MAX_NUM_BLOCKS}], got {self.num_blocks}"
            )
        if isinstance(self.hash_block_size, bool) or not isinstance(self.hash_block_size, int):
            raise UsageError(f"hash_block_size must be an int, got {self.hash_block_size!r}")
        if self.hash_block_size <= 0:
            raise UsageError(f"hash_block_size must be positive, got {self.hash_block_size}")
        medium = self.medium.encode() if isinstance(self.medium, str) else None
        if medium is None or not 0 < len(medium) <= 8:
            raise UsageError(f"medium must be a str of 1 to 8 bytes, got {self.medium!r}")
        if (isinstance(self.max_processes, bool) or not isinstance(self.max_processes, int)
                or not 1 <= self.max_processes <= MAX_PROCESSES):
            raise UsageError(
                f"max_processes must be an int in [1, {MAX_PROCESSES}], got {self.max_processes!r}"
            )
        if (isinstance(self.event_log_bytes, bool) or not isinstance(self.event_log_bytes, int)
                or self.event_log_bytes < 0 or self.event_log_bytes % 8
                or 0 < self.event_log_bytes < MIN_EVENT_LOG_BYTES):
            raise UsageError(
                f"event_log_bytes must be 0 or a multiple of 8 >= {MIN_EVENT_LOG_BYTES}, "
                f"got {self.event_log_bytes!r}"
            )
        if (isinstance(self.journal_entries, bool) or not isinstance(self.journal_entries, int)
                or not MIN_JOURNAL_ENTRIES <= self.journal_entries <= MAX_JOURNAL_ENTRIES):
            raise UsageError(
                f"journal_entries must be an int in [{MIN_JOURNAL_ENTRIES}, "
                f"{MAX_JOURNAL_ENTRIES}], got {self.journal_entries!r}"
            )
        if (isinstance(self.num_hash_lookahead_tokens, bool)
                or not isinstance(self.num_hash_lookahead_tokens, int)
                or not 0 <= self.num_hash_lookahead_tokens <= MAX_HASH_LOOKAHEAD_TOKENS):
            raise UsageError(
                f"num_hash_lookahead_tokens must be an int in [0, {MAX_HASH_LOOKAHEAD_TOKENS}], "
                f"got {self.num_hash_lookahead_tokens!r}"
            )
        if self.hash_fn_name not in ("sha256", "sha256_cbor"):
            raise UsageError(
                f"hash_fn_name must be 'sha256' or 'sha256_cbor', got {self.hash_fn_name!r}"
            )


def default_journal_entries(num_blocks: int, partial_keys: bool = False) -> int:
    """Journal entries by default: enough for one call on every block of the pool (an
    allocation that evicts writes about eight words per block, four more for a block's
    alias), at most 2**21 (32 MiB)."""
    return min((12 if partial_keys else 8) * num_blocks + 4096, 1 << 21)


@dataclass(frozen=True)
class Region:
    """One region of the segment: what it holds, who writes it, what guards it."""

    name: str
    dtype: np.dtype
    shape: Callable[[PoolConfig], tuple[int, ...]]
    writer: str
    guard: str
    invariants: str
    doc: str


REGIONS: tuple[Region, ...] = (
    Region(
        "header", HEADER_DTYPE, lambda c: (1,),
        writer="creator, then the pool under its lock", guard="pool lock (mutable part)",
        invariants="INV-HDR, INV-CONSERVE",
        doc="magic, version, config echo, free-queue counters",
    ),
    Region(
        "block_meta", BLOCK_DTYPE, lambda c: (c.num_blocks + 2,),
        writer="BlockPool; FreeKVCacheBlockQueue (prev/next/queue_key); "
        "BlockHashToBlockMap (index_next)",
        guard="pool lock", invariants="INV-FREE, INV-QKEY, INV-REF, INV-HASH",
        doc="one row per block, then the free queue's head and tail sentinel rows",
    ),
    Region(
        "block_alias", BLOCK_DTYPE, lambda c: (c.num_alias_rows,),
        writer="BlockHashToBlockMap (index_next, group_id, hash_num_tokens, block_hash)",
        guard="pool lock", invariants="INV-HASH, INV-ALIAS",
        doc="each block's alias (partial) prefix-cache key; key row num_blocks + 2 + b",
    ),
    Region(
        "index_buckets", np.dtype("<i4"), lambda c: (c.num_index_buckets,),
        writer="BlockHashToBlockMap", guard="pool lock", invariants="INV-HASH",
        doc="first block of each prefix-index bucket chain, NO_BLOCK when empty",
    ),
    Region(
        "proc_table", PROC_DTYPE, lambda c: (c.max_processes,),
        writer="attach / close / reap_dead", guard="pool lock", invariants="INV-PROC",
        doc="one slot per attached process: pid, start time, incarnation, label",
    ),
    Region(
        "ledger", np.dtype("<i4"), lambda c: (c.max_processes, c.num_blocks),
        writer="the kernels (row of the calling process); reap_dead (a dead process's row)",
        guard="pool lock", invariants="INV-LEDGER",
        doc="references each process holds on each block",
    ),
    Region(
        "event_log", np.dtype("u1"), lambda c: (c.event_log_bytes,),
        writer="EventLog.append", guard="pool lock", invariants="INV-LOG",
        doc="byte ring of msgpack KV events with sequence numbers",
    ),
    Region(
        "journal", JOURNAL_DTYPE, lambda c: (c.journal_entries,),
        writer="the lock holder, before each of its writes", guard="pool lock",
        invariants="INV-JOURNAL",
        doc="undo journal: old values of the words the current hold has written",
    ),
)


def _align(offset: int) -> int:
    return (offset + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


@dataclass(frozen=True)
class Layout:
    """Offsets and sizes of every region for one config."""

    config: PoolConfig
    offsets: dict[str, int]
    shapes: dict[str, tuple[int, ...]]
    total_bytes: int

    @classmethod
    def from_config(cls, config: PoolConfig) -> Layout:
        offsets: dict[str, int] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        offset = 0
        for region in REGIONS:
            offset = _align(offset)
            shape = region.shape(config)
            offsets[region.name] = offset
            shapes[region.name] = shape
            offset += region.dtype.itemsize * int(np.prod(shape))
        # The index addresses block_meta and block_alias as one array of key rows.
        assert offsets["block_alias"] == offsets["block_meta"] + BLOCK_DTYPE.itemsize * (
            config.num_blocks + 2
        )
        return cls(config, offsets, shapes, _align(offset))

    @property
    def num_key_rows(self) -> int:
        """Rows of block_meta and block_alias together (the prefix index's rows)."""
        return self.config.num_blocks + 2 + self.config.num_alias_rows

    def alias_row(self, block_id: int) -> int:
        """The key row of block ``block_id``'s alias key."""
        return self.config.num_blocks + 2 + block_id

    def key_rows(self, buf) -> np.ndarray:
        """A numpy view of block_meta and block_alias as one ``[num_key_rows]`` array."""
        return np.ndarray(
            (self.num_key_rows,), dtype=BLOCK_DTYPE, buffer=buf, offset=self.offsets["block_meta"]
        )

    @property
    def free_head(self) -> int:
        """Row of the free queue's head sentinel."""
        return self.config.num_blocks

    @property
    def free_tail(self) -> int:
        """Row of the free queue's tail sentinel."""
        return self.config.num_blocks + 1

    def view(self, buf, name: str) -> np.ndarray:
        """A numpy view of region ``name`` over the segment buffer ``buf``."""
        region = next(r for r in REGIONS if r.name == name)
        return np.ndarray(
            self.shapes[name], dtype=region.dtype, buffer=buf, offset=self.offsets[name]
        )

    def describe(self) -> list[tuple[str, int, int, str]]:
        """(region, offset, bytes, dtype) rows, for inspection tools."""
        rows = []
        for region in REGIONS:
            nbytes = region.dtype.itemsize * int(np.prod(self.shapes[region.name]))
            rows.append((region.name, self.offsets[region.name], nbytes, str(region.dtype)))
        return rows


def validate_pool_name(name: object) -> str:
    """Checks a pool name and returns it. Raises UsageError saying what is wrong."""
    if not isinstance(name, str):
        raise UsageError(f"pool name must be a str, got {type(name).__name__}")
    if "/" in name:
        raise UsageError(f"pool name {name!r} contains '/'; use letters, digits, '.', '_', '-'")
    if not name:
        raise UsageError("pool name is empty")
    if len(name) > MAX_POOL_NAME_CHARS:
        raise UsageError(
            f"pool name is {len(name)} characters long; at most {MAX_POOL_NAME_CHARS} allowed"
        )
    if not _POOL_NAME_RE.fullmatch(name):
        raise UsageError(
            f"pool name {name!r} must start with a letter or digit and use only letters, "
            "digits, '.', '_' and '-'"
        )
    return name


def segment_name(pool_name: str) -> str:
    """The POSIX shared-memory name of a pool: ``/shmkv-<pool name>-v<LAYOUT_VERSION>``."""
    return f"/shmkv-{validate_pool_name(pool_name)}-v{LAYOUT_VERSION}"


# ------------------------------------------------------------------ sibling segments

CHANNEL_LAYOUT_VERSION = 3
CHANNEL_MAGIC = 0x1A5E_4B76_6843_7F01
CHANNEL_WRAP = 0xFFFF_FFFF
MAX_DOORBELL_NAME_BYTES = 88
CHANNEL_HEADER_DTYPE = np.dtype(
    [
        ("magic", "<u8"),
        ("version", "<u4"),
        ("capacity_bytes", "<u4"),
        ("head", "<u8"),
        ("tail", "<u8"),
        ("producer_pid", "<i4"),
        ("consumer_pid", "<i4"),
        ("doorbell", f"S{MAX_DOORBELL_NAME_BYTES}"),
        ("owner", "V128"),  # OWNER_DTYPE at CHANNEL_OWNER_OFFSET, then padding
    ]
)
assert CHANNEL_HEADER_DTYPE.itemsize == 4 * ALIGN_BYTES
CHANNEL_OWNER_OFFSET = CHANNEL_HEADER_DTYPE.fields["owner"][1]

# The owner record of every sibling segment (see "Sibling segments" above).
OWNER_MAGIC = 0x1A5E_4B76_6F77_6E31
OWNER_DTYPE = np.dtype(
    {
        "names": ["owner_magic", "creator_pid", "pool_creator_pid", "creator_start_ticks",
                  "pool_ino", "pool_name", "pool_id", "creator_pid_ns"],
        "formats": ["<u8", "<i4", "<u4", "<u8", "<u8", f"S{MAX_POOL_NAME_CHARS}", "V16", "<u8"],
        "offsets": [0, 8, 12, 16, 24, 32, 96, 112],
        "itemsize": 120,
    }
)

# Versions and magics of the other sibling kinds (their modules lay out the rest).
BT_LAYOUT_VERSION = 3
BT_MAGIC = 0x1A5E_4B76_7462_6C31
BT_OWNER_OFFSET = 128  # in the 256-byte header's padding
KV_LAYOUT_VERSION = 4
KV_MAGIC = 0x1A5E_4B76_6B76_7332
KV_OWNER_OFFSET = 128  # in the 4 KiB header's padding
STATS_VERSION = 3
STATS_MAGIC = 0x5348_4B56_5354_4101  # "SHKVSTA" + 1
STATS_OWNER_OFFSET = 64  # the header is 192 bytes: 64 of fields, then the owner record
PUBLISHER_STATE_VERSION = 3
PUBLISHER_STATE_MAGIC = 0x5348_4B56_5055_4201  # "SHKVPUB" + 1
PUBLISHER_OWNER_OFFSET = 128  # the state is 256 bytes: 128 of fields, then the owner record
OFFLOAD_TIER_VERSION = 5  # the vLLM offload tier's table (shmkv/vllm/tier.py); v2: replica
# rows, per-chunk job bits, the data region's tag and the replica identity; v3: the counter
# block (shmkv/pool/tier_counters.py) after the header; v4: the tier's generation (its pool's
# pool_id) in the table, the data region's trailer and the replica lock file, and the version
# in the data region's name (shmkv/pool/lifecycle.py); v5: the body after the whole counter
# block (in v4 the counter rows of replica row 63 lay on the ranks of chunks 0-7), with the
# pool's v10 (a tier version never meets another through their pool)
OFFLOAD_TIER_MAGIC = 0x5EC7_0FF1_0AD3_2B61
OFFLOAD_TIER_OWNER_OFFSET = 3968  # in its 4 KiB header, after the replica identity
SGLANG_STORE_VERSION = 4  # SGLang's L3 page store (shmkv/sglang/region.py): header + pages;
# v2: the counter rows in the header, the counter block and the page producers after the pages;
# v3: no layout change: the version follows the pool's v9, so a release of v2 never opens it;
# v4: no layout change: the version follows the pool's v10, so a release of v3 never opens it
SGLANG_STORE_MAGIC = 0x5C1A_46E5_70A6_E301
SGLANG_STORE_OWNER_OFFSET = 3968  # in its 4 KiB header, after the store's identity


@dataclass(frozen=True)
class SiblingKind:
    """What shmkv cleanup needs to know of one sibling kind."""

    kind: str  # the ``<kind>`` of ``/shmkv_<kind>-<name>-v<version>``
    what: str
    version: int
    magic: int
    owner_offset: int
    # earlier versions of a kind named after its pool alone, which ``shmkv unlink`` also
    # removes (a pool used before and after an upgrade of shmkv has both)
    past_versions: tuple[int, ...] = ()


SIBLING_KINDS: dict[str, SiblingKind] = {
    k.kind: k for k in (
        SiblingKind("ch", "channel", CHANNEL_LAYOUT_VERSION, CHANNEL_MAGIC,
                    CHANNEL_OWNER_OFFSET),
        SiblingKind("bt", "block tables", BT_LAYOUT_VERSION, BT_MAGIC, BT_OWNER_OFFSET),
        SiblingKind("kv", "KV store", KV_LAYOUT_VERSION, KV_MAGIC, KV_OWNER_OFFSET),
        SiblingKind("stats", "stats", STATS_VERSION, STATS_MAGIC, STATS_OWNER_OFFSET,
                    past_versions=(1, 2)),
        SiblingKind("pub", "publisher position", PUBLISHER_STATE_VERSION,
                    PUBLISHER_STATE_MAGIC, PUBLISHER_OWNER_OFFSET, past_versions=(1, 2)),
        SiblingKind("offload", "offload tier table", OFFLOAD_TIER_VERSION, OFFLOAD_TIER_MAGIC,
                    OFFLOAD_TIER_OWNER_OFFSET, past_versions=(1, 2, 3, 4)),
        SiblingKind("sglang", "SGLang page store", SGLANG_STORE_VERSION, SGLANG_STORE_MAGIC,
                    SGLANG_STORE_OWNER_OFFSET, past_versions=(1, 2, 3)),
    )
}
DOORBELL_PREFIX = "/shmkv_bell-"
# Siblings named after their pool alone (``/shmkv_<kind>-<pool>-v<version>``): they go
# with the pool on ``shmkv unlink``. Channels, block tables and KV stores carry a rank or
# replica suffix and belong to a serving run, which removes them itself.
POOL_NAMED_SIBLINGS = ("pub", "stats", "offload", "sglang")
# The vLLM offload tier's data region is vLLM's own file (its CPU worker names it
# ``/dev/shm/vllm_offload_<engine_id>.mmap``, plus a suffix per rank); shmkv picks the
# engine id, ``shmkv_offload<version>_data-<pool>``, so every replica of this tier version
# maps the same bytes, and a replica of another version never finds them.
OFFLOAD_DATA_REGION_PREFIX = f"vllm_offload_shmkv_offload{OFFLOAD_TIER_VERSION}_data-"
# The earlier names (and the tier versions that used them), which ``shmkv unlink`` also
# removes.
PAST_OFFLOAD_DATA_REGION_PREFIXES = {
    "vllm_offload_shmkv_offload_data-": "tier v1-v3",
    "vllm_offload_shmkv_offload4_data-": "tier v4",
}
OFFLOAD_REGION_MAKING = ".making-"  # a region being made: ``<region path>.making-<random>``


OFFLOAD_REPLICAS_SUFFIX = ".replicas"  # the offload tier's replica lock file, beside its table


def offload_replicas_path(pool: str) -> str:
    """The offload tier's replica lock file (``shmkv/vllm/replicas.py``): every process of a
    replica holds a lock on its row's byte."""
    return (f"/dev/shm{sibling_segment_name('offload', pool, OFFLOAD_TIER_VERSION)}"
            f"{OFFLOAD_REPLICAS_SUFFIX}")


def offload_data_region_engine_id(pool: str) -> str:
    """The ``engine_id`` under which every replica's workers map a pool's data region."""
    return OFFLOAD_DATA_REGION_PREFIX[len("vllm_offload_"):] + validate_pool_name(pool)


def offload_data_region_pool(entry: str, prefix: str = OFFLOAD_DATA_REGION_PREFIX
                             ) -> str | None:
    """The pool a /dev/shm entry is the offload data region of (made, or being made:
    ``.making-``), or None if it is not one. ``prefix``: another tier version's name."""
    if not entry.startswith(prefix):
        return None
    pool, sep, _ = entry[len(prefix):].partition(".mmap")
    return pool if sep and pool else None


def sibling_segment_name(kind: str, name: str, version: int) -> str:
    """The POSIX name of a non-pool shmkv object: ``/shmkv_<kind>-<name>-v<version>``."""
    return f"/shmkv_{kind}-{validate_pool_name(name)}-v{version}"
