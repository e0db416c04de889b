"""`up`: N nodes ready for ssh, the hostfiles written, the job command printed.

    1. provider.check: all that can be checked, read-only; bad input stops here
    2. the run dir: launch.yaml (the config), the run's key pair
    3. provider.create(N): all or nothing
    4. ssh-keyscan into known_hosts, a first login, hosts and hosts.mpich, the command

If anything fails, or Ctrl-C comes, once the nodes exist, everything is taken down again
(launch.down.down_after: what cannot be deleted is named after the reason up failed).
"""

from __future__ import annotations

import logging
import shlex

from omegaconf import DictConfig

from spotring.launch import hostfile
from spotring.launch.down import down_after
from spotring.launch.provider import Node, Provider
from spotring.launch.run import job_for, ssh_for
from spotring.launch.rundir import RunDir
from spotring.launch.ssh import new_key, scan_host_keys

log = logging.getLogger("launch")


def up(cfg: DictConfig, run: RunDir, provider: Provider) -> list[Node]:
    provider.check()
    run.create(cfg)
    new_key(run.key, f"spotring-{run.id}")
    nodes = provider.create(cfg.nodes)
    try:
        admit(cfg, run, nodes, nodes)
    except BaseException as e:
        log.info("up: failed; taking the nodes down")
        down_after(run, provider, e)
        raise
    slots = sum(n.slots for n in nodes)
    log.info("up: %d nodes, %d slots; wrote %s, %s and %s", len(nodes), slots, run.hosts,
             run.hosts_mpich.name, run.known_hosts.name)
    job = job_for(cfg, run, provider, nodes)
    log.info("up: `spotring run` copies the project, sets the nodes up and starts, on node "
             "0:\n  %s",
             shlex.join(ssh_for(cfg, run).argv(nodes[0], job.commands[0])))
    return nodes


def admit(cfg: DictConfig, run: RunDir, nodes: list[Node], new: list[Node]) -> None:
    """Make ``nodes`` the run's nodes, of which ``new`` just came: their host keys into
    known_hosts, a first login, the hostfiles rewritten (node 0 first)."""
    run.save_nodes(nodes)
    for node in new:
        log.info("up: node %d: %s", nodes.index(node), node.summary())
    scan_host_keys(new, run.known_hosts, cfg.cluster.ssh_timeout_s)
    ssh_for(cfg, run).wait_for_login(new, cfg.cluster.ssh_timeout_s)
    hostfile.write(nodes, run.hosts, run.hosts_mpich)
