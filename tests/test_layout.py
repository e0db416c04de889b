"""The code's structure as the design states it (docs/design.md, "Packages"): data flows
one way, so no module imports, at any depth or inside a function, one that imports it
back; and the top-level packages stand in one order, each importing only those below
it:

    conf <- spotring <- trainer <- launch <- benchmarks <- sweep <- the command

conf is data (it imports nothing); spotring is the public API; trainer the built-in
trainer on it; launch runs jobs on clusters; benchmarks measures them with launch's
commands; sweep runs many trials with launch and draws its report with benchmarks.plots.
The command (spotring.cli, the dispatcher, and spotring.__main__ that runs it) is the
top: it may import any package, and no module imports it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

from tests.conftest import REPO

ORDER = ("conf", "spotring", "trainer", "launch", "benchmarks", "sweep")  # lowest first
COMMAND = ("spotring.cli", "spotring.__main__")


def modules() -> dict[str, Path]:
    found = {}
    for package in ORDER:
        for path in (REPO / package).rglob("*.py"):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def imported_by(name: str, path: Path, known: dict[str, Path]) -> dict[str, int]:
    """The project's modules that ``name`` imports (a package's name for its __init__),
    each with the line of its first import."""
    lines: dict[str, int] = {}
    for node in _run_time_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".")[:None if path.name == "__init__.py" else -1]
                package = package[:len(package) - node.level + 1]
                base = ".".join([*package, base] if base else package)
            names = {base} | {f"{base}.{alias.name}" for alias in node.names}
        else:
            continue
        for n in names & known.keys() - {name}:
            lines[n] = min(lines.get(n, node.lineno), node.lineno)
    return lines


def _run_time_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node of ``tree`` but the bodies of ``if TYPE_CHECKING:``, which never run
    (spotring/__init__.py names its lazily imported exports there for type checkers)."""
    for node in ast.iter_child_nodes(tree):
        yield node
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            for child in node.orelse:
                yield from [child, *_run_time_nodes(child)]
        else:
            yield from _run_time_nodes(node)


def layer(module: str) -> int:
    """The module's place in the order: its package's, the command's above them all."""
    return len(ORDER) if module in COMMAND else ORDER.index(module.split(".")[0])


def layer_name(module: str) -> str:
    return "the command" if module in COMMAND else module.split(".")[0]


def upward_imports(graph: dict[str, dict[str, int]], paths: dict[str, Path]) -> list[str]:
    """Every import of a module from a layer above the importer's, as PATH:LINE and why."""
    return [f"{paths[name].relative_to(REPO)}:{line}: {name} imports {imported}, but "
            f"{layer_name(name)} stands below {layer_name(imported)} "
            f"({' <- '.join(ORDER)} <- the command)"
            for name, imports in sorted(graph.items())
            for line, imported in sorted((line, i) for i, line in imports.items())
            if layer(imported) > layer(name)]


def import_graph(known: dict[str, Path]) -> dict[str, dict[str, int]]:
    return {name: imported_by(name, path, known) for name, path in known.items()}


def test_no_import_cycle():
    try:
        list(TopologicalSorter(import_graph(modules())).static_order())
    except CycleError as e:
        raise AssertionError(f"import cycle: {' -> '.join(e.args[1])}") from None


def test_packages_import_only_those_below_them():
    known = modules()
    wrong = upward_imports(import_graph(known), known)
    assert not wrong, "imports against the package order:\n" + "\n".join(wrong)


def test_an_upward_import_is_named_with_its_line():
    paths = {"spotring.checkpoint": REPO / "spotring/checkpoint.py",
             "trainer.config": REPO / "trainer/config.py",
             "spotring.cli": REPO / "spotring/cli.py"}
    graph = {"spotring.checkpoint": {"trainer.config": 12, "spotring.cli": 30},
             "trainer.config": {"spotring.checkpoint": 5},
             "spotring.cli": {"trainer.config": 40}}
    order = "(conf <- spotring <- trainer <- launch <- benchmarks <- sweep <- the command)"
    assert upward_imports(graph, paths) == [
        "spotring/checkpoint.py:12: spotring.checkpoint imports trainer.config, but spotring "
        f"stands below trainer {order}",
        "spotring/checkpoint.py:30: spotring.checkpoint imports spotring.cli, but spotring "
        f"stands below the command {order}"]
