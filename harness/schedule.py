"""A job's scripted schedule of faults, run once by a module-scoped fixture, read by many
tests: what each step saw is kept for them, and a step that fails names itself.

    schedule = Schedule("the sbatch job", lambda: job.log())
    with schedule.step("SIGTERM while the trainers start up"):
        ...                                   # waits for an event, acts, records
    with schedule.step("the preempting job"):
        ...

A failure inside a step is re-raised as an AssertionError that says which step of which
job failed, the steps done before it, and the tail of what the job said (``said``), so
that every test reading the job reports where the schedule broke, not only that it did.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager


class Schedule:
    def __init__(self, job: str, said: Callable[[], str] = lambda: "") -> None:
        self.job, self.said = job, said
        self.done: list[str] = []

    @contextmanager
    def step(self, what: str) -> Iterator[None]:
        number = len(self.done) + 1
        try:
            yield
        except Exception as e:
            before = "; ".join(f"{i}. {step}" for i, step in enumerate(self.done, 1))
            raise AssertionError(
                f"{self.job}: step {number} of its schedule ({what}) failed, after "
                f"{before or 'none'}: {type(e).__name__}: {e}\n"
                f"--- what the job said last:\n{self.said()[-6000:]}") from e
        self.done.append(what)
