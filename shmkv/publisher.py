"""The pool's global KV-event log, published over ZMQ in vLLM 0.33.0's wire format.

Routers and cache indexers that consume vLLM's KV events (Dynamo's KV router, llm-d's
indexer, vLLM's own tooling) subscribe to a shmkv pool exactly as to a vLLM engine:

- a PUB socket sends ``[topic, seq (8 bytes, big-endian), msgpack KVEventBatch]``;
- an optional ROUTER socket answers a replay request ``[b"", start_seq (8 bytes)]`` with
  every published batch from ``start_seq`` on, as ``[b"", topic, seq, payload]``, and then
  the end marker ``[b"", b"", -1 (8 bytes, signed), b""]``;
- each batch's ``data_parallel_rank`` names the scheduler process whose call produced its
  events (by default its process-table slot, see ``rank_from``);
- a shmkv extension on the same ROUTER socket: ``[b"", b"snapshot"]`` is answered with one
  batch ``[b"", topic, seq + 1, payload]`` that *is* the pool's prefix cache as of event
  ``seq`` (so the frame names the first event it leaves out)
  (``AllBlocksCleared``, then one ``BlockStored`` per KV-cache group listing every cached
  block's hash, a key held by several blocks listed as often), then
  ``[b"", b"", -1, identity]``, where ``identity`` names the pool (``pool_identity``) so that
  a consumer tells a re-created pool from the one it knew (``[b"", b"identity"]`` asks for
  that frame alone). An indexer that lost its state,
  or fell behind the ring, starts again from a snapshot instead of from sequence number 0.

How shmkv differs from vLLM's ``ZmqEventPublisher``, and why. vLLM has one publisher per
engine with a counter of its own; a shmkv pool has one log for all its schedulers, so ONE
publisher per pool serves them all (a second one is refused). Its sequence numbers are the
log's: batch ``seq`` carries exactly the event the log numbered ``seq``, so they are
consecutive, identical whichever publisher process sends them, and a replay is read back
from the log itself (a recent window is kept in memory as well). The publisher saves its
position in a small sibling segment (``/shmkv_pub-<pool>-v1``) after every send; one that
dies and is started again resumes right after the last batch it sent: no gap, and nothing
sent twice, except the single batch in flight if it was killed between sending it and
saving its position (sent again with the same sequence number and the same bytes, which a
subscriber that checks sequence numbers drops).

A publisher that falls more than a whole ring behind the log loses events; it logs how
many and goes on from the oldest event still there (subscribers see the jump in sequence
numbers, and a replay cannot fill it). Size the ring with ``event_log_bytes``.

``KVEventSubscriber`` is the consumer side: SUB plus replay, dropping duplicates and
filling gaps, decoding with shmkv's ``KVEventBatch`` (which reads vLLM's bytes too).

pyzmq is an optional dependency: ``pip install 'shmkv[zmq]'``.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import posix_ipc

from shmkv.errors import ShmKVError, UsageError
from shmkv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
    external_block_hash,
    use_int_block_hashes,
)
from shmkv.pool import layout as L
from shmkv.pool.block_pool import BlockPool
from shmkv.pool.event_log import EventCursor, LoggedEvent, decode_event
from shmkv.pool.segment import open_shm, reserve
from shmkv.pool.siblings import owner_record, write_owner

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The replay end marker: -1 as an 8-byte signed big-endian integer (vLLM's ``END_SEQ``)."""
SNAPSHOT_REQUEST = b"snapshot"
"""The replay request that asks for a snapshot of the prefix cache (a shmkv extension)."""
IDENTITY_REQUEST = b"identity"
"""The replay request that asks only for ``pool_identity`` (a shmkv extension)."""

# Bounds on what the replay socket costs, whoever connects to it (see KVEventPublisher's
# NOTE on replays).
REPLAY_SNDHWM = 1000
"""Replies queued per replay peer; a peer that reads nothing stalls its replay there."""
MAX_REPLAY_JOBS = 16
"""Requests answered at once; the others wait (at most ``MAX_WAITING_REPLAYS``)."""
MAX_WAITING_REPLAYS = 256
"""Requests waiting for a turn; one more is dropped (the requester times out)."""
REPLAY_STALL_S = 5.0
"""A replay whose peer read nothing for this long is dropped, and so are that peer's later
requests."""
REPLAY_SENDS_PER_TURN = 1024
"""Replay frames sent per ``poll()``, shared by the replays in progress (at least 16 each)."""
SNAPSHOT_REUSE_S = 1.0
"""A snapshot is computed again only when the log moved and the last one is this old."""
_MAX_STALLED_PEERS = 4096


# ZMQ transports that reach other hosts (anything else: ipc, inproc, or ZMQ's own error).
_NETWORK_TRANSPORTS = ("tcp://", "pgm://", "epgm://", "udp://", "ws://", "wss://", "tipc://",
                       "vmci://")


def is_loopback_endpoint(endpoint: str) -> bool:
    """Whether a ZMQ endpoint stays on this host: ipc:// and inproc://, or tcp:// on
    127.0.0.0/8, ::1 or localhost (not 0.0.0.0, *, an interface name or another address)."""
    import ipaddress

    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def pool_identity(pool: BlockPool) -> str:
    """A name for one incarnation of a pool: its name and the 16 random bytes of its header's
    ``pool_id`` (drawn at creation), so a pool re-created under the same name, even by a
    process with the same pid (containers), has another identity."""
    return f"{pool.pool_name}:{bytes(pool.header_snapshot()['pool_id']).hex()}"

PUBLISHER_STATE_VERSION = L.PUBLISHER_STATE_VERSION
_STATE_MAGIC = L.PUBLISHER_STATE_MAGIC
_STATE_DTYPE = np.dtype(
    [
        ("magic", "<u8"),
        ("version", "<u4"),
        ("pid", "<i4"),            # the publisher that wrote it last
        ("pool_id", "V16"),        # which pool the position is in (its header's pool_id)
        ("base_seq", "<i8", (2,)),  # two log cursors; base_which says which one is valid
        ("base_pos", "<i8", (2,)),
        ("base_which", "<i8"),
        ("next_seq", "<i8"),       # first sequence number not yet sent (>= the base's)
        ("published", "<i8"),      # batches sent, all publishers of this pool together
        ("lost", "<i8"),           # events overwritten before they were sent
    ]
)
_STATE_BYTES = L.PUBLISHER_OWNER_OFFSET + 128  # the fields, then the owner record
_W_NEXT_SEQ = _STATE_DTYPE.fields["next_seq"][1] // 8
_W_PUBLISHED = _STATE_DTYPE.fields["published"][1] // 8
assert _STATE_DTYPE.itemsize <= L.PUBLISHER_OWNER_OFFSET


class PublisherError(ShmKVError):
    """The publisher cannot run: another one holds the pool, or the pool has no log."""


def require_zmq():
    """Imports pyzmq, or raises UsageError saying how to install it."""
    try:
        import zmq
    except ImportError as exc:  # pragma: no cover  (pyzmq is in the dev extra)
        raise UsageError(
            "publishing KV events needs pyzmq: pip install 'shmkv[zmq]'"
        ) from exc
    return zmq


def state_segment_name(pool_name: str) -> str:
    """POSIX name of a pool's publisher-position segment,
    ``/shmkv_pub-<pool>-v<PUBLISHER_STATE_VERSION>``."""
    return L.sibling_segment_name("pub", pool_name, PUBLISHER_STATE_VERSION)


def unlink_state(pool_name: str) -> bool:
    """Removes a pool's saved publisher position. False if there was none."""
    try:
        posix_ipc.unlink_shared_memory(state_segment_name(pool_name))
    except posix_ipc.ExistentialError:
        return False
    return True


def saved_position(pool_name: str) -> dict | None:
    """What a pool's publisher saved (read without taking its lock): ``next_seq`` (the
    first batch not sent), ``pid`` (the publisher that saved it), ``running`` (whether a
    publisher holds the pool now), ``published`` and ``lost``; None if nothing was saved."""
    try:
        shm = open_shm(state_segment_name(pool_name), "publisher state")
    except posix_ipc.ExistentialError:
        return None
    try:
        if shm.size < _STATE_DTYPE.itemsize:
            return None
        with mmap.mmap(shm.fd, _STATE_BYTES, prot=mmap.PROT_READ) as mem:
            row = np.frombuffer(mem, dtype=_STATE_DTYPE, count=1)[0].copy()
        try:
            fcntl.flock(shm.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            running = False
            fcntl.flock(shm.fd, fcntl.LOCK_UN)
        except BlockingIOError:
            running = True
    finally:
        shm.close_fd()
    if int(row["magic"]) != _STATE_MAGIC:
        return None
    return {"next_seq": int(row["next_seq"]), "pid": int(row["pid"]), "running": running,
            "published": int(row["published"]), "lost": int(row["lost"])}


_TRAILING_INT = re.compile(r"(\d+)$")


def rank_from_label(label: str, slot: int) -> int:
    """The trailing integer of a process label ("scheduler-3", "dp3" -> 3), else the slot."""
    match = _TRAILING_INT.search(label.strip())
    return int(match.group(1)) if match else slot


class _PublisherState:
    """The saved position: a small sibling segment, flock-ed by the running publisher so
    that a second one is refused (the kernel drops the lock when the holder dies).

    A position is a valid log cursor (the start of the last read) plus the first sequence
    number not yet sent, at or after it. The cursor is double-buffered (the new one is
    written, then ``base_which`` flips) and ``next_seq`` is one aligned 8-byte store, so a
    publisher killed at any point leaves a consistent position."""

    def __init__(self, pool: BlockPool) -> None:
        self.name = state_segment_name(pool.pool_name)
        self._pool_name = pool.pool_name
        # created exclusively, or the existing one if this user's with mode 0600
        shm = open_shm(self.name, "publisher state", create=True, size=_STATE_BYTES)
        self._fd = os.dup(shm.fd)
        shm.close_fd()
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise PublisherError(
                f"pool {pool.pool_name} already has a publisher running (it holds "
                f"{self.name}); one publisher per pool serves every scheduler"
            ) from None
        if os.fstat(self._fd).st_size < _STATE_BYTES:  # made, not yet sized, by another
            os.ftruncate(self._fd, _STATE_BYTES)
            try:
                reserve(self._fd, _STATE_BYTES, f"publisher state {self.name}")
            except BaseException:
                os.close(self._fd)
                raise
        self._map = mmap.mmap(self._fd, _STATE_BYTES)
        self.row = np.ndarray((1,), dtype=_STATE_DTYPE, buffer=self._map)[0]
        self._words = memoryview(self._map).cast("q")  # the per-send stores, fast
        self._identity = bytes(pool.header_snapshot()["pool_id"])

    def saved(self) -> tuple[EventCursor, int] | None:
        """(a log cursor, the first sequence number not sent) if the saved position
        belongs to this very pool, else None."""
        row = self.row
        if (int(row["magic"]) != _STATE_MAGIC
                or int(row["version"]) != PUBLISHER_STATE_VERSION
                or bytes(row["pool_id"]) != self._identity):
            return None
        which = int(row["base_which"]) & 1
        base = EventCursor(int(row["base_seq"][which]), int(row["base_pos"][which]))
        return base, max(int(row["next_seq"]), base.seq)

    def set_base(self, cursor: EventCursor) -> None:
        """Saves ``cursor`` (where a read starts; nothing before it is unsent)."""
        row = self.row
        if int(row["magic"]) != _STATE_MAGIC:
            row["magic"] = 0
            row["version"] = PUBLISHER_STATE_VERSION
            row["pool_id"] = self._identity
            row["published"] = 0
            row["lost"] = 0
            row["base_which"] = 0
            row["base_seq"][0] = cursor.seq
            row["base_pos"][0] = cursor.pos
            row["next_seq"] = cursor.seq
            write_owner(self._map, L.PUBLISHER_OWNER_OFFSET,
                        owner_record(self._pool_name, creator=False))
            row["magic"] = _STATE_MAGIC
        row["pid"] = os.getpid()
        other = 1 - (int(row["base_which"]) & 1)
        row["base_seq"][other] = cursor.seq
        row["base_pos"][other] = cursor.pos
        row["base_which"] = other
        if int(row["next_seq"]) < cursor.seq:
            row["next_seq"] = cursor.seq

    def sent(self, seq: int) -> None:
        """Batch ``seq`` went out."""
        words = self._words
        words[_W_NEXT_SEQ] = seq + 1
        words[_W_PUBLISHED] += 1

    def add_lost(self, n: int) -> None:
        self.row["lost"] += n

    def close(self) -> None:
        del self.row
        self._words.release()
        self._map.close()
        os.close(self._fd)  # drops the flock


class _ReplayJob:
    """One replay request being answered: its peer, its frames still to send (lazily
    produced), the one that found the peer's queue full, and when it last sent one."""

    __slots__ = ("peer", "frames", "held", "progress_at")

    def __init__(self, peer: bytes, frames, now: float) -> None:
        self.peer = peer
        self.frames = frames
        self.held: tuple | None = None
        self.progress_at = now


class KVEventPublisher:
    """Publishes a pool's global event log over ZMQ, in vLLM's wire format.

    Args:
        pool: a pool name (the publisher attaches its own handle, label
            ``shmkv-publish``), or an attached ``BlockPool`` that only this publisher uses.
        endpoint: the PUB address, e.g. ``tcp://127.0.0.1:5557``; port 0 picks a free port
            (see ``.endpoint``).
        replay_endpoint: the ROUTER address for replay requests, or None for none.
        topic: the first frame of every message.
        bind: bind the PUB socket (default) or connect it (to a relay that binds).
        int_hashes: None publishes hashes as the log holds them (vLLM's default is
            integers, per ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` in the writing process);
            True turns 32-byte hashes into their 64-bit integer form (the low 64 bits,
            big-endian), as vLLM does.
        rank_from: ``"slot"`` (the writing process's process-table slot), ``"label"`` (the
            trailing integer of its label, e.g. ``scheduler-3`` -> 3, else the slot), or a
            function ``(slot, label) -> int``.
        start: where a publisher with no saved position starts: ``"oldest"`` (every event
            still in the log) or ``"end"`` (only new ones). A saved position always wins,
            unless ``resume=False``.
        buffer_steps: recent batches kept in memory for fast replays (older ones are read
            back from the log).
        hwm: the PUB socket's high-water mark.
        max_batch_events: events copied out of the log per hold of the pool lock (they
            are decoded, if at all, after it is released).
        allow_remote: bind a non-loopback address. The sockets have no authentication:
            by default only loopback (127.0.0.0/8, ::1, localhost), ipc:// and inproc://
            are bound, anything else is a PublisherError. Expose it behind a firewall that
            admits only the indexers, or through a relay that uses ZMQ CURVE.

    NOTE on replays: whoever can connect to the replay socket must not be able to grow the
    publisher's memory nor hold the pool lock for long. So a request becomes a *replay job*
    whose frames are produced lazily (a replay reads the log ``max_batch_events`` events per
    hold of the lock, as far as its peer reads), sent without blocking to a ROUTER socket
    with ``ROUTER_MANDATORY`` and a high-water mark of ``REPLAY_SNDHWM`` frames per peer: a
    peer that reads nothing stalls its job there, not in memory. At most
    ``MAX_REPLAY_JOBS`` jobs run at once (``MAX_WAITING_REPLAYS`` wait, one peer's one at a
    time); a job whose peer read nothing for ``REPLAY_STALL_S`` is dropped and that peer is
    not answered again. Snapshots are shared: one computed less than ``SNAPSHOT_REUSE_S``
    ago, or with no event logged since, answers the next request (the same bytes, sent
    without a copy). What a reader that reads nothing costs is thus at most
    ``REPLAY_SNDHWM`` small frames and the shared snapshots. Restricting who may connect is
    the operator's: see docs/events.md.

    Use it from one thread: ``poll()`` in a loop of your own, ``run()`` until ``stop()``,
    or ``start()`` for a background thread. ``close()`` saves nothing more; the position
    is saved after every send.
    """

    def __init__(
        self,
        pool: BlockPool | str,
        endpoint: str = "tcp://127.0.0.1:5557",
        replay_endpoint: str | None = None,
        topic: str = "",
        *,
        bind: bool = True,
        int_hashes: bool | None = None,
        rank_from: str | Callable[[int, str], int] = "slot",
        start: str = "oldest",
        resume: bool = True,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_batch_events: int = 16,
        allow_remote: bool = False,
    ) -> None:
        zmq = require_zmq()
        if start not in ("oldest", "end"):
            raise UsageError(f"start must be 'oldest' or 'end', got {start!r}")
        if not callable(rank_from) and rank_from not in ("slot", "label"):
            raise UsageError(f"rank_from must be 'slot', 'label' or a function, got "
                             f"{rank_from!r}")
        if buffer_steps < 0 or max_batch_events < 1:
            raise UsageError("buffer_steps must be >= 0 and max_batch_events >= 1")
        self._state: _PublisherState | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._ctx = None
        self._pub = self._replay = None
        self._owns_pool = isinstance(pool, str)
        self.pool = None
        self._read_labels = False
        if bind and not allow_remote:
            for what, addr in (("endpoint", endpoint), ("replay_endpoint", replay_endpoint)):
                if (addr is not None and addr.startswith(_NETWORK_TRANSPORTS)
                        and not is_loopback_endpoint(addr)):
                    raise PublisherError(
                        f"{what} {addr!r} is not a loopback address: the publisher has no "
                        "authentication, so it binds loopback only unless allow_remote=True "
                        "(CLI: --allow-remote). To expose it, put it behind a firewall that "
                        "admits only the indexers, or use ZMQ CURVE on a relay "
                        "(docs/cluster-index.md)"
                    )
        self.pool = BlockPool.attach(pool, label="shmkv-publish") if self._owns_pool else pool
        try:
            if not self.pool.event_log.capacity:
                raise PublisherError(
                    f"pool {self.pool.pool_name} has no event log (it was created without "
                    "enable_kv_cache_events); there is nothing to publish"
                )
            self._state = _PublisherState(self.pool)
            self.topic = topic
            self._topic = topic.encode("utf-8")
            self.int_hashes = int_hashes
            self._rank_from = rank_from
            self._labels: dict[int, str] = {}
            self._read_labels = rank_from != "slot"
            self._refresh_labels()
            self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps or None)
            self._keep_buffer = buffer_steps > 0
            self._max_batch = max_batch_events
            self.published = 0
            self.lost = 0
            self.replays = 0
            self.replays_dropped = 0  # requests not answered (a full queue, a stalled peer)
            self._jobs: list[_ReplayJob] = []
            self._waiting: deque[tuple[bytes, list[bytes]]] = deque()
            self._stalled_peers: dict[bytes, None] = {}  # oldest first, bounded
            self._snap: tuple[float, int, bytes] | None = None  # (when, seq, payload)
            self._cursor = self._initial_cursor(start, resume)
            self._ctx = zmq.Context.instance()
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.set_hwm(hwm)
            try:
                if bind:
                    self._pub.bind(endpoint)
                    self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
                else:
                    self._pub.connect(endpoint)
                    self.endpoint = endpoint
            except zmq.ZMQError as exc:
                raise PublisherError(f"cannot {'bind' if bind else 'connect'} the PUB socket "
                                     f"to {endpoint!r}: {exc}") from exc
            self.replay_endpoint = None
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                # Bounded per peer; a full queue is EAGAIN (not a silent drop), see the NOTE.
                self._replay.setsockopt(zmq.SNDHWM, REPLAY_SNDHWM)
                self._replay.setsockopt(zmq.RCVHWM, REPLAY_SNDHWM)
                self._replay.setsockopt(zmq.ROUTER_MANDATORY, 1)
                try:
                    self._replay.bind(replay_endpoint)
                except zmq.ZMQError as exc:
                    raise PublisherError(f"cannot bind the replay socket to "
                                         f"{replay_endpoint!r}: {exc}") from exc
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
            self._poller = zmq.Poller()
            if self._replay is not None:
                self._poller.register(self._replay, zmq.POLLIN)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ position

    def _initial_cursor(self, start: str, resume: bool) -> EventCursor:
        """Where to read from; sets ``_skip_below`` (events before it were sent already)."""
        oldest = self.pool.event_cursor(from_start=True)
        end = self.pool.event_cursor(from_start=False)
        saved = self._state.saved() if resume else None
        self._skip_below = 0
        if saved is not None and saved[1] <= end.seq:
            base, next_seq = saved
            if next_seq < oldest.seq:
                lost = oldest.seq - next_seq
                logger.warning("pool %s: %d events were overwritten in the log while no "
                               "publisher ran; resuming at seq %d", self.pool.pool_name,
                               lost, oldest.seq)
                self.lost += lost
                self._state.add_lost(lost)
                cursor = oldest
            else:
                cursor = base if base.seq >= oldest.seq else oldest
                self._skip_below = next_seq
        else:
            if saved is not None:
                logger.warning("pool %s: the saved publisher position (seq %d) is past the "
                               "log's end (seq %d): the pool was recreated; starting afresh",
                               self.pool.pool_name, saved[1], end.seq)
            cursor = oldest if start == "oldest" else end
        self._state.set_base(cursor)
        return cursor

    @property
    def next_seq(self) -> int:
        """The sequence number of the next batch this publisher will send."""
        return int(self._state.row["next_seq"])

    # ------------------------------------------------------------------ encoding

    def _refresh_labels(self) -> None:
        """Remembers the label of every attached process. Called at every poll, so a
        scheduler's label is known from its attach on, and kept after it closes (its last
        events may be read after that), until another process takes its slot."""
        if self._read_labels:
            self._labels.update(self.pool.process_table.labels())

    def _rank(self, slot: int) -> int:
        if self._rank_from == "slot":
            return slot
        label = self._labels.get(slot, "")
        if self._rank_from == "label":
            return rank_from_label(label, slot)
        return int(self._rank_from(slot, label))

    def _external(self, event: Any) -> Any:
        if not self.int_hashes or not isinstance(event, (BlockStored, BlockRemoved)):
            return event
        hashes = [external_block_hash(h, True) if isinstance(h, bytes) else h
                  for h in event.block_hashes]
        if isinstance(event, BlockStored):
            parent = event.parent_block_hash
            if isinstance(parent, bytes):
                parent = external_block_hash(parent, True)
            return msgspec.structs.replace(event, block_hashes=hashes,
                                           parent_block_hash=parent)
        return msgspec.structs.replace(event, block_hashes=hashes)

    def encode(self, logged: LoggedEvent) -> bytes:
        """The payload of the batch that carries one logged event."""
        batch = KVEventBatch(ts=logged.ts, events=[self._external(logged.event)],
                             data_parallel_rank=self._rank(logged.slot))
        return encode_batch(batch)

    def _payload(self, slot: int, ts: float, body: bytes) -> bytes:
        """``encode`` from the event's bytes in the log: they are spliced into the batch
        as they are (the log holds them in the wire format), decoded only to turn hashes
        into integers."""
        event: Any = msgspec.Raw(body)
        if self.int_hashes:
            event = self._external(decode_event(body))
        return encode_batch(KVEventBatch(ts=ts, events=[event],
                                         data_parallel_rank=self._rank(slot)))

    def _read(self, cursor: EventCursor) -> tuple[list, int]:
        """Raw records from ``cursor`` on: only copied under the pool lock."""
        with self.pool.lock():
            return self.pool.event_log.read_raw(cursor, self._max_batch)

    # ------------------------------------------------------------------ the loop

    def publish_pending(self, max_reads: int | None = None) -> int:
        """Sends the events logged since the last send (all of them, or what ``max_reads``
        reads of the log return); returns how many."""
        sent = 0
        state = self._state
        self._refresh_labels()
        reads = 0
        log = self.pool.event_log
        while max_reads is None or reads < max_reads:
            reads += 1
            before = self._cursor.seq
            if log.next_seq == before:
                # Nothing logged since (one aligned word, read without the lock): an idle
                # publisher does not take the pool lock at every turn.
                return sent
            records, lost = self._read(self._cursor)
            if lost:
                logger.warning("pool %s: publisher fell behind the event ring: %d events "
                               "lost (seq %d to %d)", self.pool.pool_name, lost, before,
                               before + lost - 1)
                self.lost += lost
                state.add_lost(lost)
            if not records:
                return sent
            for seq, slot, ts, body in records:
                if seq < self._skip_below:
                    continue  # sent by this publisher's previous run
                payload = self._payload(slot, ts, body)
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                state.sent(seq)
                if self._keep_buffer:
                    self._buffer.append((seq, payload))
                sent += 1
                self.published += 1
            state.set_base(self._cursor)
        return sent

    def poll(self, timeout_s: float = 0.005) -> int:
        """One turn: takes waiting replay requests (waiting up to ``timeout_s`` for one when
        no replay is in progress), sends some replay frames, then sends what was logged
        meanwhile. Returns the number of batches sent live. A turn sends at most 16 reads of
        the log and ``REPLAY_SENDS_PER_TURN`` replay frames, so neither starves the other."""
        sent = self.publish_pending(16)
        if self._replay is not None:
            wait_ms = 1 if self._jobs else int(timeout_s * 1000)
            if self._poller.poll(wait_ms):
                self._take_requests()
            self._advance_replays()
        elif not sent and timeout_s > 0:
            time.sleep(timeout_s)
        return sent + self.publish_pending(16)

    def _take_requests(self) -> None:
        """Queues the requests that came (a bounded number per turn)."""
        zmq = require_zmq()
        for _ in range(64):
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if frames[0] in self._stalled_peers or len(self._waiting) >= MAX_WAITING_REPLAYS:
                self.replays_dropped += 1
                continue
            self._waiting.append((frames[0], frames))

    def _start_job(self, peer: bytes, frames: list[bytes]) -> None:
        if len(frames) == 3 and frames[2] == IDENTITY_REQUEST:
            out = iter([(b"", b"", END_SEQ, pool_identity(self.pool).encode())])
        elif len(frames) == 3 and frames[2] == SNAPSHOT_REQUEST:
            seq, payload = self._shared_snapshot()
            # The frame carries seq + 1, the first event the snapshot leaves out, so that an
            # empty log's snapshot (seq -1) is not mistaken for the end marker.
            out = iter([(b"", self._topic, (seq + 1).to_bytes(8, "big"), payload),
                        (b"", b"", END_SEQ, pool_identity(self.pool).encode())])
        elif len(frames) == 3 and len(frames[2]) == 8:
            self.replays += 1
            out = self._replay_frames(int.from_bytes(frames[2], "big"))
        else:
            logger.warning("ignored a malformed replay request (%d frames)", len(frames))
            return
        self._jobs.append(_ReplayJob(peer, out, time.monotonic()))

    def _replay_frames(self, start: int):
        for seq, payload in self._replayable(start):
            yield (b"", self._topic, seq.to_bytes(8, "big"), payload)
        yield (b"", b"", END_SEQ, b"")

    def _advance_replays(self) -> None:
        """Sends replay frames, without blocking, while their peers' queues have room;
        drops the jobs of peers that stopped reading, and starts waiting ones."""
        zmq = require_zmq()
        now = time.monotonic()
        active = {job.peer for job in self._jobs}
        while self._waiting and len(self._jobs) < MAX_REPLAY_JOBS:
            # one job per peer at a time: its next request waits for the previous answer
            k = next((i for i, (peer, _) in enumerate(self._waiting) if peer not in active),
                     None)
            if k is None:
                break
            peer, frames = self._waiting[k]
            del self._waiting[k]
            active.add(peer)
            self._start_job(peer, frames)
        share = max(16, REPLAY_SENDS_PER_TURN // max(len(self._jobs), 1))
        for job in list(self._jobs):
            done = False
            budget = share
            while budget > 0:
                frames = job.held if job.held is not None else next(job.frames, None)
                if frames is None:
                    done = True
                    break
                try:
                    self._replay.send_multipart((job.peer, *frames), zmq.NOBLOCK,
                                                copy=False)
                except zmq.Again:  # its queue is full: it is not reading (yet)
                    job.held = frames
                    break
                except zmq.ZMQError:  # EHOSTUNREACH: the peer is gone
                    done = True
                    break
                job.held, job.progress_at = None, now
                budget -= 1
            if done:
                self._jobs.remove(job)
            elif job.held is not None and now - job.progress_at > REPLAY_STALL_S:
                self._jobs.remove(job)
                self.replays_dropped += 1
                self._stalled_peers[job.peer] = None
                if len(self._stalled_peers) > _MAX_STALLED_PEERS:
                    del self._stalled_peers[next(iter(self._stalled_peers))]
                before = len(self._waiting)
                self._waiting = deque(w for w in self._waiting if w[0] != job.peer)
                self.replays_dropped += before - len(self._waiting)
                logger.warning("pool %s: dropped a replay whose peer read nothing for %g s "
                               "(%d replies queued to it); its later requests are ignored",
                               self.pool.pool_name, REPLAY_STALL_S, REPLAY_SNDHWM)

    def _shared_snapshot(self) -> tuple[int, bytes]:
        """``snapshot()``, reused while no event was logged since, or for
        ``SNAPSHOT_REUSE_S`` if events after it are still in the log (a snapshot as of an
        older event is as exact: the requester replays from there)."""
        now = time.monotonic()
        log = self.pool.event_log
        if self._snap is not None:
            when, seq, payload = self._snap
            if log.next_seq == seq + 1 or (now - when < SNAPSHOT_REUSE_S
                                              and log.oldest().seq <= seq + 1):
                return seq, payload
        seq, payload = self.snapshot()
        self._snap = (now, seq, payload)
        return seq, payload

    def _replayable(self, start: int):
        """(seq, payload) of every published batch from ``start`` on: from the log up to
        the in-memory window, then from the window."""
        limit = self.next_seq  # only what was sent live (by this publisher or the last)
        first_buffered = self._buffer[0][0] if self._buffer else limit
        if start < first_buffered:
            cursor = self.pool.event_cursor(from_start=True)
            while cursor.seq < min(first_buffered, limit):
                records, _ = self._read(cursor)
                if not records:
                    break
                for seq, slot, ts, body in records:
                    if start <= seq < min(first_buffered, limit):
                        yield seq, self._payload(slot, ts, body)
        for seq, payload in list(self._buffer):
            if seq >= start:
                yield seq, payload

    def snapshot(self) -> tuple[int, bytes]:
        """``(seq, payload)``: one batch that rebuilds the pool's prefix cache as it stood
        right after log event ``seq`` (-1 if the log is empty), read in bounded holds of
        the pool lock (``BlockPool.cached_key_snapshot``: numpy copies of at most
        ``SNAPSHOT_CHUNK_BLOCKS`` rows' key fields per hold, of one state of the pool, whose
        position in the log is ``seq``); turning them into hashes and the batch happens
        after the holds. Hashes take the form ``int_hashes`` gives live batches."""
        pool = self.pool
        as_int = bool(self.int_hashes) or (self.int_hashes is None and use_int_block_hashes())
        snap = pool.cached_key_snapshot()
        seq, group_arr, hash_arr = snap.next_seq - 1, snap.group_ids, snap.hashes
        groups: dict[int, list[bytes]] = {}
        for group, block_hash in zip(group_arr.tolist(), hash_arr.tolist(), strict=True):
            groups.setdefault(group, []).append(bytes(block_hash))
        events: list[Any] = [AllBlocksCleared()]
        for group, hashes in sorted(groups.items()):
            events.append(BlockStored(
                block_hashes=[external_block_hash(h, as_int) for h in hashes],
                parent_block_hash=None, token_ids=[], block_size=pool.hash_block_size,
                lora_id=None, medium=pool.medium, lora_name=None, group_idx=group))
        return seq, encode_batch(KVEventBatch(ts=time.time(), events=events))

    def run(self) -> None:
        """Publishes until ``stop()``."""
        while not self._stop.is_set():
            self.poll()

    def start(self) -> KVEventPublisher:
        """Runs ``run()`` in a daemon thread; returns self."""
        if self._thread is None:
            self._thread = threading.Thread(target=self.run, name="shmkv-publisher",
                                            daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Ends ``run()`` (and joins the thread of ``start()``)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None

    def close(self) -> None:
        """Stops, closes the sockets, releases the publisher lock and the pool handle."""
        self.stop()
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None
        if self._state is not None:
            self._state.close()
            self._state = None
        self._read_labels = False
        if self._owns_pool and self.pool is not None:
            self.pool.close()
            self.pool = None

    def __del__(self) -> None:  # an unclosed publisher must not keep the pool's lock
        try:
            if self._thread is None:
                self.close()
        except Exception:  # noqa: BLE001  (interpreter shutdown)
            pass

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class KVEventSubscriber:
    """A consumer of a vLLM-format KV-event stream (shmkv's or vLLM's): SUB + replay.

    ``recv()`` returns ``(seq, KVEventBatch)`` in sequence order, each sequence number once:
    duplicates are dropped, and when a live batch skips ahead it first asks the replay
    socket (if given) for the missing ones. ``expected`` is the next sequence number wanted
    (None until the first batch; pass ``start_seq=0`` to replay from the beginning).
    """

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 *, start_seq: int | None = None, decoder: Callable[[bytes], Any] = decode_batch,
                 replay_timeout_s: float = 10.0) -> None:
        zmq = require_zmq()
        self._zmq = zmq
        self._ctx = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
        self._sub.connect(endpoint)
        self._replay_endpoint = replay_endpoint
        self._replay_timeout_ms = int(replay_timeout_s * 1000)
        self._decode = decoder
        self.expected = start_seq
        self._ready: deque[tuple[int, Any]] = deque()
        self.gaps_filled = 0
        self.duplicates = 0
        self.unfilled = 0

    def replay(self, start_seq: int) -> list[tuple[int, bytes]]:
        """Asks the replay socket for every batch from ``start_seq``; (seq, payload) pairs."""
        frames = self._request(start_seq.to_bytes(8, "big"))
        return [(int.from_bytes(seq_bytes, "big"), payload) for seq_bytes, payload in frames[:-1]]

    @property
    def socket(self):
        """The SUB socket, to wait on several subscribers with one ``zmq.Poller``."""
        return self._sub

    def snapshot(self) -> tuple[int, Any, str]:
        """Asks the replay socket for a snapshot of the pool's prefix cache: ``(seq, batch,
        pool identity)``, the batch rebuilding the cache as of event ``seq``. The next
        batch ``recv()`` returns is then ``seq + 1``."""
        frames = self._request(SNAPSHOT_REQUEST)
        if len(frames) != 2 or frames[1][0] != END_SEQ:
            raise PublisherError(f"{self._replay_endpoint} sent no snapshot (is it a shmkv "
                                 "publisher?)")
        seq_bytes, payload = frames[0]
        seq = int.from_bytes(seq_bytes, "big") - 1
        self.expected = seq + 1
        self._ready = deque(item for item in self._ready if item[0] > seq)
        return seq, self._decode(payload), frames[1][1].decode()

    def identity(self) -> str:
        """The identity of the pool behind the replay socket (``pool_identity``)."""
        frames = self._request(IDENTITY_REQUEST)
        if len(frames) != 1:
            raise PublisherError(f"{self._replay_endpoint} sent no identity (is it a shmkv "
                                 "publisher?)")
        return frames[0][1].decode()

    def send_identity_request(self):
        """Sends an identity request without waiting for the answer: returns the DEALER
        socket to poll (``zmq.POLLIN``), then to pass to :meth:`identity_answer` once it is
        readable; the caller closes it (``close(linger=0)``) in any case.

        Raises:
            UsageError: no replay endpoint was given.
            zmq.ZMQError: the request could not even be queued.
        """
        if self._replay_endpoint is None:
            raise UsageError("no replay endpoint was given")
        zmq = self._zmq
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(self._replay_endpoint)
            sock.send_multipart((b"", IDENTITY_REQUEST), zmq.NOBLOCK)
        except BaseException:
            sock.close(linger=0)
            raise
        return sock

    def identity_answer(self, sock) -> str:
        """The identity a readable socket of :meth:`send_identity_request` received.

        Raises:
            PublisherError: the answer is not a shmkv publisher's identity frame.
        """
        frames = sock.recv_multipart(self._zmq.NOBLOCK)
        if len(frames) != 4 or frames[2] != END_SEQ:
            raise PublisherError(f"{self._replay_endpoint} sent no identity (is it a shmkv "
                                 "publisher?)")
        return frames[3].decode()

    def _request(self, request: bytes) -> list[tuple[bytes, bytes]]:
        """Sends one request to the replay socket; its (seq bytes, payload) frames up to
        and including the end marker."""
        if self._replay_endpoint is None:
            raise UsageError("no replay endpoint was given")
        zmq = self._zmq
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self._replay_endpoint)
        try:
            sock.send_multipart((b"", request))
            out = []
            while True:
                if not sock.poll(self._replay_timeout_ms):
                    raise TimeoutError(f"replay from {self._replay_endpoint}: no answer "
                                       f"within {self._replay_timeout_ms} ms")
                _, _, seq_bytes, payload = sock.recv_multipart()
                out.append((seq_bytes, payload))
                if seq_bytes == END_SEQ:
                    return out
        finally:
            sock.close(linger=0)

    def _accept(self, seq: int, payload: bytes) -> None:
        if self.expected is not None and seq < self.expected:
            self.duplicates += 1
            return
        if self.expected is not None and seq > self.expected:
            if self._replay_endpoint is not None:
                for rseq, rpayload in self.replay(self.expected):
                    if self.expected <= rseq < seq:
                        if rseq > self.expected:
                            self.unfilled += rseq - self.expected
                        self._ready.append((rseq, self._decode(rpayload)))
                        self.expected = rseq + 1
                        self.gaps_filled += 1
            if seq > self.expected:
                self.unfilled += seq - self.expected
        self._ready.append((seq, self._decode(payload)))
        self.expected = seq + 1

    def recv(self, timeout_s: float = 5.0) -> tuple[int, Any] | None:
        """The next batch in order, or None if nothing came within ``timeout_s``."""
        if self._ready:
            return self._ready.popleft()
        deadline = time.monotonic() + timeout_s
        while not self._ready:
            left = deadline - time.monotonic()
            if left <= 0 or not self._sub.poll(max(int(left * 1000), 1)):
                return None
            _, seq_bytes, payload = self._sub.recv_multipart()
            self._accept(int.from_bytes(seq_bytes, "big"), payload)
        return self._ready.popleft()

    def close(self) -> None:
        self._sub.close(linger=0)

    def __enter__(self) -> KVEventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
