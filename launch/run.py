"""`run`: the project onto the nodes, the job across them, the results back.

    1. push the project (the directory the launcher runs in: launch/project.py) and the
       environment's files (launch/node_env.py) into every node's workdir; hostfiles to
       node 0; the run's key and known_hosts to every node
    2. cluster.setup on every node, then its .venv: built, copied from a node that has
       it, or already there (launch/node_env.py); each node's output in setup-<id>.log
    3. the job's command (launch/job_command.py) on node 0, or on every node for
       torchrun and none; node 0's output streams here and into job.log, the others'
       into job-node-I.log
    4. rank 0's run directory back from node 0 into the run dir's job/, also after a
       failure

Returns the job's exit code (docs/exit-codes.md); a failure's last lines are logged
with it.
"""

from __future__ import annotations

import logging
import shlex
import subprocess
import sys
import tarfile
from collections import deque
from contextlib import AbstractContextManager, ExitStack, nullcontext
from pathlib import Path

from omegaconf import DictConfig

from spotring import contract
from spotring.exits import ConfigError
from spotring.launch import job_command, node_env, project, sync, wheel
from spotring.launch.provider import Node, Provider
from spotring.launch.rundir import RunDir
from spotring.launch.ssh import RemoteError, Ssh
from spotring.support.restarts import NOTES, Outcome, classify

log = logging.getLogger("launch")


def ssh_for(cfg: DictConfig, run: RunDir) -> Ssh:
    return Ssh(cfg.cluster.ssh_user, run.key, run.known_hosts)


def results_of(cfg: DictConfig, run: RunDir) -> str:
    """Rank 0's run directory, relative to node 0's workdir."""
    return cfg.job.results or job_command.results_dir(run.id)


def job_for(cfg: DictConfig, run: RunDir, provider: Provider, nodes: list[Node],
            extra: dict[str, str] | None = None) -> job_command.JobCommand:
    """The job's command on ``nodes``, with the contract's variables and ``extra``."""
    results = results_of(cfg, run)
    env = {**cfg.job.env, **contract.environment(
        run.id, f"{provider.workdir}/{results}", len(run.tries()), cfg.checkpoint.uri),
           **(extra or {})}
    return job_command.build(cfg.job.launcher, nodes, provider.workdir, run.id,
                             list(cfg.job.command), env, results)


def prepare(cfg: DictConfig, run: RunDir, provider: Provider, nodes: list[Node],
            ssh: Ssh) -> None:
    """Steps 1 and 2 of the module docstring: the nodes ready to start the job."""
    root, launcher = Path.cwd(), cfg.job.launcher
    # Horovod where one of its launchers starts the job (horovodrun, or mpirun, which
    # Horovod documents too: a job of either may run engine=horovod); mpi4py under mpirun.
    horovod = launcher in ("horovodrun", "mpirun")
    env = node_env.Environment.of(
        wheel.build(run.path / "dist"), root, project.requirements(root),
        cfg.cluster.python or sys.executable,
        ["mpi", "horovod"] if horovod else ["mpi"] if launcher == "mpirun" else [],
        horovod, cfg.cluster.setup)
    files = project.files(root)
    sync.push(ssh, nodes, provider.workdir, run, files | env.files)
    log.info("run: copied %d files of %s to %s on %d nodes", len(files), root,
             provider.workdir, len(nodes))
    if cfg.cluster.setup:
        log.info("run: setting the nodes up: %s", cfg.cluster.setup)
        sync.setup(ssh, nodes, provider.workdir, cfg.cluster.setup)
    how = node_env.prepare(ssh, nodes, provider.workdir, env, cfg.cluster.copy_env, run.path)
    for i, node in enumerate(nodes):
        log.info("run: node %d (%s): environment %s %s", i, node.id, env.key, how[node.id])


def run(cfg: DictConfig, run: RunDir, provider: Provider) -> int:
    nodes = run.nodes()
    if not nodes or "destroyed_at" in run.state():
        raise ConfigError(f"run {run.id} has no nodes (taken down, or never up): start a new "
                          "run with `spotring up` or `spotring launch`")
    ssh = ssh_for(cfg, run)
    job = job_for(cfg, run, provider, nodes)
    prepare(cfg, run, provider, nodes, ssh)
    results = results_of(cfg, run)
    clear_notes(ssh, nodes[0], provider.workdir, run, results)
    log.info("run: on node 0 (%s): %s", nodes[0].address, job.commands[0])
    try:
        status = _start(ssh, nodes, run, job.commands)
    except BaseException:
        try:  # what there is, without hiding why the job stopped
            bring_back(ssh, nodes[0], provider.workdir, run, results)
        except (RemoteError, OSError, tarfile.TarError) as e:
            log.info("run: could not bring the results back: %s", e)
        raise
    bring_back(ssh, nodes[0], provider.workdir, run, results)
    note = next((n for n in NOTES if (run.job / n).exists()), None)
    code = job.exit_code(*status, note=note)
    if classify(code) not in (Outcome.DONE, Outcome.PREEMPTED):  # why, where it is read
        last = "\n".join("  " + line for line in status[1].splitlines()[-10:])
        log.info("run: the job exited with code %d (%s); its last lines on node 0:\n%s",
                 code, classify(code).what, last)
    else:
        log.info("run: the job exited with code %d", code)
    return code


def clear_notes(ssh: Ssh, node: Node, workdir: str, run: RunDir, results: str) -> None:
    """Rank 0's notes from a try before this one, on ``node`` and here."""
    remote = shlex.quote(f"{workdir}/{results}")
    ssh.run(node, "rm -f " + " ".join(f"{remote}/{note}" for note in NOTES))
    for note in NOTES:
        (run.job / note).unlink(missing_ok=True)


def bring_back(ssh: Ssh, node: Node, workdir: str, run: RunDir, results: str) -> None:
    """Rank 0's run directory from ``node`` into the run dir's job/."""
    names = sync.fetch(ssh, node, workdir, results, run.job)
    if names:
        log.info("run: brought back %d files to %s", len(names), run.job)
    else:
        log.info("run: the job wrote nothing to bring back")


def _start(ssh: Ssh, nodes: list[Node], run: RunDir, commands: dict[int, str]) -> tuple[int, str]:
    """The first failed node's exit code (or 0), and node 0's last lines."""
    with ExitStack() as files:
        procs = {}
        for i, command in sorted(commands.items()):
            out = (subprocess.PIPE if i == 0
                   else files.enter_context(open(run.path / f"job-node-{i}.log", "wb")))
            procs[i] = ssh.popen(nodes[i], command, tty=True, stdin=subprocess.DEVNULL,
                                 stdout=out, stderr=subprocess.STDOUT)
        try:
            tail = relay(procs[0].stdout, files.enter_context(open(run.job_log, "w")))
            codes = [proc.wait() for proc in procs.values()]
        except BaseException:  # Ctrl-C or an error: closing the connections hangs the job up
            for proc in procs.values():
                proc.terminate()
            raise
    return next((c for c in codes if c != 0), 0), tail


def relay(stdout, log_file, prefix: str = "", lock: AbstractContextManager | None = None
          ) -> str:
    """Copy a node's output here and to ``log_file`` as it comes, each line after
    ``prefix`` (under ``lock``, where several relay at once); return its last lines."""
    tail: deque[str] = deque(maxlen=50)
    for raw in stdout:
        line = prefix + raw.decode(errors="replace").replace("\r\n", "\n")  # a pty's ends
        with lock or nullcontext():
            sys.stdout.write(line)
            sys.stdout.flush()
            log_file.write(line)
            log_file.flush()
        tail.append(line)
    return "".join(tail)
