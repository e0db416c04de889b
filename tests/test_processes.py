"""benchmarks/processes.py: a benchmark's process is taken down with everything under it,
a launcher's ranks in sessions of their own too (torchrun's workers are), and once a
benchmark is stopped nothing starts."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from spotring.benchmarks import processes

# A launcher in miniature: a rank in a session of its own, as torchrun starts its workers;
# it prints the rank's pid, then waits.
LAUNCHER = textwrap.dedent("""
    import subprocess, sys, time
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                            start_new_session=True)
    print(rank.pid, flush=True)
    time.sleep(120)
""")


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


@pytest.mark.slow(cores=1)
def test_a_process_is_killed_with_the_ranks_it_started_in_sessions_of_their_own():
    launcher = processes.start([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE,
                               text=True)
    rank = int(launcher.stdout.readline())
    assert alive(rank)
    processes.kill(launcher)
    launcher.stdout.close()
    assert launcher.returncode == -9 and not alive(rank)


STOPPED = textwrap.dedent("""
    import json, subprocess, sys
    from spotring.benchmarks import processes
    launcher = processes.start([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE,
                               text=True)
    rank = int(launcher.stdout.readline())
    processes.stop_all("the test stopped it")
    try:
        processes.start([sys.executable, "-c", "pass"])
        refused = None
    except processes.Stopped as e:
        refused = str(e)
    print(json.dumps({"rank": rank, "launcher": launcher.wait(), "refused": refused,
                      "reason": processes.stop_reason()}))
""")


@pytest.mark.slow(cores=1)
def test_once_stopped_everything_under_the_process_is_killed_and_nothing_starts():
    # In a process of its own: the latch is the process's, and pytest's must stay open.
    done = subprocess.run([sys.executable, "-c", STOPPED, LAUNCHER], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    said = json.loads(done.stdout)
    assert said["launcher"] == -9 and not alive(said["rank"])
    assert said["refused"] == said["reason"] == "the test stopped it"
