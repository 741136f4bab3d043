"""Where ``shmkv run`` meets the model side (``shmkv/serve/model.py``, ``shmkv/serve/rank.py``,
``shmkv/ranks/block_table.py``): the scheduler's ``KVCacheManager`` for the model, its block-table
writer, the KV store, the rank process's entry point over the run's channels, and
:func:`child_setup`, what every child process of the run (scheduler or rank) does first.

Imports torch (the scheduler and the front end import it lazily, through here).
"""

from __future__ import annotations

import dataclasses
import gc
import os
import select
import signal
import threading
import time

from shmkv.core.kv_cache_manager import KVCacheManager
from shmkv.pool.liveness import pid_alive
from shmkv.serve import stopping

__all__ = [
    "BlockTablesWriter", "build_kv_cache_manager", "child_setup", "create_block_tables",
    "create_kv_store",
    "model_config_from_dict", "model_config_to_dict", "open_block_tables", "rank_main",
]


def model_config_to_dict(config) -> dict:
    return dataclasses.asdict(config)


def model_config_from_dict(d: dict):
    from shmkv.serve.config import TinyModelConfig  # (not .model: a replay has no torch)

    d = dict(d)
    d["sliding_window"] = tuple(d["sliding_window"])
    return TinyModelConfig(**d)


def build_kv_cache_manager(pool, cfg) -> KVCacheManager:
    """The scheduler's manager: the model's KV-cache groups over ``pool``'s blocks."""
    from shmkv.serve.config import make_kv_cache_config

    model = model_config_from_dict(cfg.model)
    bs = pool.hash_block_size
    kv_config = make_kv_cache_config(model, pool.num_gpu_blocks, bs)
    return KVCacheManager(kv_config, max_model_len=cfg.max_model_len, scheduler_block_size=bs,
                          hash_block_size=bs, enable_kv_cache_events=True, block_pool=pool)


def create_block_tables(name: str, model_config, max_num_seqs: int, max_model_len: int,
                        block_size: int, pool: str | None = None):
    from shmkv.ranks.block_table import SharedBlockTables

    num_groups = len(model_config.group_windows())
    return SharedBlockTables.create(name, max_num_reqs=max_num_seqs,
                                    max_model_len=max_model_len,
                                    block_sizes=[block_size] * num_groups, pool=pool)


def create_kv_store(name: str, model_config, num_blocks: int, block_size: int,
                    pool: str | None = None):
    from shmkv.ranks.block_table import KVStore

    return KVStore.create(name, num_layers=model_config.num_layers, num_blocks=num_blocks,
                          block_size=block_size, num_kv_heads=model_config.num_kv_heads,
                          head_size=model_config.head_size, dtype="float32", pool=pool)


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
    from shmkv.ranks.block_table import SharedBlockTables

    return BlockTablesWriter(SharedBlockTables.attach(cfg.block_tables_name))


def rank_main(tables_name: str, kv_store_name, to_rank_name: str, from_rank_name: str,
              model: dict, front_end_pid: int | None = None, nice: int = 0) -> None:
    """Entry point of a rank process of ``shmkv run``: the run's child set-up, ``nice``
    steps nicer than the front end (``RunConfig.rank_nice``), then
    ``shmkv.serve.rank.rank_main`` (which answers ``ExecuteModel`` steps until
    ``Shutdown``, dropping bad frames). ``kv_store_name``: its pool's
    ``shmkv.serve.placement.KVPlacement`` (or a CPU KV store's name)."""
    child_setup(front_end_pid)
    if nice:
        os.nice(nice)
    from shmkv.serve.rank import rank_main as run_rank

    run_rank(tables_name, kv_store_name, to_rank_name, from_rank_name,
             model_config_from_dict(model))


def child_setup(front_end_pid: int | None) -> None:
    """What every child of the run does first: leave Ctrl-C to the front end (the terminal
    sends it to the whole process group), take back the signals the front end blocks while
    it runs (a child inherits its mask), make SIGTERM a clean stop
    (``shmkv/serve/stopping.py``), and die with the front end.

    Dying with it takes two mechanisms: ``PR_SET_PDEATHSIG`` fires when the *parent* dies,
    but a child made by the fork server has the fork server as parent, and the fork server
    lives as long as any of its children holds the pipe that keeps it alive: a cycle that
    would outlive a SIGKILLed front end. So a thread also waits on the front end's pidfd
    and ends the process when it exits.

    And it freezes what it inherited (``gc.freeze``): the modules the fork server preloaded,
    torch among them, are some 170,000 objects that never become garbage. Left to the
    collector, each full collection walks them all (150 ms on a 2-vCPU VM), at whatever
    moment an allocation sets it off, inside a pool hold included: every other scheduler
    then waits. When the preload ran from installed bytecode (``pip install .``), the
    collections fell inside the holds often enough to make the schedulers wait 6-13% of
    their time instead of 0.1%.
    """
    gc.freeze()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stopping.install()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if not front_end_pid:
        return
    try:
        fd = os.pidfd_open(front_end_pid)
    except ProcessLookupError:
        os._exit(1)  # gone already
    except (OSError, AttributeError):
        fd = None  # no pidfd (kernel < 5.3): poll

    def watch() -> None:
        if fd is not None:
            select.select([fd], [], [])
        else:
            while pid_alive(front_end_pid):
                time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="front-end-watch", daemon=True).start()
