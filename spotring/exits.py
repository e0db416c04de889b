"""How a trainer process ends: its exit codes, the notes rank 0 leaves when preempted
or diverged, the way out when a rank is lost, and how a launcher reads an exit
(``classify``: which are run again, against which budget). Free of torch, so that
`python -m spotring.launch` starts fast.

    0   done
    1   failed (a traceback says why)
    2   bad configuration or data; nothing was started
    65  diverged: the loss became NaN or infinite; rank 0 leaves diverged.json
    69  a rank died or stopped answering; the message names it where it can
    75  preempted: a spot interruption notice or SIGTERM; a checkpoint was written,
        run the same command again (resume=auto) to continue
    128+N  (a shell's, srun's) ended by signal N: 137 (SIGKILL) a rank lost, 143 or 138
        (SIGTERM, SIGUSR1) a warning that came before the trainer took signals
"""

import enum
import logging
import os
import signal
import socket
import sys
import time
from typing import NoReturn

EXIT_OK = 0
EXIT_FAILED = 1  # a bug or an unexpected error: see the traceback
EXIT_CONFIG = 2  # bad input; nothing was started
EXIT_DIVERGED = 65  # the loss became NaN or infinite (EX_DATAERR)
EXIT_PEER_LOST = 69  # a collective failed because a rank died or hung (EX_UNAVAILABLE)
EXIT_PREEMPTED = 75  # a spot notice (or SIGTERM) stopped the run after a checkpoint
PREEMPTED = "preempted.json"  # rank 0's note in the run dir of why it exited 75
DIVERGED = "diverged.json"  # rank 0's note in the run dir of why it exited 65


# The launchers' restart budgets (cluster.max_preemptions, cluster.max_restarts).
MAX_PREEMPTIONS, MAX_RESTARTS = "max_preemptions", "max_restarts"


class Outcome(enum.Enum):
    """What a job's exit says happened: the one rule every launcher (launch/recover.py,
    launch/slurm.py, sweep/runner.py) reads an exit code by.

    ``budget`` is the restart budget a launcher spends on running the job again: a notice
    the trainer acted on (a checkpoint was written) spends max_preemptions; any other
    stop spends max_restarts; None: never run again (done, or the job's own verdict on
    its input or its loss, which another try would repeat). ``transient`` outcomes are the
    machines' doing, not the job's, so a launcher that can tell nothing more (SLURM's
    batch script) runs the job again on them alone; a FAILED job may be a bug, which
    launch/recover.py tells apart by a repeat of the same exit at the same step.
    """

    DONE = ("done", None, False)
    FAILED = ("failed", MAX_RESTARTS, False)  # 1, and every code not named in CODES
    BAD_INPUT = ("bad input", None, False)
    DIVERGED = ("diverged", None, False)
    LOST = ("a rank lost", MAX_RESTARTS, True)
    PREEMPTED = ("preempted", MAX_PREEMPTIONS, True)
    # SIGTERM or SIGUSR1 (a warning: a spot notice, SLURM's --signal) reached a trainer
    # still starting up, before it takes them: it ended at once, with nothing new to save.
    INTERRUPTED = ("interrupted during start-up", MAX_RESTARTS, True)

    def __init__(self, what: str, budget: str | None, transient: bool) -> None:
        self.what, self.budget, self.transient = what, budget, transient


def _killed_by(signum: int) -> int:
    """A shell's (and srun's) status for a process ended by signal ``signum``."""
    return 128 + signum


# Every exit code with a meaning of its own; any other is Outcome.FAILED.
CODES = {
    EXIT_OK: Outcome.DONE,
    EXIT_FAILED: Outcome.FAILED,
    EXIT_CONFIG: Outcome.BAD_INPUT,
    EXIT_DIVERGED: Outcome.DIVERGED,
    EXIT_PREEMPTED: Outcome.PREEMPTED,
    EXIT_PEER_LOST: Outcome.LOST,
    _killed_by(signal.SIGKILL): Outcome.LOST,  # the OOM killer, kill -9, a node gone
    _killed_by(signal.SIGTERM): Outcome.INTERRUPTED,
    _killed_by(signal.SIGUSR1): Outcome.INTERRUPTED,
}


def classify(code: int) -> Outcome:
    """The outcome of a job that exited with ``code``: a shell's status, or Python's
    subprocess returncode (-N for a process ended by signal N, which is 128 + N here)."""
    return CODES.get(_killed_by(-code) if code < 0 else code, Outcome.FAILED)


class ConfigError(ValueError):
    """Bad input (exit 2): a value the run cannot start with. The message says which and
    what is valid."""


class Diverged(Exception):
    """The loss (or the weights) stopped being finite at ``step``: exit 65. Raised on
    every rank at the same step, from a value the ranks agreed on."""

    def __init__(self, step: int, loss: float, kind: str = "train", hint: str = "") -> None:
        what = "the weights are not finite" if kind == "weights" else f"the {kind} loss is {loss}"
        super().__init__(f"{what} at step {step}: training diverged"
                         + (f"; {hint}" if hint else ""))
        self.step, self.loss = step, loss


# torchrun and horovodrun stop every rank as soon as one exits: on bad input each rank
# waits this long after its message, so that every rank (rank 0 first) gets to say it.
BAD_INPUT_GRACE_S = 3.0


def report_bad_input(error: ConfigError, rank: int, world_size: int,
                     everyone: bool = False) -> None:
    """The one paragraph of bad input on stderr: rank 0's in full; the other ranks, whose
    config fails the same way, say only that they stopped, unless ``everyone`` (a problem
    of each host's own, such as its data). Then, with several ranks, a short wait."""
    where = "" if world_size == 1 else f"rank {rank} ({socket.gethostname()}): "
    if rank == 0 or everyone:
        print(f"spotring: {where}error: {error}", file=sys.stderr)
    else:
        print(f"spotring: {where}stopped: bad configuration (rank 0 says which)",
              file=sys.stderr)
    if world_size > 1:
        time.sleep(BAD_INPUT_GRACE_S)


def exit_peer_lost(message: str) -> NoReturn:
    """Log why (which rank went missing) and leave with EXIT_PEER_LOST at once, from any
    thread: tearing a broken process group down, or returning into a collective that
    will never finish, can block forever."""
    logging.getLogger("trainer").error("%s", message)
    logging.shutdown()
    sys.stderr.flush()
    os._exit(EXIT_PEER_LOST)
