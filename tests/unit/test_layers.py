"""The package's layers (DESIGN.md section 8): imports only go down, and no module imports
itself back through others.

Every module under ``shmkv/`` is parsed with ``ast`` and every ``import`` / ``from ...
import`` of a ``shmkv`` module is taken, wherever it sits: at the top, inside a function, a
``try``. Only imports under ``if TYPE_CHECKING:`` are left out: they never run, so they
cannot make an import cycle, and annotations may name a type of any layer.

Importing a package's submodule runs the package's ``__init__`` first; that implicit step is
not an edge here (``shmkv/__init__.py`` re-exports the public names of every layer, which
makes it the top of the graph, not a part of every cycle).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "shmkv"

# Bottom to top. A module may import from its own layer or any layer below it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    # Nothing of shmkv below them. plot is a leaf drawing helper (matplotlib) that the
    # serve report uses, so it sits here rather than with the integrations.
    # model_files: what a process can see of its weights, for both integrations' identities.
    ("base", ("shmkv.errors", "shmkv.events", "shmkv.hashing", "shmkv.plot",
              "shmkv.model_files")),
    ("pool", ("shmkv.pool",)),
    ("core", ("shmkv.core",)),
    ("ranks", ("shmkv.ranks", "shmkv.messages")),
    ("serve", ("shmkv.serve",)),
    ("integrations", ("shmkv.publisher", "shmkv.metrics", "shmkv.stats",
                      "shmkv.cluster_index", "shmkv.vllm", "shmkv.sglang")),
    ("cli", ("shmkv.cli", "shmkv.__main__", "shmkv")),  # the command, and the facade
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    mods = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    for c_source in PACKAGE.rglob("*.c"):  # extension modules: leaves, named after the file
        mods.setdefault(module_name(c_source), c_source)
    return mods


def layer_of(module: str) -> int:
    """The index of ``module``'s layer: the layer naming its longest prefix."""
    best, best_len = -1, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    return best


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """(imported shmkv module, line) for every import statement of the module that runs,
    function-local ones included, ``if TYPE_CHECKING:`` blocks left out."""
    if path.suffix != ".py":
        return []
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: list[tuple[str, int]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.extend((alias.name, node.lineno) for alias in node.names
                       if alias.name.split(".")[0] == "shmkv")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            if base.split(".")[0] == "shmkv":
                for alias in node.names:
                    sub = f"{base}.{alias.name}"  # `from pkg import submodule`
                    out.append((sub if sub in modules else base, node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


def import_graph() -> dict[str, list[tuple[str, int]]]:
    modules = all_modules()
    return {m: imports_of(m, p, modules) for m, p in sorted(modules.items())}


def test_every_module_has_a_layer():
    unplaced = [m for m in all_modules() if layer_of(m) < 0]
    assert not unplaced, f"put these modules in a layer of LAYERS: {unplaced}"


def test_imports_only_go_down():
    upward = []
    for module, imports in import_graph().items():
        mine = layer_of(module)
        for target, line in imports:
            theirs = layer_of(target)
            if theirs > mine:
                upward.append(f"{module}:{line} imports {target} "
                              f"({LAYERS[mine][0]} -> {LAYERS[theirs][0]})")
    assert not upward, "imports going up the layers:\n" + "\n".join(upward)


def test_no_import_cycles():
    graph = {m: sorted({t for t, _ in imports if t != m})
             for m, imports in import_graph().items()}
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in graph.get(node, []):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                walk(nxt)
        path.pop()
        state[node] = 2

    for module in graph:
        if module not in state:
            walk(module)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_checker_sees_function_local_imports_and_skips_type_checking(tmp_path):
    """The parser itself: a function-local import counts, a TYPE_CHECKING one does not."""
    source = tmp_path / "m.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from shmkv.cli import main\n"
        "def f():\n"
        "    from shmkv.pool import layout\n"
        "    import shmkv.errors\n"
    )
    modules = {"shmkv.pool.layout": source, "shmkv.x.m": source}
    found = sorted(t for t, _ in imports_of("shmkv.x.m", source, modules))
    assert found == ["shmkv.errors", "shmkv.pool.layout"]
