"""What spotring's library API costs: a training loop with its calls beside the same plain
DDP script, its DataLoader over image files, and the built-in trainer before and after it
was rebuilt on the API.

    python -m spotring.benchmarks.api_cost          # api and dataloader
    python -m spotring.benchmarks.api_cost --only api,dataloader,trainer-before-after \\
        --before /tmp/spotring-before               # all three, about 6 minutes

Sections (--only, comma-separated), into benchmarks/results/api-cost/ (--name):
results.json, report.md, and runs/ (not results: ignored by git):

    api        one job two ways, under `torchrun --nproc-per-node 2`, 1 thread per worker:
               `plain` (torch DataLoader + DistributedSampler, DDP, SGD) and `spotring`
               (job.loader, job.wrap, job.track, job.should_stop every step, job.save
               after the timed window): benchmarks/api_cost_loops.py, whose two loops
               differ only in those lines.
               MNIST's 60,000 training images in memory (a TensorDataset, normalized as
               benchmarks/plain_loop.py does), its convnet, global batch 128. img/s:
               rank 0's wall clock over the steps after the warm-up, data loading and
               every call included. The figure: spotring / plain (goal: 0.97 or more).
    dataloader spotring.DataLoader over PNG files: MNIST's first 4096 training digits
               written once into a temporary folder in torchvision's ImageFolder layout,
               read as examples/train.py reads them (Pillow, grey, float32); one process,
               num_workers 0, 1 and 2 (persistent), global batch 128; img/s of the batches
               after the warm-up, nothing trained.
    trainer-before-after  the default run under `torchrun --nproc-per-node 2` (one epoch),
               in --before (a checkout of the commit before the rebuild, whose trainer
               was the top-level package `trainer`, run there with PYTHONPATH on it) and
               as `-m spotring.trainer` in this checkout: img/s from summary.json and the
               training seconds to 99% test accuracy, benchmarks/time_to_accuracy.py's way
               (about 15 evaluations on the whole test set; seed = the repeat's number).

Every configuration runs --repeats times (api and dataloader 5, the trainer 3), the
configurations of a repeat one after the other, in reverse order every other repeat, so
that the machine's drift falls on all alike. The figures: benchmarks/api_cost_report.py.
Bad input exits 2 before anything runs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from PIL import Image

from spotring.benchmarks import machine, record
from spotring.benchmarks.api_cost_loops import GLOBAL_BATCH, SEED, THREADS, WINDOWS
from spotring.benchmarks.api_cost_loops import MODULE as LOOPS
from spotring.benchmarks.api_cost_report import derive, render
from spotring.benchmarks.runs import json_line, run_together, shown, trainer_records
from spotring.benchmarks.stats import interleaved
from spotring.benchmarks.suite import counts
from spotring.benchmarks.time_to_accuracy import EVALUATIONS, TARGET, eval_interval, seconds_to
from spotring.benchmarks.time_to_accuracy import trainer_steps as default_run
from spotring.launch.commands import local_command
from spotring.trainer import datasets
from spotring.trainer.config import compose

MODULE = "spotring.benchmarks.api_cost"
SECTIONS = ("api", "dataloader", "trainer-before-after")
REPEATS = {"api": 5, "dataloader": 5, "trainer-before-after": 3}
WORKERS = 2  # torchrun's, for api and the trainer
LOADER_WORKERS = (0, 1, 2)
FILES = 4096
GOAL = 0.97  # spotring / plain img/s
# The trainer's module in a checkout of the commit before the rebuild: a top-level
# package then (spotring.trainer since the layout of issue 39).
BEFORE_TRAINER = "trainer"


def _run(command: list[str]) -> tuple[dict, str]:
    """One run's JSON line and its command as shown; the load it started under."""
    load = machine.load_average()[0]
    (out,) = run_together([command])
    return {**json_line(out, "images_per_second"), "load": load}, shown(command)


def _window_args(section: str) -> list[str]:
    warmup, steps = WINDOWS[section]
    return ["--global-batch", str(GLOBAL_BATCH), "--warmup", str(warmup), "--steps", str(steps)]


def measure_api(repeats: int, folder: Path) -> dict:
    runs = []
    for i, variant in interleaved(["plain", "spotring"], repeats):
        run_dir = folder / "runs" / f"api-{variant}-r{i}"
        command = local_command("torchrun", WORKERS, [
            "--variant", variant, *_window_args("api"), "--run-dir", str(run_dir)],
            module=LOOPS)
        result, shown_command = _run(command)
        shutil.rmtree(run_dir, ignore_errors=True)  # its checkpoint: not a measurement
        runs.append({**result, "repeat": i, "command": shown_command})
        print(f"[api {len(runs)}/{2 * repeats}] {variant}: "
              f"{result['images_per_second']:.0f} img/s", flush=True)
    return {"workers": WORKERS, "threads": THREADS, "goal": GOAL, "runs": runs}


def write_pngs(folder: Path, count: int) -> None:
    """MNIST's first ``count`` training digits as folder/<label>/<i>.png."""
    cfg = compose(["dataset=mnist"])
    train = datasets.load(cfg.dataset, cfg.data, SEED).train
    for i in range(count):
        label = folder / str(int(train.labels[i]))
        label.mkdir(exist_ok=True)
        Image.fromarray(train.images[i, 0].numpy(), mode="L").save(label / f"{i}.png")


def measure_dataloader(repeats: int, folder: Path) -> dict:
    runs = []
    with tempfile.TemporaryDirectory(prefix="api-cost-png-") as data:
        write_pngs(Path(data), FILES)
        for i, workers in interleaved(list(LOADER_WORKERS), repeats):
            command = local_command("single", 1, [
                "--variant", "files", *_window_args("dataloader"), "--data", data,
                "--loader-workers", str(workers)], module=LOOPS)
            result, shown_command = _run(command)
            runs.append({**result, "repeat": i, "command": shown_command})
            print(f"[dataloader {len(runs)}/{len(LOADER_WORKERS) * repeats}] num_workers "
                  f"{workers}: {result['images_per_second']:.0f} img/s", flush=True)
    return {"files": FILES, "loader_workers": list(LOADER_WORKERS), "runs": runs}


def _in_checkout(before: Path) -> list[str]:
    """The prefix that runs a command in ``before`` with its own packages first."""
    return ["env", "-C", str(before), f"PYTHONPATH={before}"]


def check_before(before: Path) -> str:
    """The commit of ``before``; raises where its trainer is not what runs there."""
    probe = subprocess.run(
        [*_in_checkout(before), sys.executable, "-c", f"import spotring, {BEFORE_TRAINER}; "
         f"print({BEFORE_TRAINER}.__file__); print(spotring.__file__)"],
        capture_output=True, text=True, timeout=120)
    files = probe.stdout.split()
    if probe.returncode != 0 or not all(Path(f).is_relative_to(before) for f in files):
        raise RuntimeError(f"{before}: its trainer does not import from there: "
                           f"{probe.stdout}{probe.stderr[-2000:]}")
    done = subprocess.run(["git", "-C", str(before), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, timeout=30)
    return done.stdout.strip() or "unknown"


def measure_trainer(repeats: int, before: Path, before_commit: str, folder: Path) -> dict:
    steps = default_run(WORKERS, None)["steps"]
    every = eval_interval(steps, EVALUATIONS)
    runs = []
    for seed, tree in interleaved(["before", "after"], repeats):
        run_dir = folder / "runs" / f"trainer-{tree}-s{seed}"
        # Emptied first: the trainer appends to the metrics.jsonl of an earlier run of
        # this name, whose evaluations would be read as this run's.
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        args = [f"hydra.run.dir={run_dir}", "telemetry.progress=false", f"train.seed={seed}",
                f"train.eval_every_steps={every}", "train.eval_samples=null"]
        command = (local_command("torchrun", WORKERS, args) if tree == "after" else
                   [*_in_checkout(before),
                    *local_command("torchrun", WORKERS, args, module=BEFORE_TRAINER)])
        load = machine.load_average()[0]
        run_together([command])
        summary = json.loads((run_dir / "summary.json").read_text())
        curve = [(r["step"], r["train_seconds"], r["accuracy"])
                 for r in trainer_records(run_dir, "test")]
        runs.append({"tree": tree, "repeat": seed, "seed": seed, "load": load,
                     "images_per_second": summary["images_per_second"],
                     "train_seconds": summary["train_seconds"],
                     "test_accuracy": summary["test_accuracy"], "steps": summary["steps"],
                     "seconds_to_target": seconds_to(curve, TARGET),
                     "curve": [list(point) for point in curve], "command": shown(command)})
        r = runs[-1]
        reached = ("not reached" if r["seconds_to_target"] is None
                   else f"{r['seconds_to_target']:.1f} s")
        print(f"[trainer {len(runs)}/{2 * repeats}] {tree}, seed {seed}: "
              f"{r['images_per_second']:.0f} img/s, {100 * TARGET:.0f}% after {reached}",
              flush=True)
    return {"before_dir": str(before), "before_commit": before_commit, "workers": WORKERS,
            "target": TARGET, "eval_every": every, "steps": steps, "runs": runs}


def measure(args: argparse.Namespace, folder: Path) -> dict:
    repeats = {s: args.repeats or REPEATS[s] for s in args.only}
    results = {}
    if "trainer-before-after" in args.only:
        before_commit = check_before(args.before)  # before anything runs
    if "api" in args.only:
        results["api"] = measure_api(repeats["api"], folder)
    if "dataloader" in args.only:
        results["dataloader"] = measure_dataloader(repeats["dataloader"], folder)
    if "trainer-before-after" in args.only:
        results["trainer_before_after"] = measure_trainer(
            repeats["trainer-before-after"], args.before, before_commit, folder)
    return results


def _sections(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    bad = [name for name in names if name not in SECTIONS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"{', '.join(map(repr, bad)) or repr(text)}: "
                                         f"valid: {', '.join(SECTIONS)}")
    return list(dict.fromkeys(names))


def _checkout(text: str) -> Path:
    path = Path(text).expanduser().resolve()
    if not (path / "trainer" / "__main__.py").is_file():
        raise argparse.ArgumentTypeError(
            f"{text}: no trainer/__main__.py there; make the checkout to compare with "
            f"`git worktree add {text} HEAD`")
    return path


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0],
                                epilog="The method: the module's docstring.")
    p.add_argument("--only", type=_sections, default=["api", "dataloader"],
                   help=f"sections, comma-separated: {', '.join(SECTIONS)} "
                   "(default: api,dataloader)")
    p.add_argument("--before", type=_checkout,
                   help="the checkout of the commit before the rebuild (trainer-before-after)")
    p.add_argument("--repeats", type=counts,
                   help="runs of every configuration (default: api and dataloader 5, "
                   "trainer-before-after 3)")
    p.add_argument("--name", default="api-cost",
                   help="the results folder: a name under benchmarks/results, or a path")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = parser()
    args = p.parse_args(argv)
    if "trainer-before-after" in args.only and args.before is None:
        p.error("--only trainer-before-after needs --before DIR, a checkout of the commit "
                "before the rebuild: git worktree add /tmp/spotring-before HEAD")
    if args.before is not None and "trainer-before-after" not in args.only:
        p.error("--before is read by the trainer-before-after section alone: add it to --only")
    return record.run_alone(MODULE, argv, args.name, "api-cost", lambda f: measure(args, f),
                            derive, render)


if __name__ == "__main__":
    sys.exit(main())
