"""A spawned SGLang instance for test_sglang_shared.py (module-level, so spawn can pickle
it): it builds its backend through SGLang's factory, as an instance does at start."""

from __future__ import annotations

import torch


def load_then_store(pool: str, keys: list[str], store_bytes: int, out) -> None:
    """Loads ``keys[:3]`` (stored by the parent) into host pages 8..10, then offers every key
    from host pages 0..5; reports the hits, the loaded pages' bytes, what was returned for
    the store, and the counters."""
    from tests.sglang_helpers import HostBuffer, make_backend, page_indices
    host = HostBuffer("page_first", seed=2)
    backend = make_backend(pool, host, store_bytes=store_bytes)
    try:
        hits = backend.batch_get_v1(keys[:3], page_indices([8, 9, 10], 4))
        # plain bytes: a torch tensor through a queue would be a shared-memory handle
        pages = [host.data_page(p * 4).view(torch.int16).numpy().tobytes() for p in (8, 9, 10)]
        stored = backend.batch_set_v1(keys, page_indices(list(range(len(keys))), 4))
        out.put((hits, pages, stored, backend.counters()))
    finally:
        backend.close()
