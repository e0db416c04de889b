"""The one restart policy (``verdict``) by which every launcher (`spotring launch`,
`spotring sbatch`, `spotring sweep`) decides whether a job runs again after an exit
(spotring/exits.py: the codes a job ends with), and on which budget. Free of torch.

The codes and what each launcher does with them are one table, docs/exit-codes.md,
rendered from CODES and the launchers' descriptions (``table``); tests/test_exits.py
checks that the page, the policy and what each launcher does agree.
"""

import enum
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from spotring.exits import (
    DIVERGED,
    EXIT_CONFIG,
    EXIT_DIVERGED,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_PEER_LOST,
    EXIT_PREEMPTED,
    PREEMPTED,
)

# The notes and the exit each says: what a launcher that exits 1 whatever its ranks did
# (torchrun) is told a preemption or a divergence by.
NOTES = {PREEMPTED: EXIT_PREEMPTED, DIVERGED: EXIT_DIVERGED}

# The restart budgets a restart spends: after a preemption, and after any other stop.
MAX_PREEMPTIONS, MAX_RESTARTS = "max_preemptions", "max_restarts"


class Outcome(enum.Enum):
    """What a job's exit says happened.

    ``budget`` is the restart budget a launcher spends on running the job again: a notice
    the job acted on (a checkpoint was written) spends MAX_PREEMPTIONS; any other stop
    MAX_RESTARTS; None: never run again (done, or the job's own verdict on its input or
    its loss, which another try would repeat). ``transient`` outcomes are the machines'
    doing, not the job's; a FAILED job may be a bug (``verdict`` says when it runs again).
    """

    DONE = ("done", None, False)
    FAILED = ("failed", MAX_RESTARTS, False)  # 1, and every code not named in CODES
    BAD_INPUT = ("bad input", None, False)
    DIVERGED = ("diverged", None, False)
    LOST = ("a rank lost", MAX_RESTARTS, True)
    PREEMPTED = ("preempted", MAX_PREEMPTIONS, True)
    # SIGTERM or SIGUSR1 (a warning: a spot notice, SLURM's --signal) reached a job still
    # starting up, before it takes them: it ended at once, with nothing new to save.
    INTERRUPTED = ("interrupted during start-up", MAX_RESTARTS, True)

    def __init__(self, what: str, budget: str | None, transient: bool) -> None:
        self.what, self.budget, self.transient = what, budget, transient


def _killed_by(signum: int) -> int:
    """A shell's (and srun's) status for a process ended by signal ``signum``."""
    return 128 + signum


@dataclass(frozen=True)
class Code:
    outcome: Outcome
    means: str  # in words, for docs/exit-codes.md


# Every exit code with a meaning of its own; any other is Outcome.FAILED.
CODES = {
    EXIT_OK: Code(Outcome.DONE, "done; rank 0 wrote `summary.json`"),
    EXIT_FAILED: Code(Outcome.FAILED, "failed: a bug or an unexpected error (a traceback "
                                      "says which)"),
    EXIT_CONFIG: Code(Outcome.BAD_INPUT, "bad configuration or data, named in one "
                                         "paragraph with what is valid; nothing was started"),
    EXIT_DIVERGED: Code(Outcome.DIVERGED, "diverged: the loss became NaN or infinite; rank 0 "
                                          "leaves `diverged.json`"),
    EXIT_PEER_LOST: Code(Outcome.LOST, "a rank died or stopped answering (within "
                                       "`engine.timeout_s`); the others name it where they "
                                       "can"),
    EXIT_PREEMPTED: Code(Outcome.PREEMPTED, "preempted: a spot notice or SIGTERM stopped "
                                            "the job after a checkpoint; rank 0 leaves "
                                            "`preempted.json`. The same command again "
                                            "resumes it"),
    _killed_by(signal.SIGKILL): Code(Outcome.LOST, "a rank ended by SIGKILL (the OOM killer, "
                                                   "`kill -9`, a node gone), as a shell or "
                                                   "srun reports it (128 + 9)"),
    _killed_by(signal.SIGTERM): Code(Outcome.INTERRUPTED, "a rank ended by SIGTERM while "
                                                          "starting up, before it takes "
                                                          "signals (128 + 15)"),
    _killed_by(signal.SIGUSR1): Code(Outcome.INTERRUPTED, "the same for SIGUSR1 (SLURM's "
                                                          "warning, 128 + 10)"),
}


def classify(code: int) -> Outcome:
    """The outcome of a job that exited with ``code``: a shell's status, or Python's
    subprocess returncode (-N for a process ended by signal N, which is 128 + N here)."""
    known = CODES.get(_killed_by(-code) if code < 0 else code)
    return Outcome.FAILED if known is None else known.outcome


def with_note(code: int, note: str | None) -> int:
    """The job's exit, where rank 0 left ``note`` (one of NOTES, or None) and its launcher
    reported ``code``: the note's exit for a job that did not end well (torchrun exits 1
    whatever its ranks did); ``code`` otherwise (a finished job's stale note is moot)."""
    return NOTES[note] if code != EXIT_OK and note is not None else code


# ------------------------------------------------------------------ the restart policy


@dataclass(frozen=True)
class Verdict:
    """A launcher's answer to a try's end: ``budget``, the restart budget it runs the job
    again on (MAX_PREEMPTIONS or MAX_RESTARTS), or None where the job does not run
    again; ``why``, in words."""

    budget: str | None
    why: str


_REPEATED = ("the same exit at the same step as the try before, which looks like a bug in "
            "the job, not the machines: another try would fail the same way")
_UNSEEN = ("a failure, which may be a bug, and the step the job stopped at is not known to "
          "tell a repeat from a fluke")


def verdict(code: int, repeated: bool | None = False) -> Verdict:
    """The one restart policy: whether a job that exited with ``code`` runs again, and on
    which budget (what each launcher's setting of that budget then bounds).

    ``repeated``: whether the try failed as the one before did, with the same exit at the
    same step and no machine lost; None where the launcher cannot see the step a try
    stopped at. A restart on MAX_RESTARTS is refused to a repeat, and, where the step is
    not seen, to a failure that is not transient (it may be a bug); a preemption is not
    judged so (a notice comes whatever the step)."""
    outcome = classify(code)
    if outcome is Outcome.DONE:
        return Verdict(None, "done")
    if outcome.budget is None:
        return Verdict(None, f"{outcome.what}: the job's own verdict on its input or its "
                             "loss; another try would end the same")
    if outcome.budget == MAX_RESTARTS and repeated:
        return Verdict(None, _REPEATED)
    if repeated is None and not outcome.transient:
        return Verdict(None, _UNSEEN)
    return Verdict(outcome.budget, outcome.what)


@dataclass(frozen=True)
class Launcher:
    """How one launcher applies ``verdict``: ``budgets``, the setting that bounds each
    restart budget there (two launchers give both budgets one setting); ``sees_steps``,
    whether it knows the step a try stopped at; ``reason``, why it does otherwise than
    `spotring launch` where it does (docs/exit-codes.md)."""

    name: str
    budgets: Mapping[str, str]
    sees_steps: bool
    reason: str = ""

    def verdict(self, code: int, repeated: bool = False) -> Verdict:
        return verdict(code, repeated if self.sees_steps else None)


def table(launchers: Sequence[Launcher]) -> str:
    """docs/exit-codes.md's table (markdown) of every code and what each launcher does
    with it, then the launchers' reasons to differ."""
    def cell(launcher: Launcher, code: int) -> str:
        answer = launcher.verdict(code)
        if answer.budget is None:
            return "done" if classify(code) is Outcome.DONE else "stops"
        again = f"runs again, on `{launcher.budgets[answer.budget]}`"
        guarded = answer.budget == MAX_RESTARTS and launcher.sees_steps
        return again + ("; stops if it repeats at the same step" if guarded else "")

    rows = [(str(code), c.means, code) for code, c in CODES.items()]
    rows.append(("any other", "failed, as 1 (255: ssh lost a node)", EXIT_FAILED))
    names = " | ".join(f"`{launcher.name}`" for launcher in launchers)
    lines = [f"| exit | means | {names} |",
             "|" + " --- |" * (2 + len(launchers)),
             *(f"| {shown} | {means} | " + " | ".join(cell(launcher, code)
                                                      for launcher in launchers) + " |"
               for shown, means, code in rows)]
    reasons = [f"- `{launcher.name}`: {launcher.reason}" for launcher in launchers
               if launcher.reason]
    return "\n".join(lines) + ("\n\n" + "\n".join(reasons) if reasons else "") + "\n"
