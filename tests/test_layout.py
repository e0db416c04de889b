"""The code's structure as the design states it (docs/design.md, "Packages"): data flows
one way, so no module imports, at any depth or inside a function, one that imports it
back; and spotring's parts stand in layers, each importing only those below it (parts
side by side import neither each other):

    spotring.conf <- spotring <- spotring.support <- spotring.trainer <- spotring.launch
                                                      <- spotring.benchmarks | spotring.sweep

spotring.conf is data (it imports nothing); spotring (the base: the modules of spotring/
itself) is the public API and the ``spotring`` command's dispatcher, which finds the
subcommands through entry points and so names no part above it; support what the parts
above share and a user's script never calls (the restart policy, Hydra's composition,
the plots); trainer the built-in trainer on them; launch runs jobs on clusters;
benchmarks measures them with launch's commands, and sweep runs many trials with them.
The parts are the repository's top-level folders, mapped under ``spotring.`` by
pyproject.toml, which this test reads.
``importlib.import_module("...")`` with a constant name counts as an import, and so does
a name in ``pytest_plugins``.

And the tests stand apart: no module outside tests/ imports tests (its conftest
included), and no test file imports another; what they share is harness/'s.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Iterable, Iterator
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

from tests.conftest import REPO, pyproject

BASE = "spotring"
LAYERS = (("spotring.conf",), (BASE,), ("spotring.support",), ("spotring.trainer",),
          ("spotring.launch",), ("spotring.benchmarks", "spotring.sweep"))  # lowest first
PARTS = [p for layer in LAYERS for p in layer]
SHOWN = " <- ".join(" | ".join(layer) for layer in LAYERS)


def parts() -> dict[str, Path]:
    """Each part's package name -> its folder, as pyproject.toml maps them."""
    setuptools = pyproject()["tool"]["setuptools"]
    return {name: REPO / folder for name, folder in setuptools["package-dir"].items()}


def modules() -> dict[str, Path]:
    found = {}
    for package, folder in parts().items():
        for path in folder.rglob("*.py"):
            name = ".".join([package, *path.relative_to(folder).with_suffix("").parts])
            found[name.removesuffix(".__init__")] = path
    return found


def imported_by(name: str, path: Path, known: dict[str, Path]) -> dict[str, int]:
    """The project's modules that ``name`` imports (a package's name for its __init__),
    each with the line of its first import."""
    lines: dict[str, int] = {}
    for node in _run_time_nodes(ast.parse(path.read_text())):
        if _imports_by_name(node):
            names = {node.args[0].value}
        elif _plugins(node):
            names = {element.value for element in node.value.elts}
        elif isinstance(node, ast.Import):
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


def _imports_by_name(node: ast.AST) -> bool:
    """importlib.import_module("constant.name")."""
    return (isinstance(node, ast.Call) and ast.unparse(node.func).endswith("import_module")
            and bool(node.args) and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str))


def _plugins(node: ast.AST) -> bool:
    """pytest_plugins = ["constant.name", ...]: the modules pytest imports as plugins."""
    return (isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "pytest_plugins" for t in node.targets)
            and isinstance(node.value, ast.List | ast.Tuple)
            and all(isinstance(e, ast.Constant) and isinstance(e.value, str)
                    for e in node.value.elts))


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


def part(module: str) -> str:
    """The part a module belongs to: the longest of PARTS its name starts with."""
    return max((p for p in PARTS if module == p or module.startswith(p + ".")), key=len)


def layer(module: str) -> int:
    return next(i for i, parts in enumerate(LAYERS) if part(module) in parts)


def wrong(importer: str, imported: str) -> bool:
    """An import from a layer above, or from another part of the same layer."""
    return layer(imported) > layer(importer) or (
        layer(imported) == layer(importer) and part(imported) != part(importer))


def upward_imports(graph: dict[str, dict[str, int]], paths: dict[str, Path]) -> list[str]:
    """Every import of a module from a layer above the importer's, as PATH:LINE and why."""
    return [f"{paths[name].relative_to(REPO)}:{line}: {name} imports {imported}, but "
            f"{part(name)} does not stand above {part(imported)} ({SHOWN})"
            for name, imports in sorted(graph.items())
            for line, imported in sorted((line, i) for i, line in imports.items())
            if wrong(name, imported)]


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


def test_an_upward_or_sideways_import_is_named_with_its_line():
    paths = {"spotring.job": REPO / "spotring/job.py",
             "spotring.trainer.config": REPO / "trainer/config.py",
             "spotring.sweep.report": REPO / "sweep/report.py"}
    graph = {"spotring.job": {"spotring.trainer.config": 12},
             "spotring.trainer.config": {"spotring.job": 5},
             "spotring.sweep.report": {"spotring.benchmarks.plots": 30,
                                       "spotring.launch": 31}}
    assert upward_imports(graph, paths) == [
        "spotring/job.py:12: spotring.job imports spotring.trainer.config, but "
        f"spotring does not stand above spotring.trainer ({SHOWN})",
        "sweep/report.py:30: spotring.sweep.report imports spotring.benchmarks.plots, but "
        f"spotring.sweep does not stand above spotring.benchmarks ({SHOWN})"]


def test_an_import_by_name_counts():
    tree = ast.parse("import importlib\nimportlib.import_module('spotring.sweep.runner')\n")
    assert [n.args[0].value for n in ast.walk(tree) if _imports_by_name(n)] == [
        "spotring.sweep.runner"]


CHECKPOINT_LAYOUT = "spotring.checkpoint.layout"


def _strings_in_code(tree: ast.AST) -> Iterator[ast.Constant]:
    """The string constants of ``tree`` that are not docstrings (f-string parts too)."""
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef
                                | ast.AsyncFunctionDef)
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and id(node) not in docstrings:
            yield node


def test_only_the_checkpoint_module_spells_the_checkpoint_layout():
    """Whoever reads checkpoints outside spotring.checkpoint.layout asks it for their names
    (manifests, files_of, folder_name, newest_valid) instead of typing them again."""
    retyped = [f"{path.relative_to(REPO)}:{node.lineno}: {node.value!r}"
               for name, path in modules().items() if name != CHECKPOINT_LAYOUT
               for node in _strings_in_code(ast.parse(path.read_text()))
               if "ckpt-" in node.value]
    assert not retyped, "the checkpoint layout typed outside spotring.checkpoint.layout:\n" + \
        "\n".join(retyped)


# Folders that hold no module of the checkout's own: environments, caches, node packages,
# what runs leave, and the data. Hidden ones (.venv, .git) too.
NOT_CODE = {"node_modules", "__pycache__", "runs", "outputs", "build", "gpu-bundle", "data"}


def python_files(root: Path) -> Iterator[Path]:
    """The checkout's Python: every .py file, and the scripts that start with a Python
    shebang (tools/suite-profile), outside NOT_CODE and hidden folders."""
    for folder, folders, files in os.walk(root):
        folders[:] = sorted(f for f in folders if f not in NOT_CODE and not f.startswith(".")
                            and not f.endswith(".egg-info"))
        for file in sorted(files):
            path = Path(folder, file)
            if file.endswith(".py") or (os.access(path, os.X_OK) and "." not in file
                                        and _shebang(path).startswith(b"#!")
                                        and b"python" in _shebang(path)):
                yield path


def _shebang(path: Path) -> bytes:
    with path.open("rb") as f:
        return f.readline(200)


def module_name(path: Path, root: Path) -> str:
    return ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")


def imports_of_tests(paths: Iterable[Path], root: Path) -> list[str]:
    """Every import that breaks the tests apart, as PATH:LINE and why: of tests (its
    conftest included) by a module outside tests/, or of a test file by another module
    of tests/."""
    tests = {module_name(p, root): p for p in (root / "tests").glob("*.py")}
    wrong = []
    for path in paths:
        inside = path.parent == root / "tests"
        imports = imported_by(module_name(path, root), path, tests)
        for line, imported in sorted((line, i) for i, line in imports.items()):
            where = f"{path.relative_to(root)}:{line}: imports {imported}"
            if not inside:
                wrong.append(f"{where}, but no module outside tests/ imports tests: what "
                             "tests/ shares with it goes in harness/")
            elif imported.startswith("tests.test_"):
                wrong.append(f"{where}, another test file: what two test files share goes "
                             "in harness/")
    return wrong


def test_no_module_outside_tests_imports_them_and_no_test_file_imports_another():
    files = list(python_files(REPO))
    assert REPO / "harness" / "ranks.py" in files and REPO / "tools" / "suite-profile" in files
    wrong = imports_of_tests(files, REPO)
    assert not wrong, "imports of tests:\n" + "\n".join(wrong)


def test_an_import_of_tests_from_outside_or_of_another_test_file_is_named_with_its_line(
        tmp_path):
    sources = {
        "tests/__init__.py": "",
        "tests/conftest.py": "from harness import REPO\npytest_plugins = ['harness.stores']\n",
        "tests/test_a.py": "import os\nfrom tests.conftest import REPO\n"
                           "from tests.test_b import helper\n",
        "tests/test_b.py": "def helper():\n    from tests import test_a\n",
        "harness/__init__.py": "",
        "harness/stores.py": "import pytest\n\nfrom tests.conftest import REPO\n",
        "benchmarks/results/run/measure.py": "import importlib\n\n"
                                             "importlib.import_module('tests.test_a')\n",
        "tools/plugins.py": "pytest_plugins = ['tests.conftest']\n",
    }
    for name, text in sources.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    outside = "no module outside tests/ imports tests: what tests/ shares with it goes in harness/"
    another = "another test file: what two test files share goes in harness/"
    assert imports_of_tests(python_files(tmp_path), tmp_path) == [
        f"benchmarks/results/run/measure.py:3: imports tests.test_a, but {outside}",
        f"harness/stores.py:3: imports tests.conftest, but {outside}",
        f"tests/test_a.py:3: imports tests.test_b, {another}",
        f"tests/test_b.py:2: imports tests.test_a, {another}",
        f"tools/plugins.py:1: imports tests.conftest, but {outside}",
    ]
