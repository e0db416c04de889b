"""SLURM for real (issue 26): a controller, munge and a slurmd in each of 2 network
namespaces (tests/slurm.py), the trainer and a user's script (examples/train.py) started
with srun across them, and the jobs of `spotring sbatch` preempted, requeued and resumed."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

from launch import slurm as sbatch
from launch.commands import local_environment
from spotring.exits import EXIT_CONFIG
from spotring.polling import poll
from tests import slurm
from tests import test_examples as examples
from tests.conftest import PARITY, QUICK, REPO, Run, assert_close
from tests.test_sweep import load, run_sweep, table_row

T = TypeVar("T")

WHY_NOT = slurm.unavailable()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with slurm.running(tmp_path_factory.mktemp("slurm") / "cluster") as started:
        yield started


def test_a_step_runs_on_each_node_under_its_own_name_and_address(cluster):
    out = cluster.run("srun", "-N", "2", "--ntasks-per-node=1", "--label", "sh", "-c",
                      "echo $(hostname) $(hostname -I) $(getent hosts node-0)").stdout
    lines = sorted(out.splitlines())
    zero, one = cluster.nodes
    assert lines == [f"0: node-0 {zero.address} {zero.address} node-0",
                     f"1: node-1 {one.address} {zero.address} node-0"]


@pytest.mark.slow
def test_srun_across_two_nodes_takes_the_steps_of_torchrun(cluster, tmp_path, ddp_2x32):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        ["srun", "-N", "2", "--ntasks-per-node=1", sys.executable, "-m", "trainer",
         f"hydra.run.dir={run_dir}", *QUICK, *PARITY, "train.batch_size=32"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env=local_environment(**cluster.env))
    run = Run(run_dir, proc)
    assert proc.returncode == 0, f"{run.output[-6000:]}\n{cluster.logs()}"
    # One rank in each namespace: rank 1 reached rank 0's store at node-0's address,
    # the only way out of its namespace.
    for node in cluster.nodes:
        assert "launch task StepId=" in (cluster.dir / f"{node.name}.log").read_text()
    assert run.summary["world_size"] == 2 and run.summary["global_batch"] == 64
    assert run.summary["steps"] == ddp_2x32.summary["steps"] == 20
    assert_close(run.params(), ddp_2x32.params(), rtol=1e-10)


@pytest.mark.slow
def test_a_users_script_under_srun_across_two_nodes_takes_one_workers_steps(
        cluster, tmp_path, monkeypatch):
    # examples/train.py as its users start it, on images in a folder every node sees.
    images = tmp_path / "images"
    examples.write_images(images)
    alone = examples.run("single", 1, images, tmp_path / "alone")
    monkeypatch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])
    ran = examples.run("srun", 2, images, tmp_path / "srun")
    summary = json.loads((tmp_path / "srun" / "summary.json").read_text())
    assert summary["launcher"] == "slurm" and summary["world_size"] == 2, summary
    assert_close(examples.weights(ran), examples.weights(alone), rtol=1e-10)


# The parity run of ddp_2x32, as a SLURM job. An evaluation after every step (it changes
# no parameter) makes a step take ~0.3 s here instead of 25 ms: long enough for a signal
# to land mid-run.
JOB = [*QUICK, *PARITY, "train.batch_size=32", "train.eval_every_steps=1"]


class Job:
    """A job of `spotring sbatch`, submitted and watched as its user would: squeue, the
    run directory, RUN_DIR/slurm-JOBID.out."""

    def __init__(self, cluster: slurm.SlurmCluster, run_dir: Path, *ours: str,
                 trainer: tuple[str, ...] = ()) -> None:
        self.cluster, self.dir = cluster, run_dir
        proc = subprocess.run(
            [sys.executable, "-m", "spotring", "sbatch", f"run_dir={run_dir}",
             "job_name=test", *ours, "--", *JOB, *trainer], cwd=REPO, capture_output=True,
            text=True, timeout=60, env=local_environment(**cluster.env))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        self.id = int(re.search(r"submitted job (\d+)", proc.stdout)[1])

    def log(self) -> str:
        path = self.dir / f"slurm-{self.id}.out"
        return path.read_text(errors="replace") if path.exists() else "(no log yet)"

    def state(self) -> str:
        """squeue's state of the job (RUNNING, PENDING...); "" once it is gone."""
        return self.cluster.run("squeue", "--noheader", f"--jobs={self.id}", "--format=%T",
                                check=False).stdout.strip()

    def steps(self) -> list[int]:
        """The steps of the checkpoints on disk."""
        return sorted(int(p.stem.split("-")[1])
                      for p in (self.dir / "checkpoints").glob("ckpt-*.pt"))

    def wait(self, check: Callable[[], T | None], what: str, timeout_s: float = 60,
             queued: bool = True) -> T:
        """The first value of ``check`` that is not None; a failure with the job's log and
        the daemons' if none comes in time, or (``queued``) the job ends first."""
        def step() -> T | None:
            value = check()
            if value is None and queued and not self.state():
                raise TimeoutError(f"{what}: the job ended first")
            return value
        try:
            return poll(step, timeout_s=timeout_s, interval_s=0.1, what=what)
        except TimeoutError as e:
            raise AssertionError(f"job {self.id}: {e}; squeue: {self.state() or 'gone'}\n"
                                 f"{self.log()[-6000:]}\n{self.cluster.logs()}") from None

    def wait_for_steps(self, count: int) -> None:
        self.wait(lambda: len(self.steps()) >= count or None, f"{count} checkpoints")

    def finish(self, timeout_s: float = 90) -> Run:
        self.wait(lambda: self.state() == "" or None, "the job's end", timeout_s, queued=False)
        run = Run(self.dir, subprocess.CompletedProcess([], 0, self.log(), ""))
        assert (self.dir / "summary.json").exists(), f"{run.output[-6000:]}\n{self.cluster.logs()}"
        return run

    def cancel(self) -> None:
        """Gone, whatever state the test left it in (so that the next test has the nodes)."""
        if self.state():
            self.cluster.run("scancel", str(self.id), check=False)
            self.wait(lambda: self.state() == "" or None, "the cancelled job's end", 30,
                      queued=False)


@pytest.fixture
def submit(cluster, tmp_path):
    jobs: list[Job] = []

    def _submit(*ours: str, trainer: tuple[str, ...] = ()) -> Job:
        cluster.wait_idle()  # all nodes free: a job of min_nodes=1 gets them all
        jobs.append(Job(cluster, tmp_path / "job", *ours, trainer=trainer))
        return jobs[-1]
    yield _submit
    for job in jobs:
        job.cancel()


def ranks(run_dir: Path) -> dict[int, int]:
    """{SLURM_PROCID: pid} of the trainer processes of the run in ``run_dir``."""
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0") if proc.name.isdigit() else []
            if b"trainer" in argv and f"hydra.run.dir={run_dir}".encode() in argv:
                env = dict(v.split(b"=", 1) for v in (proc / "environ").read_bytes().split(b"\0")
                           if b"=" in v)
                found[int(env[b"SLURM_PROCID"])] = int(proc.name)
        except (OSError, KeyError):  # ended meanwhile, or not a task of srun
            continue
    return found


@pytest.mark.slow
def test_a_warning_during_start_up_and_a_preempting_partition_each_requeue_the_job_once(
        cluster, submit, ddp_2x32):
    job = submit("nodes=2", "partition=low")
    # The warning while the trainers start up, before they catch it: they die of it
    # (nothing new to save), and the job must still come back.
    job.wait(lambda: len(ranks(job.dir)) == 2 or None, "the job's 2 ranks")
    cluster.run("scancel", "--signal=TERM", str(job.id))
    job.wait(lambda: "(restart 1)" in job.log() or None, "the requeued job's start")
    job.wait_for_steps(3)
    preempted = time.time()
    # A job of the higher tier that needs the nodes whole: SLURM preempts ours for it.
    cluster.run("sbatch", "--partition=high", "--nodes=2", "--exclusive",
                f"--output={job.dir}/high.out", "--wrap", "echo high ran")
    note = job.dir / "preempted.json"
    stopped = job.wait(lambda: note.exists() and json.loads(note.read_text())["step"] or None,
                       "rank 0's preempted.json")
    to_disk = (job.dir / "checkpoints" / f"ckpt-{stopped:09d}.pt").stat().st_mtime - preempted
    first = job.dir / "checkpoints" / f"ckpt-{stopped + 1:09d}.pt"
    job.wait(lambda: first.exists() or None, "the first step of the resumed job")
    to_step = first.stat().st_mtime - preempted
    run = job.finish()
    figures = (f"preemption to the checkpoint of step {stopped} on disk: {to_disk:.2f} s; "
               f"to the first step of the resumed job: {to_step:.1f} s")
    print(f"\n{figures}")
    assert "srun exit 143" in run.output, run.output
    assert (job.dir / "high.out").read_text() == "high ran\n"  # it had the nodes
    assert "preempted (SIGTERM)" in run.output and "srun exit 75" in run.output, run.output
    # One requeue for each stop: the script's, which SLURM's preemption does not repeat.
    assert re.findall(r"\(restart (\d+)\) on 2 nodes", run.output) == ["0", "1", "2"], \
        run.output
    assert f"resumed at step {stopped}" in run.output, run.output
    assert run.summary["resumed_from"].endswith(f"ckpt-{stopped:09d}.pt")
    assert run.summary["steps"] == 20 and run.summary["world_size"] == 2, run.summary
    assert 3 <= stopped < 20 and to_disk < 5, figures
    assert_close(run.params(), ddp_2x32.params(), rtol=1e-10)


@pytest.mark.slow
def test_a_job_requeued_onto_fewer_nodes_keeps_the_global_batch(cluster, submit, ddp_2x32):
    job = submit("nodes=2", "min_nodes=1")
    job.wait_for_steps(3)
    assert "(restart 0) on 2 nodes" in job.log(), job.log()  # all the free nodes
    with cluster.drained("node-1"):
        cluster.run("scancel", "--signal=TERM", str(job.id))
        run = job.finish()
    assert "(restart 1) on 1 nodes: node-0" in run.output, run.output
    assert "resumed at step" in run.output, run.output
    assert run.summary["world_size"] == 1 and run.summary["accumulation"] == 2
    assert run.summary["global_batch"] == ddp_2x32.summary["global_batch"] == 64
    assert run.summary["steps"] == 20 and run.summary["resumed_from"]
    assert_close(run.params(), ddp_2x32.params(), rtol=1e-10)


@pytest.mark.slow
def test_a_killed_rank_fails_the_job_in_bounded_time_and_it_resumes(cluster, submit, ddp_2x32):
    job = submit("nodes=2", trainer=("engine.timeout_s=20",))
    job.wait_for_steps(3)
    os.kill(job.wait(lambda: ranks(job.dir).get(1), "rank 1's process"), signal.SIGKILL)
    killed, last = time.monotonic(), max(job.steps())
    job.wait(lambda: job.state() not in ("RUNNING", "COMPLETING") or None, "the requeue", 30)
    ended = time.monotonic() - killed
    run = job.finish()
    print(f"\nrank 1 SIGKILLed: the job requeued {ended:.1f} s later")
    # srun: the highest status of its tasks, 128 + 9 for the one SIGKILLed.
    assert "srun exit 137" in run.output and "requeueing job" in run.output, run.output
    match = re.search(r"resumed at step (\d+)", run.output)
    assert match and int(match[1]) >= last, run.output
    assert run.summary["steps"] == 20 and run.summary["world_size"] == 2
    assert_close(run.params(), ddp_2x32.params(), rtol=1e-10)


def test_signal_usr1_asks_slurm_to_warn_every_task_with_sigusr1(capsys):
    # To the tasks (no B:): the batch shell would end srun with it, and no checkpoint.
    assert sbatch.main(["signal=USR1", "signal_s=300", "--dry-run"]) == 0
    assert "\n#SBATCH --signal=USR1@300\n" in capsys.readouterr().out


@pytest.mark.parametrize("ours, trainer, says", [
    (["nodes=1"], [], "sbatch is not on the PATH"),
    (["nodes=1", "gpus_per_node=2", "tasks_per_node=4"], [], "one task per GPU"),
    (["nodes=1", "partition=nosuch"], [], "nosuch"),
    (["nodes=1", "signal=HUP"], [], "signal=HUP: unknown; valid: TERM, USR1"),
    (["nodes=1"], ["optim.lr=abc"], "optim.lr"),
], ids=["no-sbatch", "tasks-per-gpu", "partition", "signal", "trainer-override"])
def test_bad_input_exits_2_and_submits_nothing(cluster, tmp_path, monkeypatch, capsys,
                                               ours, trainer, says):
    monkeypatch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])
    queued = cluster.run("squeue", "--noheader").stdout
    if "sbatch is not" in says:
        monkeypatch.setenv("PATH", str(tmp_path))  # no SLURM here
    run_dir = tmp_path / "job"
    code = sbatch.main([f"run_dir={run_dir}", *ours, "--", *trainer])
    err = capsys.readouterr().err
    monkeypatch.undo()
    assert code == EXIT_CONFIG and says in err, err
    assert cluster.run("squeue", "--noheader").stdout == queued and not run_dir.exists()


@pytest.mark.slow
def test_a_sweep_runs_each_trial_as_a_slurm_job(cluster, tmp_path):
    sweep_dir = tmp_path / "sweep"
    output = run_sweep(sweep_dir, "sweep=custom", "sweep.name=queued", "sweep.slurm=true",
                       "sweep.parallel=2", "sweep.trials=2", "sweep.sampler=grid",
                       trainer=("optim.lr=choice(0.05,0.1)", "train.epochs=0.02"),
                       env=cluster.env)
    study = load(sweep_dir, "queued")
    assert [t.state.name for t in study.trials] == ["COMPLETE", "COMPLETE"], output
    report = (sweep_dir / "sweep_report.md").read_text()
    for t in study.trials:
        # Started by srun, in a job of its own, and in the report.
        summary = json.loads((sweep_dir / "trials" / f"{t.number:03d}" / "summary.json")
                             .read_text())
        assert summary["launcher"] == "slurm"
        assert table_row(report, t.number)[1] == "complete"
        assert f"{100 * summary['test_accuracy']:.2f}" in table_row(report, t.number)
