"""The rank process: runs the model for one scheduler, reading its block tables and the KV
store in place.

A scheduler step, seen from both sides:
1. the scheduler writes the scheduled requests' rows into its ``SharedBlockTables`` and
   ``commit(step)``s them;
2. it sends ``ExecuteStep(step, requests)`` (row, new token ids, start position per request;
   no block ids: those are in the shared tables) over its ``Channel``;
3. the rank reads a consistent snapshot of those rows (``SharedBlockTables.read``, which
   must show ``step``), computes slot mappings, runs ``forward_paged`` (writing the new
   tokens' K/V into the ``KVStore`` and reading the rest from it) and replies
   ``StepDone(step, next_token_ids)``;
4. only then does the scheduler write tables again (the step handshake), and only then may
   it cache the blocks the step filled (``KVCacheManager.cache_blocks``): a block another
   process can hit must already hold its K/V.

Transport: ``shmkv/messages.py`` is not on main yet, so the structs and a minimal
``posix_ipc.MessageQueue`` channel live here; move them there when it lands.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Sequence
from typing import Union

import msgspec
import posix_ipc

from shmkv import layout as L
from shmkv.block_table import KVStore, SharedBlockTables, batch_token_indices
from shmkv.errors import ProtocolError, SegmentExistsError, SegmentNotFoundError, UsageError
from shmkv.serve.config import TinyModelConfig

# torch and the model are imported by ModelRunner and rank_main only: the scheduler side
# (messages, Channel, RankClient) runs without torch.

CHANNEL_VERSION = 1
MAX_MESSAGES = 10
MAX_MESSAGE_BYTES = 8192  # the Linux default ceiling (/proc/sys/fs/mqueue/msgsize_max)


# --------------------------------------------------------------------------- messages

class ScheduledRequest(msgspec.Struct, frozen=True):
    """One request of a step: its row in the block tables, the tokens to compute and the
    position of the first of them."""

    req_id: str
    row: int
    token_ids: list[int]
    start_position: int


class ExecuteStep(msgspec.Struct, frozen=True, tag="execute_step"):
    step: int
    requests: list[ScheduledRequest]


class StepDone(msgspec.Struct, frozen=True, tag="step_done"):
    step: int
    next_token_ids: list[int]


class RankReady(msgspec.Struct, frozen=True, tag="rank_ready"):
    pid: int


class RankFailed(msgspec.Struct, frozen=True, tag="rank_failed"):
    step: int
    error: str


class Shutdown(msgspec.Struct, frozen=True, tag="shutdown"):
    pass


RankMessage = Union[ExecuteStep, StepDone, RankReady, RankFailed, Shutdown]  # noqa: UP007
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(RankMessage)


def encode(msg: RankMessage) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> RankMessage:
    """Raises ProtocolError naming what was wrong with the bytes."""
    try:
        return _decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"not a rank message ({len(data)} bytes): {exc}") from exc


# --------------------------------------------------------------------------- transport

def channel_name(name: str, direction: str) -> str:
    """``/shmkv-<name>+torank-v1`` / ``+fromrank``: the two queues of a scheduler."""
    if direction not in ("torank", "fromrank"):
        raise UsageError(f"direction must be 'torank' or 'fromrank', got {direction!r}")
    return L.sibling_segment_name(name, direction, CHANNEL_VERSION)


class Channel:
    """One direction of scheduler <-> rank traffic: msgspec messages over a POSIX queue."""

    def __init__(self, queue: posix_ipc.MessageQueue) -> None:
        self._queue = queue
        self.name = queue.name

    @classmethod
    def create(cls, name: str, direction: str) -> Channel:
        qname = channel_name(name, direction)
        try:
            q = posix_ipc.MessageQueue(qname, posix_ipc.O_CREX, mode=0o600,
                                       max_messages=MAX_MESSAGES,
                                       max_message_size=MAX_MESSAGE_BYTES)
        except posix_ipc.ExistentialError as exc:
            raise SegmentExistsError(f"message queue {qname} already exists") from exc
        return cls(q)

    @classmethod
    def open(cls, name: str, direction: str) -> Channel:
        qname = channel_name(name, direction)
        try:
            return cls(posix_ipc.MessageQueue(qname))
        except posix_ipc.ExistentialError as exc:
            raise SegmentNotFoundError(f"no message queue named {qname}") from exc

    def send(self, msg: RankMessage, timeout_s: float | None = 30.0) -> None:
        data = encode(msg)
        if len(data) > self._queue.max_message_size:
            raise UsageError(
                f"{type(msg).__name__} encodes to {len(data)} bytes; the queue {self.name} takes "
                f"at most {self._queue.max_message_size}")
        self._queue.send(data, timeout=timeout_s)

    def recv(self, timeout_s: float | None = 30.0) -> RankMessage:
        """Raises posix_ipc.BusyError on timeout, ProtocolError on bad bytes."""
        data, _ = self._queue.receive(timeout=timeout_s)
        return decode(data)

    def close(self) -> None:
        self._queue.close()

    @staticmethod
    def unlink(name: str) -> None:
        """Removes both queues of ``name`` (missing ones are skipped)."""
        for direction in ("torank", "fromrank"):
            try:
                posix_ipc.unlink_message_queue(channel_name(name, direction))
            except posix_ipc.ExistentialError:
                pass


# --------------------------------------------------------------------------- the runner

class ModelRunner:
    """Maps one scheduler's block tables and the KV store, and executes its steps."""

    def __init__(self, tables_name: str, kv_store_name: str, model_config: TinyModelConfig):
        import torch

        from shmkv.serve.model import TinyTransformer

        self.tables = SharedBlockTables.attach(tables_name)
        try:
            self.kv_store = KVStore.attach(kv_store_name)
        except BaseException:
            self.tables.close()
            raise
        self.model = TinyTransformer(model_config)
        num_groups = len(model_config.group_windows())
        if num_groups != self.tables.num_groups:
            self.close()
            raise UsageError(
                f"the model has {num_groups} KV-cache groups, the block tables "
                f"{self.tables.num_groups}")
        if set(self.tables.block_sizes) != {self.kv_store.block_size}:
            self.close()
            raise UsageError(
                f"block tables' block sizes {self.tables.block_sizes} differ from the KV "
                f"store's {self.kv_store.block_size}")
        kv = self.kv_store
        want = (model_config.num_layers, model_config.num_kv_heads, model_config.head_size)
        found = (kv.num_layers, kv.num_kv_heads, kv.head_size)
        if want != found or kv.dtype != torch.float32:
            self.close()
            raise UsageError(
                f"the KV store has (layers, kv heads, head size, dtype) = {found + (kv.dtype,)}; "
                f"the model needs {want + (torch.float32,)}")

    def execute(self, step: ExecuteStep) -> list[int]:
        """Greedy next token of every scheduled request (in the step's order).

        Raises:
            ProtocolError: the tables show another step than the message (handshake broken).
            TornReadError: no consistent snapshot in time.
        """
        import torch

        reqs = step.requests
        if not reqs:
            return []
        snap = self.tables.read([r.row for r in reqs], min_step=step.step)
        if snap.step != step.step:
            raise ProtocolError(
                f"step {step.step} was sent but the block tables show step {snap.step}")
        counts = [len(r.token_ids) for r in reqs]
        starts = [r.start_position for r in reqs]
        req_indices, positions = batch_token_indices(counts, starts)
        counts_t = torch.tensor(counts, dtype=torch.int64)
        query_start_loc = torch.zeros(len(reqs) + 1, dtype=torch.int64)
        torch.cumsum(counts_t, 0, out=query_start_loc[1:])
        seq_lens = torch.tensor(starts, dtype=torch.int64) + counts_t
        token_ids = torch.tensor([t for r in reqs for t in r.token_ids], dtype=torch.int64)
        logits = self.model.forward_paged(
            token_ids, positions, query_start_loc, seq_lens, snap.block_tables,
            snap.slot_mappings(req_indices, positions), self.kv_store)
        return logits.argmax(-1).tolist()

    def close(self) -> None:
        self.tables.close()
        self.kv_store.close()


def rank_main(tables_name: str, kv_store_name: str, channel: str,
              model_config: TinyModelConfig, recv_timeout_s: float = 60.0,
              num_threads: int | None = 1) -> None:
    """Process entry point: attach, say ``RankReady``, then execute ``ExecuteStep``s until
    ``Shutdown``. Exits 0 on shutdown, 1 after reporting ``RankFailed``. ``num_threads``:
    torch's intra-op threads (1 by default: a tiny model on a shared CPU runs fastest so)."""
    step_no = -1
    to_sched = None
    if num_threads is not None:
        import torch

        torch.set_num_threads(num_threads)
    try:
        to_rank = Channel.open(channel, "torank")
        to_sched = Channel.open(channel, "fromrank")
        runner = ModelRunner(tables_name, kv_store_name, model_config)
        to_sched.send(RankReady(os.getpid()))
        while True:
            msg = to_rank.recv(recv_timeout_s)
            if isinstance(msg, Shutdown):
                break
            if not isinstance(msg, ExecuteStep):
                raise ProtocolError(f"rank got a {type(msg).__name__}, expected ExecuteStep")
            step_no = msg.step
            to_sched.send(StepDone(msg.step, runner.execute(msg)))
        runner.close()
        to_rank.close()
        to_sched.close()
    except BaseException as exc:
        traceback.print_exc(file=sys.stderr)
        if to_sched is not None:
            try:
                to_sched.send(RankFailed(step_no, f"{type(exc).__name__}: {exc}"), timeout_s=1)
            except Exception:
                pass
        sys.exit(1)


class RankClient:
    """The scheduler's end of the channel to its rank."""

    def __init__(self, channel: str) -> None:
        self._to_rank = Channel.open(channel, "torank")
        self._from_rank = Channel.open(channel, "fromrank")

    def wait_ready(self, timeout_s: float = 60.0) -> int:
        msg = self._from_rank.recv(timeout_s)
        if not isinstance(msg, RankReady):
            raise ProtocolError(f"expected RankReady, got {msg!r}")
        return msg.pid

    def execute(self, step: int, requests: Sequence[ScheduledRequest],
                timeout_s: float = 60.0) -> list[int]:
        """Sends the step and waits for its reply; the tables must be committed as ``step``.

        Raises:
            ProtocolError: the rank failed or replied out of turn.
        """
        self._to_rank.send(ExecuteStep(step, list(requests)), timeout_s)
        msg = self._from_rank.recv(timeout_s)
        if isinstance(msg, RankFailed):
            raise ProtocolError(f"rank failed at step {msg.step}: {msg.error}")
        if not isinstance(msg, StepDone) or msg.step != step:
            raise ProtocolError(f"expected StepDone for step {step}, got {msg!r}")
        return msg.next_token_ids

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._to_rank.send(Shutdown(), timeout_s)

    def close(self) -> None:
        self._to_rank.close()
        self._from_rank.close()
