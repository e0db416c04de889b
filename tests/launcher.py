"""Running the launcher as users do (python -m launch, make launch) and finding what a
local cluster leaves on this machine: namespaces, links, processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from launch.local import netns
from tests.conftest import REPO


def launcher(*args: str, env: dict | None = None, timeout: float = 120
             ) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch", *args], cwd=REPO, env=env,
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
