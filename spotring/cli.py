"""The ``spotring`` command: one entry point, a subcommand per job.

    spotring train [OVERRIDES]          train on this machine's ranks (Hydra overrides)
    spotring launch nodes=8 -- COMMAND  spot nodes up, the command across them, down again
    spotring up|run|status|down|cost    the launch steps one by one
    spotring sweep sweep=mnist_lr_wd    Optuna trials, several at once (conf/sweep/)
    spotring sbatch nodes=2 -- ...      a SLURM batch job that survives preemption
    spotring bench|report|predict       scaling benchmarks, their report, the predictor

The subcommands are not named here. Each part of spotring that brings some declares them
in a table, ``COMMANDS`` in its package's ``__init__`` (cheap to import), and registers the
table as an entry point of the group ``spotring.commands`` (pyproject.toml), as console
scripts are registered; another distribution can add commands the same way. A
subcommand's module is imported only when it runs, so that `spotring train` (the program
every rank of a launcher starts) needs neither boto3 nor matplotlib, and `spotring
--help` answers at once. Every subcommand takes --help.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points

GROUP = "spotring.commands"


@dataclass(frozen=True)
class Command:
    """A subcommand: ``target`` ("module:function") is called with the words after its
    name, ``prefix`` first, and returns the exit code; ``summary`` is its line in
    `spotring --help`. Two optional hooks ("module:function") let a launcher treat the
    command as it treats any other and still know what only the command knows:
    ``check`` takes the same words and the world sizes the job may run at, and raises
    spotring.ConfigError on what the command would refuse (check_command); ``pin`` takes
    the words and the world size of the first start and returns the words that keep the
    job's run the same on any other world size (pin_command: the trainer's global batch).
    """

    target: str
    summary: str
    prefix: tuple[str, ...] = ()
    check: str | None = None
    pin: str | None = None

    def run(self, args: Sequence[str]) -> int:
        return _load(self.target)([*self.prefix, *args])


def _load(target: str) -> Callable:
    module, _, function = target.partition(":")
    return getattr(importlib.import_module(module), function)


def commands() -> dict[str, Command]:
    """Every registered subcommand, by name, in the order the tables list them."""
    found: dict[str, Command] = {}
    for point in entry_points(group=GROUP):
        table: Mapping[str, Command] = point.load()
        found.update(table)
    return found


def _hook(words: Sequence[str], hook: str) -> tuple[Callable, Command] | None:
    """The ``hook`` of the spotring subcommand ``words`` starts (`spotring NAME ARGS`)."""
    if len(words) < 2 or words[0] != "spotring":
        return None
    command = commands().get(words[1])
    target = None if command is None else getattr(command, hook)
    return None if target is None else (_load(target), command)


def check_command(words: Sequence[str], world_sizes: Sequence[int] = ()) -> bool:
    """Ask a spotring subcommand (`spotring NAME ARGS`) whether it would start with ARGS
    on each of ``world_sizes`` workers (empty: not known yet). Raises ConfigError where it
    would not; returns whether ``words`` is a subcommand that checks its input (any other
    command is the launcher's to check: its script is there, say)."""
    found = _hook(words, "check")
    if found is None:
        return False
    check, command = found
    check([*command.prefix, *words[2:]], list(world_sizes))
    return True


def pin_command(words: Sequence[str], world_size: int) -> list[str]:
    """``words`` as they keep the job's run the same on any number of workers, once it
    first started on ``world_size``: what a spotring subcommand's ``pin`` makes of them
    (the trainer adds its global batch), or ``words`` as they are."""
    found = _hook(words, "pin")
    if found is None:
        return list(words)
    pin, _ = found
    return [*words[:2], *pin(list(words[2:]), world_size)]


def usage(found: Mapping[str, Command]) -> str:
    width = max(map(len, found), default=0)
    lines = [f"  {name:<{width}}  {command.summary}" for name, command in found.items()]
    return ("usage: spotring COMMAND [ARGS]   (spotring COMMAND --help for its own)\n\n"
            "Synchronous data-parallel PyTorch training on clusters of spot GPU instances.\n\n"
            "commands:\n" + "\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    found = commands()
    if not found:
        print("spotring: no subcommands are registered: spotring's installation is "
              "incomplete (its entry points are missing); reinstall it with pip",
              file=sys.stderr)
        return 1
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage(found), end="")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in found:
        print(f"spotring: unknown command {name!r}; valid: {', '.join(found)}\n",
              file=sys.stderr)
        print(usage(found), end="", file=sys.stderr)
        return 2
    return found[name].run(rest)
