"""Imports go one way: no circle of modules that import each other, type-checking imports included."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (("client", "weightstream"), ("service", "weightstream_server"))


def imports_of_each_module() -> dict[str, set[str]]:
    modules = {
        path.relative_to(ROOT / base).with_suffix("").as_posix().replace("/", ".").removesuffix(".__init__"): path
        for base, package in PACKAGES
        for path in (ROOT / base / package).rglob("*.py")
    }
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                submodules = {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
                found |= submodules
                if len(submodules) < len(node.names) and node.module in modules:
                    found.add(node.module)
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names} & modules.keys()
        graph[name] = found - {name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of two or more modules that reach each other (Tarjan's strongly connected components)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in sorted(graph[module]):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            group = []
            while True:
                other = stack.pop()
                group.append(other)
                if other == module:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_no_module_imports_a_module_that_imports_it_back() -> None:
    graph = imports_of_each_module()
    assert len(graph) > 100  # the packages were found
    assert circles(graph) == []


def test_a_circle_is_found() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
