"""SLURM for real (issue 26): a controller, munge and a slurmd in each of 2 network
namespaces (harness/slurm.py), srun across them, and the jobs of `spotring sbatch`, the
trainer's and a user's own command's (issue 34), preempted, requeued and resumed.

One job of the trainer (``requeued``) meets the stops a SLURM job meets, one after
another, and is requeued after each: a warning while it starts up, a job of a preempting
partition, a rank killed while its node is drained (it comes back on the other node
alone). Each test reads one guarantee off that job; it ends with the weights of the
uninterrupted parity run (conftest's ddp_2x32). A user's script under srun ends with one
worker's weights, a user's own command is requeued after a warning, and a sweep runs each
trial as a SLURM job."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest
import torch

from harness import examples, slurm, user_script
from harness.commands import call
from harness.cores import cores
from harness.schedule import Schedule
from harness.stores import environment
from harness.sweeps import load, rows, run_sweep, trial_dir
from spotring.checkpoint.layout import Checkpoints, folder_name, manifest_name
from spotring.contract import RUN_DIR
from spotring.exits import EXIT_CONFIG
from spotring.launch import slurm as sbatch
from spotring.launch.commands import local_environment
from spotring.polling import poll
from spotring.stores import open_store
from tests.conftest import PARITY, QUICK, REPO, Run, assert_close

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


# What a task may ask of the test nodes: 2 CPUs and SLURM's default 1 MB of memory each
# (harness/slurm.py), where the defaults ask for 4 CPUs and 16G.
SMALL = ("cpus_per_task=1", "mem_per_task=1M")


class Job:
    """A job of `spotring sbatch`, submitted and watched as its user would: squeue, the
    run directory, RUN_DIR/slurm-JOBID.out."""

    def __init__(self, cluster: slurm.SlurmCluster, run_dir: Path, ours: tuple[str, ...],
                 words: tuple[str, ...], cwd: Path, env: dict[str, str] | None = None) -> None:
        self.cluster, self.dir = cluster, run_dir
        cluster.wait_idle()  # all nodes free: a job of min_nodes=1 gets them all
        proc = subprocess.run(
            [sys.executable, "-m", "spotring", "sbatch", f"run_dir={run_dir}",
             "job_name=test", *SMALL, *ours, "--", *words], cwd=cwd, capture_output=True,
            text=True, timeout=300, env=local_environment(**cluster.env, **(env or {})))
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
        return sorted(c.step for c in Checkpoints(self.dir / "checkpoints", keep=1).found())

    def wait(self, check: Callable[[], T | None], what: str, timeout_s: float = 300,
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

    def finish(self, timeout_s: float = 300) -> Run:
        self.wait(lambda: self.state() == "" or None, "the job's end", timeout_s, queued=False)
        run = Run(self.dir, subprocess.CompletedProcess([], 0, self.log(), ""))
        assert (self.dir / "summary.json").exists(), f"{run.output[-6000:]}\n{self.cluster.logs()}"
        return run

    def cancel(self) -> None:
        """Gone, whatever state it was left in (so that the next job has the nodes)."""
        if self.state():
            self.cluster.run("scancel", str(self.id), check=False)
            self.wait(lambda: self.state() == "" or None, "the cancelled job's end", 30,
                      queued=False)


def ranks(run_dir: Path) -> dict[int, int]:
    """{SLURM_PROCID: pid} of the job's processes (srun's tasks) of the run in ``run_dir``:
    those whose environment names it (the contract's SPOTRING_RUN_DIR)."""
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            raw = (proc / "environ").read_bytes() if proc.name.isdigit() else b""
            env = dict(v.split(b"=", 1) for v in raw.split(b"\0") if b"=" in v)
            if env.get(RUN_DIR.encode()) == str(run_dir).encode() and b"SLURM_PROCID" in env \
                    and (proc / "comm").read_text().strip() not in ("srun", "bash"):
                found[int(env[b"SLURM_PROCID"])] = int(proc.name)
        except OSError:  # ended meanwhile
            continue
    return found


# The parity run of ddp_2x32, as a SLURM job. An evaluation after every step (it changes
# no parameter) makes a step take ~0.3 s here instead of 25 ms: each stop of the schedule
# lands mid-run, with steps to spare. A rank lost is found within engine.timeout_s.
JOB = (*QUICK, *PARITY, "train.batch_size=32", "train.eval_every_steps=1", "engine.timeout_s=20")


@dataclass
class Requeued:
    """What the schedule of ``requeued`` saw: the run at its end, the step of the
    preemption's checkpoint, the newest checkpoint when rank 1 was killed."""

    job: Job
    run: Run
    stopped: int
    killed_at: int
    to_disk: float  # seconds from the preempting job's submission to the checkpoint on disk


@pytest.fixture(scope="module")
def requeued(cluster, tmp_path_factory) -> Iterator[Requeued]:
    """The trainer's job of nodes=2 min_nodes=1 in the preemptible partition, through:
    1. SIGTERM while its ranks start up, before they take it: they die of it (143);
    2. a job of the higher tier that needs both nodes whole: SLURM preempts ours, which
       checkpoints and exits 75;
    3. node-1 drained, and its rank SIGKILLed (137): the job comes back on node-0 alone,
       with the global batch it was pinned to, and runs to its end."""
    with cores(1):  # it keeps about one core busy (tools/suite-profile: 36% of 2)
        job = Job(cluster, tmp_path_factory.mktemp("requeued") / "job",
                  ("nodes=2", "min_nodes=1", "partition=low"), JOB, REPO)
        schedule = Schedule(f"sbatch job {job.id}", job.log)
        try:
            with schedule.step("SIGTERM while the ranks start up, then the job back"):
                job.wait(lambda: len(ranks(job.dir)) == 2 or None, "the job's 2 ranks")
                cluster.run("scancel", "--signal=TERM", str(job.id))
                job.wait(lambda: "(restart 1)" in job.log() or None, "the requeued job's start")
            with schedule.step("a job of the preempting partition, then ours back"):
                job.wait_for_steps(3)
                preempted = time.time()
                cluster.run("sbatch", "--partition=high", "--nodes=2", "--exclusive",
                            f"--output={job.dir}/high.out", "--wrap", "echo high ran")
                note = job.dir / "preempted.json"
                stopped = job.wait(lambda: note.exists() and json.loads(note.read_text())[
                    "step"] or None, "rank 0's preempted.json")
                # A checkpoint is on disk once its manifest is (written after its parts).
                to_disk = (job.dir / "checkpoints" / manifest_name(stopped)).stat().st_mtime
                first = job.dir / "checkpoints" / manifest_name(stopped + 1)
                job.wait(lambda: first.exists() or None, "the first step of the resumed job")
                to_step = first.stat().st_mtime
            with schedule.step("node-1 drained and its rank SIGKILLed, then the job on "
                               "node-0"), cluster.drained("node-1"):
                pid = job.wait(lambda: ranks(job.dir).get(1), "rank 1's process")
                killed_at = max(job.steps())
                os.kill(pid, signal.SIGKILL)
                killed = time.monotonic()
                # Within engine.timeout_s (20 s) and the processes' exits.
                job.wait(lambda: job.state() not in ("RUNNING", "COMPLETING") or None,
                         "the job to leave RUNNING", timeout_s=60)
                lost_in = time.monotonic() - killed
                run = job.finish()
        finally:
            job.cancel()
    print(f"\npreemption to the checkpoint of step {stopped} on disk: "
          f"{to_disk - preempted:.2f} s; to the first step of the resumed job: "
          f"{to_step - preempted:.1f} s; rank 1 SIGKILLed: the job requeued {lost_in:.1f} s "
          "later")
    yield Requeued(job, run, stopped, killed_at, to_disk - preempted)


def restarts(output: str) -> list[tuple[int, str]]:
    """(SLURM's restart count, the nodes) of each run of the job, from its log lines."""
    return [(int(n), nodes) for n, nodes in
            re.findall(r"\(restart (\d+)\) on \d+ nodes: (\S+)", output)]


@pytest.mark.slow
def test_each_stop_requeues_the_job_once(requeued):
    # One requeue for each stop: the script's; SLURM's own for a preemption is not added.
    assert restarts(requeued.run.output) == [
        (0, "node-[0-1]"), (1, "node-[0-1]"), (2, "node-[0-1]"), (3, "node-0")], \
        requeued.run.output


@pytest.mark.slow
def test_a_warning_during_start_up_requeues_the_job(requeued):
    # The ranks died of it (128 + 15), with nothing new to save: the job came back.
    output = requeued.run.output
    assert output.index("srun exit 143") < output.index("(restart 1)"), output


@pytest.mark.slow
def test_a_preempting_partition_stops_the_job_with_a_checkpoint_it_resumes_from(requeued):
    output, stopped = requeued.run.output, requeued.stopped
    assert (requeued.job.dir / "high.out").read_text() == "high ran\n"  # it had the nodes
    assert "preempted (SIGTERM)" in output and "srun exit 75" in output, output
    assert f"resumed at step {stopped}" in output, output
    # On disk before SLURM's grace for a preempted job ran out (GraceTime).
    assert 3 <= stopped < 20 and requeued.to_disk < slurm.GRACE_S, (stopped, requeued.to_disk)


@pytest.mark.slow
def test_a_killed_rank_fails_the_job_in_bounded_time_and_it_resumes(requeued):
    # srun: the highest status of its tasks, 128 + 9 for the one SIGKILLed; within the
    # schedule's 60 s (engine.timeout_s=20), the job left RUNNING.
    output = requeued.run.output
    assert "srun exit 137" in output and "requeueing job" in output, output
    resumed = [int(s) for s in re.findall(r"resumed at step (\d+)", output)]
    assert resumed[0] == requeued.stopped and resumed[-1] >= requeued.killed_at, output


@pytest.mark.slow
def test_a_job_requeued_onto_fewer_nodes_keeps_the_global_batch_and_the_steps(requeued,
                                                                             ddp_2x32):
    """Back on one node of the two: one worker with 2 micro-steps takes the global batch
    the job was pinned to at submission, and the job ends with the weights of the
    uninterrupted 2-worker run."""
    summary, output = requeued.run.summary, requeued.run.output
    assert summary["world_size"] == 1 and summary["accumulation"] == 2, summary
    assert summary["global_batch"] == ddp_2x32.summary["global_batch"] == 64
    last = re.findall(r"resumed at step (\d+)", output)[-1]
    assert summary["steps"] == 20 and summary["resumed_from"].endswith(
        f"/{folder_name(int(last))}"), (summary, output)
    assert_close(requeued.run.params(), ddp_2x32.params(), rtol=1e-10)


@pytest.mark.slow
def test_srun_starts_one_rank_in_each_nodes_namespace(requeued, cluster):
    """Rank 1 reached rank 0's store at node-0's address, the only way out of its
    namespace: each node's slurmd launched a task of the job."""
    for node in cluster.nodes:
        assert f"launch task StepId={requeued.job.id}." in (
            cluster.dir / f"{node.name}.log").read_text(), cluster.logs()


# A user's own script (harness/user_script.py), long enough for a signal to land mid-run:
# 30 steps of a global batch of 2, within the first epoch of its 64 samples (a stop
# never falls on an epoch's end).
STEPS = ("--steps", "30", "--batch", "2", "--save-every", "4")


@pytest.mark.slow(cores=1)  # about one core busy (tools/suite-profile: 47% of 2)
def test_a_users_command_is_requeued_after_sigterm_and_ends_with_one_workers_weights(
        cluster, azurite, tmp_path):
    """... with its checkpoints in Azure Blob too (Azurite, which the nodes reach at the
    bridge's address): every rank uploads its part, with the environment of the
    submission."""
    reference = user_script.reference(tmp_path / "ref", *STEPS)
    root = user_script.write_project(tmp_path / "project")  # train.py and nothing else
    uri = azurite.uri("sbatch-users-command")
    # A time limit far off: the script reads the job's end and must not take this stop
    # for the time limit's.
    job = Job(cluster, tmp_path / "job", ("nodes=2", "time=10", f"checkpoint.uri={uri}"),
              ("python", "train.py", *STEPS, "--sleep", "0.1"), root,
              azurite.env((cluster.controller_addr, azurite.address[1])))
    try:
        job.wait_for_steps(1)  # training, from the project directory on shared storage
        cluster.run("scancel", "--signal=TERM", str(job.id))
        run = job.finish()
    finally:
        job.cancel()
    assert "srun exit 75" in run.output and "requeueing job" in run.output, run.output
    assert "time limit" not in run.output, run.output
    # The echo line prints $SPOTRING_RESTART as the script exported it.
    assert [n for n, _ in restarts(run.output)] == [0, 1], run.output
    resumed = [int(s) for s in re.findall(r"resumed from \S+ at step (\d+)", run.output)]
    assert len(resumed) == 1 and 0 < resumed[0] < 30, run.output
    summary = run.summary
    assert (summary["launcher"], summary["world_size"], summary["steps"]) == ("slurm", 2, 30)
    assert_close({"w": torch.tensor(summary["weights"])},
                 {"w": torch.tensor(reference["weights"])}, rtol=1e-10)
    with environment(azurite.env()):
        uploaded = set(open_store(uri).names())
    newest = Checkpoints(job.dir / "checkpoints", keep=1).found()[0]  # the final step's
    ranks_parts = [name for name in newest.parts() if name.endswith(".distcp")]
    assert {newest.name, *newest.parts()} <= uploaded and len(ranks_parts) == 2, (
        sorted(uploaded), newest.parts())


def test_the_dry_run_asks_for_cpus_and_memory_and_states_the_most_node_time(
        tmp_path, monkeypatch):
    monkeypatch.chdir(user_script.write_project(tmp_path))
    done = call(sbatch.main, "nodes=2", "gpus_per_node=2", "time=12:00:00", "signal=USR1",
                "signal_s=300", "checkpoint.uri=s3://b/p x", "--dry-run", "--",
                "python", "train.py", "--lr", "0.1 0.2")
    out, err = done.out, done.err
    assert done.code == 0, err
    hold = ("at most 4 runs (1 + max_restarts=3) x time=12:00:00 x 2 nodes = 96 node-hours; "
            "a stop at the time limit is not requeued (requeue_at_time_limit=false)")
    assert f"\n# Holds {hold}\n" in out and hold in err, (out, err)
    # Per task 4 CPUs, for srun too (22.05 on, it does not take them from sbatch), and
    # 16G: 32G for a node's 2 tasks. To the tasks (no B:): the batch shell would end srun.
    for line in ("#SBATCH --cpus-per-task=4", "#SBATCH --mem=32G", "#SBATCH --signal=USR1@300",
                 f'export PATH={sys.executable.rsplit("/", 1)[0]}:"$PATH" '
                 "SPOTRING_RUN_ID=\"$SLURM_JOB_ID\" SPOTRING_RUN_DIR="
                 f"{tmp_path}/runs/slurm/spotring SPOTRING_RESTART=\"${{SLURM_RESTART_COUNT:-0}}\" "
                 "SPOTRING_CHECKPOINT_URI='s3://b/p x'",
                 "srun --ntasks-per-node=2 --cpus-per-task=4 --kill-on-bad-exit=0 "
                 "python train.py --lr '0.1 0.2'"):
        assert f"\n{line}\n" in out, out
    assert "train.global_batch" not in out and "squeue" in out
    # Open MPI's consent to root, given only where the job runs as root.
    (root_only,) = [line for line in out.splitlines() if "OMPI_ALLOW_RUN_AS_ROOT=" in line]
    for uid, allowed in ((0, "1"), (1000, "unset")):
        shell = subprocess.run(["bash", "-c", f"id() {{ echo {uid}; }}; {root_only}; "
                                "echo ${OMPI_ALLOW_RUN_AS_ROOT-unset}"],
                               capture_output=True, text=True, check=True,
                               env={"PATH": os.environ["PATH"]})  # not make's root consent
        assert shell.stdout == f"{allowed}\n", (uid, shell)
    # The trainer on a node range: CPUs per node for every task; the time limit requeued;
    # the global batch on both nodes pinned (64 x 2), which it keeps on one.
    done = call(sbatch.main, "nodes=2", "min_nodes=1", "cpus_per_task=2",
                "requeue_at_time_limit=true", "checkpoint.uri=s3://b/p", "--dry-run", "--",
                "train.batch_size=64")
    out, err = done.out, done.err
    assert done.code == 0, err
    assert "\n#SBATCH --mincpus=2\n#SBATCH --cpus-per-task=2\n#SBATCH --mem=16G\n" in out, out
    assert "--kill-on-bad-exit=0 spotring train train.batch_size=64 train.global_batch=128\n" \
        in out and "SPOTRING_CHECKPOINT_URI=s3://b/p" in out, out
    assert ("x the partition's time limit x 2 nodes; a stop at the time limit is requeued "
            "(requeue_at_time_limit=true)") in err and "squeue" not in out, (out, err)


@pytest.mark.parametrize("ours, trainer, says", [
    (["nodes=1"], [], ["sbatch is not on the PATH"]),
    (["nodes=1", "gpus_per_node=2", "tasks_per_node=4"], [], ["one task per GPU"]),
    (["nodes=1", "signal=HUP"], [], ["signal=HUP: unknown; valid: TERM, USR1"]),
    (["nodes=1", "time=12h", "mem_per_task=16GB", "cpus_per_task=0"],
     [], ["time=12h: valid: MM, MM:SS, HH:MM:SS, D-HH", "mem_per_task=16GB: valid",
          "cpus_per_task=0: must be 1 or more"]),
    (["nodes=1"], ["optim.lr=abc"], ["optim.lr"]),
    # It may come back on 3 of the 4 nodes, which cannot share 128 samples.
    (["nodes=4", "min_nodes=3"], ["train.global_batch=128"],
     ["a global batch of 128 samples cannot be split over 3 workers"]),
    (["nodes=1"], ["python", "missing.py"], ["missing.py: no such file"]),
    (["nodes=1", "checkpoint.uri=ftp://host/x"], [],
     ["checkpoint.uri=ftp://host/x: expected s3://bucket/prefix, gs://"]),
    # The s3:// forgotten: every rank's checkpoints would go to ./mybucket/prefix.
    (["nodes=1", "checkpoint.uri=mybucket/prefix"], [],
     ["checkpoint.uri=mybucket/prefix: expected s3://bucket/prefix, gs://bucket/prefix, "
      "az://container/prefix or file:///path"]),
    # The key of before: unknown, as any other (checkpoint.uri on every command).
    (["nodes=1", "checkpoint_uri=s3://b/p"], [], ["Could not override 'checkpoint_uri'"]),
], ids=["no-sbatch", "tasks-per-gpu", "signal", "settings", "trainer-override", "node-range",
        "missing-script", "checkpoint-uri", "checkpoint-uri-without-scheme", "old-key"])
def test_bad_input_exits_2_and_submits_nothing(cluster, tmp_path, monkeypatch, ours, trainer,
                                               says):
    monkeypatch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])
    queued = cluster.run("squeue", "--noheader").stdout
    if says == ["sbatch is not on the PATH"]:
        monkeypatch.setenv("PATH", str(tmp_path))  # no SLURM here
    run_dir = tmp_path / "job"
    done = call(sbatch.main, f"run_dir={run_dir}", *ours, "--", *trainer)
    monkeypatch.undo()
    assert done.code == EXIT_CONFIG and all(s in done.err for s in says), done.err
    assert cluster.run("squeue", "--noheader").stdout == queued and not run_dir.exists()


@pytest.mark.slow(cores=1)
def test_a_partition_slurm_refuses_exits_2_from_the_command_and_submits_nothing(cluster,
                                                                                tmp_path):
    """The command as users type it, in a process of its own: SLURM's own verdict
    (`sbatch --test-only`) comes back as bad input, named in one paragraph."""
    queued = cluster.run("squeue", "--noheader").stdout
    run_dir = tmp_path / "job"
    proc = subprocess.run(
        [sys.executable, "-m", "spotring", "sbatch", f"run_dir={run_dir}", "nodes=1",
         "partition=nosuch", *SMALL], cwd=REPO, capture_output=True, text=True, timeout=300,
        env=local_environment(**cluster.env))
    assert proc.returncode == EXIT_CONFIG, proc.stdout + proc.stderr
    assert proc.stderr.startswith("spotring sbatch: error: SLURM refuses the job: ") and \
        "nosuch" in proc.stderr, proc.stderr
    assert cluster.run("squeue", "--noheader").stdout == queued and not run_dir.exists()


@pytest.mark.slow
def test_a_sweep_runs_each_trial_as_a_slurm_job(cluster, tmp_path):
    """A user's script swept from its project, each trial srun's job of its own."""
    project = user_script.write_project(tmp_path / "project")
    sweep_dir = tmp_path / "sweep"
    output = run_sweep(f"sweep.dir={sweep_dir}", "sweep=custom", "sweep.name=queued",
                       "sweep.slurm=true", "sweep.parallel=2", "sweep.sampler=grid",
                       "sweep.params.lr=choice(0.05,0.1)", "sweep.objectives=[test_loss]",
                       "--", "python", "train.py", "--steps", "8", "--lr", "{lr}",
                       cwd=project, env=cluster.env)
    study = load(sweep_dir, "queued")
    assert [t.state.name for t in study.trials] == ["COMPLETE", "COMPLETE"], output
    table = rows((sweep_dir / "sweep_report.md").read_text())
    for t in study.trials:
        # Started by srun, in a job of its own, and in the report.
        summary = json.loads((trial_dir(sweep_dir, t.number) / "summary.json").read_text())
        assert summary["launcher"] == "slurm", summary
        assert table[t.number]["state"] == "complete"
        assert table[t.number]["test loss"] == f"{summary['test_loss']:.4f}"
