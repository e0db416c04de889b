"""`spotring sweep` as users run it, and what it leaves behind read back: the study from
its journal, each trial's run directory (summary.json, trial.log), the report's table,
and what a running trial's processes got (/proc)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import NamedTuple

import optuna
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend

from harness import REPO
from harness.reports import sections
from spotring.contract import RUN_DIR
from spotring.launch.commands import local_environment


def sweep_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "spotring", "sweep", *args]


def run_sweep(*args: str, cwd: Path = REPO, env: dict[str, str] | None = None,
              expect: int = 0) -> str:
    """`spotring sweep ARGS` in ``cwd`` to its end; its output (stdout and stderr)."""
    proc = subprocess.run(sweep_command(*args), cwd=cwd, capture_output=True, text=True,
                          timeout=600, env=local_environment(**(env or {})))
    output = proc.stdout + proc.stderr
    assert proc.returncode == expect, f"exit {proc.returncode}\n{output[-6000:]}"
    return output


def load(sweep_dir: Path, name: str) -> optuna.Study:
    storage = JournalStorage(JournalFileBackend(str(sweep_dir / "study.journal")))
    return optuna.load_study(study_name=name, storage=storage)


def trials(sweep_dir: Path, name: str) -> list[optuna.trial.FrozenTrial]:
    """The study's trials as the journal has them now; none before the sweep made it."""
    try:
        return load(sweep_dir, name).trials
    except (KeyError, FileNotFoundError):
        return []


def trial_dir(sweep_dir: Path, number: int) -> Path:
    return sweep_dir / "trials" / f"{number:03d}"


def summary(sweep_dir: Path, number: int) -> dict:
    return json.loads((trial_dir(sweep_dir, number) / "summary.json").read_text())


class Attempt(NamedTuple):
    number: int  # as the study counted it: a sweep killed between counting and starting
    started: datetime  # leaves a gap
    ended: datetime | None  # None: its sweep was killed


def attempts(trial: Path) -> list[Attempt]:
    """The attempts of the trial in directory ``trial``, by its trial.log (this machine's
    clock)."""
    found: list[Attempt] = []
    for stamp, number, ended in re.findall(
            r"^spotring sweep: (\S+ \S+) attempt (?:(\d+) starts|(ended))",
            (trial / "trial.log").read_text(), re.MULTILINE):
        if ended:
            found[-1] = found[-1]._replace(ended=datetime.fromisoformat(stamp))
        else:
            found.append(Attempt(int(number), datetime.fromisoformat(stamp), None))
    return found


def side_by_side(sweep_dir: Path, numbers: list[int]) -> bool:
    """Whether an attempt of one of the trials ran while an attempt of another did."""
    spans = [(n, a.started, a.ended) for n in numbers
             for a in attempts(trial_dir(sweep_dir, n)) if a.ended is not None]
    return any(a < d and c < b for n, a, b in spans for m, c, d in spans if n != m)


def environment(pid: int) -> dict[str, str]:
    """A running process's environment."""
    raw = Path(f"/proc/{pid}/environ").read_bytes().decode()
    return dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)


def command_line(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_text().split("\0")[:-1]


def trial_pids(run_dir: Path | str) -> list[int]:
    """The running processes of the trial whose run directory is ``run_dir``: those whose
    environment names it (the contract's SPOTRING_RUN_DIR)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and environment(int(proc.name)).get(RUN_DIR) == str(run_dir):
                found.append(int(proc.name))
        except OSError:  # ended meanwhile
            continue
    return found


def trials_table(markdown: str) -> list[dict[str, str]]:
    """The rows of the report's table of trials, {column: cell}."""
    tables = sections(markdown)["Trials"]
    assert len(tables) == 1
    return tables[0]


def number(cell: str) -> int:
    """'[3](trials/003)' -> 3."""
    return int(cell.split("]")[0].lstrip("["))


def rows(markdown: str) -> dict[int, dict[str, str]]:
    """The report's trials table by trial number."""
    return {number(row["trial"]): row for row in trials_table(markdown)}
