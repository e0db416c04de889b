"""What the trainer costs over a plain PyTorch loop in time to accuracy, on the default MNIST job.

For 1 worker with 2 threads and for 2 workers with 1 thread each (torchrun, DDP on
Gloo), runs the trainer's default config and benchmarks/plain_loop.py with the same
network, global batch (128), data and LR curve, back to back, `--repeats` times in one
session: trainer first in even repeats, plain first in odd ones, so a drift of the
machine's speed favours neither. Reports img/s (training steps only), the training time
until the test accuracy first reaches 99% (evaluated every quarter epoch), and the
ratio trainer / plain of each back-to-back pair with their median: on a shared VM the
speed wanders by tens of percent over minutes, and a pair sees the same few minutes.
(benchmarks/throughput.py measures img/s alone, with confidence intervals; this measures
whole runs, accuracy included.)

    python -m benchmarks.mnist_overhead [--repeats 1] [--epochs 2]   # about 3 min a repeat

Writes benchmarks/results/<time>-mnist-overhead/results.json (section "mnist_overhead");
`python -m benchmarks.report` renders it.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from benchmarks import record
from benchmarks.runs import plain_result, run_together, shown, trainer_metrics
from launch.commands import local_command

EVAL_EVERY = 117  # steps of global batch 128: a quarter epoch
GLOBAL_BATCH = 128

SETUPS = {  # name: (launcher, workers, threads per worker)
    "1 worker x 2 threads": ("single", 1, 2),
    "2 workers x 1 thread": ("torchrun", 2, 1),
}


def time_to(evals: list[dict], accuracy: float) -> float | None:
    return next((e["train_seconds"] for e in evals if e["accuracy"] >= accuracy), None)


def run_trainer(launcher: str, workers: int, threads: int, epochs: int,
                run_dir: Path) -> tuple[dict, str]:
    args = [f"hydra.run.dir={run_dir}", "telemetry.progress=false", f"train.epochs={epochs}",
            f"train.batch_size={GLOBAL_BATCH // workers}", f"train.threads={threads}",
            f"train.eval_every_steps={EVAL_EVERY}"]
    command = local_command(launcher, workers, args)
    run_together([command])
    evals = [r for r in trainer_metrics(run_dir) if r["kind"] == "test"]
    summary = json.loads((run_dir / "summary.json").read_text())
    result = {"images_per_second": summary["images_per_second"],
              "test_accuracy": evals[-1]["accuracy"], "time_to_99": time_to(evals, 0.99)}
    return result, shown(command)


def run_plain(launcher: str, workers: int, threads: int, epochs: int,
              run_dir: Path) -> tuple[dict, str]:
    args = ["--epochs", str(epochs), "--batch-size", str(GLOBAL_BATCH // workers),
            "--threads", str(threads), "--eval-every", str(EVAL_EVERY)]
    command = local_command(launcher, workers, args, module="benchmarks.plain_loop")
    run_dir.mkdir(parents=True, exist_ok=True)
    result = plain_result(run_dir, run_together([command])[0])
    return {"images_per_second": result["images_per_second"],
            "test_accuracy": result["test_accuracy"],
            "time_to_99": time_to(result["evals"], 0.99)}, shown(command)


def measure(repeats: int, epochs: int, folder: Path) -> dict:
    runs: dict[str, dict[str, list[dict]]] = {s: {"trainer": [], "plain": []} for s in SETUPS}
    commands = []
    kinds = [("trainer", run_trainer), ("plain", run_plain)]
    for repeat in range(repeats):
        for setup, (launcher, workers, threads) in SETUPS.items():
            for kind, fn in kinds if repeat % 2 == 0 else kinds[::-1]:
                run_dir = folder / "runs" / f"overhead-{kind}-w{workers}-r{repeat}"
                result, command = fn(launcher, workers, threads, epochs, run_dir)
                runs[setup][kind].append(result)
                commands.append(command)
                print(f"[{repeat + 1}/{repeats}] {setup}, {kind}: "
                      f"{result['images_per_second']:.0f} img/s, "
                      f"99% after {result['time_to_99']} s, "
                      f"final {100 * result['test_accuracy']:.2f}%", flush=True)

    def median(setup: str, kind: str, key: str) -> float | None:
        values = [r[key] for r in runs[setup][kind] if r[key] is not None]
        return statistics.median(values) if values else None

    rows = []
    for setup in SETUPS:
        row = {"setup": setup} | {f"{kind}_{key}": median(setup, kind, key)
                                  for kind in ("trainer", "plain")
                                  for key in ("images_per_second", "time_to_99",
                                              "test_accuracy")}
        pairs = zip(runs[setup]["trainer"], runs[setup]["plain"], strict=True)
        row["pair_ratios"] = [t["images_per_second"] / p["images_per_second"] for t, p in pairs]
        row["ratio"] = statistics.median(row["pair_ratios"])
        rows.append(row)
    return {"epochs": epochs, "global_batch": GLOBAL_BATCH, "repeats": repeats, "rows": rows,
            "runs": runs, "commands": commands}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--epochs", type=int, default=2)
    record.add_name_argument(p, "mnist-overhead")
    args = p.parse_args()
    record.write(args.name, "mnist-overhead", lambda folder: {
        "mnist_overhead": measure(args.repeats, args.epochs, folder)})


if __name__ == "__main__":
    main()
