"""Reading a benchmark report back: report.md's tables as rows (``sections``), every
number of them held to results.json (``check_report``), the plots real PNGs
(``check_plots``), and `spotring report` run in this process (``render``). Used by the
tests of `spotring report` (tests/test_bench_report.py), of time to accuracy
(tests/test_time_to_accuracy.py) and of the sweep's report (harness/sweeps.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from harness import REPO
from spotring.benchmarks import report

REFERENCE = REPO / "benchmarks" / "results" / "reference"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PLOTS = {"throughput": ["throughput.png", "efficiency.png"], "allreduce": ["allreduce.png"],
         "batch_sizes": ["batch_sizes.png"], "prediction": ["prediction.png"],
         "time_to_accuracy": ["time_to_accuracy.png"]}
NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?")


def render(folder: Path) -> None:
    """`spotring report FOLDER`."""
    assert report.main([str(folder)]) == 0



def sections(markdown: str) -> dict[str, list[list[dict[str, str]]]]:
    """Every '## ' section's tables, each a list of {header: cell} rows."""
    out: dict[str, list[list[dict[str, str]]]] = {}
    title, lines = "", markdown.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("## "):
            title = line[3:]
            out[title] = []
        elif line.startswith("| ") and not lines[i - 1].startswith("|"):
            header = [c.strip() for c in line.strip("|").split("|")]
            rows = []
            for body in lines[i + 2:]:
                if not body.startswith("|"):
                    break
                rows.append(dict(zip(header, (c.strip() for c in body.strip("|").split("|")),
                                     strict=True)))
            out[title].append(rows)
    return out


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
    parsed = sections((folder / "report.md").read_text())
    checked = 0

    def expect(cell: str, value: float, index: int = 0) -> None:
        nonlocal checked
        assert shows(cell, value, index), (cell, value)
        checked += 1

    def spread(cell: str, stats: dict, scale: float = 1) -> None:
        expect(cell, scale * stats["mean"])
        expect(cell, scale * stats["ci95"], 1)

    assert {t for t in parsed if t not in ("Machine", "Raw data")} == {
        {"throughput": "Throughput", "allreduce": "Allreduce", "batch_sizes": "Batch sizes",
         "prediction": "Predictor", "time_to_accuracy": "Time to accuracy"}[key]
        for key in PLOTS if key in results}
    if "throughput" in results:
        (rows,) = parsed["Throughput"]
        assert len(rows) == len(results["throughput"]["rows"])
        for row in rows:
            j = next(x for x in results["throughput"]["rows"]
                     if (x["engine"], str(x["workers"]), str(x["batch"]))
                     == (row["engine"], row["workers"], row["batch / worker"]))
            spread(row["img/s per worker"], j["per_worker"])
            spread(row["img/s total"], j["total"])
            expect(row["step ms"], j["step_ms"])
            if "efficiency" in j:
                spread(row["speedup"], j["speedup"])
                spread(row["efficiency"], j["efficiency"], 100)
    if "allreduce" in results:
        busbw, algbw = parsed["Allreduce"]
        for table, key in ((busbw, "busbw_gbps"), (algbw, "algbw_gbps")):
            assert len(table) == len({r["bytes"] for rows in
                                      results["allreduce"]["transports"].values() for r in rows})
            for row in table:
                for transport, rows_json in results["allreduce"]["transports"].items():
                    expect(row[transport], next(x[key] for x in rows_json
                                                if x["bytes"] == size_of(row["size"])))
    if "batch_sizes" in results:
        (rows,) = parsed["Batch sizes"]
        for row in rows:
            for j in (x for x in results["batch_sizes"]["rows"] if x["model"] == row["model"]):
                spread(row[str(j["batch"])], j["images_per_second"])
    if "prediction" in results:
        published, *machine = parsed["Predictor"]
        for row, j in zip(published, results["prediction"]["published"], strict=True):
            assert (row["case"], int(row["nodes"])) == (j["case"], j["nodes"])
            expect(row["published"], j["published"])
            expect(row["predicted"], j["predicted"])
            expect(row["error"], 100 * j["error"])
        assert len(machine) == bool(results["prediction"].get("machine"))
        for rows in machine:
            for row, j in zip(rows, results["prediction"]["machine"], strict=True):
                assert (row["engine"], int(row["workers"])) == (j["engine"], j["workers"])
                expect(row["measured img/s"], j["measured"])
                expect(row["predicted img/s"], j["predicted"])
                expect(row["error"], 100 * j["error"])
                expect(row["r1 img/s"], j["img_s_1"])
    if "time_to_accuracy" in results:
        (rows,) = parsed["Time to accuracy"]
        assert [row["configuration"] for row in rows] == [
            j["label"] for j in results["time_to_accuracy"]["rows"]]

        def seconds(cell: str, value: float | None) -> None:
            if value is None:
                assert cell == "not reached", cell
            else:
                expect(cell, value)

        for row, j in zip(rows, results["time_to_accuracy"]["rows"], strict=True):
            by_seed = next(v for k, v in row.items() if k.startswith("seconds to "))
            for cell, value in zip(by_seed.split(", "), j["seconds"], strict=True):
                seconds(cell, value)
            seconds(row["mean"], j["mean"])
            seconds(row["worst"], j["worst"])
            expect(row["final accuracy (mean)"], 100 * j["final_accuracy"]["mean"])
            expect(row["final accuracy (worst)"], 100 * j["final_accuracy"]["worst"])
            if j["ratio"] is None:
                assert row["mean / reference"] == "-"
            else:
                expect(row["mean / reference"], j["ratio"])
            expect(row["run s (mean)"], j["train_seconds"]["mean"])
            expect(row["run s (worst)"], j["train_seconds"]["worst"])
            expect(row["run / reference"], j["run_ratio"])
    return checked


def check_plots(folder: Path, results: dict) -> None:
    for key, names in PLOTS.items():
        for name in names if key in results else []:
            data = (folder / name).read_bytes()
            assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000, name

