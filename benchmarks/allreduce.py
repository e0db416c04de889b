"""Allreduce bandwidth against message size, per transport, nccl-tests style.

    python -m benchmarks.allreduce                       # 2 ranks, 1 KB .. 64 MB
    python -m benchmarks.allreduce --ranks 4 --transports gloo mpi --repeats 3

Definitions (nccl-tests, doc/PERFORMANCE.md): for a message of S bytes that takes t
seconds on n ranks, algbw = S / t and busbw = algbw x 2(n-1)/n, the rate each link of a
ring carries (a ring allreduce sends 2(n-1)/n x S bytes per rank). busbw is what can
be compared across rank counts and with the hardware's link speed. GB/s are 10^9 bytes.

Transports, each started by its launcher (benchmarks/allreduce_ranks.py does the timing):

    gloo          torch.distributed Gloo: the path of engine=ddp and the plain loop on CPUs
    mpi           mpi4py, Open MPI's allreduce (shared memory between ranks on one host)
    horovod-gloo  Horovod over Gloo (horovodrun --gloo): engine=horovod's default
    horovod-mpi   Horovod over MPI (mpirun, HOROVOD_CPU_OPERATIONS=MPI)
    nccl          torch.distributed NCCL, where there are GPUs
    trainer-mpi   not a transport: engine=ddp engine.backend=mpi's own gradient path (its
                  comm hook's watched sum over mpi4py), to be compared with the transports

Every size of every transport is measured --repeats times, transports interleaved;
the median over repeats of each run's median loop counts (allreduce_ranks.py). So
does the median CPU a transport's threads take from a program that computes
(`background_cpu_cores`, in cores; see allreduce_ranks.py), what one more allreduce
sent while it computes takes from it (`response_cpu_seconds`, for the transports that
can send without waiting: Gloo and Horovod's), and with --cold-bytes the
median time of that size's allreduce after bursts of computing (`cold`).
Each row also says how it compares with the best transport at that size (busbw / best
busbw; the trainer's path is compared, never the best). The trainer's path is compared
through the transport it goes over, timed in the same process between its loops
(allreduce_ranks.py): of_best = of_transport x that transport's of_best, so the host's
speed, which changes between launches, cancels out of the path's overhead.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks import record
from benchmarks.allreduce_ranks import LOOPS
from benchmarks.runs import json_line, run_together, shown
from launch.commands import local_command

TRANSPORTS = {  # name: (launcher, what allreduce_ranks runs, environment)
    "gloo": ("torchrun", "gloo", {}),
    "mpi": ("mpirun", "mpi", {}),
    "horovod-gloo": ("horovodrun", "horovod", {"HOROVOD_CPU_OPERATIONS": "GLOO"}),
    "horovod-mpi": ("mpirun", "horovod", {"HOROVOD_CPU_OPERATIONS": "MPI"}),
    "nccl": ("torchrun", "nccl", {}),
    "trainer-mpi": ("mpirun", "trainer-mpi", {}),
}
# Measured like the transports, but not one of them: the trainer's path, and the
# transport it goes over (timed beside it in the same process).
TRAINER_PATHS = {"trainer-mpi": "mpi"}
# The transport each training engine's gradients travel by.
ENGINE_TRANSPORT = {"ddp": "gloo", "ddp-mpi": "trainer-mpi", "plain": "gloo",
                    "horovod-gloo": "horovod-gloo", "horovod-mpi": "horovod-mpi"}
KIB = 1024


def available() -> list[str]:
    return [t for t in TRANSPORTS if t != "nccl" or torch.cuda.device_count() >= 2]


def sizes(smallest: int = KIB, largest: int = 64 * KIB**2, factor: int = 2) -> list[int]:
    out = [smallest]
    while out[-1] * factor <= largest:
        out.append(out[-1] * factor)
    return out


def bandwidth(nbytes: int, seconds: float, ranks: int) -> dict[str, float]:
    """nccl-tests' algorithm and bus bandwidth, GB/s."""
    algbw = nbytes / seconds / 1e9
    return {"algbw_gbps": algbw, "busbw_gbps": algbw * 2 * (ranks - 1) / ranks}


def _run(transport: str, ranks: int, message_sizes: list[int], budget: float,
         cold_bytes: int | None) -> tuple[dict, str]:
    launcher, rank_side, env = TRANSPORTS[transport]
    cold = [] if cold_bytes is None else ["--cold-bytes", str(cold_bytes)]
    command = local_command(launcher, ranks, [rank_side, "--sizes", *map(str, message_sizes),
                                              "--budget", str(budget), *cold],
                            module="benchmarks.allreduce_ranks")
    (stdout,) = run_together([command], env)
    return json_line(stdout, "transport"), shown(command, env)


def measure(transports: list[str], ranks: int, message_sizes: list[int], budget: float,
            repeats: int, cold_bytes: int | None = None) -> dict:
    """Every size of every transport; with ``cold_bytes`` (the gradient's), also that
    size's allreduce after bursts of computing (allreduce_ranks.cold_allreduce_seconds),
    and back to back among the sizes, to compare with."""
    if cold_bytes is not None:
        message_sizes = sorted({*message_sizes, cold_bytes})
    seconds: dict[str, dict[int, list[float]]] = {t: {} for t in transports}
    of_transport: dict[str, dict[int, list[float]]] = {t: {} for t in transports}
    background: dict[str, list[float]] = {t: [] for t in transports}
    response_cpu: dict[str, list[float]] = {t: [] for t in transports}
    cold: dict[str, list[float]] = {t: [] for t in transports}
    commands: dict[str, str] = {}
    for repeat in range(repeats):
        for transport in transports if repeat % 2 == 0 else transports[::-1]:
            result, commands[transport] = _run(transport, ranks, message_sizes, budget,
                                               cold_bytes)
            for row in result["results"]:
                seconds[transport].setdefault(row["bytes"], []).append(row["seconds"])
                if "of_transport" in row:
                    of_transport[transport].setdefault(row["bytes"], []).append(
                        row["of_transport"])
            background[transport].append(result["background_cpu_cores"])
            if result["response_cpu_seconds"] is not None:
                response_cpu[transport].append(result["response_cpu_seconds"])
            if result["cold"]:
                cold[transport].append(result["cold"]["seconds"])
            print(f"[{repeat + 1}/{repeats}] allreduce over {transport}: "
                  + ", ".join(f"{r['bytes'] // KIB} KiB {r['seconds'] * 1e3:.3g} ms"
                              for r in result["results"][::4])
                  + f"; its threads take {result['background_cpu_cores']:.2f} cores from "
                  "computing", flush=True)
    rows = {t: [{"bytes": n, "seconds": statistics.median(s), "seconds_per_repeat": s,
                 **bandwidth(n, statistics.median(s), ranks),
                 **({"of_transport": statistics.median(of_transport[t][n]),
                     "of_transport_per_repeat": of_transport[t][n]}
                    if n in of_transport[t] else {})}
                for n, s in sorted(by_size.items())]
            for t, by_size in seconds.items()}
    for n in {r["bytes"] for rs in rows.values() for r in rs}:
        at_n = {t: r for t, rs in rows.items() for r in rs if r["bytes"] == n}
        best = max((r["busbw_gbps"] for t, r in at_n.items() if t not in TRAINER_PATHS),
                   default=None)
        for r in at_n.values():
            r["of_best"] = r["busbw_gbps"] / best if best else None
        for path, over in TRAINER_PATHS.items():
            if path in at_n and over in at_n and "of_transport" in at_n[path]:
                at_n[path]["of_best"] = at_n[path]["of_transport"] * at_n[over]["of_best"]
    return {"ranks": ranks, "budget_seconds": budget, "repeats": repeats, "loops": LOOPS,
            "commands": commands, "transports": rows,
            "background_cpu_cores": {t: statistics.median(v) for t, v in background.items()},
            "response_cpu_seconds": {t: statistics.median(v) for t, v in response_cpu.items()
                                     if v},
            **({"cold": {t: {"bytes": cold_bytes, "seconds": statistics.median(v),
                             "seconds_per_repeat": v} for t, v in cold.items()}}
               if cold_bytes is not None else {})}


def wakeup(section: dict, transport: str) -> dict | None:
    """What waking ``transport``'s threads costs a step (the predictor's t_w): its cold
    allreduce of the gradient over its back-to-back one, seconds; None where the cold
    call was not measured (results from before it was)."""
    if "cold" not in section:
        return None
    cold = section["cold"][transport]
    hot = next(r for r in section["transports"][transport] if r["bytes"] == cold["bytes"])
    return {"bytes": cold["bytes"], "cold": cold["seconds"], "hot": hot["seconds"],
            "wakeup": max(0.0, cold["seconds"] - hot["seconds"])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--transports", nargs="+", default=None, choices=list(TRANSPORTS),
                   help="default: all that this host has")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--budget", type=float, default=0.2, help="timed seconds per size")
    p.add_argument("--size-factor", type=int, default=2, help="sizes 1 KiB x f^k to 64 MiB")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cold-bytes", type=int, default=None,
                   help="also time this size after bursts of computing (the gradient's)")
    record.add_name_argument(p, "allreduce")
    args = p.parse_args()
    record.write(args.name, "allreduce", lambda folder: {"allreduce": measure(
        args.transports or available(), args.ranks, sizes(factor=args.size_factor),
        args.budget, args.repeats, args.cold_bytes)})


if __name__ == "__main__":
    main()
