"""Child processes of ``test_vllm_tier_idle.py`` (importable by the spawn context): each
joins a vLLM offload tier as a replica does, its GPU worker first, then its engine core."""

from __future__ import annotations

import logging
import os

NUM_CHUNKS = 4
DATA_BYTES = NUM_CHUNKS * os.sysconf("SC_PAGE_SIZE")


def _join(pool: str, replica: str):
    from shmkv.vllm import SharedCPUOffloadingManager
    from shmkv.vllm.lifecycle import join_as_worker

    locks, _ = join_as_worker(pool, NUM_CHUNKS, 16, replica, DATA_BYTES)
    return locks, SharedCPUOffloadingManager(pool, NUM_CHUNKS, replica_id=replica)


def make_tier_and_leave(pool: str) -> None:
    """A replica that makes (or joins) the tier and stops cleanly: both its processes'
    leaves are recorded, and the tier stays, idle."""
    locks, core = _join(pool, "leaver")
    core.close()
    locks.close()


def make_tier_and_die(pool: str) -> None:
    """A replica that makes the tier and is gone without leaving (as after a SIGKILL: the
    kernel drops its locks; its engine core's row stays in the pool's process table)."""
    _join(pool, "killed")
    os._exit(0)


def hold_tier(pool: str, ready, stop) -> None:
    """A replica's GPU worker that joins the tier and holds it (its replica lock file's
    byte, attached to no pool) until told to stop."""
    from shmkv.vllm.lifecycle import join_as_worker

    locks, _ = join_as_worker(pool, NUM_CHUNKS, 16, "holder", DATA_BYTES)
    ready.set()
    stop.wait(120)
    locks.close()


def start_replica_and_report(pool: str, out) -> None:
    """A replica's start on ``pool``: puts the warnings shmkv logged meanwhile on ``out``."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(f"{record.levelname} {record.name} {record.getMessage()}")

    shmkv_log = logging.getLogger("shmkv")
    shmkv_log.addHandler(Keep(logging.WARNING))
    locks, core = _join(pool, "starter")
    core.close()
    locks.close()
    out.put(lines)
