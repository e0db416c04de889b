"""A command's ``main`` called in this process, as its console script would run it.

    done = call(main, "train", "optim.lr=abc")   # spotring.cli.main, or any command's main
    done.code, done.out, done.err                # its exit code, its stdout and stderr
    done = python_m("spotring.launch", "up", "--help")  # `python -m spotring.launch up --help`

Bad input is proved this way, without a process of its own (which would import torch and
Hydra again); one real launched job per launcher still proves that the code and every
rank's line get through the launcher (tests/test_config.py).

``call`` takes the exit code whether ``main`` returns it or raises SystemExit (Hydra's
entry point and spotring.init exit from inside). The root logger starts as a new
process's (no handlers, level WARNING), so that what a command logs where nothing else
is configured reaches its stderr here too. Afterwards ``call`` gives back what a command
changes of the process, which a process of its own would take with it: sys.argv (the
trainer hands its words to Hydra there), os.environ, the loggers' handlers and levels
(Hydra configures logging, with a file handler in the run directory), the handlers of
the signals commands take, and torch's thread count (the trainer sets it before it
checks its data); glibc's malloc thresholds, which the trainer fixes too, stay (they only
keep freed memory in the process). Output is captured by swapping sys.stdout and
sys.stderr, as capsys does: what native code writes to the file descriptors is not in
it.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import runpy
import signal
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

# The signals a command may take for itself (spotring.init, the launcher's Ctrl-C).
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)


@dataclass(frozen=True)
class Done:
    """How a command ended: its exit ``code`` (SystemExit's code, or main's return value;
    None counts as 0), and what it wrote to stdout (``out``) and stderr (``err``)."""

    code: int
    out: str
    err: str


def call(main: Callable[[list[str]], int | None], *args: str) -> Done:
    """``main(list(args))`` in this process, its output captured and the process put back
    as it was (the module docstring)."""
    out, err = io.StringIO(), io.StringIO()
    with _restored(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:
            code = e.code
    if code is None:
        code = 0
    assert isinstance(code, int), f"main ended with {code!r}, not an exit code"
    return Done(code, out.getvalue(), err.getvalue())


def python_m(module: str, *args: str) -> Done:
    """`python -m MODULE ARGS` in this process: the module (a package's __main__) run as
    __main__ by runpy, as python -m runs it, with sys.argv[0] its file; as ``call``."""
    def run(argv: list[str]) -> None:
        sys.argv = [module, *argv]  # runpy puts the file's path first, as python -m does
        with warnings.catch_warnings():
            # Where a test imported the module already, runpy warns, and runs a new copy
            # as __main__ all the same: what python -m runs.
            warnings.filterwarnings("ignore", "'.*' found in sys.modules", RuntimeWarning)
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    return call(run, *args)


@contextlib.contextmanager
def _restored() -> Iterator[None]:
    argv, environ, threads = sys.argv, dict(os.environ), torch.get_num_threads()
    handlers = {sig: signal.getsignal(sig) for sig in SIGNALS}
    kept = {logger: (list(logger.handlers), logger.level, logger.propagate, logger.disabled)
            for logger in _loggers()}
    root = logging.getLogger()
    root.handlers.clear()  # as in a process of its own: not pytest's capture handlers
    root.setLevel(logging.WARNING)
    try:
        yield
    finally:
        sys.argv = argv
        os.environ.clear()
        os.environ.update(environ)
        torch.set_num_threads(threads)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        for logger in _loggers():  # those the command made too: as a new one is
            before, level, propagate, disabled = kept.get(logger, ([], logging.NOTSET, True,
                                                                   False))
            for handler in set(logger.handlers) - set(before):
                handler.close()  # a log file Hydra opened in the run directory
            logger.handlers[:] = before
            logger.setLevel(level)
            logger.propagate, logger.disabled = propagate, disabled


def _loggers() -> list[logging.Logger]:
    """The root logger and every named one (not the placeholders of dotted names)."""
    return [logging.getLogger(), *(logger for logger in logging.Logger.manager.loggerDict.values()
                                   if isinstance(logger, logging.Logger))]
