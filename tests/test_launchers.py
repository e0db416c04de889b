"""Every way users start the trainer, each with 2 ranks, each ending with a valid
summary.json: the launcher, the engine, and the backend its allreduce takes."""

from __future__ import annotations

import subprocess

import pytest

from harness.launcher import needs_horovod
from spotring.launch.commands import BIN, local_environment
from tests.conftest import QUICK, REPO, Run

SHORT = ["dataset=synthetic", "dataset.shape=[1,28,28]", "dataset.train_size=1280",
         "train.batch_size=32", "train.max_steps=12", "train.threads=1"]


def check_summary(run: Run, engine: str) -> None:
    summary = run.summary
    assert summary["world_size"] == 2 and summary["global_batch"] == 64
    assert summary["engine"] == engine and summary["steps"] == 12
    assert 0 <= summary["test_accuracy"] <= 1 and summary["images_per_second"] > 0


def launch(cmd: list[str], run_dir, timeout: float = 300) -> Run:
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env=local_environment())
    run = Run(run_dir, proc)
    assert proc.returncode == 0, run.output[-5000:]
    return run


def short_run(run_dir, *overrides: str) -> list[str]:
    return [f"hydra.run.dir={run_dir}", *QUICK, *SHORT, *overrides]


def trainer(run_dir, *overrides: str) -> list[str]:
    return [str(BIN / "python"), "-m", "spotring.trainer", *short_run(run_dir, *overrides)]


@pytest.mark.slow
@needs_horovod
def test_ddp_under_horovodrun_with_a_hostfile(tmp_path):
    # engine=ddp under horovodrun: rank 0 posts its store's address to horovodrun's
    # rendezvous server, so users can switch engines without switching launchers; the
    # hosts and their slots from a hostfile, as `spotring launch` gives them.
    # (engine=horovod under `horovodrun -H` is what `make train ENGINE=horovod` runs.)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\n")
    run = launch([str(BIN / "horovodrun"), "--gloo", "-np", "2", "--hostfile", str(hostfile),
                  *trainer(tmp_path / "run", "engine=ddp")], tmp_path / "run")
    check_summary(run, "ddp")
    assert run.summary["backend"] == "gloo"


@pytest.mark.slow
@needs_horovod
def test_engine_horovod_under_mpirun_takes_mpi_for_its_allreduce(tmp_path):
    # Under mpirun, Horovod's controller is MPI, and so is its CPU allreduce by default.
    # (engine=ddp under mpirun, over Gloo and over MPI: tests/test_equivalence.py.)
    run = launch([str(BIN / "mpirun"), "-np", "2", "--oversubscribe",
                  *trainer(tmp_path, "engine=horovod", "engine.backend=auto")], tmp_path)
    check_summary(run, "horovod")
    assert run.summary["backend"] == "mpi"


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["ddp", pytest.param("horovod", marks=needs_horovod)])
def test_make_train(tmp_path, engine):
    """What make runs is the users' own command, typed as they type it, the launcher and
    the program found on PATH (the venv's bin first): torchrun, or horovodrun with -H and
    no --gloo, whose MPI controller starts Open MPI 5's mpirun, which reads the command
    line only with launch/node/horovod-openmpi5.patch built in."""
    args = " ".join([f"hydra.run.dir={tmp_path}", *QUICK, *SHORT])
    run = launch(["make", "--no-print-directory", "train", f"ENGINE={engine}", "NPROC=2",
                  f"ARGS={args}"], tmp_path)
    started = {"ddp": "torchrun --standalone --nproc-per-node 2 --no-python spotring train",
               "horovod": "horovodrun -np 2 -H localhost:2 spotring train engine=horovod "
               }[engine]
    assert any(line.startswith(started) for line in run.proc.stdout.splitlines())
    check_summary(run, engine)
    # Horovod's MPI controller, not Gloo's.
    assert run.summary["backend"] == {"ddp": "gloo", "horovod": "mpi"}[engine]


@needs_horovod
def test_horovod_is_built_with_pytorch_gloo_and_mpi():
    # What `horovodrun -cb` prints, asked of the library itself.
    import horovod.torch as hvd

    assert hvd.gloo_built() and hvd.mpi_built()
