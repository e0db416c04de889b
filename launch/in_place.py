"""`launch` and `run` with job.launcher=in_place: the job trains on through lost nodes,
and their replacements join it (spotring/elastic/, docs/elastic.md).

    1. the rendezvous store the job's processes meet in, served by this process: it
       outlives every training node. Each node reaches it at its own 127.0.0.1:PORT,
       forwarded back here by an ssh connection of its own (-R), so that a cloud's
       nodes need no port open but ssh's, and nothing listens beyond loopback.
    2. the nodes prepared as `run` prepares them (launch/run.py: the project, the
       environment); on each, the command once per slot, each over its own ssh
       (launch/job_command.py's in_place), with SPOTRING_IN_PLACE=on: a job that cannot
       go on in place (its engine) exits 2 before any step. Every process's output comes
       here and into job.log, each line after [NODE/SLOT].
    3. a process that exits without the job's end (the store's ``ended``: each member
       sets it when the job ends as a whole) left it: a notice, a crash, its node gone.
       Every cluster.notice_poll_s the provider is asked which nodes still run. A node
       gone, or announcing a spot notice (launch/notice.py), is taken down and replaced
       (``replace``: launch/recover.py's, the replacement where the budget allows, else
       the others go on); on a node still up, the process is started again. Either way
       the new process joins the running job at a step boundary, with the members'
       state. Each such event is recorded in state.json ("in_place": when, which node,
       why, its replacement, when its process started), which the ledger shows beside
       the job's own seconds lost (summary.json's "in_place").
    4. once every process has ended: rank 0's run directory back from the node of the
       job's rank 0 at its end (the earliest-started process of the last members), and
       the exit code of the job's end (0, or 75 where the others could not go on: the
       run then restarts from the checkpoint, as any launch does). Where every process
       exits without the job's end, none is left to join: the same restart.
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO

from omegaconf import DictConfig

from spotring import contract
from spotring.exits import EXIT_PEER_LOST
from spotring.launch import notice
from spotring.launch.provider import NoCapacity, Node, Provider
from spotring.launch.run import (
    bring_back,
    clear_notes,
    job_for,
    prepare,
    relay,
    results_of,
    ssh_for,
)
from spotring.launch.rundir import RunDir
from spotring.launch.ssh import Ssh, on_each

log = logging.getLogger("launch")

# The run's nodes once the lost ones are replaced (launch/recover.py's: taken down,
# replaced, admitted); NoCapacity where none can be had.
Replace = Callable[[list[Node]], list[Node]]
# Whether the run's budget for a cause ("preemption": a notice; "failure": any other)
# allows one more replacement or restart, spending it if so.
Spend = Callable[[str], bool]


@dataclass
class _Process:
    """Slot ``slot`` of ``node``, the ``order``-th process the try started."""

    node: Node
    slot: int
    order: int
    ssh: subprocess.Popen
    pump: threading.Thread
    code: int | None = None
    final: bool = False  # it ended with the job as a whole, or with exit 0

    @property
    def name(self) -> str:
        return f"{self.node.id}/{self.slot}"


@dataclass
class _Job:
    """The processes of one try, and the tunnels that carry each node to the store."""

    cfg: DictConfig
    run: RunDir
    provider: Provider
    ssh: Ssh
    port: int
    out: IO[str]
    processes: list[_Process] = field(default_factory=list)
    tunnels: dict[str, subprocess.Popen] = field(default_factory=dict)
    lost: set[str] = field(default_factory=set)  # the nodes found lost, handled
    lock: threading.Lock = field(default_factory=threading.Lock)  # one line at a time

    def start(self, new: list[Node], joining: bool) -> None:
        """The job's command on every slot of the run's ``new`` nodes."""
        for node in new:
            self._tunnel(node)
            for slot in range(node.slots):
                self._start(node, slot, joining)

    def again(self, process: _Process) -> None:
        """``process``'s slot started again on its node, to join the job."""
        self._start(process.node, process.slot, joining=True)

    def _tunnel(self, node: Node) -> None:
        """The node's 127.0.0.1:port forwarded to the store here, for as long as this
        ssh runs (its remote command reads stdin: it ends when this process does)."""
        tunnel = self.ssh.popen(node, "echo forwarded && exec cat >/dev/null",
                                forward=self.port, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        if tunnel.stdout.readline() != b"forwarded\n":
            tunnel.kill()
            raise ConnectionError(f"node {node.id}: no ssh forward of its port {self.port} "
                                  f"to the rendezvous: {tunnel.communicate()[1].decode()}")
        self.tunnels[node.id] = tunnel

    def _start(self, node: Node, slot: int, joining: bool) -> None:
        nodes = self.run.nodes()
        env = {contract.RENDEZVOUS: f"127.0.0.1:{self.port}"}
        commands = job_for(self.cfg, self.run, self.provider, nodes, env).commands
        rank = sum(n.slots for n in nodes[:[n.id for n in nodes].index(node.id)]) + slot
        popen = self.ssh.popen(node, commands[rank], tty=True, stdin=subprocess.DEVNULL,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        process = _Process(node, slot, len(self.processes), popen, threading.Thread(
            target=relay, args=(popen.stdout, self.out, f"[{node.id}/{slot}] ", self.lock),
            daemon=True))
        process.pump.start()
        self.processes.append(process)
        log.info("in place: started %s%s", process.name,
                 ", to join the running job" if joining else "")

    def running(self) -> list[_Process]:
        return [p for p in self.processes if p.code is None]

    def stop(self, node: Node) -> None:
        """What still runs for ``node`` here: its processes' ssh and its tunnel (a node
        gone may leave them waiting for a peer that never answers)."""
        for p in self.processes:
            if p.node.id == node.id and p.code is None:
                p.ssh.kill()
                p.code = p.ssh.wait()
        if tunnel := self.tunnels.pop(node.id, None):
            tunnel.kill()
            tunnel.wait()

    def close(self) -> None:
        for p in self.processes:
            if p.ssh.poll() is None:  # Ctrl-C or an error: the pty's hangup ends the rank
                p.ssh.terminate()
            p.ssh.wait()
            p.pump.join(timeout=10)
        for tunnel in self.tunnels.values():
            tunnel.kill()
            tunnel.wait()


def run(cfg: DictConfig, run: RunDir, provider: Provider, replace: Replace | None = None,
        spend: Spend = lambda cause: False) -> int:
    """One try of the job in place on the run's nodes (the module docstring), until every
    process of it has ended; returns the exit code of its end. Without ``replace``
    (`spotring run`) no node is replaced; without ``spend`` no process is restarted."""
    from spotring.elastic.rendezvous import ended, serve  # torch: only for a job in place

    nodes = run.nodes()
    ssh = ssh_for(cfg, run)
    prepare(cfg, run, provider, nodes, ssh)
    results = results_of(cfg, run)
    clear_notes(ssh, nodes[0], provider.workdir, run, results)
    store = serve("127.0.0.1", 0)
    with open(run.job_log, "w") as out:
        job = _Job(cfg, run, provider, ssh, store.port, out)
        try:
            job.start(nodes, joining=False)
            _follow(job, lambda: ended(store), replace, spend)
        finally:
            job.close()
    final = [p for p in job.processes if p.final] or job.processes
    here = {n.id for n in run.nodes()}
    rank_0 = min((p for p in final if p.node.id in here), key=lambda p: p.order,
                 default=None)
    if rank_0 is not None:
        bring_back(ssh, rank_0.node, provider.workdir, run, results)
    codes = [p.code for p in final]
    code = 0 if 0 in codes else next((c for c in codes if c != 0), EXIT_PEER_LOST)
    log.info("run: the job exited with code %d", code)
    return code


def _follow(job: _Job, ended: Callable[[], bool], replace: Replace | None,
            spend: Spend) -> None:
    """Until every process has ended: each that left the job started again, on its node
    or, where the node is lost, on its replacement."""
    checked = time.monotonic()
    while job.running():
        time.sleep(0.2)
        left = []
        for p in job.running():
            if (code := p.ssh.poll()) is not None:
                p.code, p.final = code, code == 0 or ended()
                if not p.final:
                    left.append(p)
        if left and not job.running() and not ended():
            # Every process left without the job's end (a crash on all): none is left to
            # join, so the job is started again from its checkpoint (the try's exit code
            # to launch/recover.py), as any launch is.
            return
        if not left and time.monotonic() - checked < job.cfg.cluster.notice_poll_s:
            continue
        checked = time.monotonic()
        lost = _lost(job, [p.node for p in left])
        if ended():  # the job's end: nothing to replace
            continue
        for p in left:
            if p.node.id not in lost and spend("failure"):
                log.info("in place: %s exited %d, its node still up: started again there",
                         p.name, p.code)
                _record(job.run, p.node, f"exit {p.code}", p.node)
                job.again(p)
        if lost:
            _replace(job, lost, replace, spend)


def _lost(job: _Job, suspects: list[Node]) -> dict[str, str]:
    """Why each node of the run not yet found lost is lost, by id: not running (or no
    longer listed), or, of the ``suspects`` (a process of theirs left the job), one that
    ssh no longer reaches (a node going, before the provider says so) or that announces
    a spot notice."""
    running = {n.id for n in job.provider.describe() if n.state == "running"}
    nodes = [n for n in job.run.nodes() if n.id not in job.lost]
    asked = [n for n in nodes if n.id in running and n.id in {s.id for s in suspects}]
    answers = on_each(asked, lambda node: job.ssh.run(node, "true", check=False))
    unreachable = {n.id for n, a in zip(asked, answers, strict=True) if a.returncode == 255}
    asked = [n for n in asked if n.id not in unreachable]
    noticed = notice.noticed(job.ssh, asked, job.provider.workdir) if asked else {}
    lost = {n.id: "gone" for n in nodes if n.id not in running}
    lost |= dict.fromkeys(unreachable, "unreachable by ssh")
    lost |= {id: f"a spot notice ({what})" for id, what in noticed.items()}
    job.lost |= set(lost)
    return lost


def _replace(job: _Job, lost: dict[str, str], replace: Replace | None, spend: Spend) -> None:
    """Replacements for the ``lost`` nodes where they can be had and the budget allows,
    started to join the job; the others train on meanwhile, and without one."""
    gone = [n for n in job.run.nodes() if n.id in lost]
    for node in gone:
        job.stop(node)
        log.info("in place: node %s is lost (%s); the others train on", node.id,
                 lost[node.id])
    wanted = [n for n in gone if replace is not None and spend(
        "preemption" if lost[n.id].startswith("a spot notice") else "failure")]
    new: list[Node] = []
    if wanted:
        before = {n.id for n in job.run.nodes()}
        try:
            new = [n for n in replace(wanted) if n.id not in before]
        except NoCapacity as e:
            log.info("in place: no replacement to be had (%s): the others go on", e)
    replacements = dict(zip([n.id for n in wanted], new, strict=False))
    for node in gone:
        _record(job.run, node, lost[node.id], replacements.get(node.id))
    if new:
        prepare(job.cfg, job.run, job.provider, new, job.ssh)
        job.start(new, joining=True)


def _record(run: RunDir, node: Node, why: str, replacement: Node | None) -> None:
    """One event of the job in place in state.json's "in_place"."""
    run.save(in_place=[*run.state().get("in_place", []), {
        "at": time.time(), "node": node.id, "why": why,
        "replacement": replacement.id if replacement else None}])
