"""2-rank MNIST: engine=ddp vs engine=horovod (Gloo, MPI) vs a plain torchrun DDP loop.

    python -m benchmarks.mnist_engines [--repeats 3] [--batch-size 64]

The default job (convnet, batch 64 per worker, 1 core per worker) with 2 workers under
each engine and the plain loop (benchmarks/plain_loop.py), interleaved with their
references, by benchmarks/throughput.py; then the allreduce time per step of each, two
ways:

    exposed     step time - compute time (2 single workers at once, no communication):
                what gradient averaging adds to a step, after any overlap
    allreduce   one allreduce of the model's whole gradient over the engine's transport,
                timed alone (benchmarks/allreduce.py at exactly that size), and its
                share of the best transport's bus bandwidth at that size

`make bench` runs the same configurations inside its throughput and allreduce sweeps
and derives this table from them (summarize below), without measuring twice.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks import allreduce, record, throughput
from benchmarks.allreduce import ENGINE_TRANSPORT
from benchmarks.runs import MNIST, Timing, available_engines

COMPARED = ["ddp", "ddp-mpi", "horovod-gloo", "horovod-mpi", "plain"]
WORKERS = 2


def summarize(tp: dict, ar: dict, batch: int = 64) -> dict:
    """The issue-3 table from a throughput section (MNIST, with 2-worker rows) and an
    allreduce section that includes the model's gradient size."""
    size = tp["gradient_bytes"]
    rows = []
    for row in tp["rows"]:
        if (row["workers"], row["batch"], row["independent"]) != (WORKERS, batch, False):
            continue
        transport = ENGINE_TRANSPORT[row["engine"]]
        at_size = next((r for r in ar["transports"].get(transport, []) if r["bytes"] == size),
                       None)
        rows.append({
            "engine": row["engine"], "transport": transport,
            "command": next(r["commands"][0] for r in tp["runs"]
                            if (r["engine"], r["workers"], r["batch"], r["independent"])
                            == (row["engine"], WORKERS, batch, False)),
            "total": row["total"], "total_median": row["total_median"],
            "efficiency": row.get("efficiency"), "step_ms": row["step_ms"],
            "compute_ms": row.get("compute_ms"), "exposed_ms": row.get("communication_ms"),
            "allreduce_ms": at_size and 1e3 * at_size["seconds"],
            "busbw_gbps": at_size and at_size["busbw_gbps"],
            "of_best": at_size and at_size["of_best"],
        })
    return {"workload": tp["workload"], "workers": WORKERS, "batch": batch,
            "gradient_bytes": size, "rows": rows}


def measure(repeats: int, batch: int, folder: Path) -> dict:
    """The throughput and allreduce sections this table needs, and the table."""
    engines = [e for e in COMPARED if e in available_engines()]
    tp = throughput.measure_sweep(MNIST, engines, [1, WORKERS], [batch], 1, Timing(), repeats,
                                  folder)
    ar = allreduce.measure(allreduce.available(), WORKERS, [tp["gradient_bytes"]], 0.3, repeats)
    return {"throughput": tp, "allreduce": ar, "mnist_engines": summarize(tp, ar, batch)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64, help="per worker")
    record.add_name_argument(p, "mnist-engines")
    args = p.parse_args()
    record.write(args.name, "mnist-engines",
                 lambda folder: measure(args.repeats, args.batch_size, folder))


if __name__ == "__main__":
    main()
