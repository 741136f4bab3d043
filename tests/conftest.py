"""Fixtures shared by every test: unique pool names that are unlinked even on failure, also
when the run is stopped by SIGTERM (``tests/sigterm.py``)."""

from __future__ import annotations

import os
import uuid

import pytest

from shmkv import BlockPool
from shmkv.pool.block_pool import _ckernel
from shmkv.pool.layout import segment_name
from shmkv.pool.siblings import unlink_pool_siblings

# In CI (SHMKV_CI_STRICT=1, set by .ci/run) a missing C kernel or Redis fails, not skips.
from tests.ci_strict import pytest_make_collect_report, pytest_runtest_makereport  # noqa: F401
from tests.helpers import CheckedPool

# A SIGTERM to pytest runs the fixtures' finalizers (tests/sigterm.py).
from tests.sigterm import pytest_configure, pytest_unconfigure  # noqa: F401


def unique_pool_name(prefix: str = "t") -> str:
    return f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def pool_name():
    """A pool name no other test uses; its segment is unlinked at teardown."""
    name = unique_pool_name()
    yield name
    BlockPool.unlink(name)
    assert not os.path.exists(f"/dev/shm{segment_name(name)}")


@pytest.fixture
def store_name():
    """A page store's (pool's) name no other test uses; at teardown the pool and every
    sibling it owns (the data region) are removed, and nothing with the name is left."""
    name = unique_pool_name("sgl")
    yield name
    BlockPool.unlink(name)
    unlink_pool_siblings(name)
    assert not [e for e in os.listdir("/dev/shm") if name in e]


KERNELS = [
    "python",
    pytest.param(
        "c", marks=pytest.mark.skipif(_ckernel is None, reason="shmkv.pool._ckernel is not built")
    ),
]


@pytest.fixture(params=KERNELS)
def kernel(request) -> str:
    """Each pool test runs on both kernels: the pure-Python reference and the C one."""
    return request.param


@pytest.fixture
def make_pool(kernel):
    """Factory for raw pools (unique names); all are closed and unlinked at teardown."""
    made: list[BlockPool] = []

    def factory(num_gpu_blocks: int = 11, **kwargs) -> BlockPool:
        kwargs.setdefault("kernel", kernel)
        pool = BlockPool.create(unique_pool_name(), num_gpu_blocks, **kwargs)
        made.append(pool)
        return pool

    yield factory
    for pool in made:
        name = pool.pool_name
        pool.close()
        BlockPool.unlink(name)


@pytest.fixture
def make_checked_pool(make_pool):
    """Factory for pools that run check_invariants() after every public call."""

    def factory(num_gpu_blocks: int = 11, **kwargs) -> CheckedPool:
        return CheckedPool(make_pool(num_gpu_blocks, **kwargs))

    return factory
