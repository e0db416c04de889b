"""The torch and Python spotring supports, and the refusal of any other, before torch is
imported: ``import spotring`` (ImportError) and every ``spotring`` command (exit 2) name the
torch that is needed and the one installed.

    TORCH_FLOOR      the oldest torch spotring runs on, and why no older one
    TORCH_NEWEST     the newest torch tested (constraints.txt pins it)
    PYTHONS          the Pythons tested: the oldest with TORCH_FLOOR, the newest with
                     TORCH_NEWEST (make test runs both ends: docs/testing.md)

pyproject.toml declares these same ranges, and tests/test_versions.py holds the two to each
other. Every use of a torch API that is private or differs between supported releases is
spotring/torch_compat.py's. Free of torch: it reads the installed version from the
package's metadata, which costs nothing and works where torch itself cannot be imported.
"""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path

TORCH_FLOOR = (2, 8)
# What the release before the floor lacks, for the refusal and docs/api.md's table: torch
# 2.7's FSDP2 fails every HSDP backward on CPUs ("assert all_reduce_event is not None"),
# and 2.6's runs no FSDP2 on CPUs at all nor takes DCP's no_dist; a floor per engine would
# leave one of them untested at its own floor.
WHY_FLOOR = ("FSDP's hybrid sharding (HSDP) runs on CPUs from torch 2.8 on, and every engine "
             "is tested there")
TORCH_NEWEST = (2, 14)
PYTHONS = ((3, 10), (3, 13))


def _release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as "2.8.0+cu128" or "2.15.0.dev20261101"."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def _dotted(release: tuple[int, ...]) -> str:
    return ".".join(map(str, release))


def torch_problem(installed: str | None) -> str | None:
    """The paragraph refusing torch ``installed`` (a version string; None: torch is not
    installed), or None where spotring supports it. A torch newer than TORCH_NEWEST is
    not refused, only warned of (torch_untested): pyproject.toml caps no release, as pip
    would replace a user's newer torch (and its CUDA libraries) to meet a cap."""
    needed = f"torch>={_dotted(TORCH_FLOOR)}"
    if installed is None:
        return (f"spotring needs {needed}, and torch is not installed in this environment "
                f"({sys.executable}): pip install 'spotring' brings it, or install your "
                f"torch ({needed}) first")
    if _release(installed) >= TORCH_FLOOR:
        return None
    return (f"spotring needs {needed} ({WHY_FLOOR}); this environment ({sys.executable}) "
            f"has torch {installed}. Install a newer torch with its torchvision: pip install "
            f"'{needed}' torchvision")


def torch_untested(installed: str) -> str | None:
    """What rank 0 warns of at spotring.init where torch ``installed`` is newer than the
    newest tested; None otherwise."""
    if _release(installed) <= TORCH_NEWEST:
        return None
    return (f"torch {installed} is newer than the newest spotring is tested with "
            f"({_dotted(TORCH_NEWEST)}); tell us what breaks")


def installed_torch() -> str | None:
    """The installed torch's version, from its package metadata (torch is not imported)."""
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def started_as_command() -> bool:
    """Whether this process is a ``spotring`` command (the console script, or ``python -m
    spotring...`` while that module is being found), rather than a script importing the
    library. During ``python -m X`` Python sets sys.argv[0] to "-m" until X is found, and a
    script's import of spotring comes only after."""
    program = sys.argv[0] if sys.argv else ""
    return Path(program).name == "spotring" or program == "-m"


class TorchVersionError(ImportError):
    """The installed torch is older than spotring supports; the message names both."""


def require_torch(installed: str | None) -> None:
    """Refuse an unsupported torch ``installed`` at once: a command prints the paragraph
    and exits 2 (bad input, nothing started); an import raises TorchVersionError."""
    problem = torch_problem(installed)
    if problem is None:
        return
    if started_as_command():
        from spotring.exits import EXIT_CONFIG

        print(f"spotring: error: {problem}", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG)
    raise TorchVersionError(problem)
