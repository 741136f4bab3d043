"""SGLang instances in real processes share one shmkv L3 store through the real
``HiCacheStorage`` subclass, built by SGLang's factory in each: a page one stored is a hit
for the other, byte for byte, and no page is stored twice. (The store's promises across
processes, SIGKILL included, are tested without SGLang: test_sglang_store_shared.py.)"""

from __future__ import annotations

import pytest

pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

import torch  # noqa: E402

from shmkv import BlockPool  # noqa: E402
from tests.multiprocess import sglang_workers as W  # noqa: E402
from tests.multiprocess.conftest import join_processes  # noqa: E402
from tests.sglang_helpers import HostBuffer, make_backend, page_indices  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180), pytest.mark.long]
STORE_BYTES = 1 << 20
KEYS = [f"page{i}" for i in range(6)]



def _int16(page: torch.Tensor) -> bytes:
    return page.view(torch.int16).numpy().tobytes()


def test_instances_share_pages_through_sglangs_own_class(spawn_ctx, store_name):
    """This process's instance stores 3 pages; a spawned instance loads them byte for byte,
    then offers all 6 and stores only the 3 new ones; this instance loads those."""
    mine = make_backend(store_name, HostBuffer("page_first", seed=1), store_bytes=STORE_BYTES)
    try:
        assert mine.batch_set_v1(KEYS[:3], page_indices([0, 1, 2], 4)) == [True] * 3
        out = spawn_ctx.Queue()
        other = spawn_ctx.Process(target=W.load_then_store,
                                  args=(store_name, KEYS, STORE_BYTES, out))
        other.start()
        hits, pages, stored, counters = out.get(timeout=150)
        assert join_processes([other]) == [0]
        host = mine.mem_pool_host
        assert hits == [True] * 3
        assert pages == [_int16(host.data_page(p * 4)) for p in (0, 1, 2)]
        assert stored == [True] * 6
        assert (counters["stored_pages"], counters["skipped_pages"]) == (3, 3)
        assert mine.batch_exists(KEYS) == 6
        assert mine.batch_get_v1(KEYS[3:], page_indices([12, 13, 14], 4)) == [True] * 3
        theirs = HostBuffer("page_first", seed=2)
        for i, p in enumerate((12, 13, 14)):
            assert torch.equal(host.data_page(p * 4), theirs.data_page((3 + i) * 4)), i
        assert mine.counters()["stored_pages"] == 3
        pool = BlockPool.attach(store_name)
        try:
            pool.reap_dead()
            pool.check_invariants()
            assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1  # no pin left
        finally:
            pool.close()
    finally:
        mine.close()
