"""The ``spotring`` command: one entry point, a subcommand per job.

    spotring train [OVERRIDES]          train on this machine's ranks (Hydra overrides)
    spotring launch nodes=8 -- [TRAINER OVERRIDES]
    spotring up|run|status|down|cost    the launch steps one by one
    spotring sweep sweep=mnist_lr_wd    Optuna trials, several at once (conf/sweep/)
    spotring sbatch nodes=2 -- ...      a SLURM batch job that survives preemption
    spotring bench|report|predict       scaling benchmarks, their report, the predictor

Each subcommand's module is imported only when it runs, so that `spotring train` (the
program every rank of a launcher starts) needs neither boto3 nor matplotlib, and
`spotring --help` answers at once. Every subcommand takes --help.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

from launch import STEPS

# name: (module, function, one line for `spotring --help`)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "train": ("trainer.__main__", "main",
              "train here: alone, or as the program torchrun, horovodrun, mpirun or srun "
              "starts (Hydra overrides)"),
    **{step: ("launch.__main__", "main", summary) for step, summary in STEPS.items()},
    "sbatch": ("launch.slurm", "main",
               "the trainer or a command as a SLURM batch job: requeued after preemption"),
    "sweep": ("sweep.__main__", "main",
              "many trials at once, searched by Optuna: hyperparameters, model families"),
    "bench": ("benchmarks.suite", "main",
              "measure throughput, scaling and allreduce bandwidth into a results folder"),
    "report": ("benchmarks.report", "main", "a results folder's report.md and plots"),
    "predict": ("benchmarks.predict", "main",
                "predict img/s, time and cost for 1 to 256 nodes; the cheapest for a deadline"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {help_}" for name, (_, _, help_) in COMMANDS.items()]
    return ("usage: spotring COMMAND [ARGS]   (spotring COMMAND --help for its own)\n\n"
            "Synchronous data-parallel PyTorch training on clusters of spot GPU instances.\n\n"
            "commands:\n" + "\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage(), end="")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"spotring: unknown command {name!r}; valid: {', '.join(COMMANDS)}\n",
              file=sys.stderr)
        print(usage(), end="", file=sys.stderr)
        return 2
    module, function, _ = COMMANDS[name]
    entry: Callable = getattr(importlib.import_module(module), function)
    if name in STEPS:
        return entry([name, *rest], prog="spotring")
    if name == "train":
        # Hydra reads the command line itself.
        sys.argv = [f"{sys.argv[0]} train", *rest]
        return entry()
    return entry(rest)
