"""docs/crash-safety.md links each of its promises to a test: every test it names must exist,
so a renamed or deleted test cannot leave a promise pointing at nothing."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "crash-safety.md"
NODE = re.compile(r"`(tests/[\w/]+\.py)(?:::(\w+))?`")


def _test_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.name for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_every_test_the_page_names_exists():
    named = NODE.findall(DOC.read_text())
    assert len(named) >= 30, "the promise table is gone from docs/crash-safety.md"
    missing = []
    for file, name in named:
        path = ROOT / file
        if not path.is_file():
            missing.append(file)
        elif name and name not in _test_names(path):
            missing.append(f"{file}::{name}")
    assert not missing, f"docs/crash-safety.md names tests that do not exist: {missing}"


def test_every_promise_in_the_table_has_a_test():
    rows = [line for line in DOC.read_text().splitlines()
            if line.startswith("| ") and not line.startswith("| promise")
            and not line.startswith("|---")]
    promises = [row for row in rows if row.count("|") == 3]
    assert len(promises) >= 15
    for row in promises:
        assert NODE.search(row.rsplit("|", 2)[1]), f"a promise with no test: {row}"
