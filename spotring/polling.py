"""Waiting with a deadline: the one polling loop of spotring (trainer and launcher).

    address = poll(lambda: store_lookup(), timeout_s=300, interval_s=0.1,
                   what="rank 0's store address (engine.timeout_s)")

``check`` is called until it returns something other than None, or until the deadline;
an exception it raises passes straight through, so a caller decides which errors are
worth another try by catching them inside ``check`` and returning None. Free of torch,
so the launcher can import it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def poll(check: Callable[[], T | None], *, timeout_s: float, interval_s: float,
         what: str) -> T:
    """The first value of ``check()`` that is not None, tried every ``interval_s`` seconds;
    TimeoutError naming ``what`` once ``timeout_s`` seconds have passed without one.
    ``check`` runs at least once, and once more at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value is not None:
            return value
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{what}: not within {timeout_s:g} s")
        time.sleep(min(interval_s, left))
