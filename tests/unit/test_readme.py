"""The README's first example runs as printed (with a unique pool name)."""

from __future__ import annotations

import re
from pathlib import Path

from shmkv import BlockPool
from tests.conftest import unique_pool_name

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_example_runs():
    """The Use example: create, cache, a second attach hits, each frees its own."""
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    assert '"node0"' in code
    name = unique_pool_name("readme")
    try:
        exec(compile(code.replace('"node0"', repr(name)), "README.md", "exec"), {})
    finally:
        BlockPool.unlink(name)


def test_readme_kv_cache_manager_example_runs():
    """The KVCacheManager example runs against a pool created for it, and allocates."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    code = next(b for b in blocks if "KVCacheManager(" in b)
    assert '"node-kv"' in code
    name = unique_pool_name("readme-kvm")
    pool = BlockPool.create(name, 256)
    scope = {"prompt_token_ids": list(range(40))}
    try:
        exec(compile(code.replace('"node-kv"', repr(name)), "README.md", "exec"), scope)
        assert scope["num_hit"] == 0 and scope["new"] is not None
        scope["kvm"].free(scope["req"])
        scope["pool"].check_invariants()
        scope["pool"].close()
    finally:
        pool.close()
        BlockPool.unlink(name)


def test_readme_block_table_example_runs():
    """The block-table example runs as printed (torch installed)."""
    import pytest

    pytest.importorskip("torch")
    from shmkv.ranks.block_table import SharedBlockTables

    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    code = next(b for b in blocks if "SharedBlockTables.create(" in b)
    assert '"sched0"' in code
    name = unique_pool_name("readme-bt")
    try:
        exec(compile(code.replace('"sched0"', repr(name)), "README.md", "exec"), {})
    finally:
        SharedBlockTables.unlink(name)
