"""cluster=local: N nodes on this machine (network namespaces, each with an sshd)."""

from __future__ import annotations

import dataclasses
import getpass
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path

from omegaconf import DictConfig

from spotring.exits import ConfigError
from spotring.launch.down import down_after
from spotring.launch.local import netns, sshd
from spotring.launch.provider import Node, Provider, Teardown
from spotring.launch.rundir import RunDir

FIRST_HOST = 10  # node i is .10+i of the run's /24; .1 is this machine's bridge


class LocalCluster(Provider):
    name = "local"

    def __init__(self, cfg: DictConfig, run: RunDir):
        self.cfg = cfg
        self.run = run
        self.names = netns.Names(run.id)

    @property
    def workdir(self) -> str:
        # The same path for every node; each mounts its own directory there.
        return str(self.run.path / "workdir")

    def plan(self, count: int) -> list[str]:
        return [
            f"a bridge {self.names.bridge} on a free /24 of {self.cfg.subnet} (this machine: .1)",
            f"{count} network namespaces {self.names.ns(0)}..{count - 1}, each with a veth "
            f"pair to the bridge, an address (.{FIRST_HOST}, .{FIRST_HOST + 1}, ...), a "
            "hostname and an sshd (host key made here, the run's key authorized)",
            f"each node sees its own workdir at {self.workdir}, its own ~/.ssh and "
            f"/etc/hosts; its image's Python is this one ({sys.executable})",
            f"{self.cfg.slots} slot(s) per node; "
            + (f"priced at ${self.cfg.price}/hour each (cluster.price, a rehearsal: this "
               "machine bills nothing)" if self.cfg.price else "no price (this machine)"),
        ]

    def check(self) -> None:
        problems = []
        if os.geteuid() != 0:
            problems.append("cluster=local makes network namespaces: run it as root")
        elif subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
            problems.append("cluster=local: `ip netns` does not work here (iproute2 and a "
                            "kernel with network namespaces are needed)")
        if not sshd.SSHD.exists() or shutil.which("ssh-keyscan") is None:
            problems.append(f"cluster=local: {sshd.SSHD} or ssh-keyscan is missing: install "
                            "openssh-server and openssh-client (`make system-deps`)")
        if self.cfg.ssh_user != getpass.getuser():
            problems.append(f"cluster.ssh_user={self.cfg.ssh_user}: the local nodes log in "
                            f"as the user who starts them ({getpass.getuser()})")
        if problems:
            raise ConfigError("cannot start a local cluster:\n  - " + "\n  - ".join(problems))

    def create(self, count: int) -> list[Node]:
        try:
            subnet = netns.free_subnet(self.cfg.subnet, self.run.id)
            netns.add_bridge(self.names.bridge, f"{subnet[1]}/{subnet.prefixlen}")
            Path(self.workdir).mkdir(exist_ok=True)  # where each node mounts its own
            return [self._add(i) for i in range(count)]
        except BaseException as e:
            down_after(self.run, self, e)
            raise

    def _add(self, i: int) -> Node:
        net = netns.bridge_network(self.names.bridge)
        address = str(net[FIRST_HOST + i])
        ns, hostname = self.names.ns(i), f"node-{i}"
        netns.add_node(ns, self.names.veth(i), self.names.peer(i), self.names.bridge,
                       f"{address}/{net.prefixlen}")
        node_dir = self.run.path / "nodes" / f"node-{i}"
        sshd.prepare(node_dir, address, hostname, self.run.key.with_suffix(".pub").read_text())
        sshd.start(ns, node_dir, hostname, Path(self.workdir), self.cfg.ssh_user)
        return Node(id=ns, address=address, private_address=address, slots=self.cfg.slots,
                    type="netns", zone="local", lifecycle="local", launched_at=time.time(),
                    price=self.cfg.price)

    def describe(self) -> list[Node]:
        alive = set(netns.namespaces(self.names.ns_prefix))
        return [n if n.id in alive else dataclasses.replace(n, state="gone")
                for n in self.run.nodes()]

    def replace(self, lost: Sequence[Node]) -> list[Node]:
        """New nodes take the next free indices; the caller records the new node list."""
        for node in lost:
            if node.id in netns.namespaces(node.id):  # a lost node may be gone already
                self._remove(node.id)
            veth = self.names.veth(_index(node))
            if veth in netns.links(veth):
                netns.delete_link(veth)
        start = max((_index(n) for n in self.run.nodes()), default=-1) + 1
        return [self._add(i) for i in range(start, start + len(lost))]

    def destroy(self, all_mine: bool = False) -> list[str]:
        ns_prefix = netns.NS_PREFIX if all_mine else self.names.ns_prefix
        link_prefix = netns.ANY_RUNS_LINK if all_mine else self.names.link_prefix
        # `ip` failing (RuntimeError), a process we may not signal (OSError): that node only.
        teardown = Teardown((RuntimeError, OSError))
        for ns in netns.namespaces(ns_prefix):
            teardown.attempt(f"delete node {ns}", lambda ns=ns: teardown.done.append(
                self._remove(ns)))
        # Removing a namespace takes its end of the veth pair along, and usually ours.
        for link in netns.links(link_prefix):
            if teardown.attempt(f"delete link {link}", partial(netns.delete_link, link)):
                teardown.done.append(f"deleted link {link}")
        teardown.left = ([f"node {ns}" for ns in netns.namespaces(ns_prefix)]
                         + [f"link {link}" for link in netns.links(link_prefix)])
        return teardown.outcome(self.run.id, all_mine)

    def _remove(self, ns: str) -> str:
        pids = netns.delete_namespace(ns)
        stopped = f" (stopped pids {', '.join(map(str, pids))})" if pids else ""
        return f"deleted node {ns}{stopped}"


def _index(node: Node) -> int:
    return int(node.id.rsplit("-", 1)[1])
