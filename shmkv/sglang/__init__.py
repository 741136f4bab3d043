"""shmkv inside SGLang: one HiCache L3 page store shared by every instance on a node.

Needs SGLang (0.5.23) installed: ``benchmarks/sglang_peer/install.sh``. See backend.py for
the flags, store.py for the page states, region.py for the data region.
"""

from shmkv.sglang.backend import SharedHostStorage

__all__ = ["SharedHostStorage"]
