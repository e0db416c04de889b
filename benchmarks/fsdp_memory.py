"""Bytes per worker under engine=fsdp against engine=ddp: a GPT-2-small-size model's
parameters, gradients and AdamW state, on 2 and 4 CPU workers (docs/benchmarks.md).

    python -m spotring.benchmarks.fsdp_memory [--workers 2 4] [--name try]

Each run is benchmarks/fsdp_ranks.py under torchrun, one step, the runs one after another;
the bytes are counted in each worker's own tensors. Results: benchmarks/results/fsdp_memory/
(--name): results.json and report.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from spotring.benchmarks import record
from spotring.benchmarks.report import header, table
from spotring.benchmarks.runs import json_line, launch_command, run_together, shown
from spotring.benchmarks.suite import counts

ENGINES = ("ddp", "fsdp")
FIGURES = ("parameter_bytes", "gradient_bytes", "optimizer_bytes")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m spotring.benchmarks.fsdp_memory",
                                description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=counts, nargs="+", default=[2, 4],
                   help="world sizes to measure (2 4)")
    p.add_argument("--size", default="gpt2", help="fsdp_ranks' model: gpt2 (124M), tiny")
    p.add_argument("--seq", type=counts, default=64, help="tokens per worker and step (64)")
    p.add_argument("--name", default="fsdp_memory",
                   help="the results folder: a name under benchmarks/results, or a path")
    return p


def fsdp_run(engine: str, workers: int, args: list[str], run_dir: Path,
             timeout: float = 1800) -> dict:
    """benchmarks/fsdp_ranks.py on ``workers`` ranks under torchrun with ``engine`` and its
    other options ``args``: what rank 0 printed, and the command."""
    command = launch_command("torchrun", workers, [
        "--engine", engine, *args, "--run-dir", str(run_dir)],
        module="spotring.benchmarks.fsdp_ranks")
    (stdout,) = run_together([command], timeout=timeout)
    return {**json_line(stdout, "fsdp_ranks")["fsdp_ranks"], "command": shown(command)}


def measure(args: argparse.Namespace, folder: Path) -> dict:
    runs = []
    for workers in args.workers:
        for engine in ENGINES:
            run = fsdp_run(engine, workers, ["--size", args.size, "--seq", str(args.seq)],
                           folder / "runs" / f"{engine}-w{workers}")
            runs.append(run)
            most = max(sum(r[f] for f in FIGURES) for r in run["ranks"])
            print(f"{engine}, {workers} workers: {most / 2**20:.1f} MiB per worker "
                  f"(parameters, gradients, AdamW state)", flush=True)
    return {"fsdp_memory": {"runs": runs}}


def derive(results: dict) -> dict:
    """Each run's largest worker total, and FSDP's against DDP's at each world size."""
    section = results["fsdp_memory"]
    for run in section["runs"]:
        run["bytes_per_worker"] = {f: max(r[f] for r in run["ranks"]) for f in FIGURES}
        run["total_bytes_per_worker"] = max(sum(r[f] for f in FIGURES) for r in run["ranks"])
    by = {(r["engine"], r["world_size"]): r for r in section["runs"]}
    section["fsdp_of_ddp"] = {
        str(w): by["fsdp", w]["total_bytes_per_worker"] / by["ddp", w]["total_bytes_per_worker"]
        for engine, w in by if engine == "fsdp" and ("ddp", w) in by}
    return results


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def render(folder: Path, results: dict) -> Path:
    """report.md: the machine, then a row per world size and engine."""
    section = results["fsdp_memory"]
    runs, ratios = section["runs"], section["fsdp_of_ddp"]
    rows = []
    for run in runs:
        per = run["bytes_per_worker"]
        ratio = ratios.get(str(run["world_size"])) if run["engine"] == "fsdp" else 1.0
        rows.append([str(run["world_size"]), run["engine"], _mib(per["parameter_bytes"]),
                     _mib(per["gradient_bytes"]), _mib(per["optimizer_bytes"]),
                     _mib(run["total_bytes_per_worker"]),
                     "-" if ratio is None else f"{ratio:.3f}",
                     f"{max(r['peak_memory_mib'] for r in run['ranks']):.0f}",
                     f"{run['step_seconds']:.1f}"])
    first = runs[0]
    body = "\n\n".join([
        header(folder, results),
        f"## Bytes per worker: {first['size']} ({first['parameters'] / 1e6:.1f}M parameters, "
        f"float32), AdamW, {first['seq']} tokens per worker, CPU workers over Gloo",
        table(["workers", "engine", "parameters (MiB)", "gradients (MiB)", "AdamW state (MiB)",
               "total (MiB)", "of DDP's", "peak resident set (MiB)", "first step (s)"], rows),
        "The largest worker's bytes, counted in its own tensors (a DTensor's local shard) "
        "after one step: FSDP holds 1/W of each parameter, gradient and AdamW moment, DDP "
        "all of them. The peak resident set is the whole process's (torch and Python "
        "too), and each worker builds the model whole before wrap shards it, so FSDP's "
        "includes a whole copy; the first step's time includes FSDP's lazy set-up. The "
        "method: "
        "`benchmarks/fsdp_memory.py` and `benchmarks/fsdp_ranks.py`; every worker's "
        "figures are in `results.json`.",
        "```sh\n" + "\n".join(r["command"] for r in runs) + "\n```",
    ])
    return record.write_report(folder, body)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    return record.run_alone("spotring.benchmarks.fsdp_memory", argv, args.name, "fsdp-memory",
                            lambda folder: measure(args, folder), derive, render)


if __name__ == "__main__":
    sys.exit(main())
