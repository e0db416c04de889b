"""How a trainer process ends: its exit codes (the launcher acts on them), the notes
rank 0 leaves when preempted or diverged, and the way out when a rank is lost. Free of
torch, so that `python -m launch` starts fast.

    0   done
    1   failed (a traceback says why)
    2   bad configuration or data; nothing was started
    65  diverged: the loss became NaN or infinite; rank 0 leaves diverged.json
    69  a rank died or stopped answering; the message names it where it can
    75  preempted: a spot interruption notice or SIGTERM; a checkpoint was written,
        run the same command again (resume=auto) to continue
"""

import logging
import os
import sys
from typing import NoReturn

EXIT_OK = 0
EXIT_FAILED = 1  # a bug or an unexpected error: see the traceback
EXIT_CONFIG = 2  # bad input; nothing was started
EXIT_DIVERGED = 65  # the loss became NaN or infinite (EX_DATAERR)
EXIT_PEER_LOST = 69  # a collective failed because a rank died or hung (EX_UNAVAILABLE)
EXIT_PREEMPTED = 75  # a spot notice (or SIGTERM) stopped the run after a checkpoint
PREEMPTED = "preempted.json"  # rank 0's note in the run dir of why it exited 75
DIVERGED = "diverged.json"  # rank 0's note in the run dir of why it exited 65


def exit_peer_lost(message: str) -> NoReturn:
    """Log why (which rank went missing) and leave with EXIT_PEER_LOST at once, from any
    thread: tearing a broken process group down, or returning into a collective that
    will never finish, can block forever."""
    logging.getLogger("trainer").error("%s", message)
    logging.shutdown()
    sys.stderr.flush()
    os._exit(EXIT_PEER_LOST)
