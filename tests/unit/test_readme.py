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
