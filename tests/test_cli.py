"""The `spotring` command as users type it: its help, and bad input that Hydra itself
would have let through with exit 1 (a group option, a key or a type) exits 2 with the bad
value and the valid options named, before any process group or run directory exists."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO

SPOTRING = [sys.executable, "-m", "spotring"]


def spotring(*args: str, cwd=REPO, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*SPOTRING, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def test_help_lists_every_subcommand_with_a_line():
    proc = spotring("--help")
    assert proc.returncode == 0, proc.stderr
    for name in ("train", "launch", "up", "run", "status", "down", "cost", "sweep", "sbatch",
                 "bench", "report", "predict"):
        assert any(line.split()[:1] == [name] and len(line.split()) > 2
                   for line in proc.stdout.splitlines()), f"{name} missing:\n{proc.stdout}"


def test_an_unknown_subcommand_exits_2_naming_the_valid_ones():
    proc = spotring("trian")
    assert proc.returncode == 2
    assert "'trian'" in proc.stderr and "train" in proc.stderr.split("valid:")[1]


@pytest.mark.parametrize("command", ["train", "launch", "up", "run", "status", "down", "cost",
                                     "sweep", "sbatch", "bench", "report", "predict"])
def test_every_subcommand_answers_help(command):
    proc = spotring(command, "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage" in proc.stdout.lower() or "== Configuration groups ==" in proc.stdout


@pytest.mark.parametrize("override, named, valid", [
    ("dataset=imagenet", "dataset/imagenet", ["mnist", "cifar10", "synthetic"]),
    ("model=resnet9000", "model/resnet9000", ["convnet", "resnet20", "lenet"]),
    ("engine=nccl2", "engine/nccl2", ["ddp", "horovod"]),
    ("optim.lr=abc", "optim.lr=abc", ["Float"]),
    ("train.batchsize=64", "train.batchsize", ["+train.batchsize=64"]),
])
def test_bad_hydra_input_exits_2_naming_it(tmp_path, override, named, valid):
    run_dir = tmp_path / "run"
    proc = spotring("train", override, f"hydra.run.dir={run_dir}")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert named in proc.stderr
    for option in valid:
        assert option in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "Config search path" not in proc.stderr  # Hydra's developer detail is cut
    assert not run_dir.exists()


def test_a_bad_value_in_a_sweep_exits_2_before_any_trial(tmp_path):
    proc = spotring("train", "-m", "optim.lr=0.1,abc", f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "optim.lr=abc" in proc.stderr
    assert not (tmp_path / "sweep").exists()
