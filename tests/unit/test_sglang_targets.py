"""Gets whose destinations cannot take the pages as asked (a strided target, one host page
named twice): refused before anything is pinned or copied, naming the argument."""

from __future__ import annotations

import pytest

pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

import torch  # noqa: E402

from shmkv.errors import UsageError  # noqa: E402
from tests.sglang_helpers import HostBuffer, make_backend  # noqa: E402
from tests.sglang_host import page_indices  # noqa: E402


def test_a_strided_target_is_refused_and_no_target_is_written(store_name):
    """A target of the right size that is not contiguous (a strided view) is a UsageError
    naming target_location, raised before any page is copied: the other targets of the call
    stay as they were. (Before: the first target was filled, then a RuntimeError from
    ``view``.)"""
    host = HostBuffer("page_first")
    backend = make_backend(store_name, host)
    try:
        page = host.data_page(0).clone().view(-1)
        page.copy_(torch.arange(page.numel(), dtype=page.dtype))
        assert backend.set("k", page)
        good = torch.zeros_like(page)
        strided = torch.zeros(2 * page.numel(), dtype=page.dtype)[::2]
        assert strided.numel() == page.numel() and not strided.is_contiguous()
        with pytest.raises(UsageError, match="target_location must be a contiguous"):
            backend.batch_get(["k", "k"], [good, strided])
        assert not good.any()
        assert backend.store.pool.get_num_free_blocks() == backend.store.num_pages
        assert torch.equal(backend.get("k", good), page)  # a contiguous one is served
        backend.store.pool.check_invariants()
    finally:
        backend.close()


def test_a_host_page_named_twice_in_one_get_is_refused(store_name):
    """batch_get_v1 with two keys landing in one host page would answer True for both while
    the page holds one of them: a UsageError naming host_indices, nothing copied. (Before:
    both pages were copied into host page 3, and both reported loaded.)"""
    host = HostBuffer("page_first")
    backend = make_backend(store_name, host)
    try:
        assert backend.batch_set_v1(["a", "b"], page_indices([0, 1], host.page_size)) == [
            True, True]
        before = host.kv_buffer.clone()
        with pytest.raises(UsageError, match="host_indices.*page 3 twice"):
            backend.batch_get_v1(["a", "b"], page_indices([3, 3], host.page_size))
        assert torch.equal(host.kv_buffer, before)
        assert backend.store.pool.get_num_free_blocks() == backend.store.num_pages
        backend.store.pool.check_invariants()
    finally:
        backend.close()
