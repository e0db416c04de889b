"""Time to accuracy (benchmarks/time_to_accuracy.py) and its yardstick, the reference loop
(benchmarks/reference_loop.py): the seconds to the target are those of the first
evaluation at or above it, the worst and the ratio to the reference come out as computed
by hand, the reference loop's clock leaves evaluation out, and one real run, kept tiny,
from `spotring bench` to `spotring report`."""

from __future__ import annotations

import json
import math
import re
import time

import pytest
import torch

from harness.reports import REFERENCE as REFERENCE_RUN
from harness.reports import check_plots, check_report, render, sections
from spotring.benchmarks import reference_loop, suite
from spotring.benchmarks.time_to_accuracy import (
    REFERENCE,
    Configuration,
    eval_interval,
    seconds_to,
    summarize,
    trainer_steps,
)
from tests.conftest import compose_config

TARGET = 0.99
# (configuration, seed): the curve [step, training seconds, accuracy] of a hand-made run.
CURVES = {
    (REFERENCE, 0): [[10, 1.0, 0.95], [20, 2.0, 0.99], [30, 3.0, 0.985], [40, 4.0, 0.992]],
    (REFERENCE, 1): [[10, 1.5, 0.97], [20, 3.0, 0.991], [30, 4.5, 0.993]],
    (Configuration("trainer", 1), 0): [[50, 5.0, 0.989], [100, 10.0, 0.9899]],
    (Configuration("trainer", 1), 1): [[50, 4.0, 0.991], [100, 8.0, 0.995]],
    (Configuration("trainer", 2), 0): [[25, 0.7, 0.98], [50, 1.4, 0.9902]],
    (Configuration("trainer", 2), 1): [[25, 0.9, 0.97], [50, 1.8, 0.995]],
    (Configuration("trainer", 4), 0): [[12, 0.5, 0.9], [24, 1.0, 0.95]],
    (Configuration("trainer", 4), 1): [[12, 0.6, 0.91], [24, 1.2, 0.96]],
}


def hand_made() -> dict:
    """A time_to_accuracy section of results.json from the curves above."""
    runs = [{"label": c.label, "program": c.program, "workers": c.workers, "seed": seed,
             "eval_every": curve[0][0], "steps": curve[-1][0], "peak_lr": 0.1, "curve": curve,
             "train_seconds": curve[-1][1], "test_accuracy": curve[-1][2],
             "command": f"run {c.slug} {seed}", "dir": f"runs/{c.slug}-{seed}"}
            for (c, seed), curve in CURVES.items()]
    plan = {c: {"global_batch": 64 * c.workers, "steps": 100} for c, _ in CURVES}
    return {"target": TARGET, "seeds": [0, 1], "evaluations": 2, "max_steps": None,
            "rows": summarize(plan, runs, TARGET), "runs": runs}


def test_seconds_to_target_are_the_first_evaluation_at_or_above_it():
    assert seconds_to(CURVES[REFERENCE, 0], 0.99) == 2.0  # equal counts; not the later 4.0
    assert seconds_to(CURVES[REFERENCE, 0], 0.991) == 4.0  # 0.985 in between does not
    assert seconds_to(CURVES[Configuration("trainer", 1), 0], 0.99) is None
    assert seconds_to([], 0.5) is None


def test_the_rows_mean_worst_reached_and_ratio():
    rows = {r["label"]: r for r in hand_made()["rows"]}
    assert list(rows) == ["reference loop", "trainer x 1", "trainer x 2", "trainer x 4"]
    ref, one, two, four = rows.values()
    assert (ref["seconds"], ref["mean"], ref["worst"], ref["ratio"]) == ([2.0, 3.0], 2.5, 3.0,
                                                                          1.0)
    assert ref["final_accuracy"] == pytest.approx({"mean": 0.9925, "worst": 0.992})
    # One seed never reached the target: the mean is the other's, the worst is not reached.
    assert (one["seconds"], one["reached"], one["mean"], one["worst"]) == ([None, 4.0], 1, 4.0,
                                                                            None)
    assert one["ratio"] == pytest.approx(1.6)
    assert one["final_accuracy"] == pytest.approx({"mean": 0.99245, "worst": 0.9899})
    assert two["seconds"] == [1.4, 1.8] and two["worst"] == 1.8
    assert (two["mean"], two["ratio"]) == pytest.approx((1.6, 0.64))
    assert (four["reached"], four["mean"], four["worst"], four["ratio"]) == (0, None, None, None)
    # The whole run's training seconds (its last evaluation's, in these curves).
    assert ref["train_seconds"] == pytest.approx({"mean": 4.25, "worst": 4.5})
    assert (two["train_seconds"]["mean"], two["run_ratio"]) == pytest.approx((1.6, 1.6 / 4.25))


def test_the_report_shows_the_table_and_the_plot(tmp_path):
    results = json.loads((REFERENCE_RUN / "results.json").read_text())
    for key in ("throughput", "allreduce", "batch_sizes", "prediction"):
        del results[key]
    results["time_to_accuracy"] = hand_made()
    (tmp_path / "results.json").write_text(json.dumps(results))
    render(tmp_path)
    assert check_report(tmp_path) >= 4 * 5
    check_plots(tmp_path, results)
    (rows,) = sections((tmp_path / "report.md").read_text())["Time to accuracy"]
    shown = {row["configuration"]: [row["seconds to 99.00%, by seed"], row["mean"],
                                    row["worst"], row["final accuracy (mean)"],
                                    row["final accuracy (worst)"], row["mean / reference"]]
             for row in rows}
    assert shown == {
        "reference loop": ["2.0, 3.0", "2.5", "3.0", "99.25%", "99.20%", "1.00"],
        "trainer x 1": ["not reached, 4.0", "4.0 (1 of 2 seeds)", "not reached", "99.25%",
                        "98.99%", "1.60"],
        "trainer x 2": ["1.4, 1.8", "1.6", "1.8", "99.26%", "99.02%", "0.64"],
        "trainer x 4": ["not reached, not reached", "not reached", "not reached", "95.50%",
                        "95.00%", "-"],
    }


def test_the_evaluation_interval_gives_10_to_20_evaluations_of_the_default_run():
    cfg = compose_config()
    for workers in (1, 2):
        plan = trainer_steps(workers, None)
        batch = cfg.train.batch_size * workers * cfg.train.accumulation
        assert plan["global_batch"] == batch
        epochs = cfg.train.epochs * (60_000 // batch)  # in steps; train.epochs may be a fraction
        assert abs(plan["steps"] - min(cfg.train.max_steps or math.inf, epochs)) <= 1
        assert 10 <= math.ceil(plan["steps"] / eval_interval(plan["steps"], 15)) <= 20
    assert trainer_steps(2, 7)["steps"] == 7
    assert eval_interval(3, 15) == 1


# ---------------------------------------------------------------------- the reference loop


def tiny_data() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"train": (torch.randn(640, 1, 28, 28, generator=g), torch.randint(10, (640,))),
            "test": (torch.randn(200, 1, 28, 28, generator=g), torch.randint(10, (200,)))}


def test_the_reference_loop_s_clock_leaves_evaluation_out(monkeypatch):
    """Each evaluation sleeps half a second: four of them are in the wall time and in
    evaluation_seconds, not in train_seconds."""
    evaluate = reference_loop.evaluate

    def slow(model, test):
        time.sleep(0.5)
        return evaluate(model, test)

    monkeypatch.setattr(reference_loop, "evaluate", slow)
    start = time.perf_counter()
    out = reference_loop.train(seed=0, eval_every=1, threads=2, max_steps=4, data=tiny_data())
    wall = time.perf_counter() - start
    assert [step for step, _, _ in out["curve"]] == [1, 2, 3, 4]
    assert out["evaluation_seconds"] >= 2.0
    assert out["train_seconds"] < wall - 2.0
    clock = [seconds for _, seconds, _ in out["curve"]]
    assert clock == sorted(clock) and clock[-1] == out["train_seconds"]


def test_the_reference_loop_prints_one_json_line(capsys, monkeypatch):
    # The line's contract, not MNIST's: tiny_data stands in (the real run below reads it).
    monkeypatch.setattr(reference_loop, "mnist", tiny_data)
    assert reference_loop.main(["--seed", "1", "--eval-every", "2", "--max-steps", "3"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    result = json.loads(line)
    assert result.keys() >= {"train_seconds", "test_accuracy", "curve", "seed"}
    assert (result["seed"], result["steps"], result["threads"], result["batch"]) == (1, 3, 2,
                                                                                   128)
    assert [step for step, _, _ in result["curve"]] == [2, 3]
    assert result["curve"][-1][1:] == [result["train_seconds"], result["test_accuracy"]]
    assert result["train_seconds"] > 0 and 0 <= result["test_accuracy"] <= 1


def test_bad_reference_loop_input_exits_2(capsys):
    with pytest.raises(SystemExit) as exited:
        reference_loop.main(["--threads", "0"])
    assert exited.value.code == 2 and "--threads" in capsys.readouterr().err


# --------------------------------------------------------------------------- a real run


@pytest.mark.slow
def test_a_tiny_time_to_accuracy_run_from_measurement_to_report(tmp_path, capsys):
    """One seed of the reference loop and of the trainer under torchrun with 2 workers,
    20 steps each, evaluated twice, to 50% (about a minute)."""
    run = tmp_path / "run"
    assert suite.main(["--only", "time_to_accuracy", "--quick", "--seeds", "1", "--max-steps",
                       "20", "--evaluations", "2", "--target", "0.5", "--workers", "2",
                       "--name", str(run)]) == 0
    said = capsys.readouterr().out
    assert re.search(r"\[2/2\] time to accuracy trainer x 2, seed 0: 50\.00% after [\d.]+ s",
                     said), said
    render(run)
    results = json.loads((run / "results.json").read_text())
    assert check_report(run) >= 2 * 5
    check_plots(run, results)
    t = results["time_to_accuracy"]
    assert [r["label"] for r in t["rows"]] == ["reference loop", "trainer x 2"]
    for r in t["runs"]:
        assert [step for step, _, _ in r["curve"]] == [10, 20]
        assert r["curve"][-1][2] == r["test_accuracy"]
    assert t["rows"][1]["global_batch"] == trainer_steps(2, None)["global_batch"]
