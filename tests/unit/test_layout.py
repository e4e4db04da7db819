"""The shape of the code: no import loop between packages, no module too long to read.

Read from the source with ``ast`` (nothing is imported), so it runs anywhere
in a fraction of a second. A package here is a folder of modules
(``gpufeed.server.media``, ``gpufeed.server.serving.planning``); the modules
directly in ``src/gpufeed/server/`` and ``client/`` (``config``, ``app``, ``feed``...)
each count as a node of their own, since they do different jobs. An import
inside a function or under ``TYPE_CHECKING`` counts like any other: a loop
drawn only for a type checker is still a loop a reader must follow.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Where each import name's files live (src/ layout: the folders are the import names).
PACKAGES = {"gpufeed.server": ROOT / "src/gpufeed/server",
            "gpufeed.client": ROOT / "src/gpufeed/client"}
# A module longer than this does more than one job, or one job too many ways.
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    """Every module of the server and the client, by dotted name."""
    found = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def _is_package(name: str, modules: dict[str, Path]) -> bool:
    return name in modules and modules[name].name == "__init__.py"


def _imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ours that module ``name`` imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # a name inside a module: the module
                target = target.rpartition(".")[0]
            if target:
                out.add(target)
    return out


def _node(name: str, modules: dict[str, Path]) -> str:
    """The package a module belongs to; a module at the top of a root package is its own."""
    if _is_package(name, modules):
        return name
    parent = name.rpartition(".")[0]
    return name if parent in PACKAGES else parent


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        here = _node(name, modules)
        targets = {_node(t, modules) for t in _imported(name, path, modules)}
        graph.setdefault(here, set()).update(targets - {here})
    return graph


def _loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    loops = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            part = []
            while True:
                other = stack.pop()
                on_stack.discard(other)
                part.append(other)
                if other == node:
                    break
            if len(part) > 1:
                loops.append(sorted(part))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return loops


def test_the_graph_sees_the_packages():
    """The walk finds what it should: a guard against a check that passes on nothing."""
    graph = _graph()
    assert "gpufeed.server.serving.planning" in graph["gpufeed.server.serving.running"]
    assert "gpufeed.server.storage" in graph["gpufeed.server.media"]


def test_no_package_imports_one_that_imports_it_back():
    graph = _graph()
    loops = _loops(graph)
    detail = [" <-> ".join(loop) + ": " + "; ".join(
        f"{a} imports {', '.join(sorted(graph[a] & set(loop)))}" for a in loop) for loop in loops]
    assert not loops, "import loops between packages:\n" + "\n".join(detail)


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_module_over_the_line_limit(package):
    long = {str(path.relative_to(ROOT)): n for path in sorted(PACKAGES[package].rglob("*.py"))
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by idea): {long}"


def test_every_package_ships_in_the_wheel():
    """pyproject.toml lists its packages by name: a new package folder missing there is
    missing from the wheel and the image, though an editable install finds it."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    folders = {name for name, path in _modules().items() if path.name == "__init__.py"}
    assert folders <= listed, f"not in pyproject.toml's packages: {sorted(folders - listed)}"
