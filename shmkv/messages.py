"""Messages between shmkv's processes, and the node-local channel that carries them.

Every message is a tagged ``msgspec.Struct`` deriving from :class:`Message`; its tag (the
``"type"`` field on the wire) is its class name. A frame on the wire is the msgpack array
``[PROTOCOL_VERSION, message]``, so a receiver built from another protocol version refuses
the frame by name instead of misreading it. :func:`encode` and :func:`decode` are the only
way in and out; :func:`decode` raises :class:`~shmkv.errors.ProtocolError` for bytes that
are not a frame, a frame of another version, or an unknown tag, and never anything else.

Message types register themselves with :func:`message` so that modules built on top (the
serving runner's front-end and control messages) add theirs without editing this file.
This module defines the scheduler <-> rank step protocol of DESIGN section 7:
:class:`ExecuteModel` (a scheduler's step, whose block ids travel in the shared block
tables, never in the message) answered by :class:`ModelOutput`, and :class:`Shutdown`.

Transport: :class:`Channel`, a single-producer single-consumer byte ring in POSIX shared
memory with a semaphore as its doorbell (layout in ``shmkv/pool/layout.py``, "Sibling
segments"). It is used rather than ``posix_ipc.MessageQueue`` because the kernel's queue
limits (``/proc/sys/fs/mqueue``: 10 messages of 8 KiB, and 800 KiB per user) are too small
for a front end, several schedulers and their ranks, and because a ring carries prompts of
any length up to its capacity. Several channels may share one doorbell, so a consumer waits
on all of them at once (:func:`recv_any`). ``benchmarks/bench_transport.py`` measures it
against a MessageQueue.

Crash behaviour: a producer killed half way through a frame never published it (``tail``
moves only after the bytes are in); a dead consumer leaves the ring full, and the
producer's ``send`` times out with :class:`ChannelFullError` naming the consumer's pid.
Ordering relies on the stores of one process becoming visible in program order (x86-64).
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from typing import ClassVar, Union

import msgspec
import numpy as np
import posix_ipc

from shmkv.errors import (
    LayoutMismatchError,
    ProtocolError,
    SegmentError,
    SegmentExistsError,
    SegmentNotFoundError,
    ShmKVError,
    UsageError,
)
from shmkv.pool import layout as L
from shmkv.pool.barriers import fence as _fence
from shmkv.pool.liveness import pid_alive
from shmkv.pool.segment import (
    NO_SPACE_ERRNOS,
    check_path,
    create_shm,
    no_space,
    open_shm,
    semaphore_path,
)
from shmkv.pool.siblings import owner_record, write_owner

logger = logging.getLogger("shmkv.messages")

PROTOCOL_VERSION = 1
CHANNEL_MODE = 0o600
DEFAULT_CAPACITY_BYTES = 1 << 20
MIN_CAPACITY_BYTES = 4096
MAX_CAPACITY_BYTES = 1 << 31
_FRAME_LEN_BYTES = 4
_SEND_POLL_S = 0.0005
_RECV_SPINS = 64


class ChannelFullError(ShmKVError):
    """``send`` found no room in the ring before its timeout (is the consumer alive?)."""


class Message(msgspec.Struct, tag=True, tag_field="type", kw_only=True):
    """Base of every message; the wire tag is the class name."""

    TYPES: ClassVar[dict[str, type]] = {}


_decoder: msgspec.msgpack.Decoder | None = None
_frame_decoder = msgspec.msgpack.Decoder(tuple[int, msgspec.Raw])
_encoder = msgspec.msgpack.Encoder()


def message(cls: type) -> type:
    """Class decorator: registers a :class:`Message` subclass for :func:`decode`."""
    global _decoder
    if not (isinstance(cls, type) and issubclass(cls, Message)) or cls is Message:
        raise UsageError(f"{cls!r} is not a subclass of shmkv.messages.Message")
    known = Message.TYPES.get(cls.__name__)
    if known is not None and known is not cls:
        raise UsageError(f"message type {cls.__name__!r} is registered twice")
    Message.TYPES[cls.__name__] = cls
    _decoder = None  # rebuilt with the new union on the next decode
    return cls


def encode(msg: Message) -> bytes:
    """The frame bytes of a registered message."""
    if type(msg).__name__ not in Message.TYPES:
        raise UsageError(
            f"{type(msg).__name__} is not a registered message type (decorate it with "
            "@shmkv.messages.message)"
        )
    return _encoder.encode((PROTOCOL_VERSION, msg))


def decode(data: bytes | memoryview) -> Message:
    """The message of a frame.

    Raises:
        ProtocolError: not a frame, another protocol version, an unknown message type or
            fields that do not match it; the message says which.
    """
    global _decoder
    if _decoder is None:
        _decoder = msgspec.msgpack.Decoder(
            tuple[int, Union[tuple(Message.TYPES.values())]]  # noqa: UP007
        )
    try:
        version, msg = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise _explain(data, exc) from None
    if version != PROTOCOL_VERSION:
        raise _explain(data, None)
    return msg


def _explain(data: bytes | memoryview, exc: Exception | None) -> ProtocolError:
    """The error for a frame the one-pass decode refused (the rare path: decode again)."""
    try:
        version, raw = _frame_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as frame_exc:
        return ProtocolError(f"not a shmkv message frame ({len(data)} bytes): {frame_exc}")
    if version != PROTOCOL_VERSION:
        return ProtocolError(
            f"message frame of protocol version {version}, expected {PROTOCOL_VERSION} "
            "(sender and receiver run different shmkv versions)"
        )
    if isinstance(exc, msgspec.ValidationError):
        return ProtocolError(
            f"bad message ({exc}); known types: {', '.join(sorted(Message.TYPES))}"
        )
    return ProtocolError(f"undecodable message body: {exc}")


# ----------------------------------------------------------- scheduler <-> rank steps


class ScheduledRequest(msgspec.Struct, array_like=True, gc=False):
    """One request of a step: its row in the scheduler's block tables, the tokens to run
    (new prompt tokens, or the last sampled token when decoding) and the position of the
    first of them."""

    req_id: str
    row: int
    token_ids: list[int]
    start_position: int


@message
class ExecuteModel(Message):
    """A scheduler's step for its rank; the block tables of ``step`` are in shared memory."""

    step: int
    requests: list[ScheduledRequest]


@message
class ModelOutput(Message):
    """The rank's answer to ``ExecuteModel``: one greedy token per request, in order;
    ``error`` is non-empty (and ``sampled_token_ids`` empty) if the step failed."""

    step: int
    sampled_token_ids: list[int]
    error: str = ""


@message
class Shutdown(Message):
    """Asks the receiver to finish and exit."""

    reason: str = ""


# ------------------------------------------------------------------------ transport


def channel_segment_name(name: str) -> str:
    """The POSIX shared-memory name of a channel (also the stem of its doorbell)."""
    return L.sibling_segment_name("ch", name, L.CHANNEL_LAYOUT_VERSION)


def _doorbell_name(name: str) -> str:
    return f"/shmkv_bell-{L.validate_pool_name(name)}"


def _pad8(n: int) -> int:
    return (n + 7) & ~7


class Channel:
    """One direction of a conversation: exactly one process sends, one receives.

    ``Channel.create`` makes the ring (and its doorbell, unless it is given the name of a
    shared one made by :func:`create_doorbell`); ``Channel.open`` maps an existing one.
    """

    def __init__(self, name: str, mapping: mmap.mmap) -> None:
        self.name = name
        self._map: mmap.mmap | None = mapping
        self._hdr = np.ndarray((1,), L.CHANNEL_HEADER_DTYPE, buffer=mapping)
        self._head = np.ndarray((1,), "<u8", buffer=mapping, offset=_field("head"))
        self._tail = np.ndarray((1,), "<u8", buffer=mapping, offset=_field("tail"))
        self._pids = np.ndarray((2,), "<i4", buffer=mapping, offset=_field("producer_pid"))
        self._pid = os.getpid()
        # Corrupt frame headers this consumer skipped, and the bytes skipped with them.
        self.corrupt_frames = 0
        self.corrupt_bytes_skipped = 0
        self.capacity_bytes = int(self._hdr[0]["capacity_bytes"])
        self._data = memoryview(mapping)[L.CHANNEL_HEADER_DTYPE.itemsize:]
        try:
            bell = _checked_doorbell(bytes(self._hdr[0]["doorbell"]))
        except SegmentError:
            self._release()
            raise
        self.doorbell_name = bell
        try:
            self._bell = posix_ipc.Semaphore(bell)
        except posix_ipc.ExistentialError:
            self._release()
            raise SegmentNotFoundError(
                f"channel {name}: its doorbell semaphore {bell} is gone"
            ) from None

    # -- lifecycle

    @classmethod
    def create(cls, name: str, capacity_bytes: int = DEFAULT_CAPACITY_BYTES,
               doorbell: str | None = None, pool: str | None = None) -> Channel:
        """Makes a new, empty channel.

        Args:
            name: a pool-style name (letters, digits, ``._-``).
            capacity_bytes: ring size; the largest frame is half of it.
            doorbell: the name returned by :func:`create_doorbell`, to share one doorbell
                with other channels; None makes the channel's own.
            pool: the pool the channel serves, recorded with this process as its owner
                (``shmkv cleanup`` keeps it, and its doorbell, while either lives).

        Raises:
            UsageError: a bad name or capacity. SegmentExistsError: the name is taken.
            NoSpaceError: /dev/shm has no room for it (nothing is left behind).
        """
        if not isinstance(capacity_bytes, int) or isinstance(capacity_bytes, bool) or not (
            MIN_CAPACITY_BYTES <= capacity_bytes <= MAX_CAPACITY_BYTES
        ) or capacity_bytes % 8:
            raise UsageError(
                f"capacity_bytes must be a multiple of 8 in {MIN_CAPACITY_BYTES}.."
                f"{MAX_CAPACITY_BYTES}, got {capacity_bytes!r}"
            )
        shm_name = channel_segment_name(name)
        owner = owner_record(pool)
        own_bell = doorbell is None
        bell = create_doorbell(name) if own_bell else doorbell
        if len(bell.encode()) > L.MAX_DOORBELL_NAME_BYTES:
            raise UsageError(
                f"doorbell name {bell!r} is longer than {L.MAX_DOORBELL_NAME_BYTES} bytes"
            )
        size = L.CHANNEL_HEADER_DTYPE.itemsize + capacity_bytes
        try:
            shm = create_shm(shm_name, size, "channel")  # its pages reserved, mode 0600
        except posix_ipc.ExistentialError:
            if own_bell:
                unlink_doorbell(bell)
            raise SegmentExistsError(f"channel segment {shm_name} already exists") from None
        except BaseException:  # NoSpaceError: the segment is gone already, so is its bell
            if own_bell:
                unlink_doorbell(bell)
            raise
        try:
            mapping = mmap.mmap(shm.fd, size)
        finally:
            shm.close_fd()
        hdr = np.ndarray((1,), L.CHANNEL_HEADER_DTYPE, buffer=mapping)
        hdr[0]["capacity_bytes"] = capacity_bytes
        hdr[0]["version"] = L.CHANNEL_LAYOUT_VERSION
        hdr[0]["doorbell"] = bell.encode()
        write_owner(mapping, L.CHANNEL_OWNER_OFFSET, owner)
        hdr[0]["magic"] = L.CHANNEL_MAGIC  # last: a half-made channel fails open()
        del hdr
        return cls(name, mapping)

    @classmethod
    def open(cls, name: str) -> Channel:
        """Maps an existing channel, validating its header.

        Raises:
            SegmentNotFoundError: no such channel. LayoutMismatchError: naming the field.
        """
        shm_name = channel_segment_name(name)
        try:
            shm = open_shm(shm_name, "channel")  # this user's, mode 0600, else refused
        except posix_ipc.ExistentialError:
            raise SegmentNotFoundError(f"no channel named {name!r} ({shm_name})") from None
        try:
            size = shm.size
            if size < L.CHANNEL_HEADER_DTYPE.itemsize:
                raise LayoutMismatchError(f"channel {shm_name} is {size} bytes: too small")
            mapping = mmap.mmap(shm.fd, size)
        finally:
            shm.close_fd()
        hdr = np.ndarray((1,), L.CHANNEL_HEADER_DTYPE, buffer=mapping)[0].copy()
        problem = None
        if int(hdr["magic"]) != L.CHANNEL_MAGIC:
            problem = f"magic is {int(hdr['magic']):#x}, expected {L.CHANNEL_MAGIC:#x}"
        elif int(hdr["version"]) != L.CHANNEL_LAYOUT_VERSION:
            problem = f"version is {int(hdr['version'])}, expected {L.CHANNEL_LAYOUT_VERSION}"
        elif int(hdr["capacity_bytes"]) + L.CHANNEL_HEADER_DTYPE.itemsize != size:
            problem = (f"capacity_bytes is {int(hdr['capacity_bytes'])}, but the segment "
                       f"holds {size - L.CHANNEL_HEADER_DTYPE.itemsize}")
        if problem:
            mapping.close()
            raise LayoutMismatchError(f"channel {shm_name}: header field {problem}")
        return cls(name, mapping)

    @staticmethod
    def unlink(name: str) -> bool:
        """Removes a channel's segment and its own doorbell (not a shared one). False if it
        did not exist."""
        shm_name = channel_segment_name(name)
        unlink_doorbell(_doorbell_name(name))
        try:
            posix_ipc.unlink_shared_memory(shm_name)
        except posix_ipc.ExistentialError:
            return False
        return True

    def _release(self) -> None:
        self._hdr = self._head = self._tail = self._pids = None
        if self._data is not None:
            self._data.release()
            self._data = None
        if self._map is not None:
            self._map.close()
            self._map = None

    def close(self) -> None:
        """Unmaps the channel (it stays until ``unlink``)."""
        if self._map is None:
            return
        self._bell.close()
        self._release()

    def __enter__(self) -> Channel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._map is None:
            raise UsageError(f"channel {self.name!r} is closed")

    # -- producer side

    def send(self, msg: Message, timeout_s: float | None = 10.0) -> None:
        """Appends one message; waits up to ``timeout_s`` (None: forever) for room.

        Raises:
            UsageError: the message is not registered, or its frame is bigger than half
                the ring; nothing was written. ChannelFullError: no room in time.
        """
        self.send_bytes(encode(msg), timeout_s)

    def send_bytes(self, payload: bytes, timeout_s: float | None = 10.0) -> None:
        """Appends one frame of raw bytes (``send`` without the encoding)."""
        self._check_open()
        cap = self.capacity_bytes
        frame = _pad8(_FRAME_LEN_BYTES + len(payload))
        if frame > cap // 2:
            raise UsageError(
                f"message of {len(payload)} bytes is too big for channel {self.name!r} "
                f"(at most {cap // 2 - _FRAME_LEN_BYTES} bytes; create it with a larger "
                "capacity_bytes)"
            )
        tail = int(self._tail[0])
        pos = tail % cap
        skip = cap - pos if pos + frame > cap else 0
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while tail + skip + frame - int(self._head[0]) > cap:
            if deadline is not None and time.monotonic() >= deadline:
                pid = int(self._pids[1])
                raise ChannelFullError(
                    f"channel {self.name!r} stayed full for {timeout_s} s "
                    f"({tail - int(self._head[0])} of {cap} bytes unread); its consumer "
                    f"(pid {pid}) is {'alive' if pid_alive(pid) else 'gone'}"
                )
            time.sleep(_SEND_POLL_S)
        _fence()  # the consumer's head (its reads done) before our stores over that space
        data = self._data
        if skip:
            data[pos:pos + 4] = L.CHANNEL_WRAP.to_bytes(4, "little")
            pos = 0
        data[pos:pos + 4] = len(payload).to_bytes(4, "little")
        data[pos + 4:pos + 4 + len(payload)] = payload
        self._pids[0] = self._pid
        _fence()  # the frame's bytes before the tail that publishes them
        self._tail[0] = tail + skip + frame  # publishes the frame
        self._bell.release()

    # -- consumer side

    def poll_bytes(self) -> bytes | None:
        """The next frame's bytes, or None if the ring is empty; never waits.

        A corrupt frame header (a length over half the ring, or a frame that runs past what
        the producer published) never wedges the channel: its length cannot be trusted, so
        the next frame boundary is unknown, and everything unread up to the producer's
        `tail` (the one boundary a reader can trust) is skipped, counted in
        ``corrupt_frames`` and ``corrupt_bytes_skipped``, and logged; reading goes on with
        the frames sent after it (None is returned for this call)."""
        self._check_open()
        head = start = int(self._head[0])
        tail = int(self._tail[0])
        if head == tail:
            return None
        _fence()  # the tail before the bytes it publishes
        cap = self.capacity_bytes
        data = self._data
        pos = head % cap
        length = int.from_bytes(data[pos:pos + 4], "little")
        if length == L.CHANNEL_WRAP:
            head += cap - pos
            pos = 0
            length = int.from_bytes(data[0:4], "little")
        if (tail - start > cap or length > cap // 2
                or head + _pad8(_FRAME_LEN_BYTES + length) > tail):
            self._skip_corrupt(start, tail, length)
            return None
        payload = bytes(data[pos + 4:pos + 4 + length])
        _fence()  # our reads of the frame before the head that gives its space back
        self._pids[1] = self._pid
        self._head[0] = head + _pad8(_FRAME_LEN_BYTES + length)
        return payload

    def _skip_corrupt(self, head: int, tail: int, length: int) -> None:
        _fence()
        self._pids[1] = self._pid
        self._head[0] = tail
        self.corrupt_frames += 1
        self.corrupt_bytes_skipped += tail - head
        logger.warning(
            "channel %r: corrupt frame header at %d (length %d, %d bytes published): "
            "skipped the %d unread bytes up to the producer's tail", self.name, head, length,
            tail - head, tail - head,
        )

    def poll(self) -> Message | None:
        """The next message, or None if there is none; never waits.

        Raises:
            ProtocolError: the next frame does not decode. It is consumed, so the following
                call goes on with the frame after it.
        """
        payload = self.poll_bytes()
        return None if payload is None else decode(payload)

    def recv(self, timeout_s: float | None = None) -> Message | None:
        """The next message, waiting up to ``timeout_s`` (None: forever); None on timeout.

        Raises:
            ProtocolError: as ``poll``.
        """
        return recv_any([self], timeout_s)[1]

    @property
    def num_unread_bytes(self) -> int:
        self._check_open()
        return int(self._tail[0]) - int(self._head[0])


def recv_any(channels: list[Channel], timeout_s: float | None = None
             ) -> tuple[Channel | None, Message | None]:
    """Waits for a message on any of ``channels``, which must share one doorbell.

    Returns ``(channel, message)``, or ``(None, None)`` on timeout. Channels are scanned in
    order each time, so put the most urgent first.

    Raises:
        UsageError: the channels do not share a doorbell. ProtocolError: as ``poll``.
    """
    if not channels:
        raise UsageError("recv_any needs at least one channel")
    bell = channels[0]._bell
    if any(ch.doorbell_name != channels[0].doorbell_name for ch in channels):
        raise UsageError(
            "recv_any: the channels have different doorbells "
            f"({sorted({ch.doorbell_name for ch in channels})}); create them with one "
            "doorbell=create_doorbell(...)"
        )
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    spins = _RECV_SPINS
    while True:
        for ch in channels:
            payload = ch.poll_bytes()
            if payload is not None:
                return ch, decode(payload)
        if spins:
            # A reply often comes within microseconds; sleeping on the semaphore and being
            # woken costs tens of them (bench_transport.py), so look a few more times first.
            spins -= 1
            continue
        # Each frame posts the doorbell once, but a frame may be read without taking its
        # post (it was polled first), so a wake-up can find nothing: loop until the deadline.
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            return None, None
        try:
            bell.acquire(remaining)
        except (posix_ipc.BusyError, posix_ipc.SignalError):
            # A signal interrupted the wait (posix_ipc does not retry EINTR): its Python
            # handler runs at the next bytecode, so Ctrl-C still raises KeyboardInterrupt.
            pass


def _checked_doorbell(raw: bytes) -> str:
    """The doorbell name a channel's header names, if it is a shmkv doorbell name
    (``/shmkv_bell-<valid name>``) of a semaphore of this user's with mode 0600; the header
    is shared memory and is not trusted to name anything else (SegmentError)."""
    try:
        bell = raw.decode()
    except UnicodeDecodeError:
        bell = None
    if bell is not None and bell.startswith("/shmkv_bell-"):
        try:
            L.validate_pool_name(bell[len("/shmkv_bell-"):])
        except UsageError:
            bell = None
    else:
        bell = None
    if bell is None:
        raise SegmentError(f"channel header names doorbell {raw!r}: not a shmkv doorbell "
                           "name; refusing to open it")
    check_path(semaphore_path(bell), f"doorbell semaphore {bell}")
    return bell


def create_doorbell(name: str) -> str:
    """Makes a doorbell semaphore for channels created with ``doorbell=``; returns its
    name. Remove it with :func:`unlink_doorbell`."""
    bell = _doorbell_name(name)
    try:
        sem = posix_ipc.Semaphore(bell, posix_ipc.O_CREX, mode=CHANNEL_MODE, initial_value=0)
    except OSError as exc:  # a semaphore is a page of /dev/shm, written when made
        if exc.errno in NO_SPACE_ERRNOS:
            raise no_space(f"doorbell semaphore {bell}", mmap.PAGESIZE, exc.errno) from None
        raise
    except posix_ipc.ExistentialError:
        raise SegmentExistsError(f"doorbell semaphore {bell} already exists") from None
    sem.close()
    os.chmod(semaphore_path(bell), CHANNEL_MODE)  # whatever the umask
    return bell


def unlink_doorbell(bell: str) -> bool:
    """Removes a doorbell semaphore; False if it did not exist."""
    try:
        posix_ipc.unlink_semaphore(bell)
    except posix_ipc.ExistentialError:
        return False
    return True


def _field(name: str) -> int:
    return L.CHANNEL_HEADER_DTYPE.fields[name][1]


__all__ = [
    "PROTOCOL_VERSION", "Channel", "ChannelFullError", "ExecuteModel", "Message",
    "ModelOutput", "ScheduledRequest", "Shutdown", "channel_segment_name", "create_doorbell",
    "decode", "encode", "message", "recv_any", "unlink_doorbell",
]
