"""What a measurement ran on: hardware, versions, load, the code's commit.

Every results.json starts with this, and every report.md with its table, so a figure
is never read apart from the machine that produced it. The load average matters on a
shared VM: compare runs only when it was about the same.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from launch.commands import BIN

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("torch", "torchvision", "horovod", "mpi4py", "openmpi", "hydra-core", "numpy")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gib() -> float | None:
    try:
        kib = int(Path("/proc/meminfo").read_text().split()[1])  # MemTotal
        return round(kib / 2**20, 1)
    except (OSError, ValueError, IndexError):
        return None


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def gpus() -> list[str]:
    import torch

    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def describe() -> dict:
    import torch

    mpirun = subprocess.run([str(BIN / "mpirun"), "--version"], capture_output=True, text=True)
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "gpus": gpus(),
        "os": platform.platform(),
        "python": sys.version.split()[0],
        "packages": {p: _version(p) for p in PACKAGES},
        "mpi": mpirun.stdout.splitlines()[0] if mpirun.returncode == 0 else None,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available()
        else None,
        "commit": commit(),
        "load_average": load_average(),
    }


def commit() -> str:
    """The code's commit, and whether it had uncommitted changes. Results folders are what
    a run writes, not code: refreshing the committed reference rewrites one, which does
    not make the code uncommitted."""
    return _git("rev-parse", "--short", "HEAD") + (
        " (with uncommitted changes)"
        if _git("status", "--porcelain", "--", ".", ":!benchmarks/results") else "")
