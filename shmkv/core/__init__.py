"""vLLM's ``vllm/v1/core`` on the shared pool: KV-cache specs, requests, the single-type
managers, the coordinators (NoPrefixCache / Unitary / Hybrid) and ``KVCacheManager``.

Each scheduler process has its own objects of these classes (request state is private); the
blocks they hand out come from the one ``shmkv.pool.BlockPool``. Imports go down only: this
package uses ``shmkv.pool`` and the base modules (errors, events, hashing), never above.
"""
