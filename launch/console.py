"""What every launcher-side command (launch, sweep, sbatch) does with its command line,
its output and its signals, in one place."""

from __future__ import annotations

import logging
import signal
from typing import TextIO


def split_dashes(argv: list[str]) -> tuple[list[str], list[str]]:
    """The command's own arguments, and the words after `--`: the job's (a command, or
    the trainer's overrides: launch/contract.py)."""
    if "--" not in argv:
        return argv, []
    at = argv.index("--")
    return argv[:at], argv[at + 1:]


def log_to(stream: TextIO) -> None:
    """The launcher's lines, plain, on ``stream``; other libraries' (boto3) stay quiet."""
    log = logging.getLogger("launch")
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.handlers = [handler]
    log.setLevel(logging.INFO)
    log.propagate = False


def interrupt_on_termination() -> None:
    """A closed terminal or a `kill` stops the command as Ctrl-C does (KeyboardInterrupt),
    so that its clean-up runs."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)


def _interrupt(signum, frame):
    raise KeyboardInterrupt
