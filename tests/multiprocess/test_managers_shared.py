"""Two scheduler processes, each with its own single-type managers on one shared pool: a
prompt prefix cached by the first is a hit for the second, in a full-attention group and a
sliding-window group alike, and the pool's invariants hold afterwards."""

from __future__ import annotations

import pytest

from shmkv import BlockPool
from tests.conftest import unique_pool_name
from tests.multiprocess import manager_workers
from tests.multiprocess.conftest import run_processes

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("kernel", ["python", "c"])
def test_second_process_hits_the_first_ones_blocks(spawn_ctx, kernel):
    """Process B's request, sharing a 32-token system prompt with process A's, gets A's
    cached blocks: all 8 in the full-attention group, the last 2 (window 8) in the
    sliding-window group, null blocks before them."""
    from shmkv.pool.block_pool import _ckernel

    if kernel == "c" and _ckernel is None:
        pytest.skip("shmkv.pool._ckernel is not built")
    name = unique_pool_name("mgr")
    system = list(range(100, 132))
    with BlockPool.create(name, 64, hash_block_size=4, kernel=kernel) as pool:
        try:
            results = spawn_ctx.Queue()
            codes = run_processes(spawn_ctx, manager_workers.serve_one,
                                  [(name, "a", system + [1, 2, 3, 4, 5], results)])
            assert codes == [0]
            hit_a, tables_a = results.get(timeout=10)
            codes = run_processes(spawn_ctx, manager_workers.serve_one,
                                  [(name, "b", system + [9, 8, 7], results)])
            assert codes == [0]
            hit_b, tables_b = results.get(timeout=10)
            assert hit_a == 0 and hit_b == 32
            assert tables_b[0][:8] == tables_a[0][:8]
            assert tables_b[1][:8] == [0] * 6 + tables_a[1][6:8]
            assert pool.get_num_free_blocks() == 63
            pool.check_invariants()
        finally:
            BlockPool.unlink(name)
