"""What a measurement ran on: hardware, versions, load, the code's commit.

Every results.json starts with this, and every report.md with its table, so that a figure
is never read apart from the machine that produced it. The load average matters on a
shared machine: above the number of cores, other work shared it.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from spotring.benchmarks.runs import REPO
from spotring.launch.commands import BIN

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
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        return None


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _output(*command: str) -> str:
    """The first line a command prints; "" where it cannot run or fails."""
    try:
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def commit() -> str:
    """The code's commit, and whether it had uncommitted changes (results folders are
    what a run writes, not code: they do not count); "unknown" outside a git checkout."""
    head = _output("git", "rev-parse", "--short", "HEAD")
    if not head:
        return "unknown"
    dirty = _output("git", "status", "--porcelain", "--", ".", ":!benchmarks/results")
    return head + (" (with uncommitted changes)" if dirty else "")


def gpu() -> dict | None:
    """The first GPU torch sees, how many there are, and what a GPU figure is read against
    (driver, CUDA, cuDNN); None without one."""
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    driver = _output("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader")
    return {"name": props.name, "count": torch.cuda.device_count(),
            "memory_gib": round(props.total_memory / 2**30, 1),
            "capability": f"{props.major}.{props.minor}", "driver": driver.split("\n")[0] or None,
            "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version()}


def describe() -> dict:
    import torch

    mpirun = shutil.which("mpirun", path=f"{BIN}:{os.environ.get('PATH', '')}")
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "gpu": gpu(),
        "os": platform.platform(),
        "python": sys.version.split()[0],
        "packages": {p: _version(p) for p in PACKAGES},
        "mpi": (_output(mpirun, "--version").splitlines() or [None])[0] if mpirun else None,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available()
        else None,
        "commit": commit(),
        "load_average": load_average(),
    }
