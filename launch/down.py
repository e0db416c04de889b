"""`down`: delete everything of the run, say what went; safe to run again and again.

The provider finds what to delete by tag or name, not from this machine's memory, so
`down` also cleans up after a crashed `up`; `down --all-mine` after lost run dirs. A
deletion that fails does not stop the others; what is still there at the end is named,
with the command that tries again (Leftovers: exit code 1).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from spotring.launch.provider import Leftovers, Provider
from spotring.launch.rundir import RunDir

log = logging.getLogger("launch")


def down(run: RunDir, provider: Provider, all_mine: bool = False) -> list[str]:
    """The provider's deletions, logged; Leftovers if anything is still there."""
    try:
        done = provider.destroy(all_mine)
    except Leftovers as e:
        for line in e.deleted:
            log.info("down: %s", line)
        raise
    for line in done:
        log.info("down: %s", line)
    whose = f"your {provider.name} resources" if all_mine else f"run {run.id}"
    log.info("down: %s", f"done; nothing of {whose} is left" if done
             else f"nothing of {whose} was left to delete")
    # Only now: until everything went, the run is not over (`cost` counts on).
    if not all_mine and run.config.exists() and "destroyed_at" not in run.state():
        run.save(destroyed_at=time.time())
    return done


def down_after(run: RunDir, provider: Provider, failure: BaseException | None = None) -> None:
    """`down` as the clean-up at the end of `launch`, or after ``failure`` (of `up`, `run`,
    `launch`: an error, Ctrl-C, SIGTERM), with Ctrl-C, SIGTERM and SIGHUP ignored until
    it is done: a second one must not stop it halfway. What it leaves is raised as
    Leftovers; after a failure it is logged and kept for ``leftovers(failure)`` instead,
    so that the command can say both why it failed and what is left."""
    with _uninterrupted():
        try:
            down(run, provider)
        except Leftovers as e:
            if failure is None:
                raise
            log.info("down: %s", e)
            failure.spotring_leftovers = e
            return
    if failure is not None:
        failure.spotring_leftovers = None  # an earlier clean-up's, now deleted after all


def leftovers(failure: BaseException) -> Leftovers | None:
    """What the last clean-up after ``failure`` could not delete, if anything."""
    return getattr(failure, "spotring_leftovers", None)


@contextmanager
def _uninterrupted() -> Iterator[None]:
    """Ctrl-C, SIGTERM and SIGHUP ignored meanwhile (signals reach the main thread only:
    elsewhere there is nothing to hold off)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    before = {sig: signal.signal(sig, signal.SIG_IGN) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
