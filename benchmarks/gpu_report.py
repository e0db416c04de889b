"""What tools/gpu-check writes: the machine it ran on, and OUTDIR/report.md from
OUTDIR/results.json alone (benchmarks/gpu_check.py saves both after every check).

    results.json   command, mode, device, devices, bundle, spotring (where it was imported
                   from), started, machine (benchmarks/machine.py's account with the GPU's:
                   name, count, memory, capability, driver, CUDA, cuDNN, NCCL), checks
                   (each: check, status, summary, seconds, figures, commands),
                   stopped_by (the signal that stopped the kit, or null), wall_seconds,
                   passed
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import torch

from spotring.benchmarks import machine
from spotring.stores import write_atomic

STATUSES = ("passed", "failed", "stopped", "skipped")


def describe(device: str) -> dict:
    """benchmarks/machine's account, with what a GPU figure is read against."""
    info = machine.describe()
    info["torch"] = torch.__version__
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = {"name": props.name, "count": torch.cuda.device_count(),
                       "memory_gib": round(props.total_memory / 2**30, 1),
                       "capability": f"{props.major}.{props.minor}",
                       "driver": driver_version(),
                       "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
                       "nccl": info["nccl"]}
    return info


def driver_version() -> str | None:
    """The NVIDIA driver's version, as nvidia-smi says it; None where it cannot."""
    try:
        said = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (said.split() or [None])[0]


def row(cells: list[str]) -> str:
    return "| " + " | ".join(c.replace("|", "/") for c in cells) + " |"


HEADER = row(["check", "result", "figures", "s"]) + "\n" + row(["---"] * 4)


def check_row(check: dict) -> str:
    """A check's row of the table, as printed when it ends and in report.md."""
    return row([check["check"], check["status"], check["summary"], f"{check['seconds']:g}"])


def report(results: dict) -> str:
    """report.md, from results.json alone."""
    info, checks = results["machine"], results["checks"]
    gpu = info.get("gpu")
    where = (f"{gpu['count']} x {gpu['name']}" if gpu else f"CPU ({info['cpu']})")
    counts = {s: sum(c["status"] == s for c in checks) for s in STATUSES}
    stopped = (f" **Stopped by {results['stopped_by']}**: the checks it cut off say "
               "\"stopped\", those it left unstarted \"skipped\"." if results["stopped_by"]
               else "")
    lines = [f"# spotring GPU check: {where}", "",
             f"{results['started']}, `{results['command']}`, {results['mode']} mode, "
             f"{results.get('wall_seconds', '...')} s: "
             + ", ".join(f"{n} {s}" for s, n in counts.items() if n) + "." + stopped, "",
             "| machine | |", "| --- | --- |"]
    if gpu:
        lines += [f"| GPUs | {gpu['count']} x {gpu['name']} ({gpu['memory_gib']} GiB, compute "
                  f"capability {gpu['capability']}) |",
                  f"| driver, CUDA, cuDNN, NCCL | {gpu['driver']}, {gpu['cuda']}, {gpu['cudnn']}, "
                  f"{gpu['nccl']} |"]
    lines += [f"| torch, torchvision | {info['torch']}, {info['packages']['torchvision']} |",
              f"| Python, CPU | {info['python']}, {info['cpu']}, {info['cores']} cores, "
              f"{info['memory_gib']} GiB |",
              f"| spotring | {results['spotring']}, commit {info['commit']}; bundle "
              f"{results['bundle']} |", "",
              HEADER, *map(check_row, checks), "",
              f"The throughput checks train {results['throughput_workload']}.", ""]
    failed = [c for c in checks if c["status"] == "failed"]
    if failed:
        lines += ["## Failures", ""]
        for c in failed:
            lines += [f"{c['check']}:", "", *(f"    {line}" for line in
                                               c["figures"]["error"].splitlines()), ""]
    lines += ["## Commands", "", "Each check's runs, as started (their folders: runs/).", ""]
    for c in checks:
        if c["commands"]:
            lines += [f"{c['check']}:", "", *(f"    {command}" for command in c["commands"]), ""]
    return "\n".join(lines)


def save(out: Path, results: dict) -> None:
    """results.json and report.md, each whole: a kit cut off while saving leaves the
    previous pair."""
    write_atomic(out / "results.json", (json.dumps(results, indent=1) + "\n").encode())
    write_atomic(out / "report.md", report(results).encode())
