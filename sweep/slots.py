"""Slices of the resources, one trial on each at a time.

    this machine, GPUs    sweep.parallel slices of sweep.workers GPUs each
                          (CUDA_VISIBLE_DEVICES); a trial is torchrun across them
    this machine, CPUs    the cores split evenly between sweep.parallel slices (the
                          trial's processes are pinned to theirs); sweep.workers
                          processes per trial, each with its share of the cores
    a cluster             sweep.parallel slices of sweep.nodes nodes of a run `spotring
                          up` brought up; a trial is the launcher's job across them, as
                          `spotring run` starts it (launch/job_command.py)
    SLURM                 a SLURM job of sweep.nodes nodes x sweep.workers tasks (srun)

A trial (Work) is a command (the trainer's `spotring train ...` or the user's own, CMD):

    here, 1 worker        CMD
    here, W workers       torchrun --standalone --nproc-per-node W --no-python CMD
    a cluster             launch.job_command.build's job of CMD
    SLURM                 srun ... CMD

Every process of it gets Work.env: the contract's variables (spotring/contract.py), with
SPOTRING_RUN_DIR the trial's run directory (Slot.run_dir), and SPOTRING_PARAMS.

A trial's run directory is SWEEP_DIR/trials/NNN here. On a cluster rank 0 writes it
on the slice's first node, from where it is read while the trial runs and brought back
when it ends; before a trial resumes, its directory (with its newest checkpoint) goes
to the node that runs it next, which need not be the one it ran on before.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shlex
import shutil
import signal
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from spotring.contract import RUN_DIR
from spotring.exits import ConfigError
from spotring.launch import hostfile, job_command, project, sync
from spotring.launch.commands import local_command, local_environment
from spotring.launch.provider import Node
from spotring.launch.rundir import RunDir
from spotring.launch.ssh import RemoteError, Ssh, on_each

# Seconds a trial gets to checkpoint and leave after SIGTERM before it is killed.
STOP_GRACE_S = 60.0
# What the trial's processes print, written here by the runner as it comes: never sent
# to a node, or `collect` would bring that copy back over it.
TRIAL_LOG = "trial.log"
_PR_SET_PDEATHSIG = 1
log = logging.getLogger("launch")


class Attempt:
    """One start of a trial: its processes, stopped together."""

    def __init__(self, procs: Sequence[subprocess.Popen], group: bool) -> None:
        self.procs, self.group = list(procs), group

    def poll(self) -> int | None:
        """None while any process runs; then the first non-zero exit code, or 0."""
        codes = [p.poll() for p in self.procs]
        if any(c is None for c in codes):
            return None
        return next((c for c in codes if c != 0), 0)

    def stop(self) -> None:
        """SIGTERM (the trainer checkpoints and exits 75), then SIGKILL after the grace."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for p in self.procs:
                if p.poll() is None:
                    with contextlib.suppress(ProcessLookupError):  # it just ended
                        os.killpg(p.pid, sig) if self.group else p.send_signal(sig)
            try:
                for p in self.procs:
                    p.wait(timeout=STOP_GRACE_S)
                return
            except subprocess.TimeoutExpired:
                continue


@dataclass(frozen=True)
class Work:
    """What one attempt of a trial runs: ``command``, its placeholders filled, with ``env``
    in every process's environment."""

    command: list[str]
    env: dict[str, str]


class Slot:
    """Where one trial runs; ``hourly_price``: what its share costs, where known."""

    label: str
    hourly_price: float | None

    def start(self, trial_dir: Path, work: Work, log: IO[bytes]) -> Attempt:
        raise NotImplementedError

    def run_dir(self, trial_dir: Path) -> str:
        """Where rank 0 of the trial writes (SPOTRING_RUN_DIR): here, the trial dir."""
        return str(trial_dir)

    def read(self, trial_dir: Path, name: str) -> str | None:
        """A file of the trial's run directory while it runs (None if not there yet)."""
        path = trial_dir / name
        return path.read_text() if path.exists() else None

    def collect(self, trial_dir: Path) -> None:
        """Bring the trial's run directory here once it ended (nothing to do locally)."""


class LocalSlot(Slot):
    def __init__(self, label: str, workers: int, env: dict[str, str], cores: set[int] | None,
                 share: float, machine_price: float | None) -> None:
        """``share``: the slot's part of the machine, whose $/hour is ``machine_price``."""
        self.label, self.workers, self.env, self.cores = label, workers, env, cores
        self.hourly_price = None if machine_price is None else machine_price * share

    def start(self, trial_dir: Path, work: Work, log: IO[bytes]) -> Attempt:
        argv = local_command("single" if self.workers == 1 else "torchrun", self.workers, [],
                             command=work.command)
        cores = self.cores

        def in_child() -> None:
            if cores is not None:
                os.sched_setaffinity(0, cores)
            _ends_with_sweep()

        proc = subprocess.Popen(argv, env=local_environment(**self.env, **work.env), stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=in_child)
        return Attempt([proc], group=True)


def _ends_with_sweep() -> None:
    """In a trial's child process: SIGTERM when the sweep ends (killed outright), so
    that a trainer here still writes a checkpoint it resumes from."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def local_slots(parallel: int, workers: int, hourly_price: float | None) -> list[Slot]:
    """This machine split into ``parallel`` slots: GPUs where torch sees any, else cores."""
    import torch

    gpus = torch.cuda.device_count()
    if gpus:
        if parallel * workers > gpus:
            raise ConfigError(
                f"sweep.parallel={parallel} x sweep.workers={workers} = {parallel * workers} "
                f"GPUs, and this machine has {gpus}; valid: parallel x workers <= {gpus}")
        return [LocalSlot(f"GPU {','.join(ids)}", workers,
                          {"CUDA_VISIBLE_DEVICES": ",".join(ids)}, None,
                          workers / gpus, hourly_price)
                for i in range(parallel)
                for ids in [[str(g) for g in range(i * workers, (i + 1) * workers)]]]
    cores = sorted(os.sched_getaffinity(0))
    if parallel * workers > len(cores):
        raise ConfigError(
            f"sweep.parallel={parallel} x sweep.workers={workers} = {parallel * workers} "
            f"worker processes, and this machine has {len(cores)} cores (no GPU); valid: "
            f"parallel x workers <= {len(cores)}, one core per worker at least")
    per = len(cores) // parallel
    slots = []
    for i in range(parallel):
        mine = cores[i * per:(i + 1) * per]
        label = f"cores {mine[0]}-{mine[-1]}" if len(mine) > 1 else f"core {mine[0]}"
        slots.append(LocalSlot(label, workers, {}, set(mine), per / len(cores), hourly_price))
    return slots


class RemoteAttempt(Attempt):
    """A trial's job on a slice's nodes, through one ssh connection to each (a pty: when
    one closes, its node's part of the job is hung up, SIGHUP, and dies there and then).
    Stopped on the nodes instead: SIGTERM to the processes of its run directory, the
    launcher and the ranks, which checkpoint and leave as a local trial does; the
    connections close as they end, and those left after the grace are hung up."""

    def __init__(self, procs: Sequence[subprocess.Popen], ssh: Ssh, nodes: list[Node],
                 run_dir: str) -> None:
        super().__init__(procs, group=False)
        self.ssh, self.nodes = ssh, nodes
        # Its processes, by SPOTRING_RUN_DIR in their
        # environment (job_command gives it to every process of the job; their command
        # lines need not name the run directory). Not ssh clients, whose ends would hang
        # up what they started: horovodrun's on node 0, and on a local cluster, whose
        # nodes share one process table, the sweep's own.
        mark = shlex.quote(f"{RUN_DIR}={run_dir}")
        self.kill = ("found=1; for env in /proc/[0-9]*/environ; do "
                     "pid=${env#/proc/}; pid=${pid%/environ}; "
                     f"if tr '\\0' '\\n' 2>/dev/null < $env | grep -qxF -- {mark} && "
                     '[ "$(cat /proc/$pid/comm 2>/dev/null)" != ssh ]; then '
                     'kill -TERM "$pid" 2>/dev/null && found=0; fi; done; exit $found')

    def stop(self) -> None:
        if self.poll() is None:
            said = on_each(self.nodes, lambda node: self.ssh.run(node, self.kill, check=False))
            if any(proc.returncode == 0 for proc in said):  # 0: signalled some
                deadline = time.monotonic() + STOP_GRACE_S
                with contextlib.suppress(subprocess.TimeoutExpired):
                    for p in self.procs:
                        p.wait(timeout=max(0.0, deadline - time.monotonic()))
        super().stop()


class ClusterSlot(Slot):
    def __init__(self, nodes: list[Node], ssh: Ssh, workdir: str, launcher: str,
                 sweep_name: str, hourly_price: float | None) -> None:
        self.nodes, self.ssh, self.workdir, self.launcher = nodes, ssh, workdir, launcher
        self.sweep_name = sweep_name
        self.label = "nodes " + ", ".join(n.private_address for n in nodes)
        prices = [n.price if n.price is not None else hourly_price for n in nodes]
        self.hourly_price = None if None in prices else sum(prices)

    def _results(self, trial_dir: Path) -> str:
        """The trial's run directory on the slice's first node, relative to the workdir."""
        return job_command.results_dir(f"sweeps/{self.sweep_name}/{trial_dir.name}")

    def run_dir(self, trial_dir: Path) -> str:
        return f"{self.workdir}/{self._results(trial_dir)}"

    def start(self, trial_dir: Path, work: Work, log: IO[bytes]) -> Attempt:
        results = self._results(trial_dir)
        remote = shlex.quote(f"{self.workdir}/{results}")
        # Whatever an earlier attempt left, on whichever slice: its newest checkpoint.
        self.ssh.run(self.nodes[0], f"rm -rf {remote} && mkdir -p {remote}")
        files = {str(p.relative_to(trial_dir)): p for p in sorted(trial_dir.rglob("*"))
                 if p.is_file() and p.name != TRIAL_LOG}
        if files:
            self.ssh.run(self.nodes[0], f"tar -xzmf - -C {remote}", input=sync.tar(files))
        run_id = results.removeprefix("runs/")
        job = job_command.build(self.launcher, self.nodes, self.workdir, run_id, work.command,
                                env=work.env, results=results)
        # A session of their own: a Ctrl-C here reaches the sweep, which stops the trial
        # (RemoteAttempt.stop), not the connections, whose end would kill it outright.
        procs = [self.ssh.popen(self.nodes[i], command, tty=True, stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=_ends_with_sweep)
                 for i, command in sorted(job.commands.items())]
        return RemoteAttempt(procs, self.ssh, self.nodes, self.run_dir(trial_dir))

    def read(self, trial_dir: Path, name: str) -> str | None:
        path = shlex.quote(f"{self.workdir}/{self._results(trial_dir)}/{name}")
        proc = self.ssh.run(self.nodes[0], f"cat {path}", check=False)
        return proc.stdout.decode(errors="replace") if proc.returncode == 0 else None

    def collect(self, trial_dir: Path) -> None:
        try:
            sync.fetch(self.ssh, self.nodes[0], self.workdir, self._results(trial_dir),
                       trial_dir)
        except (RemoteError, OSError, tarfile.TarError) as e:
            # A node that is gone: the trial resumes from what an earlier fetch brought.
            log.warning("sweep: %s: could not bring %s back: %s", self.label, trial_dir, e)


def cluster_slots(run_id: str, runs_dir: str, parallel: int, nodes_per_trial: int,
                  launcher: str, command: list[str], sweep_name: str,
                  hourly_price: float | None) -> list[Slot]:
    """The nodes of a run `spotring up` brought up (run_id, or "latest" for the newest),
    ``nodes_per_trial`` to a slot; the project (this directory) and the environment
    that runs ``command`` (a trial's) go onto them first, as `spotring run` does."""
    from spotring.launch import config as launch_config
    from spotring.launch.clusters import provider_for
    from spotring.launch.run import prepare, ssh_for

    run = RunDir.find(runs_dir, None if run_id == "latest" else run_id)
    cfg = launch_config.with_saved_cluster(launch_config.compose([]), run.config, [])
    nodes = run.nodes()
    if not nodes or "destroyed_at" in run.state():
        raise ConfigError(f"sweep.cluster={run_id}: run {run.id} has no nodes (taken down, or "
                          "never up); bring some up with `spotring up nodes=N`")
    if parallel * nodes_per_trial > len(nodes):
        raise ConfigError(
            f"sweep.parallel={parallel} x sweep.nodes={nodes_per_trial} = "
            f"{parallel * nodes_per_trial} nodes, and run {run.id} has {len(nodes)}; valid: "
            f"parallel x nodes <= {len(nodes)}")
    project.check(Path.cwd(), command, cfg.job.max_project_mb)
    provider, ssh = provider_for(cfg, run), ssh_for(cfg, run)
    cfg.job.launcher, cfg.job.command = launcher, command  # what the environment is for
    prepare(cfg, run, provider, nodes, ssh)
    slices = [nodes[i * nodes_per_trial:(i + 1) * nodes_per_trial] for i in range(parallel)]
    if launcher != "torchrun":
        _hosts_of_each_slice(ssh, provider.workdir, slices)
    return [ClusterSlot(part, ssh, provider.workdir, launcher, sweep_name, hourly_price)
            for part in slices]


def _hosts_of_each_slice(ssh: Ssh, workdir: str, slices: list[list[Node]]) -> None:
    """horovodrun and mpirun start the ranks from the first node of a slice, over ssh
    (the run's key, which every node has), on the hosts of `hosts` in its workdir:
    there, the slice's nodes alone, not the run's, which `prepare` put on node 0."""
    slice_of = {s[0].id: s for s in slices}

    def give(first: Node) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            hosts, mpich = Path(tmp, "hosts"), Path(tmp, "hosts.mpich")
            hostfile.write(slice_of[first.id], hosts, mpich)
            ssh.run(first, f"tar -xzmf - -C {shlex.quote(workdir)}",
                    input=sync.tar({"hosts": hosts, "hosts.mpich": mpich}))

    on_each([s[0] for s in slices], give)


class SlurmAttempt(Attempt):
    """A trial as its own SLURM job (srun, which allocates and runs it). Stopped through
    SLURM: SIGTERM to the job's tasks (scancel --signal=TERM), which checkpoint and
    leave; SIGTERM to srun itself would kill the step outright."""

    def __init__(self, proc: subprocess.Popen, job_name: str) -> None:
        super().__init__([proc], group=True)
        self.job_name = job_name

    def stop(self) -> None:
        if self.poll() is None:
            subprocess.run(["scancel", "--signal=TERM", f"--name={self.job_name}"],
                           capture_output=True, timeout=60)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.procs[0].wait(timeout=STOP_GRACE_S)
        if self.poll() is None:
            subprocess.run(["scancel", f"--name={self.job_name}"], capture_output=True,
                           timeout=60)
        super().stop()


class SlurmSlot(Slot):
    """One trial at a time as a SLURM job of ``nodes`` nodes x ``workers`` tasks; SLURM
    chooses the nodes. The run directory is here, on storage the nodes share."""

    def __init__(self, index: int, nodes: int, workers: int, options: list[str],
                 sweep_name: str, hourly_price: float | None) -> None:
        self.label = f"SLURM slot {index} ({nodes} nodes x {workers} tasks)"
        self.nodes, self.workers, self.options = nodes, workers, options
        self.sweep_name, self.hourly_price = sweep_name, hourly_price

    def start(self, trial_dir: Path, work: Work, log: IO[bytes]) -> Attempt:
        job_name = f"spotring-{self.sweep_name}-{trial_dir.name}"
        argv = ["srun", f"--nodes={self.nodes}", f"--ntasks-per-node={self.workers}",
                f"--job-name={job_name}", "--kill-on-bad-exit=0", *self.options,
                *work.command]
        # srun passes this environment on to every task (--export=ALL, its default).
        proc = subprocess.Popen(argv, env=local_environment(**work.env), stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=_ends_with_sweep)
        return SlurmAttempt(proc, job_name)


def slurm_slots(parallel: int, nodes: int, workers: int, options: list[str],
                sweep_name: str, hourly_price: float | None) -> list[Slot]:
    if shutil.which("srun") is None:
        raise ConfigError("sweep.slurm=true: srun is not on the PATH; run the sweep on a "
                          "SLURM login node (or sweep.slurm=false: this machine's cores/GPUs)")
    return [SlurmSlot(i, nodes, workers, list(options), sweep_name, hourly_price)
            for i in range(parallel)]
