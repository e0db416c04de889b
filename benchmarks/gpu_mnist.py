"""The GPU kit's checks `mnist 1` and `mnist all`: the default run reaches its accuracy,
and how fast (benchmarks/gpu_check.py runs them; benchmarks/gpu_kit.py is what they share).
"""

from __future__ import annotations

import json

from spotring.benchmarks.gpu_kit import COMPOSING, Failed, Kit, Result, rate, torchrun
from spotring.benchmarks.runs import shown, trainer_records
from spotring.benchmarks.stats import mean_ci


def check_mnist(kit: Kit, result: Result, workers: int) -> None:
    """The default run under torchrun on ``workers`` ranks, each seed: seconds to the
    target (the first evaluation at or above it, on the training clock) and img/s."""
    from spotring.benchmarks.time_to_accuracy import (
        EVALUATIONS,
        eval_interval,
        seconds_to,
        trainer_steps,
    )

    with COMPOSING:
        planned = trainer_steps(workers, kit.mode.mnist_steps)["steps"]
    every = eval_interval(planned, EVALUATIONS)
    steps = [] if kit.mode.mnist_steps is None else [f"train.max_steps={kit.mode.mnist_steps}"]
    samples = kit.mode.eval_samples
    runs = result.figures.setdefault("runs", [])
    for seed in kit.mode.seeds:
        run_dir = kit.run_dir(f"mnist-w{workers}-s{seed}")
        command = torchrun(workers, kit.trainer_args(
            run_dir, f"train.seed={seed}", f"train.eval_every_steps={every}",
            f"train.eval_samples={'null' if samples is None else samples}", *steps))
        result.commands.append(shown(command))
        kit.run(command)
        summary = json.loads((run_dir / "summary.json").read_text())
        curve = [(r["step"], r["train_seconds"], r["accuracy"])
                 for r in trainer_records(run_dir, "test")]
        runs.append({"seed": seed, "seconds_to_target": seconds_to(curve, kit.mode.target),
                     "images_per_second": summary["images_per_second"],
                     "test_accuracy": summary["test_accuracy"], "steps": summary["steps"],
                     "train_seconds": summary["train_seconds"], "backend": summary["backend"],
                     "precision": summary["precision"], "curve": curve,
                     "command": shown(command)})
    reached = [r["seconds_to_target"] for r in runs if r["seconds_to_target"] is not None]
    per_second = mean_ci([r["images_per_second"] for r in runs])
    result.figures |= {"target": kit.mode.target, "workers": workers,
                       "images_per_second": per_second, "reached": len(reached)}
    target = f"{100 * kit.mode.target:g}%"
    to_target = (f"{target} in {sum(reached) / len(reached):.1f} s mean, "
                 f"{max(reached):.1f} s worst" if reached else f"{target} not reached")
    result.summary = (f"{to_target} ({len(reached)}/{len(runs)} seeds); "
                      f"{rate(per_second)}; {runs[0]['backend']}, {runs[0]['precision']}")
    if len(reached) < len(runs):
        raise Failed(f"{len(runs) - len(reached)} of {len(runs)} seeds did not reach {target} "
                     f"(final accuracies {[r['test_accuracy'] for r in runs]})")
