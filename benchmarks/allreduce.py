"""Allreduce bandwidth against message size, per transport, as nccl-tests defines it: for S
bytes in t seconds on n ranks, algbw = S / t and busbw = algbw x 2(n-1)/n, GB/s of 10^9
bytes (docs/benchmarks.md, "Allreduce").

Each transport is started by its launcher (TRANSPORTS; each rank runs
benchmarks/allreduce_ranks.py), `repeats` times, transports interleaved (reversed every
other repeat); a size's time is the median over repeats of each run's median loop.
"""

from __future__ import annotations

import importlib.util
import statistics

from spotring.benchmarks.runs import json_line, launch_command, run_together, shown

TRANSPORTS = {  # name: (launcher, what allreduce_ranks runs, environment)
    "gloo": ("torchrun", "gloo", {}),
    "mpi": ("mpirun", "mpi", {}),
    "horovod-gloo": ("horovodrun", "horovod", {"HOROVOD_CPU_OPERATIONS": "GLOO"}),
    "horovod-mpi": ("mpirun", "horovod", {"HOROVOD_CPU_OPERATIONS": "MPI"}),
    "nccl": ("torchrun", "nccl", {}),
}
KIB = 1024


def available() -> list[str]:
    """The transports this host has: MPI's with mpi4py, Horovod's where it is built,
    NCCL with two GPUs or more."""
    import torch

    has = {"gloo": True, "mpi": importlib.util.find_spec("mpi4py") is not None,
           "horovod": importlib.util.find_spec("horovod") is not None,
           "nccl": torch.cuda.device_count() >= 2}
    return [t for t, (launcher, rank_side, _) in TRANSPORTS.items()
            if has[rank_side] and (launcher != "mpirun" or has["mpi"])]


def sizes(smallest: int = KIB, largest: int = 64 * KIB**2, factor: int = 2) -> list[int]:
    out = [smallest]
    while out[-1] * factor <= largest:
        out.append(out[-1] * factor)
    return out


def bandwidth(nbytes: int, seconds: float, ranks: int) -> dict[str, float]:
    """nccl-tests' algorithm and bus bandwidth, GB/s."""
    algbw = nbytes / seconds / 1e9
    return {"algbw_gbps": algbw, "busbw_gbps": algbw * 2 * (ranks - 1) / ranks}


def measure(transports: list[str], ranks: int, message_sizes: list[int], budget: float,
            repeats: int, timeout: float = 1800) -> dict:
    """The allreduce section of results.json: every size of every transport."""
    seconds: dict[str, dict[int, list[float]]] = {t: {} for t in transports}
    commands: dict[str, str] = {}
    for repeat in range(repeats):
        for transport in transports if repeat % 2 == 0 else transports[::-1]:
            launcher, rank_side, env = TRANSPORTS[transport]
            command = launch_command(launcher, ranks, [
                rank_side, "--sizes", *map(str, message_sizes), "--budget", str(budget)],
                module="spotring.benchmarks.allreduce_ranks")
            commands[transport] = shown(command, env)
            (stdout,) = run_together([command], env, timeout)
            ranks_said = json_line(stdout, "transport")
            result = ranks_said["results"]
            for row in result:
                seconds[transport].setdefault(row["bytes"], []).append(row["seconds"])
            print(f"[{repeat + 1}/{repeats}] allreduce over {transport}: "
                  + ", ".join(f"{size_label(r['bytes'])} {r['seconds'] * 1e3:.3g} ms"
                              for r in result[::3]), flush=True)
    rows = {t: [{"bytes": n, "seconds": statistics.median(s), "seconds_per_repeat": s,
                 **bandwidth(n, statistics.median(s), ranks)}
                for n, s in sorted(by_size.items())]
            for t, by_size in seconds.items()}
    return {"ranks": ranks, "budget_seconds": budget, "repeats": repeats,
            "loops": ranks_said["loops"],
            "commands": commands, "transports": rows}


def size_label(nbytes: int) -> str:
    """1 KiB, 64 MiB, or the bytes where not a whole KiB or MiB."""
    for unit, scale in (("MiB", KIB**2), ("KiB", KIB)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes:,} B"
