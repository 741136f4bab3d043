"""Where ``shmkv run`` meets the model side (``shmkv/serve/model.py``, ``shmkv/serve/rank.py``,
``shmkv/block_table.py``): the scheduler's ``KVCacheManager`` for the model, its block-table
writer, the KV store, and the rank process's entry point over the run's channels.

Imports torch (the scheduler and the front end import it lazily, through here).
"""

from __future__ import annotations

import dataclasses
import sys
import traceback

from shmkv.errors import ProtocolError
from shmkv.kv_cache_manager import KVCacheManager
from shmkv.messages import Channel, ExecuteModel, ModelOutput, Shutdown

__all__ = [
    "BlockTablesWriter", "build_kv_cache_manager", "create_block_tables", "create_kv_store",
    "model_config_from_dict", "model_config_to_dict", "open_block_tables", "rank_main",
]


def model_config_to_dict(config) -> dict:
    return dataclasses.asdict(config)


def model_config_from_dict(d: dict):
    from shmkv.serve.model import TinyModelConfig

    d = dict(d)
    d["sliding_window"] = tuple(d["sliding_window"])
    return TinyModelConfig(**d)


def build_kv_cache_manager(pool, cfg) -> KVCacheManager:
    """The scheduler's manager: the model's KV-cache groups over ``pool``'s blocks."""
    from shmkv.serve.model import make_kv_cache_config

    model = model_config_from_dict(cfg.model)
    bs = pool.hash_block_size
    kv_config = make_kv_cache_config(model, pool.num_gpu_blocks, bs)
    return KVCacheManager(kv_config, max_model_len=cfg.max_model_len, scheduler_block_size=bs,
                          hash_block_size=bs, enable_kv_cache_events=True, block_pool=pool)


def create_block_tables(name: str, model_config, max_num_seqs: int, max_model_len: int,
                        block_size: int):
    from shmkv.block_table import SharedBlockTables

    num_groups = len(model_config.group_windows())
    return SharedBlockTables.create(name, max_num_reqs=max_num_seqs,
                                    max_model_len=max_model_len,
                                    block_sizes=[block_size] * num_groups)


def create_kv_store(name: str, model_config, num_blocks: int, block_size: int):
    from shmkv.block_table import KVStore

    return KVStore.create(name, num_layers=model_config.num_layers, num_blocks=num_blocks,
                          block_size=block_size, num_kv_heads=model_config.num_kv_heads,
                          head_size=model_config.head_size, dtype="float32")


class BlockTablesWriter:
    """The scheduler's side of its shared block tables: whole rows, then one commit."""

    def __init__(self, tables) -> None:
        self.tables = tables

    def write_row(self, row: int, block_ids: tuple[list[int], ...]) -> None:
        self.tables.add_row(block_ids, row)

    def commit_step(self, step: int) -> None:
        self.tables.commit(step)

    def close(self) -> None:
        self.tables.close()


def open_block_tables(cfg) -> BlockTablesWriter:
    from shmkv.block_table import SharedBlockTables

    return BlockTablesWriter(SharedBlockTables.attach(cfg.block_tables_name))


def rank_main(tables_name: str, kv_store_name: str, to_rank_name: str, from_rank_name: str,
              model: dict, front_end_pid: int | None = None) -> None:
    """Entry point of a rank process: executes its scheduler's ``ExecuteModel`` steps with
    the model runner of ``shmkv/serve/rank.py`` until ``Shutdown``. A failed step is
    answered with ``ModelOutput(error=...)`` and the process exits 1."""
    from shmkv.serve.scheduler import child_setup

    child_setup(front_end_pid)
    import torch

    from shmkv.serve.rank import ModelRunner

    torch.set_num_threads(1)
    to_rank = Channel.open(to_rank_name)
    from_rank = Channel.open(from_rank_name)
    runner = ModelRunner(tables_name, kv_store_name, model_config_from_dict(model))
    step = -1
    try:
        while True:
            try:
                msg = to_rank.recv(timeout_s=None)
            except ProtocolError as exc:  # a bad frame is dropped; the rank goes on
                print(f"rank ({to_rank_name}): frame dropped: {exc}", file=sys.stderr)
                continue
            if isinstance(msg, Shutdown):
                return
            if not isinstance(msg, ExecuteModel):
                print(f"rank ({to_rank_name}): {type(msg).__name__} dropped (expected "
                      "ExecuteModel or Shutdown)", file=sys.stderr)
                continue
            step = msg.step
            from_rank.send(ModelOutput(step=step, sampled_token_ids=runner.execute(msg)))
    except BaseException as exc:
        traceback.print_exc(file=sys.stderr)
        try:
            from_rank.send(ModelOutput(step=step, sampled_token_ids=[],
                                       error=f"{type(exc).__name__}: {exc}"), timeout_s=1.0)
        except Exception:  # noqa: BLE001 (the scheduler may be gone too)
            pass
        sys.exit(1)
    finally:
        runner.close()
        to_rank.close()
        from_rank.close()
