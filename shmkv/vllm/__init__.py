"""Inside vLLM: one node-wide CPU offload tier for every data-parallel replica.

vLLM 0.33.0's ``OffloadingConnector`` keeps offloaded KV chunks in CPU memory through an
``OffloadingManager`` (scheduler side, one per engine-core process) and a worker-side transfer
handler over one mmap region per engine. shmkv's spec replaces the manager's private
dictionaries with a shmkv pool, so every replica on the node sees ONE cache, and binds the
data region to that pool, so every replica's workers map the same bytes:

    --kv-transfer-config '{"kv_connector": "SharedOffloadingConnector",
      "kv_connector_module_path": "shmkv.vllm", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "SharedCPUOffloadingSpec",
      "spec_module_path": "shmkv.vllm", "cpu_bytes_to_use": 68719476736, "shmkv_pool": "node0"}}'

The rooms:

- ``manager.py``: ``SharedCPUOffloadingManager``, vLLM's LRU manager over the shared pool;
- ``recency.py``: offload keys in the pool, and vLLM's request-scoped LRU ranks;
- ``lru.py``: the eviction heap and free chunks, in shared memory, O(log chunks) a chunk;
- ``tier.py``: the tier table beside the pool (ranks, job bits, replica rows, identity);
- ``replicas.py``: a replica (engine core and GPU workers) alive or gone as one, and the
  job bits that keep a chunk out of other replicas' hands while its bytes move;
- ``identity.py``: what replicas sharing a tier must agree on;
- ``region.py``: the data region, bound to its pool;
- ``spec.py``: ``SharedCPUOffloadingSpec`` and ``SharedOffloadingConnector`` (imported on
  first use: vLLM's connector and CPU spec modules pull in its platform and worker code).

vLLM's out-of-tree spec API is experimental and changes between releases, so importing this
package checks vLLM's version against ``TESTED_VLLM_VERSIONS`` (0.32.0, the CPU build, 0.33.0
and 0.34.0; ``SHMKV_VLLM_UNTESTED=1`` tries another); ``compat.py`` holds what differs between
them, and ``cpu_worker.py`` moves the bytes
on vLLM's CPU platform, where vLLM's own CPU offloading refuses to run.
"""

from __future__ import annotations

from shmkv.vllm.compat import TESTED_VLLM_VERSIONS  # checks the vLLM release
from shmkv.vllm.manager import (
    PENDING_BIT,
    REAP_INTERVAL_S,
    SharedCPUOffloadingManager,
    data_region_engine_id,
)
from shmkv.vllm.tier import tier_table_name

_LAZY = ("SharedCPUOffloadingSpec", "SharedOffloadingConnector", "KNOWN_EXTRA_CONFIG_KEYS")

__all__ = ["PENDING_BIT", "REAP_INTERVAL_S", "TESTED_VLLM_VERSIONS", "SharedCPUOffloadingManager",
           "data_region_engine_id", "tier_table_name", *_LAZY]  # noqa: F822 (lazy)


def __getattr__(name: str):
    if name in _LAZY:
        from shmkv.vllm import spec

        value = getattr(spec, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
