"""Running the launcher as users do (python -m spotring.launch, make launch), following a launch
as it goes (a spot notice for one of its nodes), and finding what a local cluster leaves
on this machine: namespaces, links, processes."""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from harness import REPO
from harness.imds import MetadataStub
from spotring.checkpoint.layout import Checkpoints
from spotring.launch.local import netns
from spotring.launch.rundir import RunDir

CLONE_NEWNET = 0x40000000  # setns(2): join a network namespace
# Horovod (and its horovodrun) is built by `make horovod`, which `make test` runs and
# `make test-fast` does not: the tests that need it skip, saying so, where it is not built.
HOROVOD_MISSING = "Horovod is not built here: `make horovod` builds it (`make test` does)"
needs_horovod = pytest.mark.skipif(importlib.util.find_spec("horovod") is None,
                                   reason=HOROVOD_MISSING)


def launcher(*args: str, env: dict | None = None, timeout: float = 120
             ) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "spotring.launch", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def netns_unavailable() -> str | None:
    """Why this machine cannot run a local cluster, or None if it can."""
    if os.geteuid() != 0:
        return "the local cluster makes network namespaces: needs root"
    probe = f"{netns.NS_PREFIX}probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", probe], check=True)
    return None


def leftovers(run_id: str) -> list[str]:
    """The run's namespaces and links still on this machine."""
    names = netns.Names(run_id)
    return netns.namespaces(names.ns_prefix) + netns.links(names.link_prefix)


def processes(run_id: str) -> list[str]:
    """This machine's processes whose command line names the run (its nodes' sshds, the
    job's ranks and launchers), as "PID: COMMAND LINE"."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0") if proc.name.isdigit() else []
        except OSError:  # ended meanwhile
            continue
        line = " ".join(a.decode(errors="replace") for a in argv).strip()
        if run_id in line:
            found.append(f"{proc.name}: {line}")
    return found


def run_dir_of(output: str) -> RunDir | None:
    first = [line for line in output.splitlines() if line.startswith("spotring: run ")]
    if not first:
        return None
    return RunDir(Path(re.fullmatch(r"spotring: run \S+ in (\S+)", first[0]).group(1)))


def steps_on_node_0(run: RunDir) -> int:
    """The last step of node 0's metrics.jsonl (where rank 0 writes by default)."""
    metrics = run.path / f"nodes/node-0/work/runs/{run.id}/metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    return max((json.loads(line)["step"] for line in lines if line.endswith("}")), default=0)


def checkpoints_on_node_0(run: RunDir) -> list[int]:
    """The steps of the checkpoints complete on node 0 (rank 0's, by default)."""
    folder = run.path / f"nodes/node-0/work/runs/{run.id}/checkpoints"
    return sorted(c.step for c in Checkpoints(folder, keep=1).found()) if folder.is_dir() else []


class Followed:
    """A launcher process whose output (stdout and stderr together) is read as it comes."""

    def __init__(self, proc: subprocess.Popen, timeout_s: float = 400) -> None:
        self.proc, self.lines = proc, []
        self.deadline = time.monotonic() + timeout_s
        self.reader = threading.Thread(target=lambda: self.lines.extend(proc.stdout),
                                       daemon=True)
        self.reader.start()

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def wait_for(self, done: Callable[[], bool]) -> None:
        """Until ``done()``; fails, with the output, if the launcher ends or time is up."""
        while not done():
            assert self.proc.poll() is None and time.monotonic() < self.deadline, self.text
            time.sleep(0.1)

    def end(self) -> tuple[int, str]:
        """The launcher's exit code and all its output."""
        code = self.proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))
        self.reader.join(timeout=10)
        return code, self.text

    def __enter__(self) -> Followed:
        return self

    def __exit__(self, *exc: object) -> None:
        """Where the launcher still runs (a step of the test failed): SIGTERM, on which it
        takes down all it started."""
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=120)


def notice_node_1(followed: Followed, trained: int,
                  answer: Callable[[netns.Names], str] = lambda names: (
                      "the job exited with code 75")
                  ) -> tuple[RunDir, netns.Names, float, MetadataStub]:
    """EC2's spot notice for node 1 of the launch ``followed`` once node 0 logged step
    ``trained``, and the launcher's answer to it: the line ``answer`` gives for the run's
    names (by default the job's stop for it, exit 75). The notice stays up, as EC2's does
    until it takes the instance (or for good where it stops it instead): the launcher
    takes node 1 down itself. Returns the run, its names, when the notice came and node
    1's metadata service, for the caller to close."""
    followed.wait_for(lambda: run_dir_of(followed.text) is not None)
    run = run_dir_of(followed.text)
    names = netns.Names(run.id)
    followed.wait_for(lambda: names.ns(1) in netns.namespaces(names.ns_prefix))
    metadata = metadata_service_of(names.ns(1))  # up before the job starts to look
    followed.wait_for(lambda: steps_on_node_0(run) >= trained)
    noticed = time.time()
    metadata.announce_interruption()
    followed.wait_for(lambda: answer(names) in followed.text)
    return run, names, noticed, metadata


def launch_with_spares(spares: int, *args: str, python: str = sys.executable, cwd: Path = REPO,
                       env: dict[str, str] | None = None) -> subprocess.Popen:
    """`spotring ARGS` (launch, on a local cluster) run by ``python`` in ``cwd``, where the
    cluster has room for ``spares`` nodes beyond those `up` made, as EC2 answers when the
    spot pool runs dry (nothing real runs out of room here): once they are taken, a
    replacement's creation raises NoCapacity, after the lost nodes were taken down.
    stdout and stderr together, for Followed."""
    program = textwrap.dedent("""\
        import sys
        from spotring.launch.__main__ import main
        from spotring.launch.local.provider import LocalCluster
        from spotring.launch.provider import NoCapacity

        spares = [int(sys.argv[1])]
        made = LocalCluster.create

        def create(self, count):
            nodes, add = made(self, count), self._add

            def from_the_pool(index):
                if not spares[0]:
                    raise NoCapacity(f"no room for node {index}: the pool is empty")
                spares[0] -= 1
                return add(index)

            self._add = from_the_pool
            return nodes

        LocalCluster.create = create
        sys.exit(main(sys.argv[2:], prog="spotring"))
        """)
    return subprocess.Popen([python, "-c", program, str(spares), *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def metadata_service_of(ns: str) -> MetadataStub:
    """EC2's instance metadata service for node ``ns``, where the trainer looks for it by
    default: 169.254.169.254:80 of the node's own network. Its socket is made by a thread
    that joined the node's namespace (setns applies to the calling thread only)."""
    subprocess.run(["ip", "-n", ns, "addr", "add", "169.254.169.254/32", "dev", "lo"],
                   check=True)
    made = []

    def serve() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
        try:
            if libc.setns(fd, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns into {ns}")
        finally:
            os.close(fd)
        made.append(MetadataStub(address=("169.254.169.254", 80)))

    thread = threading.Thread(target=serve)
    thread.start()
    thread.join()
    return made[0]
