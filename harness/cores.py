"""The machine's cores, shared by the session's pytest-xdist workers as tokens: a test
holds one token for each process it keeps busy, and a job holds at most one per core, so
that two jobs of several processes never run side by side and nothing measured or
awaited in one waits on the other's CPU time. There is one token more than cores, as
`make -j` is given one job more than cores: a one-process test (one trainer, one CLI,
pip, or mostly waiting) may run beside a job that holds every core, and fills the waits
every job has (its ranks importing torch one after the other, its polls, its launcher's
ssh). Two one-process tests run side by side.

    with cores(2):          # a job of 2 ranks
        ...

An autouse fixture of tests/conftest.py holds them for every test marked slow
(``@pytest.mark.slow``: a token per core; ``@pytest.mark.slow(cores=1)``: one); the
helpers that start processes take their own, which inside a test's hold costs nothing.

The tokens are file locks in the session's shared folder. A taker holds a gate while it
gathers its tokens, so that a job waiting for every core is not overtaken for ever by
one-process tests, and two takers never hold part of what each other waits for.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

from filelock import FileLock, Timeout

# How often a taker looks again for a free token (filelock's own poll interval).
_POLL_S = 0.05


class Cores:
    """A token under ``folder`` for each core this process may run on and one more, taken
    with ``hold(n)``."""

    def __init__(self, folder: Path):
        self._cores = len(os.sched_getaffinity(0))
        self._gate = FileLock(folder / "cores.gate")
        self._tokens = [FileLock(folder / f"core-{i}.lock") for i in range(self._cores + 1)]
        self._held: list[FileLock] = []

    @contextmanager
    def hold(self, n: int | None) -> Iterator[None]:
        """Hold ``n`` tokens (None, or more than there are cores: one per core) while the
        block runs. Inside a holder of this process, a block asking for no more than is
        held runs at once; one asking for more is a test that says it needs fewer cores
        than it uses: RuntimeError. A taker waits as long as the holders do: each is
        bounded by its own test's timeouts."""
        n = min(n or self._cores, self._cores)
        if self._held:
            if n > len(self._held):
                raise RuntimeError(
                    f"this test holds {len(self._held)} of the {self._cores} cores and "
                    f"asks for {n}: mark it slow(cores={n})")
            yield
            return
        try:
            with self._gate:
                while len(self._held) < n:
                    for token in self._tokens:
                        if token not in self._held and len(self._held) < n:
                            try:
                                token.acquire(timeout=0)
                            except Timeout:
                                continue
                            self._held.append(token)
                    if len(self._held) < n:
                        time.sleep(_POLL_S)
            yield
        finally:
            for token in self._held:
                token.release()
            self._held.clear()


# The session's tokens: set by tests/conftest.py's session fixture, in every xdist worker.
_SESSION: list[Cores] = []


def share(folder: Path) -> None:
    """The session's tokens are in ``folder`` (the one every xdist worker sees)."""
    _SESSION[:] = [Cores(folder)]


def cores(n: int | None = None):
    """``with cores(n):`` holds ``n`` of the machine's cores (default: all) across the
    session's workers: a job of n processes, which no other job then slows down. Outside
    a test session (a benchmark's script) there is no one to share with: it holds none."""
    return _SESSION[0].hold(n) if _SESSION else nullcontext()
