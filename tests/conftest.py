"""Helpers to run the trainer as users do (real processes, real launchers) and read
back what it leaves behind."""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from spotring.checkpoint import Checkpoint, Checkpoints
from spotring.launch.commands import local_command, local_environment
from spotring.trainer.config import compose

REPO = Path(__file__).resolve().parents[1]
# Keep test runs short and their output readable.
QUICK = ["telemetry.progress=false"]


@dataclass
class Run:
    dir: Path
    proc: subprocess.CompletedProcess

    @property
    def output(self) -> str:
        return self.proc.stdout + self.proc.stderr

    @property
    def summary(self) -> dict:
        return json.loads((self.dir / "summary.json").read_text())

    def checkpoints(self) -> list[Checkpoint]:
        """The checkpoints of the run's checkpoint directory whose manifests read, oldest
        first (their parts not checked)."""
        return Checkpoints(self.dir / "checkpoints", keep=1).found()[::-1]

    def params(self, step: int | None = None) -> dict[str, torch.Tensor]:
        """The model of the checkpoint of ``step``, or of the newest one, its parts
        verified against its manifest first (CorruptCheckpoint where one differs)."""
        found = {c.step: c for c in self.checkpoints()}
        assert found, f"no checkpoint in {self.dir / 'checkpoints'}"
        checkpoint = found[max(found) if step is None else step]
        checkpoint.verify()
        return checkpoint.load()["model"]


def run_trainer(run_dir: Path, *overrides: str, launcher: str = "single", nproc: int = 1,
                expect: int | None = 0, timeout: float = 600, env: dict | None = None) -> Run:
    args = [f"hydra.run.dir={run_dir}", *QUICK, *overrides]
    proc = subprocess.run(local_command(launcher, nproc, args), cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env=local_environment(**(env or {})))
    run = Run(run_dir, proc)
    if expect is not None:
        assert proc.returncode == expect, (
            f"exit {proc.returncode}, expected {expect}\n{run.output[-6000:]}")
    return run


# The parity runs of test_equivalence.py and test_horovod.py: real MNIST, 20 steps, SGD
# with Nesterov momentum and weight decay, a checkpoint after every step (so that one run
# answers for step 1 and step 20); in float64, so that rounding cannot flip a max-pool
# near-tie (see test_equivalence.py). Add the batch size.
PARITY = ["train.max_steps=20", "train.threads=1", "train.seed=11", "checkpoint.every_steps=1",
          "checkpoint.keep=20", "train.dtype=float64", "train.eval_samples=1000"]


@pytest.fixture(scope="session")
def ddp_2x32(tmp_path_factory) -> Run:
    """The reference parity run: 2 workers x batch 32, engine=ddp under torchrun."""
    return run_trainer(tmp_path_factory.mktemp("ddp") / "run", *PARITY, "train.batch_size=32",
                       "engine=ddp", launcher="torchrun", nproc=2)


@pytest.fixture
def train(tmp_path):
    """train(name, *overrides, launcher=..., nproc=...) -> Run in tmp_path/name."""
    def _train(name: str, *overrides: str, **kwargs) -> Run:
        return run_trainer(tmp_path / name, *overrides, **kwargs)
    return _train


def compose_config(*overrides: str):
    """The composed config, as `python -m spotring.trainer` would see it (no run directory)."""
    return compose(list(overrides))


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rtol: float) -> None:
    """Every tensor of ``a`` equals the one of ``b`` within ``rtol`` (relative, as a norm)."""
    assert a.keys() == b.keys()
    for name in a:
        diff = (a[name].double() - b[name].double()).norm()
        scale = b[name].double().norm().clamp_min(1e-12)
        assert diff / scale <= rtol, f"{name}: relative difference {diff / scale:.3g} > {rtol}"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A moto S3 server on 127.0.0.1, a bucket, and the environment that points boto3
    at it (here and in the trainer processes the tests start)."""
    import boto3

    from tests.aws import aws_env, start_moto

    server = start_moto()
    host, port = server.get_host_and_port()
    env = aws_env(f"http://{host}:{port}", tmp_path_factory.mktemp("home"))
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        boto3.client("s3").create_bucket(Bucket="spotring")
        yield env
    server.stop()
