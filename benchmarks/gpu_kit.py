"""What every check of tools/gpu-check reads and fills (benchmarks/gpu_check.py runs them):
how much of each check runs (Mode: FULL, or TINY for `make test`), the kit (where it
writes, which device, how many), a check's Result, and what the checks share.

A check is a function ``check(kit, result)``: it fills ``result`` as it goes and returns
when it passed, or raises Failed (it ran and its result is wrong) or Skipped (it cannot
run here); any other exception fails it too, with its words.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from spotring.benchmarks.allreduce import KIB, sizes
from spotring.benchmarks.runs import Timing, run_together
from spotring.launch.commands import local_command

# Hydra composes through one global instance: checks that run at once take turns.
COMPOSING = threading.Lock()


@dataclass(frozen=True)
class Mode:
    """How much of each check runs."""

    name: str
    seeds: tuple[int, ...]
    target: float  # the test accuracy every MNIST run must reach
    mnist_steps: int | None  # None: the default run's whole epoch
    eval_samples: int | None  # of the MNIST runs' evaluations; None: the whole test set
    parity_steps: int
    model: tuple[str, ...]  # the throughput checks' model: a conf/model option, its keys
    shape: tuple[int, int, int]
    batch: int
    timing: Timing
    preemption_steps: int | None
    sigterm_after: int  # steps
    allreduce_sizes: tuple[int, ...]
    allreduce_budget: float  # seconds of timed calls per size
    fsdp: tuple[str, ...]  # the fsdp check's model and steps: benchmarks/fsdp_ranks.py's options
    checkpoint: tuple[str, ...]  # the checkpoint check's: benchmarks/checkpoint_ranks.py's
    parallel: int  # checks at once
    run_timeout: float  # seconds a command may take

    @property
    def workload(self) -> str:
        """The throughput checks' workload, in words."""
        model, *keys = self.model
        return (f"model={model} {' '.join(keys)} on synthetic {'x'.join(map(str, self.shape))} "
                f"images, batch {self.batch}, one process")


FULL = Mode("full", seeds=(0, 1, 2), target=0.99, mnist_steps=None, eval_samples=None,
            parity_steps=20, model=("torchvision", "model.arch=resnet50"), shape=(3, 224, 224),
            batch=128, timing=Timing(log_every=10, warmup_steps=10, intervals=6),
            preemption_steps=None, sigterm_after=50,
            allreduce_sizes=tuple(sizes(KIB, 256 * KIB**2, 4)), allreduce_budget=0.5,
            fsdp=("--size", "gpt2", "--batch", "8", "--seq", "1024", "--warmup", "3",
                  "--steps", "10", "--precision", "auto"),
            checkpoint=("--gb", "4", "--steps", "12", "--save-every", "5"),
            parallel=1, run_timeout=300)
# A few steps each; three checks at once, their numbers are not what is tested.
TINY = Mode("tiny", seeds=(0,), target=0.7, mnist_steps=30, eval_samples=1000,
            parity_steps=8, model=("cifar_convnet", "model.depth=1", "model.width=8"),
            shape=(3, 32, 32), batch=32, timing=Timing(log_every=2, warmup_steps=2, intervals=2),
            preemption_steps=40, sigterm_after=10,
            allreduce_sizes=tuple(sizes(KIB, 64 * KIB, 4)), allreduce_budget=0.02,
            fsdp=("--size", "tiny", "--batch", "2", "--seq", "16", "--warmup", "1", "--steps",
                  "2", "--precision", "auto"),
            checkpoint=("--gb", "0.02", "--steps", "12", "--save-every", "5"),
            parallel=3, run_timeout=180)


@dataclass
class Kit:
    """What every check reads: where to write, which device, how many of them, how much."""

    out: Path
    device: str  # cuda | cpu
    devices: int  # GPUs; with --device cpu, CPU workers
    mode: Mode

    @property
    def runs(self) -> Path:
        return self.out / "runs"

    def run_dir(self, name: str) -> Path:
        """runs/``name``, emptied: a trainer run appends to the metrics.jsonl it finds and
        resumes from its checkpoints, which an earlier kit's run may have left there."""
        path = self.runs / name
        shutil.rmtree(path, ignore_errors=True)
        return path

    @property
    def threads(self) -> int:
        """Torch threads of a one-process run: one where checks share the cores."""
        return 1 if self.mode.parallel > 1 else len(os.sched_getaffinity(0))

    def trainer_args(self, run_dir: Path, *overrides: str) -> list[str]:
        threads = [f"train.threads={self.threads}"] if self.mode.parallel > 1 else []
        return [f"hydra.run.dir={run_dir}", "telemetry.progress=false",
                f"train.device={self.device}", *threads, *overrides]

    def run(self, *commands: list[str]) -> list[str]:
        """Run ``commands`` at once; their stdouts (a failure raises, naming the command)."""
        return run_together(list(commands), timeout=self.mode.run_timeout)


@dataclass
class Result:
    """A check's outcome. The check fills figures and commands as it goes, so that a
    failure late in a check keeps what was measured before it."""

    check: str
    status: str = "passed"  # passed | failed | stopped (cut off) | skipped (not run)
    summary: str = ""  # the table's cell: the figures, or why it failed or did not run
    seconds: float = 0.0
    figures: dict = field(default_factory=dict)
    commands: list[str] = field(default_factory=list)


class Failed(Exception):
    """The check ran and its result is wrong; the message says how."""


class Skipped(Exception):
    """The check cannot run here; the message says why."""


def torchrun(nproc: int, args: list[str], module: str = "spotring.trainer") -> list[str]:
    """launch.commands' torchrun command, through `python -m torch.distributed.run` where
    this Python's folder has no torchrun script (a system or conda Python's torch)."""
    command = local_command("torchrun", nproc, args, module)
    if not Path(command[0]).exists():
        command[:1] = [sys.executable, "-m", "torch.distributed.run"]
    return command


def rate(stat: dict[str, float]) -> str:
    """img/s as the table shows it: mean ± 95% half-width, the mean alone for one value."""
    return f"{stat['mean']:.0f}" + (f" ± {stat['ci95']:.0f}" if stat["n"] > 1 else "") + " img/s"

