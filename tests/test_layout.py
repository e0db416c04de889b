"""The code's structure as the design states it: data flows one way, so no module of
spotring imports, at any depth or inside a function, one that imports it back."""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

from tests.conftest import REPO

PACKAGES = ("spotring", "trainer", "launch", "benchmarks", "conf")


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def imported_by(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project's modules that ``name`` imports (a package's name for its __init__)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".")[:None if path.name == "__init__.py" else -1]
                package = package[:len(package) - node.level + 1]
                base = ".".join([*package, base] if base else package)
            names |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    return {n for n in names if n in known and n != name}


def test_no_import_cycle():
    known = modules()
    graph = {name: imported_by(name, path, known) for name, path in known.items()}
    try:
        list(TopologicalSorter(graph).static_order())
    except CycleError as e:
        raise AssertionError(f"import cycle: {' -> '.join(e.args[1])}") from None
