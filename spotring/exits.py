"""How a spotring job ends: its exit codes, the notes rank 0 leaves when preempted or
diverged, bad input (ConfigError, and its one paragraph), a divergence, and the way out
when a rank is lost. Free of torch, so that `python -m spotring.launch` starts fast.

What a launcher makes of an exit (whether the job runs again, on which budget) is the
restart policy, spotring/support/restarts.py.
"""

import logging
import os
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


# torchrun, horovodrun and mpirun stop every rank as soon as one exits: on bad input each
# rank waits a while after its message (BAD_INPUT_GRACE_S, or $SPOTRING_BAD_INPUT_GRACE_S
# seconds), so that every rank, however much later it gets there, says it too.
BAD_INPUT_GRACE_S = 3.0
GRACE_VARIABLE = "SPOTRING_BAD_INPUT_GRACE_S"


def bad_input_grace_s() -> float:
    """How long a rank of several waits after its bad-input message: $SPOTRING_BAD_INPUT_GRACE_S
    seconds where it is set, else BAD_INPUT_GRACE_S. Raises ConfigError naming a value
    that is not a number of seconds, 0 or more."""
    value = os.environ.get(GRACE_VARIABLE, "").strip()
    if not value:
        return BAD_INPUT_GRACE_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise ConfigError(f"{GRACE_VARIABLE}={value}: not a number of seconds; valid: 0 or "
                          f"more ({BAD_INPUT_GRACE_S:g} where unset)")
    return seconds


def report_bad_input(error: ConfigError, rank: int, world_size: int,
                     everyone: bool = False) -> None:
    """The one paragraph of bad input on stderr: rank 0's in full; the other ranks, whose
    config fails the same way, say only that they stopped, unless ``everyone`` (a problem
    of each host's own, such as its data). Then, with several ranks, the wait of
    ``bad_input_grace_s`` (the default where the variable is bad, which the paragraph
    then names too), so that the launcher does not stop a rank before it says its line."""
    try:
        grace = bad_input_grace_s()
    except ConfigError as bad_grace:
        grace, error = BAD_INPUT_GRACE_S, ConfigError(f"{error}\n{bad_grace}")
    where = "" if world_size == 1 else f"rank {rank} ({socket.gethostname()}): "
    if rank == 0 or everyone:
        print(f"spotring: {where}error: {error}", file=sys.stderr)
    else:
        print(f"spotring: {where}stopped: bad configuration (rank 0 says which)",
              file=sys.stderr)
    if world_size > 1:
        time.sleep(grace)


def exit_peer_lost(message: str) -> NoReturn:
    """Log why (which rank went missing) and leave with EXIT_PEER_LOST at once, from any
    thread: tearing a broken process group down, or returning into a collective that
    will never finish, can block forever."""
    logging.getLogger("trainer").error("%s", message)
    logging.shutdown()
    sys.stderr.flush()
    os._exit(EXIT_PEER_LOST)
