"""The shared pool: one POSIX shared-memory segment that every scheduler process on a node maps.

Everything here is below vLLM's managers: the layout (``layout.py``, the one table of the
segment), the segment and its header checks, the pool lock with liveness and takeover, the undo
journal, the free queue, the prefix index, the event log, the process table and reference
ledger, the ``BlockPool`` facade with vLLM's API, recovery (rebuild and the invariants), the two
kernels (``_ckernel.c`` and its reference ``_pykernel.py``) and fault injection for the crash
tests. Nothing in this package imports from ``shmkv.core``, ``shmkv.ranks`` or above.
"""
