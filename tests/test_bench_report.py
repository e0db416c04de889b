"""The benchmark report: every number in report.md is the one in results.json, the plots
are real PNGs, bus bandwidth follows nccl-tests' definition; and one real benchmark run,
kept lean, from `benchmarks.suite` to `benchmarks.report`."""

from __future__ import annotations

import copy
import json
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.allreduce import TRAINER_PATHS
from benchmarks.this_machine import validate_machine
from tests.conftest import REPO

REFERENCE = REPO / "benchmarks" / "results" / "reference"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PLOTS = ["throughput.png", "efficiency.png", "allreduce.png", "batch_sizes.png",
         "prediction.png"]
NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?")


# ----------------------------------------------------------------- reading report.md


def sections(markdown: str) -> dict[str, list[list[dict[str, str]]]]:
    """Every '## ' section's tables, each a list of {header: cell} rows."""
    out: dict[str, list[list[dict[str, str]]]] = {}
    title, lines = "", markdown.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("## "):
            title = line[3:]
            out[title] = []
        elif line.startswith("| ") and (i == 0 or not lines[i - 1].startswith("|")):
            header = [c.strip() for c in line.strip("|").split("|")]
            rows = []
            for body in lines[i + 2:]:
                if not body.startswith("|"):
                    break
                rows.append(dict(zip(header, (c.strip() for c in body.strip("|").split("|")),
                                     strict=True)))
            out[title].append(rows)
    return out


def section(parsed: dict, prefix: str) -> list[list[dict[str, str]]]:
    return next(tables for title, tables in parsed.items() if title.startswith(prefix))


def shows(cell: str, value: float, index: int = 0) -> bool:
    """Whether the index-th number in ``cell`` is ``value`` as printed (to its digits)."""
    text = NUMBER.findall(cell)[index].replace(",", "")
    mantissa, _, exponent = text.partition("e")
    digits = len(mantissa.partition(".")[2])
    tolerance = 0.5 * 10 ** (int(exponent or 0) - digits) * (1 + 1e-9)
    return abs(float(text) - value) <= tolerance


def size_of(label: str) -> int:
    number, unit = label.split()[:2]
    return int(number.replace(",", "")) * {"B": 1, "KiB": 2**10, "MiB": 2**20}[unit]


def check_report(folder: Path) -> int:
    """Compare every number of report.md's tables with results.json; how many matched."""
    results = json.loads((folder / "results.json").read_text())
    text = (folder / "report.md").read_text()
    parsed = sections(text)
    checked = 0

    def expect(cell: str, value: float, index: int = 0) -> None:
        nonlocal checked
        assert shows(cell, value, index), (cell, value)
        checked += 1

    (rows,) = section(parsed, "Throughput")
    assert len(rows) == len(results["throughput"]["rows"])
    for row in rows:
        j = next(x for x in results["throughput"]["rows"]
                 if x["label"] == row["configuration"] and str(x["batch"]) == row["batch / worker"])
        expect(row["img/s per worker"], j["per_worker"]["mean"])
        expect(row["img/s per worker"], j["per_worker"]["ci95"], 1)
        expect(row["img/s total"], j["total"]["mean"])
        expect(row["img/s total (median)"], j["total_median"])
        expect(row["step ms"], j["step_ms"])
        if "efficiency" in j:
            expect(row["efficiency"], 100 * j["efficiency"])
            expect(row["speedup"], j["speedup"])
        if "communication_ms" in j:
            expect(row["compute ms"], j["compute_ms"])
            expect(row["communication ms"], j["communication_ms"])

    (rows,) = section(parsed, "Engines")
    for row in rows:
        j = next(x for x in results["mnist_engines"]["rows"] if x["engine"] == row["engine"])
        expect(row["img/s (median)"], j["total_median"])
        expect(row["allreduce ms"], j["allreduce_ms"])
        expect(row["busbw GB/s"], j["busbw_gbps"])

    busbw, algbw, *cold = section(parsed, "Allreduce")
    for table, key in ((busbw, "busbw_gbps"), (algbw, "algbw_gbps")):
        for row in table:
            n = size_of(row["size"])
            for transport, rows_json in results["allreduce"]["transports"].items():
                expect(row[transport], next(x[key] for x in rows_json if x["bytes"] == n))
    gradient = results["throughput"]["gradient_bytes"]
    for path, over in TRAINER_PATHS.items():
        row = next((x for x in results["allreduce"]["transports"].get(path, [])
                    if x["bytes"] == gradient and "of_transport" in x), None)
        if row:
            assert f"{path} {row['of_transport']:.2f}x of {over}" in text
            checked += 1
    assert len(cold) == ("cold" in results["allreduce"])
    for rows in cold:
        assert [row["transport"] for row in rows] == list(results["allreduce"]["cold"])
        for row in rows:
            j = results["allreduce"]["cold"][row["transport"]]
            hot = next(x["seconds"] for x in results["allreduce"]["transports"][row["transport"]]
                       if x["bytes"] == j["bytes"])
            expect(row["cold ms"], 1e3 * j["seconds"])
            expect(row["back to back ms"], 1e3 * hot)
            expect(row["t_w ms"], 1e3 * max(0.0, j["seconds"] - hot))

    (rows,) = section(parsed, "Batch sizes")
    for row in rows:
        for j in (x for x in results["batch_sizes"]["rows"] if x["model"] == row["model"]):
            expect(row[str(j["batch"])], j["images_per_second"]["mean"])
            expect(row[str(j["batch"])], j["images_per_second"]["ci95"], 1)

    published, machine, *split = section(parsed, "Predictor")
    assert len(split) == ("split" in results["prediction"])
    for rows in split:
        rows_json = results["prediction"]["split"]
        assert len(rows) == len(rows_json)
        for row, j in zip(rows, rows_json, strict=True):
            assert (row["engine"], int(row["batch"])) == (j["engine"], j["batch"])
            expect(row["measured img/s"], j["published"])
            expect(row["predicted"], j["predicted"])
            expect(row["error"], 100 * j["error"])
            expect(row["added ms"], j["added_ms"])
            expect(row["measured added ms"], j["measured_added_ms"])
    if "step_split" in results:
        (rows,) = section(parsed, "Step split")
        assert len(rows) == len(results["step_split"]["rows"])
        for row, j in zip(rows, results["step_split"]["rows"], strict=True):
            for header, key in (("free ms", "free_ms"), ("aligned ms", "aligned_ms"),
                                ("sync ms", "sync_ms"), ("wait + vote ms", "wait_and_vote_ms"),
                                ("gradient allreduce ms", "gradient_allreduce_ms"),
                                ("sync - free ms", "communication_ms"),
                                ("free sd ms", "free_sd_ms")):
                expect(row[header], j[key])
    for rows, key, rows_json in ((published, "published", results["prediction"]["published"]),
                                 (machine, "measured img/s", results["prediction"]["machine"])):
        assert len(rows) == len(rows_json)
        for row, j in zip(rows, rows_json, strict=True):
            expect(row[key], j["published"])
            expect(row["predicted"], j["predicted"])
            expect(row["error"], 100 * j["error"])
    for row, j in zip(machine, results["prediction"]["machine"], strict=True):
        assert (row["engine"], int(row["batch"])) == (j["engine"], j["batch"])
        expect(row["core kept"], 100 * j["compute_share"])
        for index, key in enumerate(("median", "low", "high")):
            expect(row["per repeat"], 100 * j["error_per_repeat"][key], index)
        expect(row["wait ms"], j["wait_ms"])
        expect(row["comm ms"], j["communication_ms"])
    return checked


def check_plots(folder: Path) -> None:
    for name in PLOTS:
        data = (folder / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000, name


def check_bus_bandwidth(results: dict) -> None:
    n = results["allreduce"]["ranks"]
    for rows in results["allreduce"]["transports"].values():
        for row in rows:
            assert row["algbw_gbps"] == pytest.approx(row["bytes"] / row["seconds"] / 1e9)
            assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * 2 * (n - 1) / n)


# ------------------------------------------------------------------------------ tests


def test_the_reference_report_shows_the_numbers_of_its_results_json():
    assert check_report(REFERENCE) > 100
    check_plots(REFERENCE)
    check_bus_bandwidth(json.loads((REFERENCE / "results.json").read_text()))


def test_the_report_is_rendered_from_results_json_alone(tmp_path):
    shutil.copy(REFERENCE / "results.json", tmp_path / "results.json")
    subprocess.run([sys.executable, "-m", "benchmarks.report", str(tmp_path)], cwd=REPO,
                   check=True, capture_output=True)
    assert check_report(tmp_path) > 100
    check_plots(tmp_path)


def test_derive_recomputes_the_predictions_and_says_what_made_them(tmp_path):
    """After a change to the predictor, `suite --derive` redoes what is computed from a
    run's measurements, leaves the measurements as they were, and the report names the
    command and commit that derived them beside the run's own."""
    results = json.loads((REFERENCE / "results.json").read_text())
    stale = copy.deepcopy(results)
    stale.pop("derived", None)
    for row in stale["prediction"]["machine"]:
        row["predicted"] = row["error"] = -1.0
    (tmp_path / "results.json").write_text(json.dumps(stale))
    for module in ("benchmarks.suite", "--derive", str(tmp_path)), ("benchmarks.report",
                                                                   str(tmp_path)):
        subprocess.run([sys.executable, "-m", *module], cwd=REPO, check=True,
                       capture_output=True)
    derived = json.loads((tmp_path / "results.json").read_text())
    measured = ("throughput", "allreduce", "step_split", "batch_sizes", "machine", "command")
    assert {k: derived[k] for k in measured} == {k: results[k] for k in measured}
    assert derived["prediction"]["machine"] == validate_machine(results)
    assert derived["derived"]["command"] == f"python -m benchmarks.suite --derive {tmp_path}"
    assert re.fullmatch(r"[0-9a-f]{7,}( \(with uncommitted changes\))?",
                        derived["derived"]["commit"])
    header = (tmp_path / "report.md").read_text().split("## Machine")[0]
    assert (f"recomputed from these measurements by `{derived['derived']['command']}` at "
            f"commit {derived['derived']['commit']}") in header
    assert check_report(tmp_path) > 100


@pytest.mark.slow
def test_a_quick_benchmark_run_from_measurement_to_report(tmp_path):
    """The suite as `make bench QUICK=1` runs it, narrowed to one engine, one transport
    and one model so that it takes about a minute."""
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.suite", "--quick", "--name",
                           str(run), "--engines", "ddp", "--model", "convnet", "--transports",
                           "gloo", "--table-models", "lenet", "--table-batch-sizes", "32"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    subprocess.run([sys.executable, "-m", "benchmarks.report", str(run)], cwd=REPO,
                   check=True, capture_output=True)
    results = json.loads((run / "results.json").read_text())
    assert check_report(run) > 20
    check_plots(run)
    check_bus_bandwidth(results)
    for r in results["throughput"]["runs"]:
        assert len(r["per_worker"]) >= 5 * (r["workers"] if r["independent"] else 1)
    two = next(r for r in results["throughput"]["rows"]
               if r["workers"] == 2 and not r["independent"])
    assert two["total_median"] == pytest.approx(2 * two["per_worker_median"]["median"])
    assert results["machine"]["cores"] and results["command"].startswith("python -m")
    # Gloo's threads sleep while the program computes: nothing taken from the compute,
    # but each allreduce sent while it computes takes some (well under a 25 ms burst).
    assert 0 <= results["allreduce"]["background_cpu_cores"]["gloo"] < 0.05
    assert 0 <= results["allreduce"]["response_cpu_seconds"]["gloo"] < 0.025
    # ...and the gradient's allreduce after computing is timed, for the predictor's t_w.
    cold = results["allreduce"]["cold"]["gloo"]
    assert cold["bytes"] == results["throughput"]["gradient_bytes"] and cold["seconds"] > 0
    # The step split: one Gloo job; its figures are consistent, the predictor compares.
    (split,) = results["step_split"]["rows"]
    assert split["engine"] == "ddp" and split["batch"] == 64
    assert all(len(v) == 3 for v in split["per_block_ms"].values())
    assert split["free_ms"] > split["free_sd_ms"] > 0
    for key in ("gradient_bytes", "gradient_tensors"):
        assert results["step_split"][key] == results["throughput"][key]
    assert results["throughput"]["gradient_tensors"] == 8  # the convnet: 4 weights, 4 biases
    (predicted,) = results["prediction"]["split"]
    assert predicted["published"] == pytest.approx(
        2 * 64 * 1000 / (split["free_ms"] + split["communication_ms"]))


@pytest.mark.slow
def test_the_trainers_mpi_path_is_timed_beside_mpi_in_its_own_process(tmp_path):
    """On this VM raw MPI's 738 KB allreduce takes 0.095 or 0.40 ms depending on when it
    is launched, so the trainer's path (its comm hook's watched sum) is compared with
    mpi4py's Allreduce timed in turn in the same process, on the same buffer."""
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.allreduce", "--transports", "mpi",
                           "trainer-mpi", "--repeats", "2", "--budget", "0.05", "--size-factor",
                           "64", "--name", str(run)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    transports = json.loads((run / "results.json").read_text())["allreduce"]["transports"]
    mpi = {row["bytes"]: row for row in transports["mpi"]}
    assert all("of_transport" not in row for row in mpi.values())
    paths = transports["trainer-mpi"]
    assert [row["bytes"] for row in paths] == sorted(mpi) == [2**10, 2**16, 2**22]
    for row in paths:
        assert len(row["of_transport_per_repeat"]) == 2
        assert row["of_transport"] == statistics.median(row["of_transport_per_repeat"])
        assert row["of_best"] == pytest.approx(row["of_transport"] * mpi[row["bytes"]]["of_best"])
        assert all(ratio > 0 for ratio in row["of_transport_per_repeat"])
    # How close the ratio comes to 1 is the 0.8x target, which the report judges
    # (met or missed) from a full run: a bound here failed CI on a loaded machine.


@pytest.mark.slow
def test_the_step_split_runs_the_trainers_engines_under_their_launchers(tmp_path):
    """engine=ddp engine.backend=mpi under a real mpirun (DDP's buckets summed by
    trainer.engines.mpi's hook) and engine=horovod under a real horovodrun, whose
    prefixed output is read back; every mode measured every cycle."""
    run = tmp_path / "split"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.step_split", "--engines",
                           "ddp-mpi", "horovod-gloo", "--batch-sizes", "16", "--cycles", "2",
                           "--block", "3", "--name", str(run)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    split = json.loads((run / "results.json").read_text())["step_split"]
    assert [(row["engine"], row["batch"]) for row in split["rows"]] == [
        ("ddp-mpi", 16), ("horovod-gloo", 16)]
    launchers = {e: c.split()[:2] for e, c in split["commands"].items()}
    assert launchers == {"ddp-mpi": [".venv/bin/mpirun", "-np"],
                         "horovod-gloo": [".venv/bin/horovodrun", "--gloo"]}
    for row in split["rows"]:
        blocks = row["per_block_ms"]
        assert {m: len(v) for m, v in blocks.items()} == {"sync": 2, "aligned": 2, "free": 2}
        assert row["communication_ms"] == pytest.approx(statistics.median(
            [a - b for a, b in zip(blocks["sync"], blocks["free"], strict=True)]))
        assert row["free_ms"] > 0 and row["free_sd_ms"] >= 0
    # The engines' own threads' CPU per mode (the one-job share of a spinning thread):
    # Horovod's cycles even through blocks that send nothing; DDP over MPI has no thread.
    took = {row["engine"]: row["other_threads_cores"] for row in split["rows"]}
    assert took["horovod-gloo"]["free"] > 0.02
    assert all(0 <= v < 0.05 for v in took["ddp-mpi"].values())
