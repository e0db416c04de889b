"""--dry-run: the whole plan of a command, made without touching any cloud API."""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import DictConfig

from spotring.launch import project
from spotring.launch.provider import Node, Provider
from spotring.launch.run import job_for, results_of
from spotring.launch.rundir import RunDir


def plan(command: str, cfg: DictConfig, run: RunDir, provider: Provider) -> list[str]:
    lines = [f"dry run of `{command}`: nothing is created, no cloud API is called",
             f"run       {run.id} in {run.path}",
             f"cluster   {provider.name}, {cfg.nodes} nodes"]
    if command in ("up", "launch"):
        lines += [f"up        {line}" for line in provider.plan(cfg.nodes)]
        lines.append(f"up        then ssh-keyscan into {run.known_hosts}, and writes {run.hosts} "
                     "(ADDRESS slots=G) and hosts.mpich (ADDRESS:G)")
    if command in ("run", "launch"):
        # Placeholder nodes: the real addresses and slots (G, the GPUs of the type EC2
        # gives) are known only after `up`; the command is shown for one slot each.
        nodes = [Node(f"node-{i}", f"NODE{i}", f"NODE{i}", 1, "", "", "")
                 for i in range(cfg.nodes)]
        job = job_for(cfg, run, provider, nodes)
        files = project.files(Path.cwd())
        size = sum(p.stat().st_size for p in files.values()) / 2**20
        lines += [f"run       copy the project {Path.cwd()} ({len(files)} files, {size:.1f} MB) "
                  f"to {provider.workdir} on every node; hostfiles to node 0, the run's key "
                  "and known_hosts to every node",
                  "run       setup on every node: " + (cfg.cluster.setup or "(none)"),
                  f"run       then its .venv on top of {cfg.cluster.python or sys.executable}: "
                  "spotring at this version, the project's requirements ("
                  + (" ".join(project.requirements(Path.cwd())) or "none") + "); built once, "
                  "copied to the nodes that come later"]
        lines += [f"run       on node {i}: {cmd}" for i, cmd in job.commands.items()]
        lines.append("run       (shown with 1 slot per node; `up` writes each node's GPUs "
                     "into hosts, and -np is their sum)")
        lines.append(f"run       bring back {results_of(cfg, run)} (logs, metrics, "
                     f"TensorBoard, summary, final checkpoint) to {run.job}")
    if command in ("down", "launch"):
        lines.append("down      delete everything tagged or named with the run id: instances "
                     "and fleets, launch template, placement group, security group, key pair")
    if command == "cost":
        lines.append(f"cost      $/hour of {cfg.nodes} nodes from the spot price history; the "
                     "newest (or named) run's node-hours and $/epoch")
    if command == "status":
        lines.append("status    describe the run's nodes")
    return lines
