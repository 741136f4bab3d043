"""The rank process: runs the model for one scheduler, reading its block tables and the KV
store in place.

A scheduler step, seen from both sides:
1. the scheduler writes the scheduled requests' rows into its ``SharedBlockTables`` and
   ``commit(step)``s them;
2. it sends ``ExecuteModel(step, requests)`` (row, new token ids, start position per
   request; no block ids: those are in the shared tables) over its channel to the rank;
3. the rank reads a consistent snapshot of those rows (``SharedBlockTables.read``, which
   must show ``step``), computes slot mappings, runs ``forward_paged`` (writing the new
   tokens' K/V into the ``KVStore`` and reading the rest from it) and replies
   ``ModelOutput(step, sampled_token_ids)``;
4. only then does the scheduler write tables again (the step handshake), and only then may
   it cache the blocks the step filled (``KVCacheManager.cache_blocks``): a block another
   process can hit must already hold its K/V.

Messages and transport are ``shmkv.messages``' (``ExecuteModel``, ``ModelOutput``,
``Shutdown``, ``Channel``): two channels per scheduler, ``<name>.torank`` and
``<name>.fromrank`` (``create_rank_channels`` / ``unlink_rank_channels``).
"""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Sequence

from shmkv.errors import ProtocolError, UsageError
from shmkv.messages import Channel, ExecuteModel, ModelOutput, ScheduledRequest, Shutdown
from shmkv.ranks.block_table import SharedBlockTables, batch_token_indices
from shmkv.serve.config import TinyModelConfig
from shmkv.serve.stopping import EXIT_TERMINATED, TERM_POLL_S, terminated

# torch and the model are imported by ModelRunner and rank_main only: the scheduler side
# (RankClient, the channels) runs without torch.

__all__ = ["ModelRunner", "RankClient", "ScheduledRequest", "create_rank_channels",
           "rank_main", "unlink_rank_channels"]


def to_rank_channel(name: str) -> str:
    return f"{name}.torank"


def from_rank_channel(name: str) -> str:
    return f"{name}.fromrank"


def create_rank_channels(name: str) -> None:
    """Creates the two channels between scheduler ``name`` and its rank."""
    Channel.create(to_rank_channel(name)).close()
    try:
        Channel.create(from_rank_channel(name)).close()
    except BaseException:
        Channel.unlink(to_rank_channel(name))
        raise


def unlink_rank_channels(name: str) -> None:
    """Removes both channels (missing ones are skipped)."""
    Channel.unlink(to_rank_channel(name))
    Channel.unlink(from_rank_channel(name))


# --------------------------------------------------------------------------- the runner

class ModelRunner:
    """Maps one scheduler's block tables and its pool's KV (``kv``: a
    ``shmkv.serve.placement.KVPlacement``, or the name of a CPU ``KVStore`` attended in
    place), and executes its steps on the placement's device."""

    def __init__(self, tables_name: str, kv, model_config: TinyModelConfig):
        import torch

        from shmkv.serve.model import TinyTransformer
        from shmkv.serve.placement import open_rank_kv

        self.tables = SharedBlockTables.attach(tables_name)
        try:
            self.kv_store = open_rank_kv(kv, self.tables)
        except BaseException:
            self.tables.close()
            raise
        kv = self.kv_store
        self.model = TinyTransformer(model_config, device=kv.kv.device, dtype=kv.dtype)
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
        want = (model_config.num_layers, model_config.num_kv_heads, model_config.head_size)
        found = (kv.num_layers, kv.num_kv_heads, kv.head_size)
        if want != found or kv.dtype not in (torch.float32, torch.bfloat16):
            self.close()
            raise UsageError(
                f"the KV store has (layers, kv heads, head size, dtype) = {found + (kv.dtype,)}; "
                f"the model needs {want + ('float32 or bfloat16',)}")

    def execute(self, step: ExecuteModel) -> list[int]:
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
        kv, tables, slots = self.kv_store.prepare(reqs, snap, req_indices, positions)
        logits = self.model.forward_paged(token_ids, positions, query_start_loc, seq_lens,
                                          tables, slots, kv)
        tokens = logits.argmax(-1).tolist()
        self.kv_store.finish()  # the blocks it completed are where others can hit them
        return tokens

    def close(self) -> None:
        self.tables.close()
        self.kv_store.close()


def rank_main(tables_name: str, kv_store_name, to_rank_name: str, from_rank_name: str,
              model_config: TinyModelConfig, recv_timeout_s: float | None = None,
              num_threads: int | None = 1) -> None:
    """Process entry point: attach, then answer every ``ExecuteModel`` on ``to_rank_name``
    with a ``ModelOutput`` on ``from_rank_name`` until ``Shutdown``; exits 0 then. A frame
    that does not decode, or a message of another type, is dropped (said on stderr) and the
    rank goes on. A step that fails is answered with ``ModelOutput(error=...)`` and the
    process exits 1; so does a wait longer than ``recv_timeout_s`` (None: no limit). Sent
    SIGTERM (in a child of ``shmkv run``: ``engine.child_setup``), it stops between two steps,
    closes what it mapped and exits 143.
    ``num_threads``: torch's intra-op threads (1 by default: a tiny model on a shared CPU
    runs fastest so)."""
    step_no = -1
    inbox = outbox = runner = None
    if num_threads is not None:
        import torch

        torch.set_num_threads(num_threads)
    try:
        inbox = Channel.open(to_rank_name)
        outbox = Channel.open(from_rank_name)
        runner = ModelRunner(tables_name, kv_store_name, model_config)
        deadline = None
        while not terminated():
            if deadline is None and recv_timeout_s is not None:
                deadline = time.monotonic() + recv_timeout_s
            wait = TERM_POLL_S if deadline is None else min(
                TERM_POLL_S, max(deadline - time.monotonic(), 0.0))
            try:
                msg = inbox.recv(wait)
            except ProtocolError as exc:
                print(f"rank ({to_rank_name}): frame dropped: {exc}", file=sys.stderr)
                continue
            if msg is None:
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"no message from the scheduler in {recv_timeout_s} s")
                continue
            deadline = None
            if isinstance(msg, Shutdown):
                return
            if not isinstance(msg, ExecuteModel):
                print(f"rank ({to_rank_name}): {type(msg).__name__} dropped (expected "
                      "ExecuteModel or Shutdown)", file=sys.stderr)
                continue
            step_no = msg.step
            outbox.send(ModelOutput(step=msg.step, sampled_token_ids=runner.execute(msg)))
        sys.exit(EXIT_TERMINATED)  # SIGTERM: stopped between two steps
    except SystemExit:
        raise
    except BaseException as exc:
        traceback.print_exc(file=sys.stderr)
        if outbox is not None:
            try:
                outbox.send(ModelOutput(step=step_no, sampled_token_ids=[],
                                        error=f"{type(exc).__name__}: {exc}"), timeout_s=1)
            except Exception:  # noqa: BLE001 (the scheduler may be gone too)
                pass
        sys.exit(1)
    finally:
        for part in (runner, inbox, outbox):
            if part is not None:
                part.close()


class RankClient:
    """The scheduler's end of the two channels to its rank."""

    def __init__(self, channel: str) -> None:
        self._to_rank = Channel.open(to_rank_channel(channel))
        self._from_rank = Channel.open(from_rank_channel(channel))

    def execute(self, step: int, requests: Sequence[ScheduledRequest],
                timeout_s: float = 60.0) -> list[int]:
        """Sends the step and waits for its answer; the tables must be committed as
        ``step``.

        Raises:
            ProtocolError: the rank failed, answered out of turn, or not in time.
        """
        self._to_rank.send(ExecuteModel(step=step, requests=list(requests)), timeout_s)
        msg = self._from_rank.recv(timeout_s)
        if msg is None:
            raise ProtocolError(f"no answer from the rank to step {step} in {timeout_s} s")
        if not isinstance(msg, ModelOutput) or msg.step != step:
            raise ProtocolError(f"expected ModelOutput for step {step}, got {msg!r}")
        if msg.error:
            raise ProtocolError(f"rank failed at step {step}: {msg.error}")
        return msg.sampled_token_ids

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._to_rank.send(Shutdown(reason="scheduler done"), timeout_s)

    def close(self) -> None:
        self._to_rank.close()
        self._from_rank.close()
