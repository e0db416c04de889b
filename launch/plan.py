"""--dry-run: the whole plan of a command, made without touching any cloud API."""

from __future__ import annotations

from omegaconf import DictConfig

from launch import job_command
from launch.provider import Node, Provider
from launch.rundir import RunDir


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
        job = job_command.build(cfg.job.launcher, nodes, provider.workdir, run.id,
                                list(cfg.job.args))
        lines += [f"run       copy the code (the files git knows) to {provider.workdir} "
                  "on every node; hostfiles, key and known_hosts to node 0",
                  "run       setup on every node: " + (cfg.cluster.setup or "(none)")]
        lines += [f"run       on node {i}: {cmd}" for i, cmd in job.commands.items()]
        lines.append("run       (shown with 1 slot per node; `up` writes each node's GPUs "
                     "into hosts, and -np is their sum)")
        lines.append(f"run       bring back {job_command.results_dir(run.id)} (logs, "
                     f"metrics, TensorBoard, summary, final checkpoint) to {run.job}")
    if command in ("down", "launch"):
        lines.append("down      delete everything tagged or named with the run id: instances "
                     "and fleets, launch template, placement group, security group, key pair")
    if command == "cost":
        lines.append(f"cost      $/hour of {cfg.nodes} nodes from the spot price history; the "
                     "newest (or named) run's node-hours and $/epoch")
    if command == "status":
        lines.append("status    describe the run's nodes")
    return lines
