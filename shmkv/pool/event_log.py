"""The pool's global KV-event log: every process's events, in lock order, with sequence
numbers, in a byte ring inside the segment.

Each record is ``[u32 payload bytes][u32 slot][u64 seq][f64 ts][msgpack event][pad to 8]``.
Positions are monotonic 64-bit byte counts; a record lives at ``pos % capacity`` and never
straddles the end of the ring: a record that would is preceded by a pad record (payload
length ``PAD``) that fills the ring to its end. Before a record is written over old ones,
the oldest-record pointers in the header move past them, so ``[log_oldest_pos,
log_write_pos)`` always holds whole, intact records with consecutive sequence numbers
starting at ``log_oldest_seq``.

Writers append under the pool lock, journaling (``shmkv/pool/journal.py``) the ring bytes and
header words they overwrite, so a writer killed half way is rolled back whole. Readers keep
a private cursor ``(seq, pos)`` and copy records out under the lock; a reader that fell
more than a ring behind is told how many events it lost and continues from the oldest
record still there.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass
from typing import Union

import msgspec

from shmkv.events import AllBlocksCleared, BlockRemoved, BlockStored
from shmkv.pool import layout as L
from shmkv.pool.journal import Journal, JournaledView

_RECORD = struct.Struct("<IIQd")
PAD = 0xFFFF_FFFF
_ALIGN = 8

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(
    Union[BlockStored, BlockRemoved, AllBlocksCleared]  # noqa: UP007 (a runtime union)
)


def decode_event(body: bytes) -> BlockStored | BlockRemoved | AllBlocksCleared:
    """An event from its bytes in the log (``EventLog.read_raw``)."""
    return _decoder.decode(body)


@dataclass(frozen=True)
class LoggedEvent:
    """One event of the global log."""

    seq: int
    slot: int  # process-table slot of the process that caused it
    ts: float
    event: BlockStored | BlockRemoved | AllBlocksCleared


@dataclass
class EventCursor:
    """A reader's position in the log: the next sequence number and its byte position."""

    seq: int
    pos: int


class EventLog:
    """Appends to and reads from the event ring of a pool segment (callers hold the lock).

    ``BlockPool.event_log`` is this object; its read side (``capacity``, ``next_seq``,
    ``oldest``, ``end``, ``read``, ``read_raw``) is what the publisher, the metrics and the
    CLI use, under ``pool.lock()``.

    Args:
        mem: the segment's mmap.
        hdr64: flat int64 memoryview of the header.
        layout: the pool's layout.
        journal: the pool's undo journal.
    """

    def __init__(self, mem, hdr64, layout: L.Layout, journal: Journal) -> None:
        self._mem = mem
        self._hdr = hdr64
        self._hdr_w = JournaledView(hdr64, journal, 0, 8)
        self._save_bytes = journal.save_bytes
        self._base = layout.offsets["event_log"]
        self.capacity = layout.config.event_log_bytes  # bytes of the ring; 0: no log

    @property
    def next_seq(self) -> int:
        """The sequence number the next event logged will get."""
        return self._hdr[L.H_NEXT_EVENT_SEQ]

    def oldest(self) -> EventCursor:
        """A cursor at the oldest event still in the ring."""
        return EventCursor(self._hdr[L.H_LOG_OLDEST_SEQ], self._hdr[L.H_LOG_OLDEST_POS])

    def end(self) -> EventCursor:
        """A cursor past the newest event: it reads only what is logged from now on."""
        return EventCursor(self._hdr[L.H_NEXT_EVENT_SEQ], self._hdr[L.H_LOG_WRITE_POS])

    def append(self, slot: int, events: list) -> int:
        """Appends events; returns how many did not fit (larger than a quarter of the ring)."""
        if not self.capacity:
            return len(events)
        dropped = 0
        ts = time.time()
        for event in events:
            payload = _encoder.encode(event)
            need = _RECORD.size + len(payload)
            need += -need % _ALIGN
            if need > self.capacity // 4:
                dropped += 1
                continue
            self._append_record(slot, ts, payload, need)
        return dropped

    def _append_record(self, slot: int, ts: float, payload: bytes, need: int) -> None:
        hdr, cap = self._hdr_w, self.capacity
        pos = hdr[L.H_LOG_WRITE_POS]
        phys = pos % cap
        if phys + need > cap:  # pad to the end of the ring, start again at 0
            self._make_room(pos, cap - phys)
            self._save_bytes(self._base + phys, _RECORD.size)
            _RECORD.pack_into(self._mem, self._base + phys, PAD, 0, 0, 0.0)
            pos += cap - phys
            phys = 0
            hdr[L.H_LOG_WRITE_POS] = pos
        self._make_room(pos, need)
        seq = hdr[L.H_NEXT_EVENT_SEQ]
        start = self._base + phys
        self._save_bytes(start, need)
        _RECORD.pack_into(self._mem, start, len(payload), slot, seq, ts)
        self._mem[start + _RECORD.size:start + _RECORD.size + len(payload)] = payload
        hdr[L.H_NEXT_EVENT_SEQ] = seq + 1
        hdr[L.H_LOG_WRITE_POS] = pos + need

    def _make_room(self, pos: int, need: int) -> None:
        """Moves the oldest-record pointers past every record that [pos, pos + need)
        would overwrite."""
        hdr, cap = self._hdr_w, self.capacity
        oldest = hdr[L.H_LOG_OLDEST_POS]
        seq = hdr[L.H_LOG_OLDEST_SEQ]
        while oldest < pos and oldest < pos + need - cap:
            length, _, _, _ = _RECORD.unpack_from(self._mem, self._base + oldest % cap)
            if length == PAD:
                oldest += cap - oldest % cap
            else:
                size = _RECORD.size + length
                oldest += size + (-size % _ALIGN)
                seq += 1
        hdr[L.H_LOG_OLDEST_POS] = oldest
        hdr[L.H_LOG_OLDEST_SEQ] = seq

    def read(self, cursor: EventCursor,
             max_events: int | None = None) -> tuple[list[LoggedEvent], int]:
        """Events from ``cursor`` on, decoded (advancing it).

        Args:
            cursor: where to read from; moved past what is returned.
            max_events: at most this many (None: all there are).

        Returns:
            (events, lost): ``lost`` counts events overwritten before this reader got them
            (it fell more than a ring behind).
        """
        records, lost = self.read_raw(cursor, max_events)
        return [LoggedEvent(seq, slot, ts, _decoder.decode(body))
                for seq, slot, ts, body in records], lost

    def read_raw(self, cursor: EventCursor, max_events: int | None = None
                 ) -> tuple[list[tuple[int, int, float, bytes]], int]:
        """As :meth:`read`, without decoding: ``(seq, slot, ts, msgpack bytes of the
        event)`` records. Copying is all a reader then does under the lock; it decodes
        (``decode_event``) after releasing it.

        Returns:
            (records, lost), as :meth:`read`.
        """
        hdr, cap = self._hdr, self.capacity
        lost = 0
        oldest_seq = hdr[L.H_LOG_OLDEST_SEQ]
        if cursor.seq < oldest_seq:
            lost = oldest_seq - cursor.seq
            cursor.seq, cursor.pos = oldest_seq, hdr[L.H_LOG_OLDEST_POS]
        end = hdr[L.H_LOG_WRITE_POS]
        out: list[tuple[int, int, float, bytes]] = []
        while cursor.pos < end and (max_events is None or len(out) < max_events):
            start = self._base + cursor.pos % cap
            length, slot, seq, ts = _RECORD.unpack_from(self._mem, start)
            if length == PAD:
                cursor.pos += cap - cursor.pos % cap
                continue
            out.append((seq, slot, ts,
                        self._mem[start + _RECORD.size:start + _RECORD.size + length]))
            size = _RECORD.size + length
            cursor.pos += size + (-size % _ALIGN)
            cursor.seq = seq + 1
        return out, lost

    def reset(self) -> None:
        """Empties the log (a new pool). Sequence numbers continue where they were."""
        hdr = self._hdr
        hdr[L.H_LOG_WRITE_POS] = 0
        hdr[L.H_LOG_OLDEST_POS] = 0
        hdr[L.H_LOG_OLDEST_SEQ] = hdr[L.H_NEXT_EVENT_SEQ]
