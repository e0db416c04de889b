"""Measure throughput, allreduce bandwidth, batch sizes and time to accuracy into one folder.

    spotring bench --quick            # a few minutes: 1 repeat, batch 64, sizes x4 apart
    spotring bench                    # 3 repeats, batch 32/64/128, sizes x2 apart, ...
    spotring bench --workers 1 2 4 8 --model resnet20 --shape 3 32 32 --only throughput
    spotring report                   # the newest run's report.md and plots

Into <results>/<time>-bench[-quick]/results.json (record.py): one section per --only
(throughput.py, allreduce.py, batch_sizes.py, time_to_accuracy.py), then the prediction
(predict.py) derived from them. docs/benchmarks.md has the method. Bad input exits 2
before anything starts.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

from spotring.benchmarks import (
    allreduce,
    batch_sizes,
    predict,
    record,
    throughput,
    time_to_accuracy,
)
from spotring.benchmarks.runs import (
    ENGINES,
    MNIST,
    Timing,
    Workload,
    available_engines,
    check_workload,
    synthetic,
)

QUICK = {"repeats": 1, "allreduce_repeats": 1, "timing": Timing(5, 10, 5), "batches": [64],
         "size_factor": 4, "budget": 0.1, "table_batches": batch_sizes.QUICK_BATCHES,
         "seeds": 2}
FULL = {"repeats": 3, "allreduce_repeats": 3, "timing": Timing(10, 20, 8),
        "batches": [32, 64, 128], "size_factor": 2, "budget": 0.3,
        "table_batches": batch_sizes.FULL_BATCHES, "seeds": 5}
SECTIONS = ("throughput", "allreduce", "batch_sizes", "time_to_accuracy")
TABLE_MODELS = [m for g in [*batch_sizes.GROUPS, batch_sizes.RESNET50] for m in g.models]


def counts(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: must be 1 or more")
    return value


def _accuracy(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text}: must be a fraction in (0, 1], e.g. 0.99")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="spotring bench", description=__doc__.splitlines()[0],
                                epilog="The method: docs/benchmarks.md.")
    p.add_argument("--quick", action="store_true", help="a few minutes instead of an hour or so")
    p.add_argument("--name", help="the results folder: a name under benchmarks/results, or a "
                   "path (default: <time>-bench[-quick])")
    p.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    p.add_argument("--repeats", type=counts, help="of every run (default: 1 quick, 3 full)")
    p.add_argument("--engines", nargs="+", choices=list(ENGINES),
                   help="default: every engine this host has")
    p.add_argument("--workers", nargs="+", type=counts, default=[1, 2],
                   help="worker counts of the throughput runs, one host (default: 1 2)")
    p.add_argument("--batch-sizes", nargs="+", type=counts,
                   help="per worker, throughput (default: 64 quick, 32 64 128 full)")
    p.add_argument("--threads", type=counts, default=1, help="torch threads per worker")
    p.add_argument("--model", help="a conf/model option, on synthetic data (default: MNIST's "
                   "convnet)")
    p.add_argument("--shape", nargs=3, type=counts, default=[1, 28, 28], metavar=("C", "H", "W"),
                   help="input of --model")
    p.add_argument("--transports", nargs="+", choices=list(allreduce.TRANSPORTS),
                   help="default: every transport this host has")
    p.add_argument("--table-models", nargs="+", choices=TABLE_MODELS,
                   help="models of the batch-size table (default: all)")
    p.add_argument("--table-batch-sizes", nargs="+", type=counts)
    p.add_argument("--target", type=_accuracy, default=time_to_accuracy.TARGET,
                   help="time to accuracy: the test accuracy to reach (default 0.99)")
    p.add_argument("--seeds", type=counts, help="time to accuracy: seeds 0..N-1 of every "
                   "configuration (default: 2 quick, 5 full)")
    p.add_argument("--evaluations", type=counts, default=time_to_accuracy.EVALUATIONS,
                   help="time to accuracy: evaluations per run, about (default 15)")
    p.add_argument("--max-steps", type=counts,
                   help="time to accuracy: stop every run after N steps (smoke tests)")
    return p


def _check(p: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, int] | None:
    """Everything a run needs, before it starts: exit 2 (p.error) naming what is wrong."""
    for option, asked, there in (("--engines", args.engines, available_engines()),
                                 ("--transports", args.transports, allreduce.available())):
        missing = sorted(set(asked or []) - set(there))
        if missing:
            p.error(f"{option} {' '.join(missing)}: not on this host; it has "
                    f"{', '.join(there)} (Horovod's need `make horovod`, NCCL 2 GPUs)")
    from spotring.exits import ConfigError

    if "time_to_accuracy" in args.only:
        try:
            for n in args.workers:
                time_to_accuracy.trainer_steps(n, args.max_steps)
        except (ConfigError, ValueError) as e:
            p.error(f"--only time_to_accuracy: {e}")
    if "throughput" not in args.only:
        return None
    try:
        return check_workload(_workload(args))
    except ConfigError as e:
        p.error(f"--model {args.model}: {e}")


def _workload(args: argparse.Namespace) -> Workload:
    return MNIST if args.model is None else synthetic(args.model, tuple(args.shape))


def measure(args: argparse.Namespace, gradient: dict[str, int] | None, folder) -> dict:
    mode = QUICK if args.quick else FULL
    results: dict = {"quick": args.quick}
    if "throughput" in args.only:
        print("== throughput", flush=True)
        results["throughput"] = throughput.measure_sweep(
            _workload(args), args.engines or available_engines(), args.workers,
            args.batch_sizes or mode["batches"], args.threads, mode["timing"],
            args.repeats or mode["repeats"], folder, gradient)
    if "allreduce" in args.only:
        print("== allreduce", flush=True)
        sizes = set(allreduce.sizes(factor=mode["size_factor"]))
        if gradient:
            sizes.add(gradient["gradient_bytes"])
        results["allreduce"] = allreduce.measure(
            args.transports or allreduce.available(), max(2, *args.workers), sorted(sizes),
            mode["budget"], args.repeats or mode["allreduce_repeats"])
    if "batch_sizes" in args.only:
        print("== batch sizes", flush=True)
        groups = batch_sizes.GROUPS + ([] if args.quick else [batch_sizes.RESNET50])
        if args.table_models:
            groups = [replace(g, models=tuple(m for m in g.models if m in args.table_models))
                      for g in groups]
        results["batch_sizes"] = batch_sizes.measure(
            [g for g in groups if g.models], args.table_batch_sizes or mode["table_batches"],
            os.cpu_count(), 1, folder)
    if "time_to_accuracy" in args.only:
        print("== time to accuracy", flush=True)
        results["time_to_accuracy"] = time_to_accuracy.measure(
            args.workers, list(range(args.seeds or mode["seeds"])), args.target,
            args.max_steps, args.evaluations, folder)
    return results


def derive(results: dict) -> dict:
    """The predictor's section: the published figures, and this run's where it has both
    throughput and allreduce."""
    results["prediction"] = {"published": predict.validate_published()}
    if "throughput" in results and "allreduce" in results:
        results["prediction"]["machine"] = predict.validate_machine(results)
    return results


def main(argv: list[str] | None = None) -> int:
    """spotring bench: measure, write results.json, print where it is (exit 2: bad input)."""
    argv = sys.argv[1:] if argv is None else argv
    p = parser()
    args = p.parse_args(argv)
    gradient = _check(p, args)
    folder = record.write(args.name, "bench-quick" if args.quick else "bench",
                          record.command_line("spotring.benchmarks.suite", p.prog, argv),
                          lambda folder: measure(args, gradient, folder), derive)
    make = f" (or `make report RUN={folder.name}`)" if folder.parent == record.RESULTS else ""
    print(f"\nwritten: {folder / 'results.json'}\n`spotring report {folder}`{make} makes "
          "report.md and the plots")
    return 0


if __name__ == "__main__":
    sys.exit(main())
