"""What the trainer costs over a plain PyTorch loop, on the default MNIST job.

For 1 worker with 2 threads and for 2 workers with 1 thread each (torchrun, DDP on
Gloo), runs the trainer's default config and benchmarks/plain_loop.py with the same
network, global batch (128), data and LR curve, alternating them `--repeats` times in
one session so both see the same machine. Reports img/s (training steps only) and the
training time until the test accuracy first reaches 99% (evaluated every quarter
epoch), and the ratio trainer / plain.

    python -m benchmarks.mnist_overhead [--repeats 1] [--epochs 2]

Writes benchmarks/results/mnist-overhead-<time>/{results.json,report.md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from launch.commands import local_command, local_environment

REPO = Path(__file__).resolve().parents[1]
EVAL_EVERY = 117  # steps of global batch 128: a quarter epoch

SETUPS = {  # name: (launcher, workers, threads per worker)
    "1 worker x 2 threads": ("single", 1, 2),
    "2 workers x 1 thread": ("torchrun", 2, 1),
}


def time_to(evals: list[dict], accuracy: float) -> float | None:
    return next((e["train_seconds"] for e in evals if e["accuracy"] >= accuracy), None)


def run_trainer(launcher: str, workers: int, threads: int, epochs: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        args = [f"hydra.run.dir={tmp}", "telemetry.progress=false", f"train.epochs={epochs}",
                f"train.batch_size={128 // workers}", f"train.threads={threads}",
                f"train.eval_every_steps={EVAL_EVERY}"]
        subprocess.run(local_command(launcher, workers, args), cwd=REPO, check=True,
                       env=local_environment(), capture_output=True, text=True)
        summary = json.loads((Path(tmp) / "summary.json").read_text())
        records = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").open()]
    evals = [r for r in records if r["kind"] == "test"]
    return {"images_per_second": summary["images_per_second"],
            "test_accuracy": summary["test_accuracy"], "time_to_99": time_to(evals, 0.99)}


def run_plain(launcher: str, workers: int, threads: int, epochs: int) -> dict:
    args = ["--epochs", str(epochs), "--batch-size", str(128 // workers),
            "--threads", str(threads), "--eval-every", str(EVAL_EVERY)]
    out = subprocess.run(local_command(launcher, workers, args, module="benchmarks.plain_loop"),
                         cwd=REPO, check=True, env=local_environment(), capture_output=True,
                         text=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    return {"images_per_second": result["images_per_second"],
            "test_accuracy": result["test_accuracy"],
            "time_to_99": time_to(result["evals"], 0.99)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--epochs", type=int, default=2)
    args = p.parse_args()

    runs: dict[str, dict[str, list[dict]]] = {s: {"trainer": [], "plain": []} for s in SETUPS}
    for repeat in range(args.repeats):
        for setup, (launcher, workers, threads) in SETUPS.items():
            for kind, fn in (("trainer", run_trainer), ("plain", run_plain)):
                result = fn(launcher, workers, threads, args.epochs)
                runs[setup][kind].append(result)
                print(f"[{repeat + 1}/{args.repeats}] {setup}, {kind}: "
                      f"{result['images_per_second']:.0f} img/s, "
                      f"99% after {result['time_to_99']} s, "
                      f"final {100 * result['test_accuracy']:.2f}%", flush=True)

    def median(setup: str, kind: str, key: str) -> float | None:
        values = [r[key] for r in runs[setup][kind] if r[key] is not None]
        return statistics.median(values) if values else None

    rows = ["| setup | trainer img/s | plain img/s | ratio | trainer s to 99% | "
            "plain s to 99% | trainer final | plain final |", "|" + " --- |" * 8]
    for setup in SETUPS:
        t, p_ = median(setup, "trainer", "images_per_second"), median(setup, "plain",
                                                                       "images_per_second")
        cells = [setup, f"{t:.0f}", f"{p_:.0f}", f"{t / p_:.3f}"]
        for kind in ("trainer", "plain"):
            seconds = median(setup, kind, "time_to_99")
            cells.append("not reached" if seconds is None else f"{seconds:.1f}")
        cells += [f"{100 * median(setup, k, 'test_accuracy'):.2f}%" for k in ("trainer", "plain")]
        rows.append("| " + " | ".join(cells) + " |")
    table = "\n".join(rows)
    print("\n" + table)

    out = REPO / "benchmarks" / "results" / f"mnist-overhead-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True)
    (out / "results.json").write_text(json.dumps(runs, indent=1))
    (out / "report.md").write_text(
        f"# Trainer vs plain PyTorch loop, MNIST, {args.epochs} epochs, global batch 128\n\n"
        f"Medians of {args.repeats} run(s) each, alternated in one session. "
        f"`python -m benchmarks.mnist_overhead --repeats {args.repeats}`\n\n{table}\n")
    print(f"\nwritten: {out}/report.md")


if __name__ == "__main__":
    main()
