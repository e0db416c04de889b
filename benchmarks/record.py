"""One folder per benchmark run: <results>/<run>/.

    results.json   {"command", "started", "finished", "wall_seconds", "machine", and one
                    section per benchmark: "throughput", "allreduce", "batch_sizes",
                    "time_to_accuracy", "prediction"}
    runs/          every measured run's own folder (metrics.jsonl, summary.json, log)
    report.md, *.png   written from results.json alone by `spotring report`

<results> is benchmarks/results/ in a checkout (`make bench`), ./benchmarks/results/
where spotring is installed as a package.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

from spotring.benchmarks import machine
from spotring.benchmarks.runs import REPO, shown
from spotring.stores import write_atomic

RESULTS = REPO / "benchmarks" / "results"


def write(name: str | None, kind: str, command: str, measure: Callable[[Path], dict],
          derive: Callable[[dict], dict]) -> Path:
    """Run ``measure(folder)`` (it returns results.json's sections) into a new results
    folder, between the header (machine, command, start) and the end (time, load); save;
    then add what ``derive`` computes from the whole, and save again: a failure there
    loses no measurement."""
    folder = RESULTS / (name or f"{time.strftime('%Y%m%d-%H%M%S')}-{kind}")
    folder.mkdir(parents=True, exist_ok=True)
    start = time.time()
    results = {"command": command, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
               "machine": machine.describe()}
    results.update(measure(folder))
    results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    results["wall_seconds"] = round(time.time() - start, 1)
    results["machine"]["load_average_end"] = machine.load_average()
    save(folder, results)
    save(folder, derive(results))
    return folder


def run_alone(module: str, argv: list[str], name: str | None, kind: str,
              measure: Callable[[Path], dict], derive: Callable[[dict], dict],
              render: Callable[[Path, dict], Path]) -> int:
    """A benchmark run on its own (`python -m ``module`` ``argv```): ``write`` its results
    folder (``name``, ``kind``, ``measure``, ``derive``), then ``render(folder, results)``
    its report, and say where. Returns 0, the exit code of its main."""
    command = command_line(module, f"python -m {module}", argv)
    folder = write(name, kind, command, measure, derive)
    print(f"written: {render(folder, load(folder))}")
    return 0


def write_report(folder: Path, markdown: str) -> Path:
    """folder/report.md holding ``markdown``, replaced whole or not at all."""
    path = folder / "report.md"
    write_atomic(path, (markdown + "\n").encode())
    return path


def command_line(module: str, prog: str, argv: list[str]) -> str:
    """How this process was started, as a user would type it: `python -m module ARGV`, or
    `prog ARGV` (spotring's command)."""
    started_as = getattr(getattr(sys.modules["__main__"], "__spec__", None), "name", None)
    return shown([*(["python", "-m", module] if started_as == module else prog.split()),
                  *argv])


def save(folder: Path, results: dict) -> Path:
    """results.json, replaced whole or not at all."""
    path = folder / "results.json"
    write_atomic(path, (json.dumps(results, indent=1) + "\n").encode())
    return path


def load(folder: Path) -> dict:
    return json.loads((folder / "results.json").read_text())


def find(run: str | None) -> Path:
    """A results folder: a name under RESULTS, a path, or None / "latest" (the newest).
    FileNotFoundError, naming the runs there are, where there is none."""
    runs = sorted(RESULTS.glob("*/results.json"), key=lambda p: p.stat().st_mtime)
    if run is None or run == "latest":
        if runs:
            return runs[-1].parent
    else:
        for folder in (Path(run), RESULTS / run):
            if (folder / "results.json").is_file():
                return folder
    names = ", ".join(p.parent.name for p in runs) or "none yet: run `spotring bench` first"
    raise FileNotFoundError(f"no results.json for run {run or 'latest'!r} (a folder under "
                            f"{RESULTS}, or a path to one); the runs there: {names}")
