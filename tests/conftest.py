"""Helpers to run the trainer as users do (real processes, real launchers) and read
back what it leaves behind; and what the session's tests share across pytest-xdist's
workers: the cores (``cores``: a test marked slow holds one for each process it keeps
busy, harness/cores.py) and the runs several test files compare with (``cached``: built
once per session by the first worker that asks)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from filelock import FileLock

from harness import REPO
from harness.cores import cores, share
from spotring.checkpoint.layout import Checkpoint, Checkpoints
from spotring.checkpoint.parts import load_whole
from spotring.launch.commands import local_command, local_environment
from spotring.trainer.config import compose

# The object stores' emulators (moto_s3, azurite, gcs_emulator), for every test.
pytest_plugins = ["harness.stores"]


def pyproject() -> dict:
    """The checkout's pyproject.toml (tomllib from Python 3.11 on; its backport, a
    dependency of spotring on 3.10, before)."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        import tomli as tomllib
    return tomllib.loads((REPO / "pyproject.toml").read_text())

# Keep test runs short and their output readable.
QUICK = ["telemetry.progress=false"]

# The session's folder that every xdist worker sees: set by the session fixture below.
_SHARED: list[Path] = []


@pytest.fixture(scope="session", autouse=True)
def shared_folder(tmp_path_factory) -> Path:
    """The session's folder common to all workers (pytest's base temporary folder of the
    session; under xdist, the parent of each worker's own)."""
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"
    folder.mkdir(exist_ok=True)
    _SHARED[:] = [folder]
    share(folder)
    return folder


@pytest.fixture(autouse=True)
def _cores_for_slow_tests(request) -> Iterator[None]:
    """A test marked slow starts processes of its own: it holds the cores it says it
    keeps busy, ``@pytest.mark.slow(cores=1)``, or all of them."""
    marker = request.node.get_closest_marker("slow")
    if marker is None:
        yield
        return
    with cores(marker.kwargs.get("cores")):
        yield


def cached(name: str, build: Callable[[Path], object], n_cores: int | None = None) -> Path:
    """The session's folder ``name``, which ``build(folder)`` fills the first time any
    worker asks (holding ``n_cores`` of the cores: the processes the build keeps busy);
    the others wait for it and read it. A build that fails leaves nothing, and the next
    one to ask tries again."""
    folder = _SHARED[0] / name
    if (folder / ".built").exists():
        return folder
    # The cores first, then the name: the order every taker of both keeps (a slow test
    # holds the cores already), so that two workers never wait on each other.
    with cores(n_cores), FileLock(_SHARED[0] / f"{name}.lock"):
        if not (folder / ".built").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(folder)
            (folder / ".built").touch()
    return folder


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
        return load_whole(checkpoint)["model"]


def run_trainer(run_dir: Path, *overrides: str, launcher: str = "single", nproc: int = 1,
                expect: int | None = 0, timeout: float = 600, env: dict | None = None) -> Run:
    """The trainer with ``overrides`` on ``nproc`` ranks, started by ``launcher`` (one of
    launch.commands.LAUNCHERS), or by the test itself (launcher="spawned":
    harness/ranks.py, where no launcher is what the test is about: the trainer's ranks
    start in milliseconds instead of importing torch and Hydra each), to its end."""
    args = [f"hydra.run.dir={run_dir}", *QUICK, *overrides]
    with cores(nproc):
        if launcher == "spawned":
            proc = _spawned(run_dir, nproc, args, timeout, env or {})
        else:
            proc = subprocess.run(local_command(launcher, nproc, args), cwd=REPO,
                                  capture_output=True, text=True, timeout=timeout,
                                  env=local_environment(**(env or {})))
    run = Run(run_dir, proc)
    if expect is not None:
        assert proc.returncode == expect, (
            f"exit {proc.returncode}, expected {expect}\n{run.output[-6000:]}")
    return run


def _spawned(run_dir: Path, nproc: int, args: list[str], timeout: float,
             env: dict[str, str]) -> subprocess.CompletedProcess:
    """The trainer's ranks spawned here, as a CompletedProcess: the first failing rank's
    exit code (else 0) and every rank's output."""
    from harness import ranks

    with ranks.Ranks(run_dir, nproc, ranks.trainer, env=env, argv=args) as job:
        codes = job.wait(timeout)
        output = job.output()
    return subprocess.CompletedProcess(args, next((c for c in codes if c), 0), output, "")


def cached_trainer_run(name: str, *overrides: str, **kwargs) -> Run:
    """run_trainer's run, made once per session (``cached``) for every test that compares
    with it; read it, do not write into it."""
    def build(folder: Path) -> None:
        run = run_trainer(folder / "run", *overrides, **kwargs)
        (folder / "output.txt").write_text(run.output)

    folder = cached(name, build, kwargs.get("nproc", 1))
    output = (folder / "output.txt").read_text()
    return Run(folder / "run", subprocess.CompletedProcess([], 0, output, ""))


# The parity runs (test_equivalence.py, test_precision.py, test_horovod.py): real MNIST,
# 20 steps, SGD with Nesterov momentum and weight decay, a checkpoint after every step
# (so that one run answers for every step), a train record every 5; in float64, so that
# rounding cannot flip a max-pool near-tie (see test_equivalence.py); NCHW, so that
# test_precision.py turns on only the option each test is about. Add the batch size.
PARITY = ["train.max_steps=20", "train.threads=1", "train.seed=11", "checkpoint.every_steps=1",
          "checkpoint.keep=20", "train.dtype=float64", "train.eval_samples=1000",
          "telemetry.log_every=5", "train.channels_last=false"]


@pytest.fixture
def ddp_2x32() -> Run:
    """The parity run of 2 workers x batch 32, engine=ddp under torchrun (once a session)."""
    return cached_trainer_run("ddp_2x32", *PARITY, "train.batch_size=32", "engine=ddp",
                              launcher="torchrun", nproc=2)


@pytest.fixture
def one_worker() -> Run:
    """The parity run of 1 worker x batch 64, which N workers with the same global batch
    equal (once a session)."""
    return cached_trainer_run("one_worker", *PARITY, "train.batch_size=64", launcher="spawned")


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

    from harness.aws import aws_env, start_moto

    server = start_moto()
    host, port = server.get_host_and_port()
    env = aws_env(f"http://{host}:{port}", tmp_path_factory.mktemp("home"))
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        boto3.client("s3").create_bucket(Bucket="spotring")
        yield env
    server.stop()
