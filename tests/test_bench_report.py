"""The benchmark report: every number in report.md is the one in results.json, the plots
are real PNGs, bus bandwidth follows nccl-tests' definition, the intervals are 95%
confidence intervals; bad input exits 2 before anything runs; and one real benchmark
run, kept lean, from `spotring bench` to `spotring report`. The commands run in this
process (their main), but for one real `spotring report` that exits 2."""

from __future__ import annotations

import json
import re
import shutil
import statistics
import subprocess
import sys

import pytest

from harness.reports import REFERENCE, check_plots, check_report, render
from spotring.benchmarks import predict, report, suite
from spotring.benchmarks.stats import mean_ci
from tests.conftest import REPO


def check_bus_bandwidth(results: dict) -> None:
    n = results["allreduce"]["ranks"]
    for rows in results["allreduce"]["transports"].values():
        for row in rows:
            assert row["algbw_gbps"] == pytest.approx(row["bytes"] / row["seconds"] / 1e9)
            assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * 2 * (n - 1) / n)


# ------------------------------------------------------------------------------ tests


def test_the_reference_report_shows_the_numbers_of_its_results_json():
    results = json.loads((REFERENCE / "results.json").read_text())
    assert check_report(REFERENCE) > 100
    check_plots(REFERENCE, results)
    check_bus_bandwidth(results)
    text = (REFERENCE / "report.md").read_text()
    assert f"| commit | {results['machine']['commit']} |" in text


def test_the_report_is_rendered_from_results_json_alone(tmp_path):
    shutil.copy(REFERENCE / "results.json", tmp_path / "results.json")
    render(tmp_path)
    assert check_report(tmp_path) > 100
    check_plots(tmp_path, json.loads((tmp_path / "results.json").read_text()))


def test_a_run_of_some_sections_renders_those_alone(tmp_path):
    results = json.loads((REFERENCE / "results.json").read_text())
    for key in ("throughput", "batch_sizes", "prediction"):
        del results[key]
    (tmp_path / "results.json").write_text(json.dumps(results))
    render(tmp_path)
    assert check_report(tmp_path) > 10
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["allreduce.png"]


def test_the_confidence_interval_is_student_s_95_percent_of_the_mean():
    values = [1.0, 2.0, 3.0, 4.0, 5.0]  # t(0.975, 4 dof) = 2.7764
    assert mean_ci(values) == pytest.approx(
        {"mean": 3.0, "ci95": 2.7764 * statistics.stdev(values) / 5**0.5, "n": 5}, rel=1e-3)
    many = [float(x % 7) for x in range(400)]  # t(0.975, 399 dof) = 1.9659
    assert mean_ci(many)["ci95"] == pytest.approx(1.9659 * statistics.stdev(many) / 20, rel=1e-4)


def test_report_of_an_unknown_run_exits_2_naming_it():
    # The command family's one real process: `spotring report` as a user starts it.
    out = subprocess.run([sys.executable, "-m", "spotring.benchmarks.report", "no-such-run"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "no-such-run" in out.stderr and "reference" in out.stderr


@pytest.mark.parametrize("args, named", [
    (["--model", "resnet9000"], "resnet9000"),
    (["--workers", "0"], "0"),
    (["--engines", "nccl2"], "nccl2"),
    (["--only", "batch_sizes", "--table-models", "vgg"], "vgg"),
    (["--only", "time_to_accuracy", "--target", "1.5"], "1.5"),
    (["--only", "time_to_accuracy", "--target", "0"], "0"),
    (["--only", "time_to_accuracy", "--seeds", "0"], "0"),
])
def test_bad_bench_input_exits_2_before_anything_runs(tmp_path, capsys, args, named):
    with pytest.raises(SystemExit) as exited:
        suite.main(["--quick", "--name", str(tmp_path / "run"), *args])
    assert exited.value.code == 2 and named in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_every_command_has_help_under_its_spotring_name(capsys):
    for main, prog in ((suite.main, "spotring bench"), (report.main, "spotring report"),
                       (predict.main, "spotring predict")):
        with pytest.raises(SystemExit) as exited:
            main(["--help"])
        assert exited.value.code == 0 and capsys.readouterr().out.startswith(f"usage: {prog}")


@pytest.mark.slow
def test_a_quick_benchmark_run_from_measurement_to_report(tmp_path, capsys):
    """`spotring bench --quick`, narrowed to the trainer and the plain loop over Gloo, the
    Gloo and MPI allreduce, and one model of the batch-size table (about two minutes; time
    to accuracy has its own, tests/test_time_to_accuracy.py)."""
    run = tmp_path / "run"
    assert suite.main(["--quick", "--name", str(run), "--only", "throughput", "allreduce",
                       "batch_sizes", "--engines", "ddp", "plain", "--transports", "gloo",
                       "mpi", "--table-models", "lenet", "--table-batch-sizes", "32"]) == 0
    said = capsys.readouterr().out
    assert re.search(r"\[\d+/4\] throughput ddp x 2, batch 64: \d+ ± \d+ img/s", said), said
    assert re.search(r"\[1/1\] batch sizes lenet, batch 32: \d+ ± \d+ img/s", said), said
    render(run)
    results = json.loads((run / "results.json").read_text())
    assert check_report(run) > 40
    check_plots(run, results)
    check_bus_bandwidth(results)
    assert results["command"].startswith("spotring bench --quick")
    (row,) = results["batch_sizes"]["rows"]
    assert (row["model"], row["batch"], len(row["intervals"])) == ("lenet", 32, 5)
    assert results["throughput"]["gradient_bytes"] == 4 * (32 * 25 + 32 + 64 * 32 * 25 + 64
                                                           + 1024 * 128 + 128 + 1280 + 10)
    rows = {(r["engine"], r["workers"]): r for r in results["throughput"]["rows"]}
    assert rows.keys() == {("ddp", 1), ("ddp", 2), ("plain", 1), ("plain", 2)}
    for r in results["throughput"]["runs"]:
        assert len(r["per_worker"]) == 5  # the measured intervals, warm-up left out
    two = rows[("ddp", 2)]
    assert two["total"]["mean"] == pytest.approx(2 * two["per_worker"]["mean"])
    assert two["efficiency"]["mean"] == pytest.approx(
        two["per_worker"]["mean"] / rows[("ddp", 1)]["per_worker"]["mean"])
    assert set(results["allreduce"]["transports"]) == {"gloo", "mpi"}
    assert {r["engine"] for r in results["prediction"]["machine"]} == {"ddp", "plain"}
