"""What spotring's library API costs: a training loop with its calls beside the same plain
DDP script, its DataLoader over image files, and the built-in trainer before and after it
was rebuilt on the API.

    python -m spotring.benchmarks.api_cost                   # api and dataloader, about 3 minutes
    python -m spotring.benchmarks.api_cost --only api,dataloader,trainer-before-after \\
        --before /tmp/spotring-before               # all three, about 6 minutes
    torchrun --standalone --nproc-per-node 2 -m spotring.benchmarks.api_cost --variant spotring

Sections (--only, comma-separated), into benchmarks/results/api-cost/ (--name):
results.json, report.md, and runs/ (not results: ignored by git):

    api        one job two ways, under `torchrun --nproc-per-node 2`, 1 thread per worker:
               `plain` (torch DataLoader + DistributedSampler, DDP, SGD) and `spotring`
               (job.loader, job.wrap, job.track, job.should_stop every step, job.save
               after the timed window); the two loops below differ only in those lines
               (and in the DDP: DDP's defaults, and spotring's engine's, which views
               gradients in its buckets).
               MNIST's 60,000 training images in memory (a TensorDataset, normalized as
               benchmarks/plain_loop.py does), its convnet, global batch 128. img/s:
               rank 0's wall clock over the steps after the warm-up, data loading and
               every call included. The figure: spotring / plain (goal: 0.97 or more).
    dataloader spotring.DataLoader over PNG files: MNIST's first 4096 training digits
               written once into a temporary folder in torchvision's ImageFolder layout,
               read as examples/train.py reads them (Pillow, grey, float32); one process,
               num_workers 0, 1 and 2 (persistent), global batch 128; img/s of the batches
               after the warm-up, nothing trained.
    trainer-before-after  the default run, `torchrun --nproc-per-node 2 -m spotring.trainer` (one
               epoch), in --before (a checkout of the commit before the rebuild, run there
               with PYTHONPATH on it) and in this checkout: img/s from summary.json and the
               training seconds to 99% test accuracy, benchmarks/time_to_accuracy.py's way
               (about 15 evaluations on the whole test set; seed = the repeat's number).

Every configuration runs --repeats times (api and dataloader 5, the trainer 3), the
configurations of a repeat one after the other, in reverse order every other repeat, so
that the machine's drift falls on all alike. Each figure is the mean over the repeats with
its 95% interval (benchmarks/stats.py); a ratio is the mean of the repeats' own ratios
(each of two runs side by side), and is "unjudgeable" where its interval spans the goal.
Bad input exits 2 before anything runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torchvision.datasets import ImageFolder
from torchvision.transforms import v2

import spotring
from spotring.benchmarks import machine, record
from spotring.benchmarks.plain_loop import mnist, network
from spotring.benchmarks.report import commands, header, spread, table
from spotring.benchmarks.runs import json_line, run_together, shown, trainer_records
from spotring.benchmarks.stats import interleaved, mean_ci
from spotring.benchmarks.suite import counts
from spotring.benchmarks.time_to_accuracy import EVALUATIONS, TARGET, eval_interval, seconds_to
from spotring.benchmarks.time_to_accuracy import trainer_steps as default_run
from spotring.launch.commands import local_command
from spotring.stores import write_atomic
from spotring.trainer import datasets
from spotring.trainer.config import compose

MODULE = "spotring.benchmarks.api_cost"
SECTIONS = ("api", "dataloader", "trainer-before-after")
REPEATS = {"api": 5, "dataloader": 5, "trainer-before-after": 3}
WORKERS = 2  # torchrun's, for api and the trainer
THREADS = 1  # torch threads per process
GLOBAL_BATCH = 128
SEED = 0
WINDOWS = {"api": (30, 600), "dataloader": (10, 300)}  # (warm-up steps, timed steps)
LOADER_WORKERS = (0, 1, 2)
FILES = 4096
GOAL = 0.97  # spotring / plain img/s


# ------------------------------------------------------------------------ one run


class Window:
    """The wall-clock seconds of steps warmup+1 .. warmup+steps of a loop: ``tick()`` after
    every step says when the window is complete."""

    def __init__(self, warmup: int, steps: int, global_batch: int) -> None:
        self.warmup, self.steps, self.global_batch = warmup, steps, global_batch
        self.done, self.started, self.seconds = 0, 0.0, 0.0

    def epochs(self, steps_per_epoch: int) -> int:
        """Epochs that hold the warm-up and the window."""
        return math.ceil((self.warmup + self.steps) / steps_per_epoch)

    @property
    def complete(self) -> bool:
        return self.done >= self.warmup + self.steps

    def tick(self) -> bool:
        self.done += 1
        if self.done == self.warmup:
            self.started = time.perf_counter()
        elif self.complete:
            self.seconds = time.perf_counter() - self.started
        return self.complete

    def result(self, **fields) -> dict:
        return {"images_per_second": self.steps * self.global_batch / self.seconds,
                "seconds": self.seconds, "warmup": self.warmup, "steps": self.steps,
                "global_batch": self.global_batch, **fields}


def mnist_in_memory():
    """MNIST's 60,000 training images, normalized, and labels: a TensorDataset."""
    return TensorDataset(*mnist()["train"])


def network_and_sgd():
    """benchmarks/plain_loop.py's convnet, and SGD with momentum over it."""
    model = network()
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def train_step(model, optimizer, x, y) -> None:
    loss = F.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def plain(args: argparse.Namespace) -> dict | None:
    """The job as a plain PyTorch DDP script; rank 0's window."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(THREADS)
    torch.manual_seed(SEED)
    dataset = mnist_in_memory()
    sampler = DistributedSampler(dataset, world, rank, seed=SEED, drop_last=True)
    loader = DataLoader(dataset, args.global_batch // world, sampler=sampler, drop_last=True)
    model, optimizer = network_and_sgd()
    model = DistributedDataParallel(model)
    window = Window(args.warmup, args.steps, args.global_batch)
    for epoch in range(window.epochs(len(loader))):
        sampler.set_epoch(epoch)
        for x, y in loader:
            train_step(model, optimizer, x, y)
            if window.tick():
                break
        if window.complete:
            break
    dist.barrier()  # leave together: no rank closes while another still reduces
    dist.destroy_process_group()
    return window.result(variant="plain", world_size=world) if rank == 0 else None


def with_spotring(args: argparse.Namespace) -> dict | None:
    """The same job with spotring's calls; rank 0's window."""
    with spotring.init(threads=THREADS, seed=SEED, run_dir=args.run_dir) as job:
        dataset = mnist_in_memory()
        loader = job.loader(dataset, args.global_batch)
        model, optimizer = job.wrap(*network_and_sgd())
        job.track(model=model, optimizer=optimizer, loader=loader)
        window = Window(args.warmup, args.steps, args.global_batch)
        for _ in loader.epochs(window.epochs(loader.steps_per_epoch)):
            for x, y in loader:
                train_step(model, optimizer, x, y)
                if job.should_stop():
                    job.save_and_exit()
                if window.tick():
                    break
            if window.complete:
                break
        result = window.result(variant="spotring", world_size=job.world_size)
        job.save()  # after the window: a checkpoint costs what the disk does
    return result if job.is_main else None


def image_files(args: argparse.Namespace) -> dict:
    """spotring.DataLoader over the PNG files in args.data, one process; the window."""
    torch.set_num_threads(THREADS)
    to_tensor = v2.Compose([v2.Grayscale(), v2.ToImage(),
                            v2.ToDtype(torch.float32, scale=True)])
    workers = args.loader_workers
    loader = spotring.DataLoader(ImageFolder(args.data, transform=to_tensor),
                                 args.global_batch, seed=SEED, rank=0, world_size=1,
                                 num_workers=workers, persistent_workers=workers > 0)
    window = Window(args.warmup, args.steps, args.global_batch)
    for _ in loader.epochs(window.epochs(loader.steps_per_epoch)):
        for _batch in loader:
            if window.tick():
                break
        if window.complete:
            break
    return window.result(variant="files", loader_workers=workers, files=len(loader.dataset))


VARIANTS = {"plain": plain, "spotring": with_spotring, "files": image_files}


# ------------------------------------------------------------------------- driver


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
            module=MODULE)
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
                "--loader-workers", str(workers)], module=MODULE)
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
        [*_in_checkout(before), sys.executable, "-c",
         "import spotring, trainer; print(trainer.__file__); print(spotring.__file__)"],
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
        command = local_command("torchrun", WORKERS, [
            f"hydra.run.dir={run_dir}", "telemetry.progress=false", f"train.seed={seed}",
            f"train.eval_every_steps={every}", "train.eval_samples=null"])
        if tree == "before":
            command = [*_in_checkout(before), *command]
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


# --------------------------------------------------------------------- the figures


def judge(ratio: dict, goal: float) -> str:
    """Whether a ratio's 95% interval lies at or above ``goal``, below it, or spans it."""
    low, high = ratio["mean"] - ratio["ci95"], ratio["mean"] + ratio["ci95"]
    if low >= goal:
        return "met"
    if high < goal:
        return "missed"
    return "unjudgeable: the 95% interval spans it"


def _paired(runs: list[dict], key: str, field: str, mine, base) -> list[float]:
    """Per repeat: ``field`` of the run whose ``key`` is ``mine`` over that of ``base``;
    repeats where either is None are left out."""
    by = {(r["repeat"], r[key]): r[field] for r in runs}
    return [by[i, mine] / by[i, base] for i in sorted({r["repeat"] for r in runs})
            if by[i, mine] is not None and by[i, base] is not None]


def _figures(runs: list[dict], key: str, value, field: str = "images_per_second") -> dict:
    values = [r[field] for r in runs if r[key] == value]
    reached = [v for v in values if v is not None]
    return {"values": values, **(mean_ci(reached) if reached else {"mean": None})}


def derive(results: dict) -> dict:
    if "api" in results:
        a = results["api"]
        a["plain"], a["spotring"] = (_figures(a["runs"], "variant", v)
                                     for v in ("plain", "spotring"))
        a["ratio"] = mean_ci(_paired(a["runs"], "variant", "images_per_second",
                                     "spotring", "plain"))
        a["ratio_of_means"] = a["spotring"]["mean"] / a["plain"]["mean"]
        a["verdict"] = judge(a["ratio"], a["goal"])
    if "dataloader" in results:
        d = results["dataloader"]
        d["rows"] = [{"loader_workers": n, **_figures(d["runs"], "loader_workers", n),
                      "over_0": mean_ci(_paired(d["runs"], "loader_workers",
                                                "images_per_second", n, 0))}
                     for n in d["loader_workers"]]
    if "trainer_before_after" in results:
        t = results["trainer_before_after"]
        t["figures"] = {}
        for tree in ("before", "after"):
            t["figures"][tree] = {"images_per_second": _figures(t["runs"], "tree", tree),
                       "seconds_to_target": _figures(t["runs"], "tree", tree,
                                                     "seconds_to_target"),
                       "test_accuracy": _figures(t["runs"], "tree", tree, "test_accuracy")}
        for field in ("images_per_second", "seconds_to_target"):
            ratios = _paired(t["runs"], "tree", field, "after", "before")
            t[f"{field}_ratio"] = mean_ci(ratios) if ratios else None
    return results


# ------------------------------------------------------------------------ report.md


def _number(value: float | None, digits: int = 0, missing: str = "not reached") -> str:
    return missing if value is None else f"{value:.{digits}f}"


def _ratio(stats: dict | None) -> str:
    return "-" if stats is None else spread(stats, 3)


def api_section(a: dict) -> str:
    pairs = sorted({r["repeat"] for r in a["runs"]})
    by = {(r["repeat"], r["variant"]): r for r in a["runs"]}
    rows = [[str(i), f"{by[i, 'plain']['images_per_second']:.0f}",
             f"{by[i, 'spotring']['images_per_second']:.0f}",
             f"{by[i, 'spotring']['images_per_second'] / by[i, 'plain']['images_per_second']:.3f}",
             f"{by[i, 'plain']['load']:.2f}", f"{by[i, 'spotring']['load']:.2f}"]
            for i in pairs]
    first = a["runs"][0]
    return "\n\n".join([
        "## The API's cost: the same job as a plain DDP script and with spotring",
        f"{a['workers']} workers under torchrun, {a['threads']} thread each, global batch "
        f"{first['global_batch']}, MNIST in memory, benchmarks/plain_loop.py's convnet, SGD; "
        f"img/s over {first['steps']} steps after {first['warmup']} warm-up steps, loading "
        "and every call included (spotring: job.loader, job.wrap, job.track, job.should_stop "
        "every step; job.save after the window).",
        table(["", "img/s (mean ± 95%)", "spotring / plain"], [
            ["plain", spread(a["plain"]), "-"],
            ["spotring", spread(a["spotring"]),
             f"{_ratio(a['ratio'])} (of the means: {a['ratio_of_means']:.3f})"]]),
        f"Goal: spotring / plain at least {a['goal']:.2f}, judged on the 95% interval of the "
        f"repeats' own ratios: **{a['verdict']}**.",
        table(["repeat", "plain img/s", "spotring img/s", "spotring / plain",
               "load (1 min) before plain", "before spotring"], rows),
        commands([r["command"] for r in a["runs"]]),
    ])


def dataloader_section(d: dict) -> str:
    first = d["runs"][0]
    rows = [[str(row["loader_workers"]), spread(row), _ratio(row["over_0"]),
             ", ".join(f"{v:.0f}" for v in row["values"])] for row in d["rows"]]
    return "\n\n".join([
        "## spotring.DataLoader over image files",
        f"{first['files']} PNG files (MNIST digits, 28x28 grey) in torchvision's ImageFolder "
        "layout, decoded with Pillow to float32 as examples/train.py reads them; one process, "
        f"global batch {first['global_batch']}, img/s over {first['steps']} batches after "
        f"{first['warmup']} warm-up batches (persistent workers), nothing trained.",
        table(["num_workers", "img/s (mean ± 95%)", "over num_workers 0", "by repeat"], rows),
        commands([r["command"] for r in d["runs"]]),
    ])


def trainer_section(t: dict) -> str:
    target = f"{100 * t['target']:.0f}%"
    rows = []
    for tree in ("before", "after"):
        f = t["figures"][tree]
        mine = sorted((r for r in t["runs"] if r["tree"] == tree), key=lambda r: r["seed"])
        rows.append([tree, spread(f["images_per_second"]),
                     ", ".join(f"{r['images_per_second']:.0f}" for r in mine),
                     "-" if f["seconds_to_target"]["mean"] is None
                     else spread(f["seconds_to_target"], 1),
                     ", ".join(_number(r["seconds_to_target"], 1) for r in mine),
                     ", ".join(f"{100 * r['test_accuracy']:.2f}%" for r in mine)])
    rows.append(["after / before", _ratio(t["images_per_second_ratio"]), "",
                 _ratio(t["seconds_to_target_ratio"]), "", ""])
    return "\n\n".join([
        "## The built-in trainer before and after its rebuild on the API",
        f"The default run (`torchrun --nproc-per-node {t['workers']} -m spotring.trainer`, "
        "one epoch, "
        f"{t['steps']} steps) with an evaluation on the whole test set every "
        f"{t['eval_every']} steps: before = `{t['before_commit']}` (a worktree at "
        f"{t['before_dir']}, run there with PYTHONPATH on it), after = the working tree. img/s "
        f"from summary.json; seconds to {target}: the training seconds (evaluation excluded) "
        "of the first evaluation at or above it. Seed = the repeat's number, the same for "
        "both trees; a ratio is the mean of the seeds' own ratios.",
        table(["tree", "img/s (mean ± 95%)", "img/s by seed",
               f"s to {target} (mean ± 95%)", f"s to {target} by seed",
               "final accuracy by seed"], rows),
        commands([r["command"] for r in t["runs"]]),
    ])


def render(folder: Path, results: dict) -> Path:
    parts = [header(folder, results)]
    if "api" in results:
        parts.append(api_section(results["api"]))
    if "dataloader" in results:
        parts.append(dataloader_section(results["dataloader"]))
    if "trainer_before_after" in results:
        parts.append(trainer_section(results["trainer_before_after"]))
    parts.append("The method: `benchmarks/api_cost.py`. `results.json` holds every run's "
                 "figures, command and the load it started under.")
    path = folder / "report.md"
    write_atomic(path, ("\n\n".join(parts) + "\n").encode())
    return path


# -------------------------------------------------------------------------- command


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


def _processes(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text}: must be 0 or more")
    return value


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
    one = p.add_argument_group("one run (what the driver starts)")
    one.add_argument("--variant", choices=tuple(VARIANTS),
                     help="run one measured loop and print its JSON line (rank 0)")
    one.add_argument("--global-batch", type=counts, default=GLOBAL_BATCH)
    one.add_argument("--warmup", type=counts, default=WINDOWS["api"][0],
                     help="steps before the timed window")
    one.add_argument("--steps", type=counts, default=WINDOWS["api"][1], help="timed steps")
    one.add_argument("--run-dir", default="runs/api-cost", help="spotring's run_dir")
    one.add_argument("--data", help="--variant files: an ImageFolder of images")
    one.add_argument("--loader-workers", type=_processes, default=0,
                     help="--variant files: DataLoader processes (0: none)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = parser()
    args = p.parse_args(argv)
    if args.variant is not None:
        if args.variant == "files" and args.data is None:
            p.error("--variant files needs --data DIR (an ImageFolder of images)")
        result = VARIANTS[args.variant](args)
        if result is not None:
            print(json.dumps(result), flush=True)
        return 0
    if "trainer-before-after" in args.only and args.before is None:
        p.error("--only trainer-before-after needs --before DIR, a checkout of the commit "
                "before the rebuild: git worktree add /tmp/spotring-before HEAD")
    if args.before is not None and "trainer-before-after" not in args.only:
        p.error("--before is read by the trainer-before-after section alone: add it to --only")
    command = record.command_line(MODULE, f"python -m {MODULE}", argv)
    folder = record.write(args.name, "api-cost", command, lambda f: measure(args, f), derive)
    print(f"written: {render(folder, record.load(folder))}")
    return 0


if __name__ == "__main__":
    code = main()
    # Free DDP's reducer, which holds the Gloo group, before the interpreter finalizes:
    # Gloo's threads may otherwise abort a run that succeeded (benchmarks/plain_loop.py).
    gc.collect()
    sys.exit(code)
