"""The ranks of a job, spawned by the test itself, as PyTorch's own distributed tests
spawn theirs (torch.testing._internal.common_distributed.MultiProcessTestCase): no
launcher, no Hydra, no fresh interpreter per rank.

    with Ranks(tmp_path / "run", 2, workloads.residual, steps=16) as job:
        job.until(lambda: job.step() >= 4, "step 4")
        job.signal(1, signal.SIGTERM)                   # a notice on rank 1
        assert job.wait() == [75, 75]

Each rank is a process forked from a server that imported torch and spotring once
(multiprocessing's forkserver, preloaded), so that it starts in milliseconds rather than
the seconds a new interpreter spends importing torch. It gets the environment torchrun
gives a worker (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, a free port
where rank 0 serves the TCPStore, as spotring.init does under torchrun without an agent),
SPOTRING_RUN_DIR, and an output file of its own. No agent watches the ranks: what they
do about a lost peer is spotring's own doing (exit 69, naming it), and what they exit
with is theirs, not a launcher's summary of it.

One rank alone gets no launcher variables: spotring.init sees a single process. The
built-in trainer runs as a rank's workload too (``trainer``: `spotring train ARGS`),
where what a test looks at is the trainer, not the launcher that starts it.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import re
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.cores import cores
from spotring.contract import RUN_DIR

_CONTEXT = multiprocessing.get_context("forkserver")
# What every rank needs, imported once in the server that forks them (before it starts:
# the first Ranks of a test process starts it).
_CONTEXT.set_forkserver_preload(["torch", "torch._dynamo", "torch.distributed.checkpoint",
                                 "spotring.job",
                                 "spotring.engines.ddp", "spotring.engines.fsdp",
                                 "spotring.trainer.__main__", "spotring.trainer.job",
                                 "harness.workloads"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(env: dict[str, str], log: str, target: Callable[..., Any],
          kwargs: dict[str, Any]) -> None:
    """A rank's process: its environment and output file, then the workload. Its exit
    code is the workload's (sys.exit), or 1 with the traceback in its output. It leads a
    process group of its own, as a rank on a node of its own would, so that what it starts
    (DataLoader workers) ends with it."""
    os.setsid()
    # A process forked from a forkserver starts its own children through one (its
    # DataLoader workers: a forkserver of the rank's, which a SIGKILLed rank leaves behind
    # with them): give it the start method a fresh interpreter has, as under torchrun.
    multiprocessing.set_start_method(None, force=True)
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # Whole lines: under PYTHONUNBUFFERED (set here, as the launchers set it) the streams
    # write through, so print's text and its newline are two writes, and a line that
    # another thread writes can fall between them.
    sys.stdout.reconfigure(line_buffering=True, write_through=False)
    sys.stderr.reconfigure(line_buffering=True, write_through=False)
    target(**kwargs)


def trainer(argv: list[str]) -> None:
    """`spotring train ARGV` as a rank's workload: its exit code is the trainer's."""
    from spotring.trainer.__main__ import main

    sys.exit(main(argv))


class Ranks:
    """``world_size`` ranks running ``target(**kwargs)`` (a module-level function, so
    that the server can import it), with ``run_dir`` as SPOTRING_RUN_DIR and ``env`` on
    top of this process's environment. Every rank is killed at the end of the ``with``
    where it still runs: a failed assertion leaves none behind."""

    def __init__(self, run_dir: Path, world_size: int, target: Callable[..., Any], *,
                 env: dict[str, str] | None = None, **kwargs: Any) -> None:
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self.logs: list[Path] = []
        base = {**os.environ, RUN_DIR: str(run_dir), "PYTHONUNBUFFERED": "1", **(env or {})}
        port = str(free_port())
        self.processes: list[multiprocessing.Process] = []
        self._target, self._kwargs, self._base = target, kwargs, base
        for rank in range(world_size):
            self._start({} if world_size == 1 else {
                "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port})

    def _start(self, launcher: dict[str, str]) -> int:
        index = len(self.processes)
        log = self.run_dir.with_name(f"{self.run_dir.name}.rank{index}.log")
        log.write_text("")
        process = _CONTEXT.Process(target=_rank, name=f"rank {index}",
                                   args=(self._base | launcher, str(log), self._target,
                                         self._kwargs))
        process.start()
        self.processes.append(process)
        self.logs.append(log)
        return index

    def start_another(self) -> int:
        """One more process of the same workload, started alone (no launcher's
        variables), as a new node's joins a job in place (spotring/elastic/); its index
        among ``processes``."""
        return self._start({})

    def __enter__(self) -> Ranks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()

    def kill(self) -> None:
        """SIGKILL every rank still running and what each started (its process group: a
        rank killed alone leaves its DataLoader workers behind), and reap them all."""
        for process in self.processes:
            if process.is_alive():  # should it not lead its group yet
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):  # a group's id stays its own
                os.killpg(process.pid, signal.SIGKILL)
        for process in self.processes:
            process.join(timeout=30)

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self.processes]

    def signal(self, rank: int, signum: int) -> None:
        os.kill(self.processes[rank].pid, signum)

    def output(self, rank: int | None = None) -> str:
        """What ``rank`` printed (stdout and stderr), or every rank's, rank 0's first."""
        ranks = range(len(self.logs)) if rank is None else [rank]
        return "".join(self.logs[r].read_text() for r in ranks)

    def running(self) -> list[int]:
        return [r for r, process in enumerate(self.processes) if process.is_alive()]

    def step(self) -> int:
        """The newest step rank 0 printed a loss for (``step N loss L`` lines: rank 0's
        process, or whichever is rank 0 at the time in a job in place)."""
        return max(losses(self.output()), default=0)

    def until(self, done: Callable[[], object], what: str, timeout: float = 300,
              while_any: bool = False) -> bool:
        """Poll ``done()`` until it is true (True), or until a rank has ended (False;
        ``while_any``: until none runs, as ranks of a job in place leave); fail naming
        ``what`` after ``timeout`` seconds, which only bounds a failure."""
        deadline = time.monotonic() + timeout
        while not done():
            if len(self.running()) < (1 if while_any else len(self.processes)):
                return False
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"no {what} in {timeout} s:\n{self.output()[-5000:]}")
            time.sleep(0.02)
        return True

    def wait(self, timeout: float = 300) -> list[int]:
        """Every rank's exit code once all have ended (-N: killed by signal N); fails,
        killing those still running, after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        for process in self.processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        if still := self.running():
            self.kill()
            raise AssertionError(f"ranks {still} still running after {timeout} s:\n"
                                 f"{self.output()[-5000:]}")
        return [process.exitcode for process in self.processes]


def run(run_dir: Path, world_size: int, target: Callable[..., Any], *, expect: int = 0,
        timeout: float = 300, env: dict[str, str] | None = None, **kwargs: Any) -> str:
    """The ranks run to their end, each exiting ``expect``; their output."""
    with cores(world_size), Ranks(run_dir, world_size, target, env=env, **kwargs) as job:
        codes = job.wait(timeout)
        output = job.output()
    assert codes == [expect] * world_size, f"exit codes {codes}:\n{output[-5000:]}"
    return output


def losses(output: str) -> dict[int, float]:
    """Each step's loss as rank 0 printed it (the same samples give the same loss)."""
    return {int(m[1]): float(m[2]) for m in re.finditer(r"^step (\d+) loss (\S+)$", output,
                                                         re.M)}
