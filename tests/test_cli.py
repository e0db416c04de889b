"""The `spotring` command as users type it: its help, and bad input that Hydra itself
would have let through with exit 1 (a group option, a key or a type) exits 2 with the bad
value and the valid options named, before any process group or run directory exists.

Each runs `spotring.cli.main` in this process (harness/commands.py); the installed command
is tests/test_package.py's, and the trainer's bad input under real launchers
tests/test_config.py's."""

from __future__ import annotations

import pytest

from harness.commands import call, python_m
from spotring.cli import main

SUBCOMMANDS = ["train", "launch", "up", "run", "status", "down", "cost", "sweep", "sbatch",
               "bench", "report", "predict"]


def test_help_lists_every_subcommand_with_a_line():
    done = python_m("spotring", "--help")
    assert done.code == 0, done.err
    for name in SUBCOMMANDS:
        assert any(line.split()[:1] == [name] and len(line.split()) > 2
                   for line in done.out.splitlines()), f"{name} missing:\n{done.out}"


def test_an_unknown_subcommand_exits_2_naming_the_valid_ones():
    done = call(main, "trian")
    assert done.code == 2
    assert "'trian'" in done.err and "train" in done.err.split("valid:")[1]


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_subcommand_answers_help(command):
    done = call(main, command, "--help")
    assert done.code == 0, done.err[-2000:]
    assert "usage" in done.out.lower() or "== Configuration groups ==" in done.out


@pytest.mark.parametrize("override, named, valid", [
    ("dataset=imagenet", "dataset/imagenet", ["mnist", "cifar10", "synthetic"]),
    ("model=resnet9000", "model/resnet9000", ["convnet", "resnet20", "lenet"]),
    ("engine=nccl2", "engine/nccl2", ["ddp", "horovod"]),
    ("optim.lr=abc", "optim.lr=abc", ["Float"]),
    ("train.batchsize=64", "train.batchsize", ["+train.batchsize=64"]),
])
def test_bad_hydra_input_exits_2_naming_it(tmp_path, override, named, valid):
    run_dir = tmp_path / "run"
    done = call(main, "train", override, f"hydra.run.dir={run_dir}")
    assert done.code == 2, done.err[-3000:]
    assert named in done.err
    for option in valid:
        assert option in done.err, done.err
    assert "Traceback" not in done.err
    assert "Config search path" not in done.err  # Hydra's developer detail is cut
    assert not run_dir.exists()


def test_a_bad_value_in_a_sweep_exits_2_before_any_trial(tmp_path):
    done = call(main, "train", "-m", "optim.lr=0.1,abc", f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert done.code == 2, done.err[-3000:]
    assert "optim.lr=abc" in done.err
    assert not (tmp_path / "sweep").exists()
