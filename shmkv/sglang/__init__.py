"""shmkv inside SGLang: one HiCache L3 page store shared by every instance on a node.

``SharedHostStorage`` (backend.py) needs SGLang (0.5.23) installed:
``benchmarks/sglang_peer/install.sh``; it is imported on first use, so the page store itself
(store.py: page states; region.py: the data region) imports without SGLang.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SharedHostStorage"]


def __getattr__(name: str) -> Any:
    if name == "SharedHostStorage":
        from shmkv.sglang.backend import SharedHostStorage
        return SharedHostStorage
    raise AttributeError(f"module 'shmkv.sglang' has no attribute {name!r}")
