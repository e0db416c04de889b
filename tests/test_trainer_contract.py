"""The built-in trainer reads the launch contract as a user's script does
(spotring/contract.py): `spotring train ARGS` started with $SPOTRING_RUN_DIR and
$SPOTRING_CHECKPOINT_URI behaves as `spotring train hydra.run.dir=... checkpoint.uri=...
ARGS`, which is all a launcher needs to know of it."""

from __future__ import annotations

import json
import subprocess
import sys

import boto3
import pytest

from spotring import contract
from spotring.checkpoint.layout import Checkpoints, manifest_name, newest_valid
from spotring.launch.commands import local_command, local_environment

# A few steps on a small synthetic dataset: what is looked at is where the files go.
ARGS = ["dataset=synthetic", "dataset.shape=[1,28,28]", "dataset.train_size=256",
        "dataset.test_size=64", "train.batch_size=32", "train.max_steps=4",
        "train.eval_samples=64", "telemetry.progress=false", "preemption.notices=none"]


def train(cwd, *args: str, launcher: str = "single", nproc: int = 1,
          **env: str) -> subprocess.CompletedProcess:
    if launcher == "single":  # the command users type
        command = [sys.executable, "-m", "spotring", "train", *ARGS, *args]
    else:
        command = local_command(launcher, nproc, [*ARGS, *args])
    proc = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300,
                          env=local_environment(**env))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc


def objects(uri: str) -> list[str]:
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    listed = boto3.client("s3").list_objects_v2(Bucket=bucket, Prefix=prefix + "/")
    return sorted(o["Key"].removeprefix(prefix + "/") for o in listed.get("Contents", []))


def checkpoint_objects(step: int, uri: str, tmp_path) -> list[str]:
    """What a checkpoint of ``step`` is in S3, read from its manifest there (verified):
    the manifest and every part it lists."""
    found = newest_valid(tmp_path / "nothing-local", uri)
    assert found is not None and found.step == step, found
    return sorted([manifest_name(step), *found.parts()])


@pytest.mark.slow(cores=1)
def test_the_run_directory_is_the_contracts_and_a_restart_continues_in_it(tmp_path):
    run_dir = tmp_path / "run"
    first = train(tmp_path, **{contract.RUN_DIR: str(run_dir)})
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["run_dir"] == str(run_dir) and summary["steps"] == 4
    assert [c.step for c in Checkpoints(run_dir / "checkpoints", keep=1).found()] == [4]
    assert (run_dir / "metrics.jsonl").is_file() and (run_dir / "train.log").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no runs/<time>/
    assert "Traceback" not in first.stderr
    # The launcher's restart: the same command, the same variables.
    again = train(tmp_path, "train.max_steps=6", **{contract.RUN_DIR: str(run_dir)})
    assert "resumed at step 4" in again.stdout + again.stderr
    assert json.loads((run_dir / "summary.json").read_text())["steps_this_run"] == 2


@pytest.mark.slow
def test_checkpoints_go_to_the_contracts_uri_and_rank_1_writes_only_into_the_run(tmp_path, s3):
    uri = "s3://spotring/contract/run"
    run_dir = tmp_path / "run"
    train(tmp_path, launcher="torchrun", nproc=2,
          **{contract.RUN_DIR: str(run_dir), contract.CHECKPOINT_URI: uri})
    assert objects(uri) == checkpoint_objects(4, uri, tmp_path)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and uri in summary["checkpoints"]
    # Rank 1 wrote its part of the checkpoint into the run's directory, nothing elsewhere:
    # the checkpoint is whole there too.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert newest_valid(run_dir / "checkpoints").step == 4
    # checkpoint.uri, given, is the run's: the variable is only the default.
    explicit = "s3://spotring/contract/explicit"
    train(tmp_path, f"hydra.run.dir={tmp_path / 'other'}", f"checkpoint.uri={explicit}",
          **{contract.CHECKPOINT_URI: uri})
    assert objects(explicit) == checkpoint_objects(4, explicit, tmp_path)
    assert objects(uri) == checkpoint_objects(4, uri, tmp_path)
