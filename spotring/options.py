"""Options with a fixed set of values, and the one way a bad one is reported.

A field typed with a ``Choice`` takes no other value: OmegaConf refuses any other as a
Hydra config is composed, naming the valid ones; and where a value comes from a Python
call instead (spotring.init), ``one_of`` words the refusal the same way.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from enum import Enum
from typing import Any


class Choice(str, Enum):
    """One of a field's fixed values: a field of such a type takes no other, OmegaConf
    refuses any other as the config is composed, naming the valid ones. Each is named as
    it reads, and prints, formats, compares and hashes as that string (enum.StrEnum does
    this from Python 3.11 on)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


def choices(name: str, values: str) -> type[Choice]:
    """A Choice type of the space-separated ``values``: choices("Backend", "auto gloo")."""
    return Choice(name, [(value, value) for value in values.split()])


def one_of(key: str, value: Any, valid: Iterable[str]) -> str | None:
    """A problem line if ``value`` is not in ``valid``, with a close match when there is one
    ("engine=hvd: unknown (did you mean horovod?); valid: ddp, horovod")."""
    valid = [str(v) for v in valid]
    if str(value) in valid:
        return None
    close = difflib.get_close_matches(str(value), valid, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"{key}={value}: unknown{hint}; valid: {', '.join(valid)}"
