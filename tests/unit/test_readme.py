"""The README and docs/: their examples run as printed (with unique names), the README stays
short, and every relative link (files and #anchors) resolves."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from shmkv import BlockPool
from tests.conftest import unique_pool_name

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
README_MAX_LINES = 300

_CODE = re.compile(r"```python\n(.*?)```", re.S)
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _python_blocks(*files: Path) -> list[str]:
    return [block for f in files for block in _CODE.findall(f.read_text())]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = _FENCE.sub("", path.read_text())
    return {_slug(m) for m in re.findall(r"^#+ +(.+)$", text, re.M)}


def _relative_links(path: Path) -> list[str]:
    text = _FENCE.sub("", path.read_text())
    return [t for t in _LINK.findall(text) if not re.match(r"[a-z]+:", t)]


def test_readme_example_runs():
    """The tour's first example: create, cache, a second attach hits, each frees its own."""
    code = _python_blocks(README)[0]
    assert '"node0"' in code
    name = unique_pool_name("readme")
    try:
        exec(compile(code.replace('"node0"', repr(name)), "README.md", "exec"), {})
    finally:
        BlockPool.unlink(name)


def test_readme_kv_cache_manager_example_runs():
    """The KVCacheManager example runs against a pool created for it, and allocates."""
    code = next(b for b in _python_blocks(README) if "KVCacheManager(" in b)
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


def test_block_table_example_runs():
    """The block-table example of docs/api.md runs as printed (torch installed)."""
    pytest.importorskip("torch")
    from shmkv.ranks.block_table import SharedBlockTables

    code = next(b for b in _python_blocks(README, *DOCS) if "SharedBlockTables.create(" in b)
    assert '"sched0"' in code
    name = unique_pool_name("readme-bt")
    try:
        exec(compile(code.replace('"sched0"', repr(name)), "docs/api.md", "exec"), {})
    finally:
        SharedBlockTables.unlink(name)


def test_readme_is_short():
    """The README is an entry point, not the reference: at most 300 lines."""
    assert len(README.read_text().splitlines()) <= README_MAX_LINES


def test_readme_vllm_flag_is_valid_json():
    """The --kv-transfer-config of the Use with vLLM section parses and names shmkv.vllm."""
    m = re.search(r"--kv-transfer-config '([^']*)'", README.read_text())
    assert m, "no vllm serve command with --kv-transfer-config"
    extra = json.loads(m.group(1))["kv_connector_extra_config"]
    assert extra["spec_module_path"] == "shmkv.vllm"


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(doc):
    """Every relative link (docs, code, images) names a file that exists, and every #anchor
    names a heading of its target."""
    broken = []
    for link in _relative_links(doc):
        target, _, anchor = link.partition("#")
        path = (doc.parent / target).resolve() if target else doc
        if not path.exists():
            broken.append(f"{link}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(f"{link}: no heading #{anchor}")
    assert not broken, broken


def test_readme_links_every_doc():
    """Each docs/*.md page is reachable from the README."""
    linked = {Path(t.partition("#")[0]).name for t in _relative_links(README)}
    assert [d.name for d in DOCS if d.name not in linked] == []
