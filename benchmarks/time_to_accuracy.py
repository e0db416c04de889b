"""Training seconds to a target test accuracy: the trainer's default recipe per worker
count, beside the fixed reference loop (benchmarks/reference_loop.py); the method:
docs/benchmarks.md, "Time to accuracy".

A run's time to the target is the training seconds (evaluation and checkpoints excluded)
of its first evaluation at or above the target, nothing interpolated; the seeds run the
configurations interleaved, reversed every other seed.
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
from dataclasses import dataclass
from pathlib import Path

from spotring.benchmarks import reference_loop
from spotring.benchmarks.runs import (
    MNIST,
    json_line,
    launch_command,
    run_together,
    shown,
    shown_dir,
    trainer_records,
)
from spotring.benchmarks.stats import interleaved

EVALUATIONS = 15  # per run, about: the curve's points
TARGET = 0.99


@dataclass(frozen=True)
class Configuration:
    program: str  # reference | trainer
    workers: int = 1

    @property
    def label(self) -> str:
        return "reference loop" if self.program == "reference" else f"trainer x {self.workers}"

    @property
    def slug(self) -> str:
        return "reference" if self.program == "reference" else f"trainer-w{self.workers}"


REFERENCE = Configuration("reference")


def eval_interval(steps: int, evaluations: int) -> int:
    """Steps between evaluations for about ``evaluations`` of them in a run of ``steps``."""
    return max(1, math.ceil(steps / evaluations))


def trainer_steps(workers: int, max_steps: int | None) -> dict:
    """The default config's global batch and steps at ``workers`` workers, from the config
    composed as `python -m spotring.trainer` would and the trainer's own schedule (raises
    spotring.exits.ConfigError)."""
    from spotring.sampler import steps_in_epoch
    from spotring.trainer.config import compose, global_batch
    from spotring.trainer.schedule import lr_schedule

    cfg = compose([])
    if cfg.dataset.name != "mnist":
        raise ValueError(f"the default dataset is {cfg.dataset.name}; the time-to-accuracy "
                         "benchmark and its reference loop train MNIST")
    batch = global_batch(cfg, workers)
    steps = lr_schedule(cfg, batch, steps_in_epoch(MNIST.train_samples, batch)).total_steps
    for cap in (cfg.train.max_steps, max_steps):
        steps = steps if cap is None else min(steps, cap)
    return {"global_batch": batch, "steps": steps}


def reference_steps(max_steps: int | None) -> dict:
    steps = reference_loop.steps_per_epoch(MNIST.train_samples)
    return {"global_batch": reference_loop.BATCH,
            "steps": steps if max_steps is None else min(steps, max_steps)}


def seconds_to(curve: list, target: float) -> float | None:
    """The training seconds of the first evaluation at or above ``target``; None if none."""
    return next((seconds for _, seconds, accuracy in curve if accuracy >= target), None)


def _run(config: Configuration, seed: int, eval_every: int, max_steps: int | None,
         run_dir: Path) -> dict:
    """One run: its curve [(step, train seconds, accuracy)], final figures and command.
    ``run_dir`` is emptied first: the trainer appends to a metrics.jsonl it finds there."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    if config.program == "reference":
        command = launch_command("single", 1, [
            "--seed", str(seed), "--eval-every", str(eval_every),
            *([] if max_steps is None else ["--max-steps", str(max_steps)])],
            module="spotring.benchmarks.reference_loop")
        (out,) = run_together([command])
        (run_dir / "stdout.json").write_text(out)
        result = json_line(out, "curve")
        result["peak_lr"] = reference_loop.PEAK_LR
    else:
        command = launch_command("torchrun" if config.workers > 1 else "single", config.workers, [
            f"hydra.run.dir={run_dir}", "telemetry.progress=false", f"train.seed={seed}",
            f"train.eval_every_steps={eval_every}", "train.eval_samples=null",
            *([] if max_steps is None else [f"train.max_steps={max_steps}"])])
        run_together([command])
        result = json.loads((run_dir / "summary.json").read_text())
        result["curve"] = [(r["step"], r["train_seconds"], r["accuracy"])
                           for r in trainer_records(run_dir, "test")]
    return {"label": config.label, "program": config.program, "workers": config.workers,
            "seed": seed, "eval_every": eval_every, "steps": result["steps"],
            "peak_lr": result["peak_lr"], "curve": [list(point) for point in result["curve"]],
            "train_seconds": result["train_seconds"], "test_accuracy": result["test_accuracy"],
            "command": shown(command), "dir": shown_dir(run_dir)}


def summarize(plan: dict[Configuration, dict], runs: list[dict], target: float) -> list[dict]:
    """The rows of the report's table, the reference's first: every number computed here."""
    rows = []
    for config, steps in plan.items():
        mine = sorted((r for r in runs if r["label"] == config.label), key=lambda r: r["seed"])
        seconds = [seconds_to(r["curve"], target) for r in mine]
        reached = [s for s in seconds if s is not None]
        finals = [r["test_accuracy"] for r in mine]
        rows.append({
            "label": config.label, "program": config.program, "workers": config.workers,
            **steps, "eval_every": mine[0]["eval_every"], "peak_lr": mine[0]["peak_lr"],
            "seeds": [r["seed"] for r in mine], "seconds": seconds, "reached": len(reached),
            "mean": statistics.fmean(reached) if reached else None,
            "worst": max(reached) if len(reached) == len(seconds) else None,
            "final_accuracy": {"mean": statistics.fmean(finals), "worst": min(finals)},
            "train_seconds": {"mean": statistics.fmean(r["train_seconds"] for r in mine),
                              "worst": max(r["train_seconds"] for r in mine)}})
    reference, reference_run = rows[0]["mean"], rows[0]["train_seconds"]["mean"]
    for row in rows:
        row["ratio"] = (None if row["mean"] is None or not reference
                        else row["mean"] / reference)
        row["run_ratio"] = row["train_seconds"]["mean"] / reference_run
    return rows


def measure(workers: list[int], seeds: list[int], target: float, max_steps: int | None,
            evaluations: int, folder: Path) -> dict:
    """The time_to_accuracy section of results.json."""
    plan = {REFERENCE: reference_steps(max_steps)}
    plan |= {Configuration("trainer", n): trainer_steps(n, max_steps) for n in sorted(workers)}
    order = list(plan)
    runs: list[dict] = []
    total = len(seeds) * len(order)
    for i, config in interleaved(order, len(seeds)):
        seed = seeds[i]
        every = eval_interval(plan[config]["steps"], evaluations)
        run = _run(config, seed, every, max_steps,
                   folder / "runs" / f"tta-{config.slug}-s{seed}")
        runs.append(run)
        seconds = seconds_to(run["curve"], target)
        reached = ("not reached" if seconds is None
                   else f"{100 * target:.2f}% after {seconds:.1f} s")
        print(f"[{len(runs)}/{total}] time to accuracy {config.label}, seed {seed}: "
              f"{reached}; final {100 * run['test_accuracy']:.2f}% after "
              f"{run['train_seconds']:.1f} s of training", flush=True)
    return {"target": target, "seeds": seeds, "evaluations": evaluations,
            "max_steps": max_steps, "rows": summarize(plan, runs, target), "runs": runs}
