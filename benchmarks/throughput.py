"""Throughput of the trainer for worker counts, per-worker batch sizes and engines.

    python -m benchmarks.throughput                                # MNIST, 1 and 2 workers
    python -m benchmarks.throughput --workers 1 2 4 --batch-sizes 32 64 128 --repeats 5
    python -m benchmarks.throughput --engines ddp horovod-mpi plain --model resnet20 \
        --shape 3 32 32                                            # synthetic CIFAR-sized data

Method (Horovod's pytorch_synthetic_benchmark, airbench's honesty):

- every run trains --warmup-steps unmeasured, then --intervals intervals of --log-every
  steps; img/s per interval comes from the trainer's own metrics.jsonl (training steps
  only: evaluation and checkpoints are outside its stopwatch) or the plain loop's;
- per configuration: img/s per worker and in total as mean +- 1.96 sigma over all
  measured intervals of all repeats, and the median over repeats of each run's mean;
- the configurations are interleaved, in reverse order every other repeat, so that a
  noisy neighbour or thermal drift hits them all alike;
- speedup and efficiency are against one worker of the same program (the trainer alone,
  or the plain loop alone) with the same batch per worker and threads per worker, so a
  worker is one core: N workers ideally give N times the img/s; efficiency is also
  given per repeat (a run and its own repeat's 1-worker run), as median and range;
- the time per step is split into compute, the mean step time of N single-worker runs
  started together (the same work on an equally busy host, no communication; they log
  every step, so their spread is per step and their step-time standard deviation is
  measured too), and communication, the rest: what gradient averaging adds to a step,
  after overlap, including waiting for the slowest worker.

Engines: ddp (torchrun, Gloo), horovod-gloo (horovodrun --gloo), horovod-mpi (mpirun,
engine.backend=mpi), plain (benchmarks/plain_loop.py under torchrun: a plain DDP loop
with the same network, data and batch; MNIST only).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from benchmarks import record
from benchmarks.runs import (
    ENGINES,
    MNIST,
    Run,
    Setup,
    Timing,
    Workload,
    gradient,
    measure,
    synthetic,
)
from benchmarks.stats import interval_stats, median_range, scaling

ALL_ENGINES = list(ENGINES)


def reference(engine: str) -> str:
    """The engine whose 1-worker and independent runs a configuration is compared with:
    the trainer at 1 worker has no communication, whatever the engine."""
    return "plain" if engine == "plain" else "ddp"


def plan(engines: list[str], workers: list[int], batches: list[int],
         threads: int) -> list[Setup]:
    """Every configuration to run, with the 1-worker and compute-only references."""
    setups: list[Setup] = []

    def add(setup: Setup) -> None:
        if setup not in setups:
            setups.append(setup)

    for batch in batches:
        for engine in engines:
            add(Setup(reference(engine), 1, batch, threads))
            for n in workers:
                if n > 1:
                    add(Setup(engine, n, batch, threads))
                    add(Setup(reference(engine), n, batch, threads, independent=True))
    return setups


def run_interleaved(setups: list[Setup], workload: Workload, timing: Timing, repeats: int,
                    folder: Path) -> dict[Setup, list[Run]]:
    runs: dict[Setup, list[Run]] = {s: [] for s in setups}
    total = repeats * len(setups)
    for repeat in range(repeats):
        order = setups if repeat % 2 == 0 else setups[::-1]
        for setup in order:
            run = measure(setup, workload, timing, folder / "runs" / f"{setup.slug}-r{repeat}")
            runs[setup].append(run)
            done = sum(map(len, runs.values()))
            stats = interval_stats(run.per_worker)
            print(f"[{done}/{total}] {setup.label}, batch {setup.batch}: "
                  f"{stats['mean']:.0f} +- {stats['ci95']:.0f} img/s per worker", flush=True)
    return runs


def step_time(batch: int, per_worker: list[float]) -> dict[str, float]:
    """Mean and standard deviation of the step time of one run's single-step intervals
    (an independent run's): the compute time, and how much it varies."""
    steps = [1000 * batch / x for x in per_worker]
    return {"mean_ms": statistics.fmean(steps), "sd_ms": statistics.pstdev(steps)}


def step_times(runs: list[Run]) -> dict[str, float]:
    """step_time of every repeat, medians over repeats."""
    per_run = [step_time(r.setup.batch, r.per_worker) for r in runs]
    return {k: median_range([t[k] for t in per_run])["median"] for k in ("mean_ms", "sd_ms")}


def summarize(runs: dict[Setup, list[Run]], workload: Workload, timing: Timing) -> dict:
    """The rows of the throughput table: every number the report shows, computed here."""
    def means(setup: Setup) -> list[float]:
        return [interval_stats(r.per_worker)["mean"] for r in runs[setup]]

    rows = []
    for setup, setup_runs in runs.items():
        pooled = [x for r in setup_runs for x in r.per_worker]
        per_worker = interval_stats(pooled)
        median = median_range(means(setup))
        n = setup.workers
        step_ms = 1000 * setup.batch / median["median"]
        row = {
            "label": setup.label, "engine": setup.engine, "workers": n, "batch": setup.batch,
            "threads": setup.threads, "independent": setup.independent,
            "per_worker": per_worker, "per_worker_median": median,
            "total": {"mean": n * per_worker["mean"], "ci95": n * per_worker["ci95"]},
            "total_median": n * median["median"], "step_ms": step_ms,
        }
        one = Setup(reference(setup.engine), 1, setup.batch, setup.threads)
        if n > 1 and one in runs:  # independent runs too: the ceiling set by the host
            row |= scaling(row["total_median"], median_range(means(one))["median"], n)
            # A run against its own repeat's 1-worker run: adjacent in time, alike in load.
            row["efficiency_per_repeat"] = median_range(per_repeat_efficiency(
                [r.per_worker for r in setup_runs], [r.per_worker for r in runs[one]]))
            alone = Setup(reference(setup.engine), n, setup.batch, setup.threads, True)
            if alone in runs and not setup.independent:
                compute_ms = step_times(runs[alone])["mean_ms"]
                row |= {"compute_ms": compute_ms, "communication_ms": step_ms - compute_ms}
        if setup.independent:
            row["step_time"] = step_times(setup_runs)
        rows.append(row)
    return {"workload": workload.name, "timing": vars(timing) | {"steps": timing.steps},
            "rows": rows, "runs": [r.to_json() for rs in runs.values() for r in rs]}


def per_repeat_efficiency(many: list[list[float]], ones: list[list[float]]) -> list[float]:
    """Each repeat's N-worker run against the same repeat's 1-worker run: the ratio of
    their mean img/s per worker (adjacent in time, alike in load)."""
    return [statistics.fmean(n) / statistics.fmean(one)
            for n, one in zip(many, ones, strict=True)]


def runs_by_setup(section: dict) -> dict[tuple, list[dict]]:
    """The runs of a throughput section by (engine, workers, batch, independent), each
    configuration's in repeat order."""
    runs: dict[tuple, list[dict]] = {}
    for r in section["runs"]:
        runs.setdefault((r["engine"], r["workers"], r["batch"], r["independent"]), []).append(r)
    return runs


def paired_efficiencies(section: dict) -> dict[str, list[float]]:
    """Per engine, per_repeat_efficiency of every multi-worker configuration, pooled over
    batch sizes: from the runs of a throughput section, so it can be recomputed from
    results.json."""
    runs = runs_by_setup(section)
    out: dict[str, list[float]] = {}
    for (engine, n, batch, independent), many in runs.items():
        one = runs.get((reference(engine), 1, batch, False))
        if n > 1 and not independent and one:
            out.setdefault(engine, []).extend(per_repeat_efficiency(
                [r["per_worker"] for r in many], [r["per_worker"] for r in one]))
    return out


def measure_sweep(workload: Workload, engines: list[str], workers: list[int],
                  batches: list[int], threads: int, timing: Timing, repeats: int,
                  folder: Path) -> dict:
    if not workload.plain and "plain" in engines:
        print(f"plain: skipped, the plain loop trains MNIST's convnet, not {workload.name}")
        engines = [e for e in engines if e != "plain"]
    setups = plan(engines, workers, batches, threads)
    section = summarize(run_interleaved(setups, workload, timing, repeats, folder), workload,
                        timing)
    return section | {"repeats": repeats, **gradient(workload)}


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="a conf/model option, on synthetic data (default: MNIST, convnet)")
    p.add_argument("--shape", nargs=3, type=int, default=[1, 28, 28], help="C H W")


def workload_of(args: argparse.Namespace) -> Workload:
    return MNIST if args.model is None else synthetic(args.model, tuple(args.shape))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", nargs="+", default=ALL_ENGINES, choices=ALL_ENGINES)
    p.add_argument("--workers", nargs="+", type=int, default=[1, 2])
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[64], help="per worker")
    p.add_argument("--threads", type=int, default=1, help="per worker")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--intervals", type=int, default=6)
    add_workload_arguments(p)
    record.add_name_argument(p, "throughput")
    args = p.parse_args()
    if args.intervals < 5:
        p.error("--intervals: at least 5 measured intervals (Horovod's method)")
    timing = Timing(args.log_every, args.warmup_steps, args.intervals)
    record.write(args.name, "throughput", lambda folder: {"throughput": measure_sweep(
        workload_of(args), args.engines, args.workers, args.batch_sizes, args.threads,
        timing, args.repeats, folder)})


if __name__ == "__main__":
    main()
