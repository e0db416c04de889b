"""One folder per benchmark run: benchmarks/results/<run>/.

    results.json   {"machine": ..., "command": ..., "started": ..., "finished": ...,
                    "wall_seconds": ..., and one section per benchmark: "throughput",
                    "allreduce", "batch_sizes", "mnist_engines", "prediction"}
    runs/          every trainer run's own folder (metrics.jsonl, summary.json, log)
    report.md, *.png   written from results.json by `python -m benchmarks.report`

Every benchmark module writes through here, so a report can be made of any of them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks import machine
from benchmarks.runs import shown
from trainer.stores import write_atomic

RESULTS = Path(__file__).resolve().parent / "results"


def add_name_argument(p: argparse.ArgumentParser, kind: str) -> None:
    p.add_argument("--name", help=f"the results folder: a name under benchmarks/results, or a "
                   f"path (default: <time>-{kind})")


def write(name: str | None, kind: str, measure: Callable[[Path], dict],
          derive: Callable[[dict], dict] | None = None) -> dict:
    """Run ``measure(folder)`` (it returns results.json's sections) into a new results
    folder, between the header (machine, command, start) and the end (time, load); then
    add what ``derive`` computes from the whole (header included). The measurements are
    saved first: a failure in ``derive`` loses no measured hour (`suite --derive` redoes
    it)."""
    folder = _new_folder(name, kind)
    results = _begin()
    results.update(measure(folder))
    _finish(folder, results)
    if derive is not None:
        results = derive(results)
        save(folder, results)
    return results


def rederive(folder: Path, derive: Callable[[dict], dict]) -> dict:
    """Redo what ``derive`` computes from a results folder's measurements (after a change
    to the predictor, say). The measurements keep their own header; "derived" says which
    command and commit made the rest, and when."""
    results = load(folder)
    results["derived"] = {"command": _command(), "at": _now(), "commit": machine.commit()}
    results = derive(results)
    save(folder, results)
    return results


def _new_folder(name: str | None = None, kind: str = "bench") -> Path:
    folder = RESULTS / (name or f"{time.strftime('%Y%m%d-%H%M%S')}-{kind}")
    folder.mkdir(parents=True, exist_ok=name is not None)
    return folder


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")


def _command() -> str:
    """How this process was started, as a user would type it."""
    main = sys.modules["__main__"]
    module = main.__spec__.name if getattr(main, "__spec__", None) else Path(sys.argv[0]).stem
    return shown([Path(sys.executable).name, "-m", module, *sys.argv[1:]])


def _begin() -> dict:
    """The header of a results.json: the machine, the command, the start."""
    return {"command": _command(), "started": _now(),
            "start_time": time.time(), "machine": machine.describe()}


def _finish(folder: Path, results: dict) -> Path:
    results["finished"] = _now()
    results["wall_seconds"] = round(time.time() - results.pop("start_time"), 1)
    results["machine"]["load_average_end"] = machine.load_average()
    path = save(folder, results)
    where = folder.name if folder.parent == RESULTS else str(folder)
    print(f"\nwritten: {path}\n`python -m benchmarks.report {where}` (or `make report "
          f"RUN={where}`) makes report.md and the plots")
    return path


def save(folder: Path, results: dict) -> Path:
    """results.json, replaced whole or not at all (--derive rewrites a measured one)."""
    path = folder / "results.json"
    write_atomic(path, (json.dumps(results, indent=1) + "\n").encode())
    return path


def load(folder: Path) -> dict:
    return json.loads((folder / "results.json").read_text())


def find(run: str | None) -> Path:
    """A results folder: a name under benchmarks/results, a path, or None (the newest)."""
    if run is None or run == "latest":
        folders = sorted(RESULTS.glob("*/results.json"), key=lambda p: p.stat().st_mtime)
        if not folders:
            raise FileNotFoundError(f"no results under {RESULTS}: run `make bench` first")
        return folders[-1].parent
    return Path(run) if Path(run).is_dir() else RESULTS / run
