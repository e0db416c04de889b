"""spotring as a user installs it: the wheel, in a new virtual environment, used from a
directory outside the checkout. The new environment borrows torch and the other
dependencies from the checkout's .venv (a .pth line, so none of .venv's own .pth files,
and so not its editable spotring, are read); spotring and its parts come from the wheel
alone. The user's directory holds modules named as the repository's folders are
(launch.py, trainer.py, sweep.py, conf/, benchmarks/), each of which raises on import:
installed, spotring's parts live under `spotring.`, so none of them is ever imported.
moto, matplotlib and pytest are shadowed by modules that refuse to import, so the trainer
and the launcher's dry run are shown not to need them."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from harness.installed import checkout_wheel, spotring_venv
from tests.conftest import QUICK, REPO

pytestmark = pytest.mark.slow(cores=1)

NOT_FOR_USERS = ("moto", "matplotlib", "pytest")
# The user's own modules, named as spotring's folders are in the repository.
USERS_OWN = ("launch.py", "trainer.py", "sweep.py", "conf/__init__.py", "benchmarks/__init__.py")
STEPS = ["train.max_steps=4", "train.eval_samples=500", *QUICK]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    """PATH and environment of a new venv with the wheel installed, and a bare cwd."""
    root = tmp_path_factory.mktemp("user")
    env_dir = spotring_venv(root / "env")
    blocked = root / "blocked"
    blocked.mkdir()
    for name in NOT_FOR_USERS:
        (blocked / f"{name}.py").write_text(
            f"raise ImportError('{name} is not installed for this user (tests/test_package.py)')\n")
    work = root / "work"
    for name in USERS_OWN:
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        (work / name).write_text(f"raise RuntimeError('the user\\'s own {name} was imported')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env |= {"PATH": f"{env_dir / 'bin'}:{Path(sys.executable).parent}:{env['PATH']}",
            "PYTHONPATH": str(blocked), "OMP_NUM_THREADS": "1"}
    return {"env": env, "cwd": work}


def user(installed: dict, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), cwd=installed["cwd"], env=installed["env"],
                          capture_output=True, text=True, timeout=timeout)


def test_spotring_is_the_only_top_level_name():
    with zipfile.ZipFile(checkout_wheel()) as wheel:
        record = next(n for n in wheel.namelist() if n.endswith(".dist-info/RECORD"))
        rows = list(csv.reader(wheel.read(record).decode().splitlines()))
    tops = {row[0].split("/")[0] for row in rows}
    assert tops == {"spotring", record.split("/")[0]}, sorted(tops)
    code = {row[0] for row in rows}
    for folder in ("trainer", "launch", "sweep", "benchmarks", "conf"):  # every module of it
        for path in (REPO / folder).rglob("*.py"):
            if (path.parent / "__init__.py").is_file():  # not benchmarks/results/*/x.py
                assert f"spotring/{folder}/{path.relative_to(REPO / folder)}" in code, path


def test_the_command_is_the_wheels(installed):
    proc = user(installed, "spotring", "--help")
    assert proc.returncode == 0, proc.stderr
    assert "predict" in proc.stdout
    where = user(installed, "python", "-c", "import spotring.trainer, spotring.conf; "
                 "print(spotring.trainer.__file__, spotring.conf.__file__)")
    assert where.returncode == 0, where.stderr
    assert str(REPO) not in where.stdout and "site-packages" in where.stdout


@pytest.mark.parametrize("args", [["launch", "--help"], ["sweep", "--help"],
                                  ["sbatch", "--dry-run", "nodes=2", "--", "train.epochs=1"]])
def test_the_users_own_modules_shadow_nothing(installed, args):
    proc = user(installed, "python", "-m", "spotring", *args)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "was imported" not in proc.stdout + proc.stderr


def test_spotring_train_alone(installed, tmp_path):
    run_dir = tmp_path / "run"
    proc = user(installed, "python", "-m", "spotring", "train", f"data.root={REPO / 'data'}",
                f"hydra.run.dir={run_dir}", *STEPS)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4 and 0 < summary["test_accuracy"] <= 1


@pytest.mark.slow
def test_spotring_train_under_torchrun(installed, tmp_path):
    run_dir = tmp_path / "run"
    proc = user(installed, "torchrun", "--standalone", "--nproc-per-node", "2", "--no-python",
                "spotring", "train", f"data.root={REPO / 'data'}", f"hydra.run.dir={run_dir}",
                *STEPS)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 4


def test_spotring_launch_dry_run(installed):
    proc = user(installed, "spotring", "launch", "--dry-run", "nodes=8")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "8" in proc.stdout
