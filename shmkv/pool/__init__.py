"""The shared pool: one POSIX shared-memory segment that every scheduler process on a node maps.

Everything here is below vLLM's managers: the layout (``layout.py``, the one table of the
segment), the segment and its header checks, the pool lock with liveness and takeover, the undo
journal, the free queue, the prefix index, the event log, the process table and reference
ledger (``process_table.py``), the repair after a dead hold (``repair.py``), recovery
(``recovery.py``: rebuild and the invariants, on the segment's views), the ``BlockPool`` facade
with vLLM's API on top of them all, the two kernels (``_ckernel.c`` and its reference
``_pykernel.py``) and fault injection for the crash tests. Nothing in this package imports
from ``shmkv.core``, ``shmkv.ranks`` or above (``tests/unit/test_layers.py``).
"""
