"""tools/gpu-check OUTDIR: spotring's GPU paths, run, measured and checked in one command.

    tools/gpu-check OUTDIR --bundle gpu-bundle        # on a GPU machine (docs/gpu.md)
    tools/gpu-check OUTDIR --device cpu --tiny        # the same checks in a minute on a CPU

Made for a GPU machine at hand for half an hour with no network: it installs the wheels
`make gpu-bundle` downloaded (--bundle DIR) into a temporary folder, runs the checks below
one after another, prints a table row as each ends, and writes OUTDIR/report.md and
OUTDIR/results.json (the machine: GPU name and count, driver, CUDA, cuDNN, torch, NCCL;
each figure with the command that gave it), saved again after every check; each run's
own folder is under OUTDIR/runs/. Planned to end within 9 minutes on one H100 (not yet
timed on one): a check not started within --budget (540 s) is skipped.

    check            what runs                                           passes when
    mnist 1          the default run (MNIST) under torchrun, 1 rank      every seed reaches
                     (an NCCL group of one), seeds 0-2: seconds to 99%   99% test accuracy
                     and img/s
    mnist all        the same on all N GPUs                              the same
    parity           N ranks over NCCL against one process alone with    weights within 1e-10
                     the N-fold batch, float64
    throughput ...   ResNet-50 on synthetic 3x224x224, batch 128, one    the run ends well
                     GPU: img/s and peak memory at fp32, bf16, bf16
                     channels_last, the same compiled, fp16 (scaler)
    preemption       SIGTERM mid-run (deterministic algorithms on):      exit 75, and the
                     the same command resumes, beside an uninterrupted   weights equal bit
                     run                                                 for bit
    allreduce        bus bandwidth against message size over NCCL        every size timed

The N-GPU checks are skipped on one GPU, and a configuration the trainer refuses here
(fp16 on a CPU, torch.compile with no compiler or no Triton) is skipped with its words.
A check that fails says why and the others go on. Exit code: 0 when every check that ran
passed, 1 when one failed, 2 when the kit cannot start (no GPU, the trainer's packages
missing).

--tiny: a few steps of each, for `make test` (tests/test_gpu_check.py), so that the kit
cannot rot: 70% for the MNIST target, one seed, a small convnet on 3x32x32 for ResNet-50,
and with --device cpu two CPU workers over Gloo stand in for N GPUs.

Until the bundle is on the path this imports the standard library, torch and the parts of
benchmarks/ that need nothing more; what imports the trainer's packages (Hydra...) is
imported in the functions that use it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import torch

from spotring import checkpoint
from spotring.benchmarks import gpu_bundle, machine
from spotring.benchmarks.allreduce import KIB, bandwidth, size_label, sizes
from spotring.benchmarks.runs import (
    REPO,
    Setup,
    Timing,
    json_line,
    measure,
    run_together,
    shown,
    synthetic,
    trainer_records,
)
from spotring.benchmarks.stats import mean_ci
from spotring.exits import EXIT_PREEMPTED
from spotring.launch.commands import local_command, local_environment

PARITY_RTOL = 1e-10  # float64: what tests/test_equivalence.py holds N ranks to
PARITY_BATCH = 32  # per rank
# Hydra composes through one global instance: checks that run at once take turns.
COMPOSING = threading.Lock()


@dataclass(frozen=True)
class Mode:
    """How much of each check runs."""

    name: str
    seeds: tuple[int, ...]
    target: float  # the test accuracy every MNIST run must reach
    mnist_steps: int | None  # None: the default run's whole epoch
    eval_samples: int | None  # of the MNIST runs' evaluations; None: the whole test set
    parity_steps: int
    model: tuple[str, ...]  # the throughput checks' model: a conf/model option, its keys
    shape: tuple[int, int, int]
    batch: int
    timing: Timing
    preemption_steps: int | None
    sigterm_after: int  # steps
    allreduce_sizes: tuple[int, ...]
    allreduce_budget: float  # seconds of timed calls per size
    parallel: int  # checks at once
    run_timeout: float  # seconds a command may take


FULL = Mode("full", seeds=(0, 1, 2), target=0.99, mnist_steps=None, eval_samples=None,
            parity_steps=20, model=("torchvision", "model.arch=resnet50"), shape=(3, 224, 224),
            batch=128, timing=Timing(log_every=10, warmup_steps=10, intervals=6),
            preemption_steps=None, sigterm_after=50,
            allreduce_sizes=tuple(sizes(KIB, 256 * KIB**2, 4)), allreduce_budget=0.5,
            parallel=1, run_timeout=300)
# A few steps each; three checks at once, their numbers are not what is tested.
TINY = Mode("tiny", seeds=(0,), target=0.7, mnist_steps=30, eval_samples=1000,
            parity_steps=8, model=("cifar_convnet", "model.depth=1", "model.width=8"),
            shape=(3, 32, 32), batch=32, timing=Timing(log_every=2, warmup_steps=2, intervals=2),
            preemption_steps=40, sigterm_after=10,
            allreduce_sizes=tuple(sizes(KIB, 64 * KIB, 4)), allreduce_budget=0.02,
            parallel=3, run_timeout=180)

# The throughput checks: precision, memory order, compilation.
VARIANTS = {
    "fp32": ("train.precision=fp32", "train.channels_last=false"),
    "bf16": ("train.precision=bf16", "train.channels_last=false"),
    "bf16 channels_last": ("train.precision=bf16", "train.channels_last=true"),
    "bf16 channels_last compile": ("train.precision=bf16", "train.channels_last=true",
                                   "train.compile=true"),
    "fp16": ("train.precision=fp16", "train.channels_last=false"),
}


@dataclass
class Kit:
    """What every check reads: where to write, which device, how many of them, how much."""

    out: Path
    device: str  # cuda | cpu
    devices: int  # GPUs; with --device cpu, CPU workers
    mode: Mode
    deadline: float  # time.monotonic() after which no check starts

    @property
    def runs(self) -> Path:
        return self.out / "runs"

    @property
    def threads(self) -> int:
        """Torch threads of a one-process run: one where checks share the cores."""
        return 1 if self.mode.parallel > 1 else len(os.sched_getaffinity(0))

    def trainer_args(self, run_dir: Path, *overrides: str) -> list[str]:
        threads = [f"train.threads={self.threads}"] if self.mode.parallel > 1 else []
        return [f"hydra.run.dir={run_dir}", "telemetry.progress=false",
                f"train.device={self.device}", *threads, *overrides]

    def run(self, *commands: list[str]) -> list[str]:
        """Run ``commands`` at once; their stdouts (a failure raises, naming the command)."""
        return run_together(list(commands), timeout=self.mode.run_timeout)


@dataclass
class Result:
    """A check's outcome. The check fills figures and commands as it goes, so that a
    failure late in a check keeps what was measured before it."""

    check: str
    status: str = "passed"  # passed | failed | skipped
    summary: str = ""  # the table's cell: the figures, or why it failed or was skipped
    seconds: float = 0.0
    figures: dict = field(default_factory=dict)
    commands: list[str] = field(default_factory=list)


class Failed(Exception):
    """The check ran and its result is wrong; the message says how."""


class Skipped(Exception):
    """The check cannot run here; the message says why."""


class Unusable(Exception):
    """The kit cannot start here (exit 2); the message says what to do."""


def torchrun(nproc: int, args: list[str], module: str = "spotring.trainer") -> list[str]:
    """launch.commands' torchrun command, through `python -m torch.distributed.run` where
    this Python's folder has no torchrun script (a system or conda Python's torch)."""
    command = local_command("torchrun", nproc, args, module)
    if not Path(command[0]).exists():
        command[:1] = [sys.executable, "-m", "torch.distributed.run"]
    return command


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The model of a trainer run's newest checkpoint."""
    return checkpoint.newest_valid(run_dir / "checkpoints").load()["model"]


def relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest of |a - b| / |b| over the tensors (norms, in float64)."""
    if a.keys() != b.keys():
        raise Failed(f"different parameters: {sorted(a.keys() ^ b.keys())}")
    return max(((a[k].double() - b[k].double()).norm()
                 / b[k].double().norm().clamp_min(1e-12)).item() for k in a)


def rate(stat: dict[str, float]) -> str:
    """img/s as the table shows it: mean ± 95% half-width, the mean alone for one value."""
    return f"{stat['mean']:.0f}" + (f" ± {stat['ci95']:.0f}" if stat["n"] > 1 else "") + " img/s"


def drop_heavy(run_dir: Path) -> None:
    """Checkpoints and TensorBoard files are not results, and OUTDIR is to be committed
    (runs.trainer_records drops them too, from the runs it reads)."""
    for heavy in ("checkpoints", "tensorboard"):
        shutil.rmtree(run_dir / heavy, ignore_errors=True)


# ---------------------------------------------------------------------------- checks

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
        run_dir = kit.runs / f"mnist-w{workers}-s{seed}"
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


def check_parity(kit: Kit, result: Result) -> None:
    """N ranks of PARITY_BATCH under torchrun against one process alone with N x
    PARITY_BATCH, in float64: the same global batches, so the same weights up to rounding.
    Both at once: only the weights are compared."""
    n = kit.devices
    common = ["train.dtype=float64", f"train.max_steps={kit.mode.parity_steps}",
              "train.seed=11", "train.eval_samples=1000"]
    many, one = kit.runs / f"parity-w{n}", kit.runs / "parity-w1"
    commands = [torchrun(n, kit.trainer_args(many, *common, f"train.batch_size={PARITY_BATCH}")),
                local_command("single", 1, kit.trainer_args(
                    one, *common, f"train.batch_size={n * PARITY_BATCH}"))]
    result.commands += map(shown, commands)
    kit.run(*commands)
    difference = relative_difference(final_weights(many), final_weights(one))
    for run_dir in (many, one):
        drop_heavy(run_dir)
    result.figures = {"ranks": n, "steps": kit.mode.parity_steps,
                      "relative_difference": difference, "rtol": PARITY_RTOL}
    result.summary = (f"{n} x {PARITY_BATCH} = 1 x {n * PARITY_BATCH} after "
                      f"{kit.mode.parity_steps} steps: relative difference {difference:.1e}")
    if not difference <= PARITY_RTOL:
        raise Failed(f"weights differ by {difference:.3g} relative (float64 allows "
                     f"{PARITY_RTOL:g})")


def refused(overrides: tuple[str, ...]) -> list[str]:
    """What the trainer would refuse about ``overrides`` here (exit 2): its own words."""
    from spotring.trainer.config import compose, gpu_path_problems

    with COMPOSING:
        return gpu_path_problems(compose(list(overrides)))


def check_throughput(kit: Kit, result: Result, variant: str) -> None:
    """img/s of one process over the measured intervals (warm-up and compilation left
    out), and its peak memory, for one precision / memory order / compile variant."""
    mode = kit.mode
    model, *model_args = mode.model
    workload = synthetic(model, mode.shape, *model_args, f"train.device={kit.device}",
                         *VARIANTS[variant], train_size=mode.timing.steps * mode.batch)
    if problems := refused(workload.overrides):
        raise Skipped("; ".join(problems))
    run = measure(Setup("ddp", 1, mode.batch, kit.threads), workload, mode.timing,
                  kit.runs / f"throughput-{variant.replace(' ', '-')}")
    result.commands.append(run.command)
    summary = json.loads((Path(REPO, run.dir) / "summary.json").read_text())
    per_second = mean_ci(run.per_worker)
    result.figures = {"workload": " ".join(mode.model), "shape": list(mode.shape),
                      "batch": mode.batch, "images_per_second": per_second,
                      "intervals": run.per_worker, "peak_memory_mb": summary["peak_memory_mb"],
                      "precision": summary["precision"], "compile_seconds":
                      summary["compile_seconds"], "command": run.command}
    compiling = (f", {summary['compile_seconds']:.0f} s compiling" if summary["compile"]
                 else "")
    result.summary = f"{rate(per_second)}, peak {summary['peak_memory_mb']:.0f} MiB{compiling}"


def steps_logged(run_dir: Path) -> int:
    """The newest step rank 0 logged in metrics.jsonl."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return max((json.loads(line)["step"] for line in lines if line.endswith("}")), default=0)


def check_preemption(kit: Kit, result: Result) -> None:
    """One run stopped by SIGTERM after sigterm_after steps must exit 75 with a checkpoint,
    and the same command must resume it to the weights of an uninterrupted run started
    beside it, bit for bit: deterministic algorithms on (benchmarks/deterministic_trainer)."""
    steps = ([] if kit.mode.preemption_steps is None
             else [f"train.max_steps={kit.mode.preemption_steps}"])

    def command(run_dir: Path) -> list[str]:
        # A record every step, so that the signal is sent as soon as the step is logged.
        return [sys.executable, "-m", "spotring.benchmarks.deterministic_trainer",
                *kit.trainer_args(run_dir, "telemetry.log_every=1", "preemption.imds=false",
                                  *steps)]

    whole, cut = kit.runs / "preemption-whole", kit.runs / "preemption-cut"
    result.commands += [shown(command(whole)), shown(command(cut))]
    with contextlib.ExitStack() as stack:
        procs = [stack.enter_context(started(command(d), kit.runs / f"{d.name}.out"))
                 for d in (whole, cut)]
        deadline = time.monotonic() + kit.mode.run_timeout
        while steps_logged(cut) < kit.mode.sigterm_after:
            if procs[1].poll() is not None or time.monotonic() > deadline:
                how = (f"did not get there within {kit.mode.run_timeout:g} s"
                       if procs[1].poll() is None else f"ended first (exit {procs[1].poll()})")
                raise Failed(f"the run to be stopped at step {kit.mode.sigterm_after} {how}: "
                             f"{kit.runs / 'preemption-cut.out'}")
            time.sleep(0.01)
        procs[1].send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=kit.mode.run_timeout) for p in procs]
    stopped = json.loads((cut / "preempted.json").read_text()) if codes[1] == EXIT_PREEMPTED \
        else None
    result.figures = {"exit_code": codes[1], "stopped_at": stopped and stopped["step"]}
    if codes[0] != 0:
        raise Failed(f"the uninterrupted run failed (exit {codes[0]}): "
                     f"{kit.runs / 'preemption-whole.out'}")
    if stopped is None:
        raise Failed(f"SIGTERM after step {kit.mode.sigterm_after}: exit {codes[1]}, expected "
                     f"{EXIT_PREEMPTED}: {kit.runs / 'preemption-cut.out'}")
    kit.run(command(cut))  # the same command again: it resumes
    total = json.loads((whole / "summary.json").read_text())["steps"]
    resumed = json.loads((cut / "summary.json").read_text())
    a, b = final_weights(cut), final_weights(whole)
    equal = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    difference = relative_difference(a, b)
    for run_dir in (whole, cut):
        drop_heavy(run_dir)
    result.figures |= {"steps": total, "resumed_steps": resumed["steps"],
                       "resumed_from": resumed["resumed_from"], "bitwise_equal": equal,
                       "relative_difference": difference}
    result.summary = (f"SIGTERM: exit 75 at step {stopped['step']} of {total}; resumed: "
                      + ("weights equal bit for bit" if equal
                         else f"weights differ by {difference:.1e} relative"))
    if not (stopped["step"] < total and resumed["resumed_from"]
            and resumed["steps_this_run"] == total - stopped["step"]):
        raise Failed(f"stopped at step {stopped['step']} of {total}, then the same command "
                     f"ran {resumed['steps_this_run']} steps from {resumed['resumed_from']}")
    if not equal:
        raise Failed(f"the resumed run's weights differ from the uninterrupted run's by "
                     f"{difference:.3g} relative")


@contextlib.contextmanager
def started(command: list[str], log: Path):
    """A process of ``command`` (its output to ``log``), killed with its children if it
    is still running when the block ends."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        proc = subprocess.Popen(command, cwd=REPO, env=local_environment(), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def check_allreduce(kit: Kit, result: Result) -> None:
    """benchmarks/allreduce_ranks.py on every device: nccl-tests' bus bandwidth per size."""
    transport = "nccl" if kit.device == "cuda" else "gloo"
    command = torchrun(kit.devices, [transport, "--sizes", *map(str, kit.mode.allreduce_sizes),
                                     "--budget", str(kit.mode.allreduce_budget)],
                       module = "spotring.benchmarks.allreduce_ranks")
    result.commands.append(shown(command))
    (stdout,) = kit.run(command)
    said = json_line(stdout, "transport")
    rows = [{"bytes": r["bytes"], "seconds": r["seconds"],
             **bandwidth(r["bytes"], r["seconds"], said["ranks"])} for r in said["results"]]
    best = max(rows, key=lambda r: r["busbw_gbps"])
    result.figures = {"transport": transport, "ranks": said["ranks"], "sizes": rows,
                      "command": shown(command)}
    result.summary = (f"{transport}, {said['ranks']} ranks: busbw {best['busbw_gbps']:.2f} GB/s "
                      f"at {size_label(best['bytes'])}, {rows[0]['seconds'] * 1e6:.0f} µs at "
                      f"{size_label(rows[0]['bytes'])}")


@dataclass(frozen=True)
class Check:
    name: str
    run: Callable[[Kit, Result], None]
    many: bool = False  # needs 2 devices or more


CHECKS = [
    Check("mnist 1", partial(check_mnist, workers=1)),
    Check("mnist all", lambda kit, result: check_mnist(kit, result, kit.devices), many=True),
    Check("parity", check_parity, many=True),
    *(Check(f"throughput {v}", partial(check_throughput, variant=v)) for v in VARIANTS),
    Check("preemption", check_preemption),
    Check("allreduce", check_allreduce, many=True),
]


def run_check(kit: Kit, check: Check) -> Result:
    """One check, its failure or skip caught and said in one line."""
    result, start = Result(check.name), time.monotonic()
    try:
        if start > kit.deadline:
            raise Skipped("not started: the kit's time budget (--budget) was spent")
        if check.many and kit.devices < 2:
            raise Skipped(f"needs 2 {kit.device} devices or more; this machine has 1")
        check.run(kit, result)
    except Skipped as e:
        result.status, result.summary = "skipped", str(e)
    except Exception as e:  # noqa: BLE001 - any failure is this check's, the others go on
        why = str(e) if isinstance(e, Failed) else f"{type(e).__name__}: {e}"
        result.status, result.summary = "failed", " ".join(why.split())[:300]
        result.figures["error"] = why
    result.seconds = round(time.monotonic() - start, 1)
    return result


# ---------------------------------------------------------------------------- the run

def describe(device: str) -> dict:
    """benchmarks/machine's account, with what a GPU figure is read against."""
    info = machine.describe()
    info["torch"] = torch.__version__
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = {"name": props.name, "count": torch.cuda.device_count(),
                       "memory_gib": round(props.total_memory / 2**30, 1),
                       "capability": f"{props.major}.{props.minor}",
                       "driver": driver_version(),
                       "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
                       "nccl": info["nccl"]}
    return info


def driver_version() -> str | None:
    """The NVIDIA driver's version, as nvidia-smi says it; None where it cannot."""
    try:
        said = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (said.split() or [None])[0]


def use_bundle(bundle: Path | None, stack: contextlib.ExitStack) -> str:
    """Install ``bundle`` into a temporary folder put first on this process's path and its
    children's (PYTHONPATH); then check that the trainer imports. What was used."""
    used = "none (this Python's own packages)"
    if bundle is not None:
        site = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="spotring-bundle-")))
        try:
            wheels = gpu_bundle.install(bundle, site)
        except gpu_bundle.BundleError as e:
            raise Unusable(str(e)) from e
        sys.path.insert(0, str(site))
        os.environ["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(site), os.environ.get("PYTHONPATH")]))
        used = f"{bundle} ({len(wheels)} wheels)"
    try:
        import torch.utils.tensorboard  # noqa: F401  (what rank 0 writes with)

        import spotring.trainer.__main__  # noqa: F401
    except ImportError as e:
        raise Unusable(f"{e}: the trainer's packages are missing here. Where the package index "
                       "is reachable, `make gpu-bundle` downloads them into gpu-bundle/; "
                       "bring that folder and give --bundle gpu-bundle (docs/gpu.md)") from e
    return used


def row(cells: list[str]) -> str:
    return "| " + " | ".join(c.replace("|", "/") for c in cells) + " |"


HEADER = row(["check", "result", "figures", "s"]) + "\n" + row(["---"] * 4)


def report(results: dict) -> str:
    """report.md, from results.json alone."""
    info, checks = results["machine"], results["checks"]
    gpu = info.get("gpu")
    where = (f"{gpu['count']} x {gpu['name']}" if gpu else f"CPU ({info['cpu']})")
    counts = {s: sum(c["status"] == s for c in checks) for s in ("passed", "failed", "skipped")}
    lines = [f"# spotring GPU check: {where}", "",
             f"{results['started']}, `{results['command']}`, {results['mode']} mode, "
             f"{results.get('wall_seconds', '...')} s: "
             + ", ".join(f"{n} {s}" for s, n in counts.items()) + ".", "",
             "| machine | |", "| --- | --- |"]
    if gpu:
        lines += [f"| GPUs | {gpu['count']} x {gpu['name']} ({gpu['memory_gib']} GiB, compute "
                  f"capability {gpu['capability']}) |",
                  f"| driver, CUDA, cuDNN, NCCL | {gpu['driver']}, {gpu['cuda']}, {gpu['cudnn']}, "
                  f"{gpu['nccl']} |"]
    lines += [f"| torch, torchvision | {info['torch']}, {info['packages']['torchvision']} |",
              f"| Python, CPU | {info['python']}, {info['cpu']}, {info['cores']} cores, "
              f"{info['memory_gib']} GiB |",
              f"| spotring | {info['commit']}, bundle {results['bundle']} |", "",
              HEADER, *(row([c["check"], c["status"], c["summary"], f"{c['seconds']:g}"])
                        for c in checks), "",
              f"The throughput checks train {results['throughput_workload']}.", ""]
    failed = [c for c in checks if c["status"] == "failed"]
    if failed:
        lines += ["## Failures", ""]
        for c in failed:
            lines += [f"{c['check']}:", "", *(f"    {line}" for line in
                                               c["figures"]["error"].splitlines()), ""]
    lines += ["## Commands", "", "Each check's runs, as started (their folders: runs/).", ""]
    for c in checks:
        if c["commands"]:
            lines += [f"{c['check']}:", "", *(f"    {command}" for command in c["commands"]), ""]
    return "\n".join(lines)


def save(out: Path, results: dict) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "report.md").write_text(report(results))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/gpu-check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, metavar="OUTDIR",
                        help="where report.md, results.json and runs/ go")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda (default): every GPU torch sees; cpu: 2 CPU workers")
    parser.add_argument("--tiny", action="store_true", help="a few steps of each check")
    parser.add_argument("--bundle", type=Path, metavar="DIR", help="the folder `make "
                        "gpu-bundle` made (default: none, this Python's own packages)")
    parser.add_argument("--budget", type=float, default=540.0, metavar="SECONDS",
                        help="seconds after which no check starts (default 540)")
    args = parser.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    with contextlib.ExitStack() as stack:
        try:
            if args.device == "cuda" and not torch.cuda.is_available():
                raise Unusable("--device cuda: torch sees no GPU here (torch "
                               f"{torch.__version__}); --device cpu --tiny runs on a CPU")
            bundle = use_bundle(args.bundle, stack)
        except Unusable as e:
            print(f"gpu-check: {e}", file=sys.stderr)
            return 2
        mode = TINY if args.tiny else FULL
        devices = torch.cuda.device_count() if args.device == "cuda" else 2
        out = args.out.resolve()
        kit = Kit(out, args.device, devices, mode, time.monotonic() + args.budget)
        kit.runs.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        model, *keys = mode.model
        results = {"command": shlex.join(["tools/gpu-check", *argv]), "mode": mode.name,
                   "device": args.device, "devices": devices, "bundle": bundle,
                   "throughput_workload": f"model={model} {' '.join(keys)} on synthetic "
                   f"{'x'.join(map(str, mode.shape))} images, batch {mode.batch}, one process",
                   "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                   "machine": describe(args.device), "checks": []}
        where = results["machine"].get("gpu", {}).get("name", "CPU")
        print(f"gpu-check: {devices} x {where}, {mode.name} mode, into {out}\n{HEADER}",
              flush=True)
        order = [c.name for c in CHECKS]
        with ThreadPoolExecutor(mode.parallel) as pool:
            for future in as_completed([pool.submit(run_check, kit, c) for c in CHECKS]):
                result = future.result()
                print(row([result.check, result.status, result.summary,
                           f"{result.seconds:g}"]), flush=True)
                results["checks"].append(asdict(result))
                results["checks"].sort(key=lambda c: order.index(c["check"]))
                save(out, results)
        results["wall_seconds"] = round(time.monotonic() - start, 1)
        results["passed"] = all(c["status"] != "failed" for c in results["checks"])
        save(out, results)
    print(f"gpu-check: {'all that ran passed' if results['passed'] else 'FAILED'} in "
          f"{results['wall_seconds']:g} s; {out / 'report.md'}", flush=True)
    return 0 if results["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
