"""Editing a recorded history, to show that the checker notices the edit."""

from __future__ import annotations

from collections.abc import Callable

from shmkv.pool.recorder import _FRAME, Record, _encoder, read_history


def rewrite_history(path: str, edit: Callable[[Record], Record | None]) -> None:
    """Rewrites the history file with ``edit`` applied to each record (None drops it)."""
    records, _ = read_history(path)
    with open(path, "wb") as f:
        for rec in records:
            rec = edit(rec)
            if rec is not None:
                payload = _encoder.encode(rec)
                f.write(_FRAME.pack(len(payload)) + payload)
