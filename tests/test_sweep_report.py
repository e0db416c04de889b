"""The sweep's report: the Pareto front against a brute-force recomputation, and
sweep_report.md and its PNGs from synthetic trials, one and two objectives: every trial
once, in order, with its summary's numbers, the best and the Pareto set marked exactly."""

from __future__ import annotations

import random
import sys

import numpy as np
import pytest

from harness.reports import PNG_SIGNATURE
from harness.sweeps import number, trials_table
from spotring.sweep import report
from spotring.sweep.report import TrialRow, pareto_front

# ------------------------------------------------------------------------- Pareto front


def brute_force(values: list[list[float]], directions: list[str]) -> list[int]:
    """i is on the front unless some point is at least as good everywhere and better
    somewhere, everything turned into maximising."""
    if not values:
        return []
    p = np.array(values, dtype=float) * [1 if d == "maximize" else -1 for d in directions]
    at_least = (p[None, :, :] >= p[:, None, :]).all(axis=2)  # [i, j]: j >= i everywhere
    better = (p[None, :, :] > p[:, None, :]).any(axis=2)
    return [i for i in range(len(p)) if not (at_least[i] & better[i]).any()]


@pytest.mark.parametrize("seed", range(12))
def test_pareto_front_matches_brute_force(seed):
    rng = random.Random(seed)
    m = rng.choice([1, 2, 2, 3])
    directions = [rng.choice(["maximize", "minimize"]) for _ in range(m)]
    # Small integers give ties and equal points; floats the general case.
    draw = (lambda: rng.randint(0, 4)) if seed % 2 else (lambda: rng.random())
    values = [[draw() for _ in range(m)] for _ in range(rng.randint(1, 40))]
    front = pareto_front(values, directions)
    assert front == brute_force(values, directions)
    assert front == sorted(set(front))
    # Equal points share their fate.
    for i, j in ((i, j) for i in range(len(values)) for j in range(len(values))):
        if values[i] == values[j]:
            assert (i in front) == (j in front)


def test_pareto_front_by_hand():
    points = [[1, 5], [2, 4], [2, 4], [3, 3], [1, 4], [3, 1]]
    assert pareto_front(points, ["maximize", "maximize"]) == [0, 1, 2, 3]
    assert pareto_front(points, ["minimize", "minimize"]) == [4, 5]
    accuracy_memory = [[0.99, 1.6], [0.98, 0.4], [0.97, 0.4], [0.99, 1.6], [0.99, 2.0]]
    assert pareto_front(accuracy_memory, ["maximize", "minimize"]) == [0, 1, 3]
    assert pareto_front([], ["maximize"]) == []
    assert pareto_front([[0.5], [0.7], [0.7]], ["maximize"]) == [1, 2]
    with pytest.raises(ValueError, match="direction"):
        pareto_front([[1.0]], ["max"])


# ------------------------------------------------------------------------------ report


def summary(accuracy: float, loss: float, seconds: float, parameters: int,
            mb: float) -> dict:
    return {"test_accuracy": accuracy, "test_loss": loss, "train_seconds": seconds,
            "parameters": parameters, "parameter_mb": mb, "images_per_second": 1000.0}


def row(number: int, state: str, s: dict | None = None, values: list[float] | None = None,
        *, restarts: int = 0, dollars: float | None = None, note: str = "",
        wall: float = 20.0, **params: str) -> TrialRow:
    return TrialRow(number=number, state=state, params=params or {"optim.lr": f"0.0{number}"},
                    summary=s, values=values, restarts=restarts, wall_seconds=wall,
                    dollars=dollars, note=note, run_dir=f"trials/{number:03d}")


def check_png(path):
    import matplotlib.image

    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert len(data) > 5_000
    height, width = matplotlib.image.imread(path).shape[:2]
    assert 300 < width < 2000 and 200 < height < 2000


def test_one_objective(tmp_path):
    rows = [
        row(0, "complete", summary(0.9812, 0.06123, 12.34, 431080, 1.64441), [0.9812],
            wall=30, **{"optim.lr": "0.0123", "optim.weight_decay": "1e-05"}),
        row(1, "pruned", note="pruned at step 200 (test_accuracy 0.91)", wall=5),
        row(2, "complete", summary(0.9921, 0.0301, 11.0, 431080, 1.64441), [0.9921],
            restarts=1, wall=40.4, **{"optim.lr": "0.0812", "optim.weight_decay": "3e-04"}),
        row(3, "failed", restarts=2, note="exit 1 after 2 retries", wall=10),
        row(4, "complete", summary(0.9875, 0.045, 10.0, 431080, 1.64441), [0.9875], wall=30),
        row(5, "running", wall=9.6),
    ]
    again = ["spotring", "train", "optim.lr=0.0812", "optim.weight_decay=3e-04"]
    path = report.write(tmp_path, "mnist_lr_wd", {"test_accuracy": "maximize"}, rows, [2],
                        "spotring sweep sweep=mnist_lr_wd", again)
    assert path == tmp_path / "sweep_report.md"
    md = path.read_text()
    assert md.startswith("# Sweep: mnist_lr_wd\n")
    assert ("6 trials: 3 complete, 1 pruned, 1 failed, 1 running. Objectives: test accuracy "
            "(maximize). Wall time of the trials 2 min 05 s.") in md
    assert "spotring sweep sweep=mnist_lr_wd" in md
    best = md.split("## Best trial")[1].split("##")[0]
    assert "Trial 2 ([trials/002](trials/002)): `optim.lr=0.0812`, " \
           "`optim.weight_decay=3e-04`; test accuracy 99.21%." in best
    assert "to train it again from the project directory:\n\n```sh\nspotring train " \
           "optim.lr=0.0812 optim.weight_decay=3e-04\n```" in best

    table = trials_table(md)
    assert [number(r["trial"]) for r in table] == [2, 4, 0, 1, 3, 5]
    assert list(table[0]) == ["trial", "state", "optim.lr", "optim.weight_decay",
                              "test accuracy (%)", "test loss", "training time (s)",
                              "parameters", "parameter memory (MiB)", "restarts", "note"]
    first, zero, failed = table[0], table[2], table[4]
    assert (first["state"], first["test accuracy (%)"], first["restarts"]) == \
        ("complete", "99.21", "1")
    assert (zero["optim.weight_decay"], zero["test loss"], zero["training time (s)"],
            zero["parameters"], zero["parameter memory (MiB)"]) == \
        ("1e-05", "0.0612", "12.3", "431,080", "1.64")
    assert failed["state"] == "failed" and failed["note"] == "exit 1 after 2 retries"
    assert failed["test accuracy (%)"] == "" and failed["optim.weight_decay"] == ""
    assert table[3]["note"] == "pruned at step 200 (test_accuracy 0.91)"

    check_png(tmp_path / "optimization_history.png")
    assert "![optimization history](optimization_history.png)" in md
    # Nothing else: no Pareto plot for one objective, no temporary file left behind.
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "optimization_history.png", "sweep_report.md"]


def test_two_objectives(tmp_path):
    objectives = {"test_accuracy": "maximize", "parameter_mb": "minimize"}
    points = {0: (0.99, 1.6), 1: (0.985, 0.41), 2: (0.97, 0.41), 3: (0.99, 1.6),
              4: (0.95, 0.1), 6: (0.98, 2.0)}
    rows = [row(n, "complete", summary(a, 0.05, 20.0, int(mb * 2**18), mb), [a, mb],
                dollars=0.0123 if n == 4 else None) for n, (a, mb) in points.items()]
    rows.insert(5, row(5, "failed", note="diverged at step 40 (loss nan)"))
    front = [list(points)[i] for i in pareto_front([list(p) for p in points.values()],
                                                   list(objectives.values()))]
    assert front == [0, 1, 3, 4]
    md = report.write(tmp_path, "memory", objectives, rows, front, "spotring sweep sweep=memory",
                      ["python", "train.py", "--lr", "0.01 0.02"]).read_text()
    assert "Objectives: test accuracy (maximize), parameter memory (minimize)." in md
    assert ", $0.012 at the sweep's price." in md
    best = md.split("## Pareto front (4 trials)")[1].split("## Trials")[0]
    assert [line.split()[2] for line in best.splitlines() if line.startswith("- Trial")] == \
        ["0", "1", "3", "4"]
    assert "- Trial 1 ([trials/001](trials/001)): `optim.lr=0.01`; test accuracy 98.50%; " \
           "parameter memory 0.41 MiB." in best
    assert "(trial 0, the first of the front), to train it again from the project " \
           "directory:\n\n```sh\npython train.py --lr '0.01 0.02'\n```" in best

    table = trials_table(md)
    # Ties on the first objective by trial number; the failed trial last.
    assert [number(r["trial"]) for r in table] == [0, 3, 1, 6, 2, 4, 5]
    assert sorted(number(r["trial"]) for r in table if r["pareto"] == "★") == front
    assert all(r["pareto"] == "" for r in table if number(r["trial"]) not in front)
    assert [r["dollars"] for r in table] == ["", "", "", "", "", "0.012", ""]
    assert table[2]["parameter memory (MiB)"] == "0.41" and table[2]["parameters"] == "107,479"
    assert table[6]["note"] == "diverged at step 40 (loss nan)"

    for name in ("optimization_history.png", "pareto_front.png"):
        check_png(tmp_path / name)
        assert f"]({name})" in md


def test_extra_objective_gets_a_column_and_maximized_x(tmp_path):
    objectives = {"images_per_second": "maximize", "test_accuracy": "maximize"}
    rows = [row(n, "complete", summary(a, 0.05, 20.0, 1000, 0.1), [ips, a])
            for n, (ips, a) in enumerate([(900.0, 0.98), (1200.0, 0.97), (800.0, 0.99)])]
    md = report.write(tmp_path, "fast", objectives, rows, [0, 1, 2], "spotring sweep")
    table = trials_table(md.read_text())
    assert [r["img/s"] for r in table] == ["1200", "900", "800"]
    assert "Its command" not in md.read_text()  # none given
    check_png(tmp_path / "pareto_front.png")


def test_nothing_complete_and_no_matplotlib(tmp_path, monkeypatch):
    import spotring.support

    monkeypatch.delattr(spotring.support, "plotting", raising=False)
    # As if matplotlib were absent: importing spotring.support.plotting raises ImportError.
    monkeypatch.setitem(sys.modules, "spotring.support.plotting", None)
    rows = [row(0, "running"), row(1, "failed", note="exit 1 after 2 retries")]
    md = report.write(tmp_path, "s", {"test_accuracy": "maximize"}, rows, [],
                      "spotring sweep").read_text()
    assert "No trial has completed yet." in md
    assert [number(r["trial"]) for r in trials_table(md)] == [0, 1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep_report.md"]

    rows.append(row(2, "complete", summary(0.9, 0.1, 1.0, 10, 0.1), [0.9]))
    md = report.write(tmp_path, "s", {"test_accuracy": "maximize"}, rows, [2],
                      "spotring sweep").read_text()
    assert "No plots: they need matplotlib" in md
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep_report.md"]


def test_a_scripts_trials_show_what_they_reported_and_the_best_command(tmp_path):
    """A sweep of a user's command: the summary columns are those its summary.json has,
    an objective of its own gets a column, and the best trial's command line is how to
    train it again."""
    objectives = {"val_loss": "minimize"}
    rows = [row(n, "complete", {"test_loss": loss, "train_seconds": 1.25, "val_loss": val},
                [val], restarts=n, lr=lr)
            for n, (lr, loss, val) in enumerate([("0.05", 0.5, 0.25), ("0.1", 0.4, 0.125)])]
    rows.append(row(2, "failed", note="summary.json has no number for val_loss", lr="0.2"))
    md = report.write(tmp_path, "script", objectives, rows, [1], "spotring sweep",
                      ["python", "train.py", "--lr", "0.1", "--note", "a b"]).read_text()
    table = trials_table(md)
    assert list(table[0]) == ["trial", "state", "lr", "test loss", "training time (s)",
                              "val loss", "restarts", "note"]
    assert [(number(r["trial"]), r["val loss"], r["test loss"], r["restarts"]) for r in table] \
        == [(1, "0.125", "0.4000", "1"), (0, "0.25", "0.5000", "0"), (2, "", "", "0")]
    best = md.split("## Best trial")[1].split("## Trials")[0]
    assert "Trial 1 ([trials/001](trials/001)): `lr=0.1`; val loss 0.125." in best
    assert "```sh\npython train.py --lr 0.1 --note 'a b'\n```" in best
    assert "spotring train" not in md
