"""Throughput of the trainer for worker counts, per-worker batch sizes and engines
(docs/benchmarks.md, "Throughput"): each configuration started as users start it
(benchmarks/runs.py), warm-up left out, the configurations interleaved and reversed every
other repeat; img/s per worker and in total with 95% intervals, and speedup and
efficiency against one worker of the same program (the trainer, or the plain loop) at the
same batch and threads per worker.
"""

from __future__ import annotations

from pathlib import Path

from spotring.benchmarks.runs import ENGINES, Run, Setup, Timing, Workload, measure
from spotring.benchmarks.stats import mean_ci, scaling


def reference(engine: str) -> str:
    """The engine whose 1-worker run a configuration is compared with: the trainer at 1
    worker has nothing to average, whatever the engine."""
    return "plain" if ENGINES[engine].program == "plain" else "ddp"


def plan(engines: list[str], workers: list[int], batches: list[int],
         threads: int) -> list[Setup]:
    """Every configuration to run, with the 1-worker references, each once."""
    setups = [Setup(reference(e) if n == 1 else e, n, batch, threads)
              for batch in batches for e in engines for n in sorted({1, *workers})]
    return list(dict.fromkeys(setups))


def run_interleaved(setups: list[Setup], workload: Workload, timing: Timing, repeats: int,
                    folder: Path) -> dict[Setup, list[Run]]:
    runs: dict[Setup, list[Run]] = {s: [] for s in setups}
    total = repeats * len(setups)
    for repeat in range(repeats):
        for setup in setups if repeat % 2 == 0 else setups[::-1]:
            run = measure(setup, workload, timing, folder / "runs" / f"{setup.slug}-r{repeat}")
            runs[setup].append(run)
            stats = mean_ci(run.per_worker)
            print(f"[{sum(map(len, runs.values()))}/{total}] throughput {setup.label}, "
                  f"batch {setup.batch}: {stats['mean']:.0f} ± {stats['ci95']:.0f} img/s "
                  "per worker", flush=True)
    return runs


def summarize(runs: dict[Setup, list[Run]]) -> list[dict]:
    """The rows of the throughput table: every number the report shows, computed here."""
    per_worker = {s: mean_ci([x for r in rs for x in r.per_worker]) for s, rs in runs.items()}
    rows = []
    for setup, stats in per_worker.items():
        n = setup.workers
        row = {"label": setup.label, "engine": setup.engine, "workers": n,
               "batch": setup.batch, "threads": setup.threads, "per_worker": stats,
               "total": {"mean": n * stats["mean"], "ci95": n * stats["ci95"]},
               "step_ms": 1000 * setup.batch / stats["mean"]}
        one = Setup(reference(setup.engine), 1, setup.batch, setup.threads)
        if n > 1 and one in per_worker:
            row |= scaling(stats, per_worker[one], n)
        rows.append(row)
    return rows


def measure_sweep(workload: Workload, engines: list[str], workers: list[int],
                  batches: list[int], threads: int, timing: Timing, repeats: int,
                  folder: Path, gradient: dict[str, int]) -> dict:
    """The throughput section of results.json; ``gradient``: runs.check_workload's."""
    if not workload.plain and "plain" in engines:
        print(f"plain: skipped, the plain loop trains MNIST's convnet, not {workload.name}")
        engines = [e for e in engines if e != "plain"]
    runs = run_interleaved(plan(engines, workers, batches, threads), workload, timing,
                           repeats, folder)
    return {"workload": workload.name, "train_samples": workload.train_samples,
            "timing": vars(timing) | {"steps": timing.steps}, "repeats": repeats, **gradient,
            "rows": summarize(runs), "runs": [r.to_json() for rs in runs.values() for r in rs]}
