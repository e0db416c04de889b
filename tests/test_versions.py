"""The torch and Python spotring supports (spotring/versions.py): the range declared in
pyproject.toml is the one make test runs at both ends, a torch below it is refused at once
by name, and torch's private parts are named in spotring/torch_compat.py alone.

The refusal is proved without installing an old torch: a folder holding only an older
torch's package metadata, first on PYTHONPATH, is what pip's metadata says is installed,
and the check reads nothing else.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from spotring import torch_compat, versions
from spotring.launch.commands import BIN
from tests.conftest import REPO, pyproject

OLDER = "2.7.1"  # a release below the floor


def test_a_torch_below_the_floor_is_refused_naming_both_versions_and_the_floor_is_not():
    problem = versions.torch_problem(OLDER)
    assert f"torch>={versions.TORCH_FLOOR[0]}.{versions.TORCH_FLOOR[1]}" in problem
    assert f"has torch {OLDER}" in problem and sys.executable in problem
    assert versions.torch_problem("2.8.0+cu128") is None
    assert versions.torch_problem("2.15.0.dev20261101+cpu") is None  # newer: warned of
    assert "newer than the newest" in versions.torch_untested("2.15.0")
    assert versions.torch_untested("2.14.1+cu130") is None
    assert "torch is not installed" in versions.torch_problem(None)


@pytest.fixture
def older_torch(tmp_path) -> dict[str, str]:
    """An environment in which pip's metadata says torch OLDER is installed."""
    info = tmp_path / f"torch-{OLDER}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {OLDER}\n")
    return {"PYTHONPATH": str(tmp_path), "PATH": f"{BIN}:/usr/bin:/bin"}


@pytest.mark.slow(cores=1)
@pytest.mark.parametrize("argv, code", [
    ([sys.executable, "-c", "import spotring"], 1),        # ImportError, for a script
    ([str(BIN / "spotring"), "train"], 2),                  # a command: bad input
    ([sys.executable, "-m", "spotring.trainer"], 2),
])
def test_import_and_the_commands_refuse_an_older_torch_at_once(older_torch, tmp_path, argv,
                                                               code):
    done = subprocess.run(argv, env=older_torch, cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == code, done.stderr
    assert "spotring needs torch>=2.8" in done.stderr and f"has torch {OLDER}" in done.stderr
    if code == 1:
        assert "TorchVersionError" in done.stderr
    else:  # one paragraph, no traceback, nothing started
        assert done.stderr.startswith("spotring: error: ") and "Traceback" not in done.stderr
        assert list(tmp_path.iterdir()) == [tmp_path / f"torch-{OLDER}.dist-info"]


def _declared(requirement: str, name: str) -> tuple[int, int]:
    """(major, minor) of ``name``'s pinned or lower-bound version in ``requirement`` lines."""
    found = re.search(rf"^{name}\s*(==|>=)\s*(\d+)\.(\d+)", requirement, re.M)
    assert found, f"no {name} in {requirement[:200]}"
    return int(found[2]), int(found[3])


def test_the_declared_range_is_the_range_make_test_runs():
    """pyproject's lower bounds and classifiers, constraints-oldest.txt (the oldest end),
    constraints.txt (the newest end) and the Makefile's Pythons all say versions.py's."""
    project = pyproject()["project"]
    dependencies = "\n".join(project["dependencies"])
    assert _declared(dependencies, "torch") == versions.TORCH_FLOOR
    assert _declared((REPO / "constraints-oldest.txt").read_text(), "torch") \
        == versions.TORCH_FLOOR
    assert _declared((REPO / "constraints.txt").read_text(), "torch") == versions.TORCH_NEWEST
    oldest, newest = versions.PYTHONS
    assert project["requires-python"] == f">={oldest[0]}.{oldest[1]}"
    classifiers = {tuple(map(int, c.rsplit(":: ", 1)[1].split(".")))
                   for c in project["classifiers"] if c.startswith("Programming Language")}
    assert classifiers == {(3, minor) for minor in range(oldest[1], newest[1] + 1)}
    makefile = (REPO / "Makefile").read_text()
    assert f"OLDEST_PYTHON ?= {oldest[0]}.{oldest[1]}" in makefile
    assert f"NEWEST_PYTHON ?= {newest[0]}.{newest[1]}" in makefile


# torch's private parts, and its APIs that differ between supported releases.
PRIVATE = re.compile(r"torch\.(utils\.)?_[a-z]|storage_data|_StorageInfo|\breader\.(fs|path)\b"
                     r"|FileSystemBase|get_capabilities")


def test_torchs_private_parts_are_named_in_one_module_only():
    """spotring/torch_compat.py is the one home of torch's moving parts: no other module
    of the package (its parts included) names one."""
    folders = [REPO / folder for folder in pyproject()["tool"]["setuptools"]["package-dir"]
               .values()]
    found = sorted(f"{path.relative_to(REPO)}:{number}: {line.strip()}"
                   for folder in folders for path in folder.rglob("*.py")
                   if path.name != "torch_compat.py"
                   for number, line in enumerate(path.read_text().splitlines(), 1)
                   if PRIVATE.search(line.split("#")[0]))
    assert not found, "\n".join(found)


def test_the_cpus_features_are_linuxs_whichever_way_torch_tells_them():
    """torch 2.9 on asks the CPU itself, 2.8 reads /proc/cpuinfo: the same bf16 answer."""
    bf16 = {"avx512_bf16", "amx_bf16"}
    if not Path("/proc/cpuinfo").exists():
        pytest.skip("no /proc/cpuinfo to compare with")
    assert bf16 & torch_compat.cpu_features() == bf16 & torch_compat.cpuinfo_flags()
