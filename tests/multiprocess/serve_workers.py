"""Child processes for tests/multiprocess/test_serve_run.py (module level, so spawn can
import them)."""

from __future__ import annotations

import gc


def gc_after_child_setup(results) -> None:
    """Imports what the run's fork server preloads, then does a child's set-up; reports how
    many objects the collector tracked before, how many it froze, and how many it still
    walks after."""
    import torch  # noqa: F401  (preloaded by the fork server of `shmkv run`)

    from shmkv.serve import engine, rank, scheduler  # noqa: F401

    gc.collect()
    inherited = len(gc.get_objects())
    engine.child_setup(None)
    results.put((inherited, gc.get_freeze_count(), len(gc.get_objects())))
