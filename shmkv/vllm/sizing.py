"""What /dev/shm must hold beside the tier: vLLM's own inter-process buffers.

vLLM's multiprocess executor passes each step between an engine core and its workers
through shared-memory ring buffers in /dev/shm (``shm_broadcast.MessageQueue``): per
engine, one broadcast queue to its workers (10 chunks of ``VLLM_MQ_MAX_CHUNK_BYTES_MB``,
16 MiB by default), one response queue per worker (10 chunks of 24 MiB) and, with tensor
or decode-context parallelism, one queue per such group (6 chunks of 4 MiB). The files are
sparse: they take their apparent size only as the queues fill, so a /dev/shm that looked
big enough at start can run out while serving, and the process that faults on the missing
page (an engine core) dies with SIGBUS. With two engines of one worker each that is 800
MiB of apparent size; the tier's data region, reserved whole when it is made, leaves the
rest of /dev/shm to them.

:func:`vllm_ipc_bytes` is that sum for the engines of one node (an upper bound: an engine
run without the multiprocess executor makes none); :func:`check_room_after_tier` warns at
an engine core's start when /dev/shm would keep less than it.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from shmkv.pool.siblings import human_bytes

MIB = 1 << 20
_BROADCAST_CHUNKS, _RESPONSE_CHUNKS, _GROUP_CHUNKS = 10, 10, 6
_RESPONSE_CHUNK_BYTES, _GROUP_CHUNK_BYTES = 24 * MIB, 4 * MIB
DEFAULT_MQ_CHUNK_MB = 16

logger = logging.getLogger(__name__)


def vllm_ipc_bytes(parallel: Any, environ: dict[str, str] | None = None) -> int:
    """The apparent size of vLLM's shared-memory queues for the engines of this node:
    ``parallel`` is vLLM's ParallelConfig (its world size, TP and DCP sizes, and the number
    of data-parallel engines on this node), ``environ`` the environment (vLLM's
    ``VLLM_MQ_MAX_CHUNK_BYTES_MB``; default ``os.environ``)."""
    env = os.environ if environ is None else environ
    chunk_mb = int(env.get("VLLM_MQ_MAX_CHUNK_BYTES_MB", DEFAULT_MQ_CHUNK_MB))
    world = int(getattr(parallel, "world_size", 1) or 1)
    groups = sum(int(getattr(parallel, name, 1) or 1) > 1
                 for name in ("tensor_parallel_size", "decode_context_parallel_size"))
    per_engine = (_BROADCAST_CHUNKS * chunk_mb * MIB + world * _RESPONSE_CHUNKS
                  * _RESPONSE_CHUNK_BYTES + groups * _GROUP_CHUNKS * _GROUP_CHUNK_BYTES)
    engines = getattr(parallel, "data_parallel_size_local", None) \
        or getattr(parallel, "data_parallel_size", 1) or 1
    return int(engines) * per_engine


def check_room_after_tier(shm_dir: str, tier_bytes: int, ipc_bytes: int) -> str | None:
    """Warns (and returns the warning) when /dev/shm, once the tier's ``tier_bytes`` are
    taken (0 for a tier already made: its pages are reserved), keeps less than vLLM's
    queues may grow to (``ipc_bytes``); None when it keeps enough."""
    st = os.statvfs(shm_dir)
    free = st.f_bavail * st.f_frsize
    left = free - tier_bytes
    if left >= ipc_bytes:
        return None
    if left < 0:
        kept = (f"{shm_dir} has {human_bytes(free)} free and the offload tier takes up to "
                f"{human_bytes(tier_bytes)} (cpu_bytes_to_use): the first worker refuses to "
                "make a tier that does not fit, and")
    else:
        kept = (f"{shm_dir} keeps {human_bytes(left)} once the offload tier's "
                f"{human_bytes(tier_bytes)} are taken, and")
    message = (
        f"{kept} vLLM's own inter-process queues of this node's engines may grow to "
        f"{human_bytes(ipc_bytes)} while serving (sparse files that fill later; an engine "
        "core that finds no page left dies with SIGBUS): lower cpu_bytes_to_use, or give "
        "/dev/shm more room (docker run --shm-size=...)")
    logger.warning("shmkv: %s", message)
    return message
