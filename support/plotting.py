"""matplotlib for the reports' PNG files: the headless backend, and a PNG written whole.

    from spotring.support.plotting import plt, save
    fig, ax = plt.subplots()
    ...
    save(fig, folder / "history.png")

The benchmarks' report (spotring.benchmarks.plots) and the sweep's (spotring.sweep.report)
both draw with it, and neither imports the other: it sits in the base package, the lowest
layer both stand on, beside the rule it applies (spotring.stores.write_atomic: a reader
sees the old file or the new one). matplotlib is an extra (`spotring[bench]`,
`spotring[sweep]`): importing this module raises ImportError without it, and nothing
imports it at the package's import.
"""

from __future__ import annotations

import io
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers, in tests, under a launcher
import matplotlib.pyplot as plt  # noqa: E402

from spotring.stores import write_atomic  # noqa: E402

__all__ = ["plt", "save"]


def save(fig, path: Path) -> None:
    """``fig`` as a PNG at ``path``, whole or not at all, and closed (pyplot keeps every
    open figure in memory)."""
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110)
    plt.close(fig)
    write_atomic(path, png.getvalue())
