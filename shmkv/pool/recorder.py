"""History recording: every pool call of one process, with the lock hold it ran in.

A pool opened with ``BlockPool.create(..., record=PATH)`` / ``BlockPool.attach(...,
record=PATH)``, or with ``$SHMKV_RECORD_DIR`` set (one file per pool handle in that folder),
is an instance of a recording subclass chosen at attach time; a pool opened without one is a
plain ``BlockPool`` and runs not one instruction more (``benchmarks/bench_block_pool.py``).

What is recorded, one msgpack frame per record (a 4-byte little-endian length, then the
record), each written with one ``os.write`` (so it is in the kernel's page cache, and
survives a SIGKILL of the process, as soon as the call returns):

- ``Opened``: the process, its slot and the pool's config (the first frame);
- ``Enter``: written inside the hold, before the call does anything: the hold's number
  (the header's ``lock_seq``, which every hold of the pool lock bumps under the lock, in both
  kernels), the call's number in this process, its name and arguments (block ids for
  handles; a request's hashes, tokens and salt);
- ``Exit``: written inside the same hold, after the call: its answer (block ids, a hit list
  or None, a bool) or its error, and the KV events it queued;
- ``Released``: the references of a process table slot given back (a dead process reaped by
  this one, or this process's own at ``close()``), as (block id, references) in the order
  the blocks reach the free queue, with the hold number: written inside the hold, before the
  release runs, whatever path released it (a repair at the start of a hold, an allocation
  short of blocks, ``reap_dead``, ``close``);
- ``Closed``: ``close()`` finished.

A hold commits when it is given back (the undo journal's length goes to 0). So every hold of
a process but its last committed, and a process that died in a hold whose call has an
``Enter`` but no ``Exit`` died before the commit: the hold was rolled back by the next
holder (``shmkv/pool/repair.py``), and it had no effect. A dead process's last hold with
every ``Exit`` written may have committed or not: the checker tries both.

Writing the history never fails nor changes a pool call. A file in ``$SHMKV_RECORD_DIR``
is a new one (``O_EXCL | O_NOFOLLOW``: never a planted file or link). If a record cannot be
written whole (a full disk, a file size limit), recording stops and the file is emptied,
since a history missing its later records would tell the checker the process stopped calling
where it did not; ``pool.record_error`` says why, and a ``RuntimeWarning`` is issued. If not
even the first record (``Opened``) can be written, ``create``/``attach`` raise OSError
naming the file, and leave nothing (the handle's slot given back).

Calls that are not recorded (``unpin_blocks``, ``cache_partial_block``,
``move_block_hashes``...) write an ``Enter``/``Exit`` pair with ``op`` set to their name
and no arguments, so a checker can refuse a history that used them.
"""

from __future__ import annotations

import os
import struct
import uuid
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

from shmkv.errors import UsageError
from shmkv.pool import layout as L

RECORD_ENV = "SHMKV_RECORD_DIR"
_FRAME = struct.Struct("<I")


class Opened(msgspec.Struct, tag="open"):
    pid: int
    slot: int
    pool: str
    kernel: str
    num_blocks: int
    enable_caching: bool
    hash_block_size: int
    enable_kv_cache_events: bool
    label: str = ""
    none_hash: bytes = b""  # the pool's NONE_HASH: a checker hashes requests as its processes


class Enter(msgspec.Struct, tag="enter"):
    seq: int
    n: int
    op: str
    args: dict[str, Any] = {}


class Exit(msgspec.Struct, tag="exit"):
    n: int
    result: Any = None
    error_type: str | None = None
    error: str | None = None
    events: list[Any] = []


class Released(msgspec.Struct, tag="release"):
    seq: int
    n: int
    slot: int
    pid: int
    own: bool
    blocks: list[tuple[int, int]] = []


class Closed(msgspec.Struct, tag="close"):
    n: int


Record = Opened | Enter | Exit | Released | Closed
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Record)


def read_history(path: str) -> tuple[list[Record], bool]:
    """The records of one history file, and whether its last frame was cut short (the
    process was killed while writing it; the cut frame is left out)."""
    with open(path, "rb") as f:
        data = f.read()
    out: list[Record] = []
    pos = 0
    while pos + 4 <= len(data):
        (size,) = _FRAME.unpack_from(data, pos)
        if pos + 4 + size > len(data):
            break
        out.append(_decoder.decode(data[pos + 4:pos + 4 + size]))
        pos += 4 + size
    return out, pos != len(data)


def record_path(record: str | None, pool_name: str) -> str | None:
    """The file a new pool handle records to: ``record``, else a fresh file in
    ``$SHMKV_RECORD_DIR`` if set, else None (no recording)."""
    if record is not None:
        if not isinstance(record, (str, os.PathLike)) or not str(record):
            raise UsageError(f"record must be a file path, got {record!r}")
        return str(record)
    folder = os.environ.get(RECORD_ENV)
    if not folder:
        return None
    return os.path.join(folder, f"{pool_name}-{os.getpid()}-{uuid.uuid4().hex[:8]}.history")


def _ids(blocks: Iterable[Any]) -> list[int]:
    return [getattr(b, "block_id", -1) for b in blocks]


def _events(events: list[Any]) -> list[Any]:
    return [msgspec.to_builtins(e) for e in events]


class RecordingMixin:
    """Put before ``BlockPool`` in a subclass (``recording_class``): records every call."""

    def __init__(self, *args: Any, record: str, fresh: bool = False, **kwargs: Any) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
        if fresh:  # a name this process made up: a new file, never a planted one or a link
            flags |= os.O_EXCL | os.O_NOFOLLOW
        self._rec_fd = os.open(record, flags, 0o600)
        self._rec_path = str(record)
        self._rec_n = 0
        self.record_error: str | None = None
        try:
            super().__init__(*args, **kwargs)
        except BaseException:
            os.close(self._rec_fd)
            raise
        self._rec_write(Opened(
            pid=os.getpid(), slot=self.slot, pool=self.pool_name, kernel=self.kernel,
            num_blocks=self.num_gpu_blocks, enable_caching=self.enable_caching,
            hash_block_size=self.hash_block_size,
            enable_kv_cache_events=self.enable_kv_cache_events, label=kwargs.get("label", ""),
            none_hash=self.none_hash,
        ))
        if self.record_error is not None:  # not even the first record: refuse the handle
            error = self.record_error
            self.close()
            raise OSError(f"record: cannot write the history file: {error}")

    # ------------------------------------------------------------------ writing

    def _rec_write(self, rec: Record) -> None:
        """Appends one whole frame, or stops recording (``_rec_stop``): a pool call never
        fails, nor changes, because its history could not be written."""
        if self._rec_fd < 0:
            return
        frame = _encoder.encode(rec)
        frame = _FRAME.pack(len(frame)) + frame
        try:
            written = os.write(self._rec_fd, frame)
        except OSError as exc:
            self._rec_stop(str(exc))
            return
        if written != len(frame):  # a full disk or a file size limit: cut short
            self._rec_stop(f"wrote {written} of a {len(frame)}-byte record")

    def _rec_stop(self, why: str) -> None:
        """Recording cannot go on (a full disk, a file size limit...): the history is emptied,
        since one missing its later records would tell the checker this process stopped
        calling (or died) where it did not, and recording stops; the pool runs on as one that
        never recorded. ``record_error`` says why."""
        fd, self._rec_fd = self._rec_fd, -1
        self.record_error = f"{self._rec_path}: {why}"
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass  # not a regular file (a device...): nothing to empty
        os.close(fd)
        if self._rec_n:  # a handle open already (the first record failing refuses it)
            warnings.warn(f"shmkv: recording this pool's history stopped ({self.record_error});"
                          " the history file was emptied", RuntimeWarning, stacklevel=3)

    def _rec_next(self) -> int:
        self._rec_n += 1
        return self._rec_n

    def _claim_slot(self, label: bytes) -> None:
        # The process table exists now, and the attach holds may reap the dead already.
        table = self.process_table
        release = table.release_slot

        def recorded_release(slot: int) -> int:
            row = self._ledger[slot]
            held = row.nonzero()[0][::-1]  # the order release_slot frees them in
            self._rec_write(Released(
                seq=int(self._hdr64[L.H_LOCK_SEQ]), n=self._rec_next(), slot=int(slot),
                pid=int(self._procs[slot]["pid"]), own=slot == self.slot,
                blocks=[(int(b), int(row[b])) for b in held],
            ))
            return release(slot)

        table.release_slot = recorded_release
        super()._claim_slot(label)

    def _rec_call(self, op: str, args: dict[str, Any], fn, *call_args: Any,
                  answer=None) -> Any:
        """Runs ``fn(*call_args)`` in one hold (joining the caller's, if it holds the lock),
        with an ``Enter`` before and an ``Exit`` after, both inside it."""
        with self._lock:
            n = self._rec_next()
            self._rec_write(Enter(seq=int(self._hdr64[L.H_LOCK_SEQ]), n=n, op=op, args=args))
            queued = len(self._event_queue)
            try:
                result = fn(*call_args)
            except BaseException as exc:
                self._rec_write(Exit(n=n, error_type=type(exc).__name__, error=str(exc),
                                     events=_events(self._event_queue[queued:])))
                raise
            self._rec_write(Exit(n=n, result=None if answer is None else answer(result),
                                 events=_events(self._event_queue[queued:])))
        return result

    def record_call(self, op: str, args: dict[str, Any], fn, *call_args: Any,
                    answer=None) -> Any:
        """Records a call of a layer above the pool (a ``KVCacheManager`` call...) as one
        hold: ``fn(*call_args)`` runs inside it, its pool calls recorded within; ``answer``
        turns the result into what the history keeps (None: nothing)."""
        return self._rec_call(op, args, fn, *call_args, answer=answer)

    # ------------------------------------------------------------------ vLLM's calls

    def get_new_blocks(self, num_blocks: int):
        return self._rec_call("get_new_blocks", {"num_blocks": num_blocks},
                              super().get_new_blocks, num_blocks, answer=_ids)

    def free_blocks(self, ordered_blocks: Iterable[Any], evict_first: bool = False) -> None:
        blocks = list(ordered_blocks)
        args = {"block_ids": _ids(blocks), **({"evict_first": True} if evict_first else {})}
        self._rec_call("free_blocks", args, super().free_blocks, blocks, evict_first)

    def touch(self, blocks: Sequence[Any]) -> None:
        blocks = list(blocks)
        self._rec_call("touch", {"block_ids": _ids(blocks)}, super().touch, blocks)

    def cache_full_blocks(self, request: Any, blocks: Sequence[Any], num_cached_blocks: int,
                          num_full_blocks: int, block_size: int, kv_cache_group_id: int,
                          block_mask: Sequence[bool] | None = None) -> None:
        lora = getattr(request, "lora_request", None)
        args = {
            "block_ids": _ids(blocks), "num_cached_blocks": num_cached_blocks,
            "num_full_blocks": num_full_blocks, "block_size": block_size,
            "kv_cache_group_id": kv_cache_group_id,
            "block_mask": None if block_mask is None else [bool(m) for m in block_mask],
            "block_hashes": [bytes(h) for h in getattr(request, "block_hashes", ())],
            "all_token_ids": (list(request.all_token_ids)
                              if self.enable_kv_cache_events else None),
            "cache_salt": getattr(request, "cache_salt", None),
            "session_id": getattr(request, "session_id", None),
            "lora": None if lora is None else [lora.lora_name, lora.lora_int_id,
                                               getattr(lora, "lora_path", "")],
        }
        self._rec_call("cache_full_blocks", args, super().cache_full_blocks, request, blocks,
                       num_cached_blocks, num_full_blocks, block_size, kv_cache_group_id,
                       block_mask)

    def get_cached_block(self, block_hash: bytes, kv_cache_group_ids: Sequence[int]):
        return self._rec_call(
            "get_cached_block",
            {"block_hash": block_hash, "kv_cache_group_ids": list(kv_cache_group_ids)},
            super().get_cached_block, block_hash, kv_cache_group_ids,
            answer=lambda hit: None if hit is None else _ids(hit))

    def get_cached_prefix(self, block_hashes: Sequence[bytes], kv_cache_group_id: int = 0,
                          max_num_blocks: int | None = None):
        return self._rec_call(
            "get_cached_prefix",
            {"block_hashes": list(block_hashes), "kv_cache_group_id": kv_cache_group_id,
             "max_num_blocks": max_num_blocks},
            super().get_cached_prefix, block_hashes, kv_cache_group_id, max_num_blocks,
            answer=_ids)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        ids = list(block_ids)
        self._rec_call("evict_blocks", {"block_ids": [int(b) for b in ids]},
                       super().evict_blocks, ids)

    def reset_prefix_cache(self) -> bool:
        return self._rec_call("reset_prefix_cache", {}, super().reset_prefix_cache,
                              answer=bool)

    # ------------------------------------------------------------------ the rest

    def _unrecorded(self, op: str, fn, *args: Any) -> Any:
        return self._rec_call(op, {}, fn, *args)

    def unpin_blocks(self, blocks, on_reuse) -> None:
        self._unrecorded("unpin_blocks", super().unpin_blocks, blocks, on_reuse)

    def cache_partial_block(self, *args: Any, **kwargs: Any) -> Any:
        return self._unrecorded("cache_partial_block",
                                lambda: super(RecordingMixin, self).cache_partial_block(
                                    *args, **kwargs))

    def move_block_hashes(self, src_block, dst_block) -> None:
        self._unrecorded("move_block_hashes", super().move_block_hashes, src_block, dst_block)

    def _maybe_evict_cached_block(self, block) -> bool:
        return self._unrecorded("_maybe_evict_cached_block",
                                super()._maybe_evict_cached_block, block)

    def close(self) -> None:
        if self._segment.buf is None:
            return
        try:
            super().close()
            self._rec_write(Closed(n=self._rec_next()))
        finally:
            if self._rec_fd >= 0:
                os.close(self._rec_fd)
                self._rec_fd = -1


_classes: dict[type, type] = {}


def recording_class(cls: type) -> type:
    """The recording subclass of a pool class (made once per class)."""
    if cls not in _classes:
        _classes[cls] = type(f"Recording{cls.__name__}", (RecordingMixin, cls), {})
    return _classes[cls]
