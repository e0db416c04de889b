"""`down`: delete everything of the run, say what went; safe to run again and again.

The provider finds what to delete by tag or name, not from this machine's memory, so
`down` also cleans up after a crashed `up`; `down --all-mine` after lost run dirs.
"""

from __future__ import annotations

import logging
import time

from launch.provider import Provider
from launch.rundir import RunDir

log = logging.getLogger("launch")


def down(run: RunDir, provider: Provider, all_mine: bool = False) -> list[str]:
    done = provider.destroy(all_mine)
    for line in done:
        log.info("down: %s", line)
    whose = f"your {provider.name} resources" if all_mine else f"run {run.id}"
    log.info("down: %s", f"done; nothing of {whose} is left" if done
             else f"nothing of {whose} was left to delete")
    if not all_mine and run.config.exists() and "destroyed_at" not in run.state():
        run.save(destroyed_at=time.time())
    return done
