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


# ---------------------------------------------------------------------------- generated parts

def _update_docs():
    """scripts/update_docs.py, imported as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("update_docs", ROOT / "scripts" /
                                                  "update_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_docs_are_current():
    """docs/layout.md (rendered from shmkv/pool/layout.py) and the sample outputs of README.md
    and docs/serving.md (rendered from a real run's JSON with the functions the command
    prints with) are what `python scripts/update_docs.py` writes now."""
    stale = [p.relative_to(ROOT).as_posix() for p, text in _update_docs().expected_files().items()
             if p.read_text() != text]
    assert stale == [], f"run python scripts/update_docs.py: {stale} are stale"


def test_layout_doc_has_every_region_and_field():
    """The generated page names every region and every field of the record dtypes."""
    from shmkv.pool import layout as L

    text = (ROOT / "docs" / "layout.md").read_text()
    names = [r.name for r in L.REGIONS] + [
        f for dt in (L.HEADER_DTYPE, L.BLOCK_DTYPE, L.PROC_DTYPE, L.JOURNAL_DTYPE)
        for f in dt.names]
    assert [n for n in names if f"`{n}`" not in text] == []
    assert f"Layout version {L.LAYOUT_VERSION}," in text


def test_readme_first_screen_shows_the_comparison():
    """The first screen (50 lines) has the main command and its output: the three runs and
    the table comparing them."""
    lines = README.read_text().splitlines()[:50]
    assert "    pip install '.[torch]' && shmkv run" in lines
    # the torch advice comes before the command it is about
    text = "\n".join(lines)
    assert text.index("torch==2.13.0") < text.index("pip install '.[torch]' && shmkv run")
    start = lines.index("<!-- sample: shmkv-run -->")
    end = lines.index("<!-- end sample -->")
    shown = "\n".join(lines[start:end])
    for needle in ("run 1 of 4: one shared pool", "run 4 of 4: 4 private pools",
                   "pool, routing", "against the best baseline router"):
        assert needle in shown, needle


_ISSUE_TALK = re.compile(r"\bissues? ?-?\d+|\bissue's\b|\bitem \d+ of\b|\(issue\b", re.I)


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_docs_speak_of_features_not_issues(doc):
    """A reader cannot follow "issue 16's figures" or "item 8 of issue 20": the docs name
    features and figures."""
    assert _ISSUE_TALK.findall(doc.read_text()) == []


def test_dev_extra_has_what_the_tests_import():
    """cbor2 (the sha256_cbor cross-checks) is in the dev extra, with the others."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    dev = {re.split(r"[<>=]", d)[0] for d in extras["dev"]}
    assert {"cbor2", "pytest", "hypothesis", "redis", "pyzmq", "matplotlib"} <= dev


def test_readme_says_what_skipped_tests_need():
    """Every module a test skips without, that the dev and torch extras do not install, is
    named in the README's paragraph on skips, with CUDA, redis-server and SGLang."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    installed = {re.split(r"[<>=]", d)[0].replace("-", "_").lower()
                 for d in extras["dev"] + extras["torch"]}
    installed |= {"zmq", "numpy", "msgspec"}  # pyzmq's module; the runtime dependencies
    skipped = {m.split(".")[0] for f in (ROOT / "tests").rglob("*.py")
               for m in re.findall(r"importorskip\(\s*[\"']([\w.]+)", f.read_text())}
    text = README.read_text()
    section = text[text.index("Tests skip, each with its reason"):text.index("**What it is.**")]
    missing = [m for m in sorted(skipped - installed) if m.lower() not in section.lower()]
    assert missing == []
    for need in ("CUDA", "redis-server", "SGLang", "vLLM 0.33.0"):
        assert need in section, need


def test_the_default_run_and_ci_run_name_the_same_markers():
    """The README's test command leaves out the `long` and `slow` markers (pyproject.toml's
    addopts), the README names both and the command that adds the `long` tests, and CI runs
    that command (`.ci/run`'s last pytest line: everything but the hours-long soaks)."""
    import shlex

    import tomllib

    addopts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"][
        "ini_options"]["addopts"]
    args = shlex.split(addopts)
    assert args[args.index("-m") + 1] == "not long and not slow"
    text = README.read_text()
    assert "`long`" in text and "`slow`" in text
    assert "python -m pytest -q -m \"not slow\"" in text
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.startswith("python -m pytest")]
    assert len(ci) == 1 and ci[0].startswith('python -m pytest -q -m "not slow"'), ci
