"""The sweep's report: SWEEP_DIR/sweep_report.md and its PNGs, from plain rows.

    sweep_report.md           the study, its trial counts, objectives and command; the best
                              trial (or the Pareto set) with its command line, which trains
                              it again; one table of every trial, best first
    optimization_history.png  objective 1 per trial and the best so far (complete trials)
    pareto_front.png          two objectives against each other, Pareto members joined
                              (two or more objectives only)

Nothing here runs a process or asks Optuna: the runner hands over TrialRows.
"""

from __future__ import annotations

import itertools
import math
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spotring.stores import write_atomic

REPORT = "sweep_report.md"
HISTORY = "optimization_history.png"
PARETO = "pareto_front.png"
STATES = ("complete", "pruned", "failed", "running")


@dataclass
class TrialRow:
    number: int  # Optuna trial number, 0-based
    state: str  # "complete" | "pruned" | "failed" | "running"
    params: dict[str, str]  # override key -> value as the trial got it
    summary: dict[str, Any] | None  # the trial's summary.json (None if it did not finish)
    values: list[float] | None  # the objective values Optuna was told (complete trials)
    restarts: int  # attempts after its first (each resumed from its checkpoint, if any)
    wall_seconds: float  # wall time of all its attempts
    dollars: float | None  # None when the sweep has no price
    note: str  # why it failed or was pruned; "" otherwise
    run_dir: str  # relative to the sweep dir, e.g. "trials/003"


@dataclass(frozen=True)
class Metric:
    name: str
    unit: str = ""
    scale: float = 1.0  # test_accuracy is a fraction in summary.json, shown in percent
    spec: str = ".4g"

    def number(self, value: float) -> str:
        return f"{self.scale * value:{self.spec}}"

    def text(self, value: float) -> str:
        """'test accuracy 99.12%', 'parameter memory 1.64 MiB'."""
        gap = "" if self.unit in ("", "%") else " "
        return f"{self.name} {self.number(value)}{gap}{self.unit}"

    @property
    def header(self) -> str:
        return f"{self.name} ({self.unit})" if self.unit else self.name

    def axis(self, direction: str) -> str:
        """'test accuracy (%, maximize)', 'test loss (minimize)'."""
        return f"{self.name} ({self.unit + ', ' if self.unit else ''}{direction})"


METRICS = {
    "test_accuracy": Metric("test accuracy", "%", 100, ".2f"),
    "test_loss": Metric("test loss", spec=".4f"),
    "train_seconds": Metric("training time", "s", spec=".1f"),
    "images_per_second": Metric("img/s", spec=".0f"),
    "parameters": Metric("parameters", spec=",.0f"),
    "parameter_mb": Metric("parameter memory", "MiB", spec=".2f"),
    "peak_memory_mb": Metric("peak memory", "MiB", spec=".0f"),
    "dollars": Metric("dollars", spec=".3f"),
}
# The table's columns read from each trial's summary.json, in this order, where any
# trial's has them (a script's summary.json holds what it reported).
SUMMARY_COLUMNS = ("test_accuracy", "test_loss", "train_seconds", "parameters", "parameter_mb")


def metric(key: str) -> Metric:
    return METRICS.get(key) or Metric(key.replace("_", " "))


def pareto_front(values: list[list[float]], directions: list[str]) -> list[int]:
    """Indices of the non-dominated points (directions: "maximize"/"minimize" per objective).
    Equal points are all kept."""
    signs = []
    for d in directions:
        if d not in ("maximize", "minimize"):
            raise ValueError(f"direction {d!r}: maximize or minimize")
        signs.append(-1.0 if d == "maximize" else 1.0)
    # Everything minimised: j dominates i when it is no worse anywhere and better somewhere.
    costs = []
    for point in values:
        if len(point) != len(signs):
            raise ValueError(f"{len(point)} values for {len(signs)} directions")
        costs.append([s * v for s, v in zip(signs, point, strict=True)])

    def dominated(i: int) -> bool:
        return any(all(b <= a for a, b in zip(costs[i], other, strict=True)) and other != costs[i]
                   for other in costs)

    return [i for i in range(len(costs)) if not dominated(i)]


def write(sweep_dir: Path, name: str, objectives: dict[str, str], rows: list[TrialRow],
          best: list[int], command: str, best_command: list[str] | None = None) -> Path:
    """Write sweep_dir/sweep_report.md (+ PNGs), return its path. ``best_command``: the
    trials' command with the best trial's values, which trains it again."""
    sweep_dir = Path(sweep_dir)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    by_number = {r.number: r for r in rows}
    pareto = set(best) if len(objectives) > 1 else set()
    drawn = _draw(sweep_dir, objectives, rows, best)
    parts = [
        f"# Sweep: {name}",
        _overview(objectives, rows),
        f"```sh\n{command}\n```\n\nThe same command in the same directory continues the "
        "study; finished trials are not run again.",
        _best(objectives, [by_number[n] for n in best if n in by_number], best_command),
        "## Trials",
        _trials(objectives, rows, pareto),
    ]
    if drawn is None:
        parts.append("(No plots: they need matplotlib, `pip install 'spotring[sweep]'`.)")
    elif drawn:
        parts.append("\n".join(f"![{png.removesuffix('.png').replace('_', ' ')}]({png})"
                               for png in drawn))
    path = sweep_dir / REPORT
    write_atomic(path, ("\n\n".join(parts) + "\n").encode())
    return path


# ------------------------------------------------------------------------------ markdown


def _overview(objectives: dict[str, str], rows: list[TrialRow]) -> str:
    counts = ", ".join(f"{sum(r.state == s for r in rows)} {s}" for s in STATES)
    aims = ", ".join(f"{metric(k).name} ({d})" for k, d in objectives.items())
    line = (f"{len(rows)} trials: {counts}. Objectives: {aims}. Wall time of the trials "
            f"{_duration(sum(r.wall_seconds for r in rows))}")
    priced = [r.dollars for r in rows if r.dollars is not None]
    if priced:
        line += f", ${sum(priced):.3f} at the sweep's price"
    return line + "."


def _best(objectives: dict[str, str], best: list[TrialRow],
          best_command: list[str] | None) -> str:
    if not best:
        return "## Best trial\n\nNo trial has completed yet."
    several = len(objectives) > 1
    lines = [f"- {_one(r, objectives)}" for r in best]
    parts = [f"## Pareto front ({len(best)} trials)" if several else "## Best trial",
             "\n".join(lines) if several else lines[0][2:]]
    whose = f" (trial {best[0].number}, the first of the front)" if several else ""
    if best_command is not None:
        parts.append(f"Its command{whose}, to train it again from the project directory:"
                     f"\n\n```sh\n{shlex.join(best_command)}\n```")
    return "\n\n".join(parts)


def _one(row: TrialRow, objectives: dict[str, str]) -> str:
    """'Trial 7 ([trials/007](trials/007)): `optim.lr=0.08`; test accuracy 99.12%.'"""
    params = ", ".join(f"`{k}={v}`" for k, v in row.params.items()) or "no parameters"
    values = "; ".join(metric(k).text(v) for k, v in zip(objectives, row.values or [],
                                                          strict=False))
    return f"Trial {row.number} ([{row.run_dir}]({row.run_dir})): {params}; {values}."


def _trials(objectives: dict[str, str], rows: list[TrialRow], pareto: set[int]) -> str:
    keys = list(objectives)
    params = list(dict.fromkeys(k for r in rows for k in r.params))
    # Objectives the summary columns do not show (img/s, peak memory) get their own, read
    # from what Optuna was told; dollars has its column already.
    extra = [(i, k) for i, k in enumerate(keys) if k not in SUMMARY_COLUMNS and k != "dollars"]
    priced = any(r.dollars is not None for r in rows)
    shown = [k for k in SUMMARY_COLUMNS if any(k in (r.summary or {}) for r in rows)]
    headers = (["trial", "state"] + (["pareto"] if pareto else []) + params
               + [metric(k).header for k in shown]
               + [metric(k).header for _, k in extra] + ["restarts"]
               + (["dollars"] if priced else []) + ["note"])
    body = []
    for r in _ordered(rows, objectives[keys[0]]):
        summary = r.summary or {}
        cells = [f"[{r.number}]({r.run_dir})", r.state]
        if pareto:
            cells.append("★" if r.number in pareto else "")
        cells += [r.params.get(k, "") for k in params]
        cells += [_cell(k, summary.get(k)) for k in shown]
        cells += [_cell(k, r.values[i] if r.values else None) for i, k in extra]
        cells.append(str(r.restarts))
        if priced:
            cells.append(_cell("dollars", r.dollars))
        cells.append(r.note)
        body.append(cells)
    caption = (f"Sorted by {metric(keys[0]).name}, best first, then the trials without a "
               "value by number." + (" ★: on the Pareto front." if pareto else ""))
    return caption + "\n\n" + _table(headers, body)


def _ordered(rows: list[TrialRow], direction: str) -> list[TrialRow]:
    """Best first by the first objective; the trials without a value after, by number."""
    sign = -1.0 if direction == "maximize" else 1.0

    def rank(r: TrialRow) -> tuple:
        v = r.values[0] if r.values else math.nan
        return (0, sign * v, r.number) if math.isfinite(v) else (1, 0.0, r.number)

    return sorted(rows, key=rank)


def _cell(key: str, value: Any) -> str:
    return "" if value is None else metric(key).number(value)


def _table(headers: list[str], rows: list[list[str]]) -> str:
    # Like benchmarks/report.py's, but params and notes are free text: a '|' in them
    # would split the cell.
    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |"

    return "\n".join([line(headers), "|" + " --- |" * len(headers), *map(line, rows)])


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, s = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {s:02d} s"
    return f"{minutes // 60} h {minutes % 60:02d} min"


# -------------------------------------------------------------------------------- plots


def _draw(sweep_dir: Path, objectives: dict[str, str], rows: list[TrialRow],
          best: list[int]) -> list[str] | None:
    """The PNGs drawn, by file name; None without matplotlib (the markdown still goes out)."""
    done = sorted((r for r in rows if r.state == "complete" and r.values),
                  key=lambda r: r.number)
    if not done:
        return []
    try:
        # Here, not at the top: the runner imports this module before any trial, and
        # matplotlib is an extra. spotring.support.plotting sets the Agg backend.
        from spotring.support import plotting as plots
    except ImportError:
        return None
    drawn = [HISTORY]
    _history(plots, sweep_dir / HISTORY, objectives, done, best)
    if len(objectives) > 1:
        _front(plots, sweep_dir / PARETO, objectives, done, set(best))
        drawn.append(PARETO)
    return drawn


def _history(plots, path: Path, objectives: dict[str, str], done: list[TrialRow],
             best: list[int]) -> None:
    """Objective 1 of each complete trial, by trial number, and the best so far. Pruned
    and failed trials have no objective value and are left out."""
    from matplotlib.ticker import MaxNLocator

    key, direction = next(iter(objectives.items()))
    m = metric(key)
    x = [r.number for r in done]
    y = [m.scale * r.values[0] for r in done]
    so_far = list(itertools.accumulate(y, max if direction == "maximize" else min))
    fig, ax = plots.plt.subplots(figsize=(7, 4))
    ax.plot(x, y, "o", color="tab:blue", alpha=0.8, label="complete trial")
    ax.step(x, so_far, where="post", color="tab:red", label="best so far")
    top = [(n, v) for n, v in zip(x, y, strict=True) if n in best]
    if top and len(objectives) == 1:
        ax.plot(*zip(*top, strict=True), "*", color="tab:red", markersize=14, label="best")
    ax.set(xlabel="trial", ylabel=m.axis(direction), title="Optimization history")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # no trial 2.5 with few trials
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    plots.save(fig, path)


def _front(plots, path: Path, objectives: dict[str, str], done: list[TrialRow],
           members: set[int]) -> None:
    """Objective 1 (y) against objective 2 (x), or test accuracy on y wherever it is one of
    the two, as in MathWorks' accuracy-against-memory plot. The members (of the front
    over every objective) are highlighted; the line joins the front of the two drawn."""
    keys = list(objectives)
    iy, ix = (1, 0) if keys[1] == "test_accuracy" else (0, 1)
    mx, my = metric(keys[ix]), metric(keys[iy])
    dx, dy = objectives[keys[ix]], objectives[keys[iy]]
    points = [(mx.scale * r.values[ix], my.scale * r.values[iy]) for r in done]
    fig, ax = plots.plt.subplots(figsize=(7, 4.5))
    for on, style in ((False, {"color": "tab:grey", "alpha": 0.7, "label": "complete trial"}),
                      (True, {"color": "tab:red", "markersize": 8, "label": "Pareto front"})):
        chosen = [p for r, p in zip(done, points, strict=True) if (r.number in members) == on]
        if chosen:
            ax.plot(*zip(*chosen, strict=True), "o", **style)
    line = sorted(points[i] for i in pareto_front([list(p) for p in points], [dx, dy]))
    # The edge of what the front dominates: for x minimised, along x to the next member,
    # then up or down to it; for x maximised, first up or down, then along x.
    ax.step(*zip(*line, strict=True), where="post" if dx == "minimize" else "pre",
            color="tab:red", alpha=0.6)
    for r, p in zip(done, points, strict=True):
        ax.annotate(str(r.number), p, textcoords="offset points", xytext=(4, 4),
                    fontsize=7)
    ax.set(xlabel=mx.axis(dx), ylabel=my.axis(dy), title="Pareto front")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    plots.save(fig, path)
