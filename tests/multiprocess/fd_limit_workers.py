"""A process that attaches to (or creates) a pool under every descriptor limit from "none
free" up, and reports what each failed attempt left open (importable, for spawn)."""

from __future__ import annotations

import os
import resource

from shmkv import BlockPool


def _open_fds() -> list[int]:
    return sorted(int(fd) for fd in os.listdir("/proc/self/fd"))


def _shm_mappings() -> int:
    with open("/proc/self/maps") as maps:
        return sum("/dev/shm/" in line for line in maps)


def attach_under_limits(name: str, kernel: str, create: bool, queue) -> None:
    """Puts (limit, fds before, fds after, mappings before, mappings after, outcome) on
    ``queue`` for each soft RLIMIT_NOFILE from "no descriptor free" up, until the call
    succeeds."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    own = f"{name}-own"
    # Warm up every import and lazy open first, so that only the call counts.
    BlockPool.attach(name, kernel=kernel).close()
    BlockPool.create(own, 16, kernel=kernel).__exit__(None, None, None)
    rows = []
    for extra in range(16):
        fds, maps = _open_fds(), _shm_mappings()
        lowest_free = min(set(range(len(fds) + 1)) - set(fds))  # no descriptor below it
        resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free + extra, hard))
        try:
            pool = (BlockPool.create(own, 16, kernel=kernel) if create
                    else BlockPool.attach(name, kernel=kernel))
        except OSError as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        else:
            outcome = "ok"
            pool.close()
            if create:
                BlockPool.unlink(own)
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        rows.append((extra, fds, _open_fds(), maps, _shm_mappings(), outcome))
        if outcome == "ok":
            break
    queue.put(rows)
