"""Memory barriers for the Python paths that publish through shared memory with plain
numpy / memoryview stores (the Channel ring, the block-table seqlock).

``fence()`` is a full barrier (``__atomic_thread_fence(__ATOMIC_SEQ_CST)`` in
``shmkv/pool/_ckernel.c``): stores before it are visible to another CPU before stores after
it, and loads after it see at least what loads before it saw. x86-64 keeps stores in order
(TSO) and needs none of this; aarch64 (GH200 nodes) does. Without the C kernel built,
``fence`` is a no-op and ``HAVE_FENCE`` is False: correct on x86-64 only (CI requires the C
kernel, ``.ci/run``). Which store publishes which: ``shmkv/pool/layout.py``, "Memory
ordering".
"""

from __future__ import annotations

try:
    from shmkv.pool._ckernel import fence
    HAVE_FENCE = True
except ImportError:  # pure-Python install: x86-64 (TSO) only
    HAVE_FENCE = False

    def fence() -> None:
        """No-op: the C kernel is not built (x86-64's store order is relied on)."""


__all__ = ["HAVE_FENCE", "fence"]
