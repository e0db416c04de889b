"""How launchers read a job's exit (spotring.exits.classify): which exit is which, which
are run again, and against which budget."""

from __future__ import annotations

import pytest

from spotring.exits import MAX_PREEMPTIONS, MAX_RESTARTS, Outcome, classify


@pytest.mark.parametrize("code, outcome, budget, transient", [
    (0, Outcome.DONE, None, False),
    (1, Outcome.FAILED, MAX_RESTARTS, False),  # a crash: maybe a bug, restarted with care
    (2, Outcome.BAD_INPUT, None, False),  # the job's own verdict: never run again
    (65, Outcome.DIVERGED, None, False),
    (69, Outcome.LOST, MAX_RESTARTS, True),
    (137, Outcome.LOST, MAX_RESTARTS, True),  # srun: a task SIGKILLed
    (-9, Outcome.LOST, MAX_RESTARTS, True),  # Python's subprocess: the same
    (75, Outcome.PREEMPTED, MAX_PREEMPTIONS, True),
    (143, Outcome.INTERRUPTED, MAX_RESTARTS, True),  # SIGTERM before the trainer took it
    (138, Outcome.INTERRUPTED, MAX_RESTARTS, True),  # SIGUSR1 likewise
    (3, Outcome.FAILED, MAX_RESTARTS, False),  # a code of no meaning of its own
    (255, Outcome.FAILED, MAX_RESTARTS, False),  # ssh's own failure
])
def test_each_exit_is_classified_with_its_restart_budget(code, outcome, budget, transient):
    got = classify(code)
    assert (got, got.budget, got.transient) == (outcome, budget, transient)
