"""What each try of a launch reached, recorded in state.json ("tries") for the restart
decisions (launch/recover.py) and the bill (launch/ledger.py). One entry per try:

    started_at, ended_at   when the launcher started the job and saw it end (epoch s)
    nodes                  the ids of the nodes it ran on
    exit                   the job's exit code; null when ssh to a node failed
    step                   the step it reached: rank 0's preempted.json says, else the
                           last train record of metrics.jsonl (every telemetry.log_every
                           steps, so up to that many short), else where it resumed
    resumed_from           the step it resumed at ("resumed at step N" in job.log; 0:
                           from the start)
    reason, noticed_at,    from preempted.json where the job left one: why, when the
    saved_at, checkpoint   notice (or SIGTERM) reached it and when its checkpoint was
                           complete on every store (absent in older notes: null)
    last_record            [step, time] of its last train record, or null
    back_at                a try that was restarted: when a later try's train records
                           reached last_record's step again (null: none did)
    restart                "preemption" or "failure": the cause of the restart after
                           it; null where the run stopped (or finished)
    lost                   the nodes it lost, which the restart replaced
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from spotring.exits import PREEMPTED
from spotring.launch.rundir import RunDir

# The trainer's line (trainer/loop.py) and the library's (spotring/job.py: restore).
_RESUMED = re.compile(r"resumed (?:from \S+ )?at step (\d+)")


def outcome(run: RunDir, started_at: float, nodes: list[str], code: int | None) -> dict:
    """What the try that started at ``started_at`` on ``nodes`` and ended with ``code``
    left in the run dir (its notes, metrics and log were just brought back)."""
    # A note is this try's only if the job ran (ssh may have failed before run.py
    # removed the last try's).
    note = _note(run.job) if code is not None else {}
    records = _train_records(run.job / "metrics.jsonl", started_at)
    # job.log is this try's only if the job started (ssh may have failed before).
    fresh = run.job_log.exists() and run.job_log.stat().st_mtime >= started_at
    found = _RESUMED.findall(run.job_log.read_text()) if fresh else []
    resumed = int(found[-1]) if found else 0
    step = note.get("step", records[-1][0] if records else resumed)
    return {"started_at": started_at, "ended_at": time.time(), "nodes": nodes, "exit": code,
            "step": step, "resumed_from": resumed, "reason": note.get("reason"),
            "noticed_at": note.get("noticed_at"), "saved_at": note.get("saved_at"),
            "checkpoint": note.get("checkpoint"),
            "last_record": list(records[-1]) if records else None}


def record(run: RunDir, outcome: dict, restart: str | None, lost: list[str]) -> None:
    """Append the try to state.json, and to the try restarted before it, when this one
    reached its last recorded step again."""
    done = run.tries()
    if done and done[-1]["restart"] and done[-1]["last_record"]:
        step = done[-1]["last_record"][0]
        again = [t for s, t in _train_records(run.job / "metrics.jsonl", outcome["started_at"])
                 if s >= step]
        done[-1]["back_at"] = again[0] if again else None
    run.save(tries=[*done, {**outcome, "back_at": None, "restart": restart, "lost": lost}])


def step_reached(job_dir: Path, since: float) -> int | None:
    """The step a try that started at ``since`` reached, as ``outcome`` reads it from
    ``job_dir`` (rank 0's run directory): its preempted.json, else its last train record;
    None where it left neither."""
    records = _train_records(job_dir / "metrics.jsonl", since)
    return _note(job_dir).get("step", records[-1][0] if records else None)


def _note(job_dir: Path) -> dict:
    path = job_dir / PREEMPTED
    return json.loads(path.read_text()) if path.exists() else {}


def _train_records(metrics: Path, since: float) -> list[tuple[int, float]]:
    """(step, time) of the train records written since ``since``, in order."""
    if not metrics.exists():
        return []
    records = []
    for line in metrics.read_text().splitlines():
        if not line.endswith("}"):  # a line cut off by a node that vanished mid-write
            continue
        r = json.loads(line)
        if r.get("kind") == "train" and r["time"] >= since:
            records.append((r["step"], r["time"]))
    return records
