"""The processes a benchmark starts, and taking them down whole (Linux).

A measured command is a launcher with its ranks (torchrun and its workers) or a single
process. Each starts in a session of its own (start), so that Ctrl-C at the benchmark's
terminal does not reach it half-way, and is taken down with every process under it
(kill), found by their parents in /proc: torchrun starts each worker in a session of its
own too, so that killing the launcher's process group would leave the workers running.
A benchmark that is stopped (stop_all) starts nothing more and kills all under it; the
latch is the process's, and stays.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
KILLED_WITHIN = 10.0  # seconds kill and kill_all wait for what they killed to die

_lock = threading.Lock()  # between a start and the latch, so that none slips past it
_stop_reason: str | None = None


class Stopped(RuntimeError):
    """Nothing starts any more: stop_all ran. The message is its reason."""


def start(command: list[str], **popen) -> subprocess.Popen:
    """``subprocess.Popen(command, **popen)`` in a session of its own; raises Stopped
    after stop_all."""
    with _lock:
        if _stop_reason is not None:
            raise Stopped(_stop_reason)
        return subprocess.Popen(command, start_new_session=True, **popen)


def stop_reason() -> str | None:
    """Why stop_all ran (its first reason); None while it has not."""
    return _stop_reason


def stop_all(reason: str) -> None:
    """No process starts from now on (start raises Stopped(reason)), and every process
    under this one is killed. Safe from any thread, and more than once (the first reason
    stays)."""
    global _stop_reason
    with _lock:
        _stop_reason = _stop_reason or reason
    kill_all()


def kill(proc: subprocess.Popen) -> None:
    """``proc`` and every process under it, killed at once; then ``proc`` reaped.
    Processes that ``proc`` left behind after it ended are no longer under it: kill_all
    finds them under a subreaper."""
    def alive() -> set[int]:
        if proc.returncode is not None:  # reaped: its pid may be another process's now
            return set()
        under = _under(proc.pid)  # walked while the pid is still proc's (not yet reaped)
        return under | ({proc.pid} if proc.poll() is None else set())

    _kill_fixpoint(alive)
    proc.wait()


def kill_all() -> None:
    """Every process under this one, killed at once."""
    _kill_fixpoint(lambda: _under(os.getpid()))


def become_subreaper() -> None:
    """Make this process the subreaper of everything under it (Linux's
    PR_SET_CHILD_SUBREAPER); where that is not available, nothing changes."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _kill_fixpoint(alive: Callable[[], set[int]]) -> None:
    """SIGSTOP what ``alive`` finds until it finds nothing new (a stopped process forks
    no more), then SIGKILL it all: nothing started meanwhile escapes. Returns once each
    has died (the kernel ends a killed process when it next runs, not at once), or after
    KILLED_WITHIN seconds."""
    frozen: set[int] = set()
    while new := alive() - frozen:
        for pid in new:
            _signal(pid, signal.SIGSTOP)
        frozen |= new
    for pid in frozen:
        _signal(pid, signal.SIGKILL)
    deadline = time.monotonic() + KILLED_WITHIN
    while any(_running(pid) for pid in frozen) and time.monotonic() < deadline:
        time.sleep(0.01)


def _signal(pid: int, sig: int) -> None:
    # Gone already, or its pid reused by a process not ours.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _stat(pid: int | str) -> tuple[str, int] | None:
    """``pid``'s state letter and parent, from /proc; None where it has ended."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    state, parent = stat[stat.rindex(")") + 2:].split()[:2]  # after "pid (comm) "
    return state, int(parent)


def _running(pid: int) -> bool:
    """Whether ``pid`` is a process not yet dead (a zombie is dead, only not reaped)."""
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"


def _under(root: int) -> set[int]:
    """The live processes under ``root`` (not itself), by /proc's parent links; zombies
    are left out: they are dead, and their children have new parents."""
    children: dict[int, list[int]] = {}
    try:
        entries = [e.name for e in os.scandir("/proc") if e.name.isdigit()]
    except OSError:  # not Linux: nothing to find
        return set()
    for name in entries:
        stat = _stat(name)
        if stat is not None and stat[0] != "Z":  # not ended meanwhile, nor dead
            children.setdefault(stat[1], []).append(int(name))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found
