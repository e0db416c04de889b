"""A real SLURM cluster of N nodes on this machine, for the tests of `srun`/`sbatch`.

    this machine   munged (one for all: its socket is a path every namespace sees),
                   slurmctld on the bridge's address (the local cluster's .1)
    node i         a network namespace of the local cluster (launch/local/netns.py) with
                   address .10+i and hostname node-i; a slurmd -N node-i in it, whose
                   /etc/hosts names every node, as a cluster's DNS would
    partitions     low (the default) and high over all nodes: a job of high that needs
                   their CPUs preempts the jobs of low (SIGTERM, GraceTime, requeue)

Everything lives in one directory (slurm.conf, the munge key, state, spool, logs) and
goes with it: stop() ends every daemon and every process left in the namespaces, and
says which did not end. Debian's slurm-wlm 22.05 and munge, as root (`make system-deps`).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from harness.launcher import netns_unavailable, processes
from spotring.launch.local import netns
from spotring.launch.local.provider import FIRST_HOST
from spotring.polling import poll

DAEMONS = ("munged", "slurmctld", "slurmd")
# What a job of the preemptible partition (low) gets between SIGTERM and SIGKILL when a
# job of the higher tier takes its nodes: the time a checkpoint must be on disk within.
GRACE_S = 30
COMMANDS = ("srun", "sbatch", "scancel", "sinfo", "scontrol")

CONF = """\
ClusterName=spotring
SlurmctldHost={controller}({controller_addr})
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire: also how long a requeued job waits before it may start again (120 s);
# sched_interval: how often pending jobs are looked at besides on events (60 s).
AuthInfo=socket={dir}/munge/socket,cred_expire=5
StateSaveLocation={dir}/ctld
SlurmctldPidFile={dir}/ctld/slurmctld.pid
SlurmdSpoolDir={dir}/%n
SlurmdPidFile={dir}/%n/slurmd.pid
# The daemons run in the foreground: their logs are their output, DIR/<daemon>.log.
MailProg=/bin/true
# No cgroups here: processes are tracked by parentage, tasks are not bound to cores.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobRequeue=1
ReturnToService=2
# Quick to notice a node that went, quick to forget a job that ended.
SlurmdTimeout=30
MinJobAge=2
KillWait=5
{nodes}
# A preempting partition over the same nodes: a job of `high` requeues the jobs of `low`
# in its way, which get SIGTERM at once and GraceTime seconds to checkpoint.
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
PartitionName=low Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1 GraceTime={grace_s}
PartitionName=high Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
"""


def unavailable() -> str | None:
    """Why this machine cannot run the SLURM cluster, or None if it can."""
    if (why := netns_unavailable()) is not None:
        return why
    missing = [c for c in DAEMONS + COMMANDS if shutil.which(c, path="/usr/sbin:/usr/bin") is None]
    if missing:
        return f"{', '.join(missing)} missing: install slurm-wlm and munge (`make system-deps`)"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@dataclass
class Node:
    name: str
    address: str
    ns: str


class SlurmCluster:
    """``nodes`` SLURM nodes in namespaces of run ``slurm-<pid>``, configured in ``dir``."""

    def __init__(self, dir: Path, nodes: int = 2):
        self.dir = dir
        self.run_id = f"slurm-{os.getpid()}"
        self.names = netns.Names(self.run_id)
        self.count = nodes
        self.nodes: list[Node] = []
        self.daemons: dict[str, subprocess.Popen] = {}
        self.leftover_pids: list[int] = []
        self.conf = dir / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """What srun, sbatch, sinfo... need to find this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def start(self, timeout_s: float = 30) -> None:
        """Up to the point where sinfo shows every node idle; stop() undoes what it did,
        whether or not it got there."""
        self._network()
        self._configure()
        self._daemon("munged", ["munged", "--foreground", "--force",
                                f"--socket={self.dir}/munge/socket",
                                f"--key-file={self.dir}/munge/key",
                                f"--pid-file={self.dir}/munge/pid",
                                f"--seed-file={self.dir}/munge/seed",
                                "--log-file=/dev/null"])
        self._wait(lambda: (self.dir / "munge/socket").exists() or None, "munged's socket",
                   timeout_s)
        self._daemon("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
        for node in self.nodes:
            self._daemon(node.name, netns.on_node(
                node.ns, node.name, [(self.dir / "hosts", Path("/etc/hosts"))],
                ["slurmd", "-D", "-f", str(self.conf), "-N", node.name]))
        self.wait_idle(timeout_s)

    def _network(self) -> None:
        subnet = netns.free_subnet("10.213.0.0/16", self.run_id)
        self.controller_addr = str(subnet[1])
        netns.add_bridge(self.names.bridge, f"{subnet[1]}/{subnet.prefixlen}")
        for i in range(self.count):
            node = Node(f"node-{i}", str(subnet[FIRST_HOST + i]), self.names.ns(i))
            netns.add_node(node.ns, self.names.veth(i), self.names.peer(i), self.names.bridge,
                           f"{node.address}/{subnet.prefixlen}")
            self.nodes.append(node)

    def _configure(self) -> None:
        (self.dir / "munge").mkdir(mode=0o755, parents=True)  # the socket's: all may enter
        key = self.dir / "munge/key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        (self.dir / "ctld").mkdir()
        for node in self.nodes:
            (self.dir / node.name).mkdir()
        cpus = os.cpu_count() or 1
        self.conf.write_text(CONF.format(
            controller=socket.gethostname(), controller_addr=self.controller_addr,
            ctld_port=free_port(), slurmd_port=free_port(), dir=self.dir, grace_s=GRACE_S,
            nodes="\n".join(f"NodeName={n.name} NodeAddr={n.address} CPUs={cpus} State=UNKNOWN"
                            for n in self.nodes)))
        # slurmd 22.05 loads a cgroup plugin whatever the config; autodetect fails in a
        # namespace (`ip netns exec` mounts a /sys of its own) and v1 stays unused.
        (self.dir / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")
        (self.dir / "hosts").write_text("127.0.0.1 localhost\n" + "".join(
            f"{n.address} {n.name}\n" for n in self.nodes))

    def _daemon(self, name: str, argv: list[str]) -> None:
        with open(self.dir / f"{name}.log", "wb") as log:  # the daemon keeps its copy
            self.daemons[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                                  stdin=subprocess.DEVNULL,
                                                  start_new_session=True)

    def _wait(self, check: Callable[[], bool | None], what: str, timeout_s: float) -> None:
        """poll(check), failing early where a daemon exited; the daemons' logs on failure."""
        def step() -> bool | None:
            if ended := {n: p.returncode for n, p in self.daemons.items() if p.poll() is not None}:
                raise RuntimeError(f"{what}: daemons exited: {ended}")
            return check()
        try:
            poll(step, timeout_s=timeout_s, interval_s=0.05, what=what)
        except (TimeoutError, RuntimeError) as e:
            raise RuntimeError(f"{e}\n{self.logs()}") from None

    def _states(self) -> dict[str, str]:
        """sinfo's state of each node: idle, alloc, drain, idle* (not answering)..."""
        out = self.run("sinfo", "--noheader", "--Node", "--format=%N %t", check=False).stdout
        return dict(line.split() for line in out.splitlines() if line.strip())

    def _idle(self) -> bool | None:
        return self._states() == {n.name: "idle" for n in self.nodes} or None

    def run(self, *argv: str, check: bool = True, timeout: float = 30
            ) -> subprocess.CompletedProcess:
        """A SLURM command (sinfo, scontrol...) against this cluster."""
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **self.env})
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: exit {proc.returncode}: {proc.stderr}")
        return proc

    @contextmanager
    def drained(self, node: str, timeout_s: float = 30) -> Iterator[None]:
        """``node`` drained for the block (its job runs on, no new one starts there), then
        back in service: idle and answering, as the next test expects."""
        self.run("scontrol", "update", f"nodename={node}", "state=drain", "reason=test")
        try:
            yield
        finally:
            self.run("scontrol", "update", f"nodename={node}", "state=resume")
            self._wait(lambda: self._states().get(node) == "idle" or None,
                       f"sinfo: {node} idle again", timeout_s)

    def wait_idle(self, timeout_s: float = 30) -> None:
        """Until every node is idle: the last job's nodes done completing, a resumed node
        answering again."""
        self._wait(self._idle, f"sinfo: {self.count} nodes idle", timeout_s)

    def logs(self, tail: int = 15) -> str:
        """The last lines of every daemon's log, for a failure message."""
        parts = []
        for path in sorted(self.dir.glob("*.log")):
            lines = path.read_text(errors="replace").splitlines()[-tail:]
            if lines:
                parts.append(f"--- {path.relative_to(self.dir)}\n" + "\n".join(lines))
        return "\n".join(parts)

    def stop(self) -> None:
        """Every slurmd and what it started (the namespaces go, with every process in
        them), then slurmctld and munged, then the bridge; ``leftover_pids``: the
        processes that outlived it all (none, normally)."""
        pids: list[int] = []
        for ns in netns.namespaces(self.names.ns_prefix):
            pids += netns.delete_namespace(ns)
        for proc in self.daemons.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.daemons.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for link in netns.links(self.names.link_prefix):
            netns.delete_link(link)
        self.leftover_pids = [p for p in pids if netns._signal(p, 0)]


@contextmanager
def running(dir: Path, nodes: int = 2) -> Iterator[SlurmCluster]:
    """A started cluster in ``dir`` (made here); afterwards no daemon of it runs, no process
    of its nodes is left, and ``dir`` is gone."""
    dir.mkdir()
    cluster = SlurmCluster(dir, nodes)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        alive = processes(str(dir))  # munged, slurmctld, slurmd name it in their arguments
        shutil.rmtree(dir)
    assert alive == [] and cluster.leftover_pids == [], (alive, cluster.leftover_pids)
