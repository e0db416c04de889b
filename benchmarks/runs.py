"""Start one measured training run the way users do, and read back its img/s per interval.

A run is a Setup (engine, workers, batch per worker, threads per worker) of a Workload
(dataset and model). N workers start under the engine's launcher (ENGINES; the table of
docs/benchmarks.md), one worker as `python -m spotring.trainer` or the plain loop alone,
whatever the engine: it has nothing to average. Each run writes into its own folder (the
trainer's metrics.jsonl, summary.json, log; the plain loop's stdout.json); its checkpoints
and TensorBoard files are deleted once read: they are not measurements.
"""

from __future__ import annotations

import contextlib
import json
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from spotring.benchmarks import processes
from spotring.launch.commands import BIN, local_command, local_environment

_PARTS = Path(__file__).resolve().parents[1]
# Where the measured commands run, and what their paths are shown relative to: the
# checkout these modules are in (its data/ holds MNIST, its git the commit), or, where
# spotring is installed from a wheel, the directory the benchmark was started in, as for
# `spotring train`. Never the installed package's folder, whose modules (exits.py,
# runtime.py...) would shadow others of those names for a `python -m` started there.
REPO = _PARTS if (_PARTS / "pyproject.toml").is_file() else Path.cwd()
MIB = 2**20


@dataclass(frozen=True)
class Engine:
    program: str  # trainer | plain
    launcher: str  # for more than one worker
    args: tuple[str, ...]
    transport: str  # the allreduce its gradients take on CPUs (benchmarks/allreduce.py)
    bucket_bytes: int  # gradient bytes per allreduce: DDP's bucket_cap_mb, Horovod's fusion


ENGINES = {
    "ddp": Engine("trainer", "torchrun", ("engine=ddp",), "gloo", 25 * MIB),
    "ddp-mpi": Engine("trainer", "mpirun", ("engine=ddp", "engine.backend=mpi"), "mpi",
                      25 * MIB),
    "horovod-gloo": Engine("trainer", "horovodrun", ("engine=horovod", "engine.backend=gloo"),
                           "horovod-gloo", 128 * MIB),
    "horovod-mpi": Engine("trainer", "mpirun", ("engine=horovod", "engine.backend=mpi"),
                          "horovod-mpi", 128 * MIB),
    "plain": Engine("plain", "torchrun", (), "gloo", 25 * MIB),
}


def available_engines() -> list[str]:
    """The engines this host can run: Horovod's only where it is built (`make horovod`)."""
    try:
        import horovod.torch  # noqa: F401
    except ImportError:
        return [name for name in ENGINES if not name.startswith("horovod")]
    return list(ENGINES)


@dataclass(frozen=True)
class Workload:
    """What every worker trains: the trainer's overrides and the input they imply."""

    name: str
    overrides: tuple[str, ...] = ()
    shape: tuple[int, int, int] = (1, 28, 28)
    train_samples: int = 60_000
    plain: bool = False  # benchmarks.plain_loop trains the same network on the same data


# model=convnet in float32: the network benchmarks.plain_loop trains too, so that the
# throughput section compares the trainer with a plain loop of the same job.
MNIST = Workload("mnist convnet", ("model=convnet", "train.precision=fp32",
                                   "train.channels_last=false"), plain=True)


def synthetic(model: str, shape: tuple[int, int, int], *model_args: str,
              train_size: int = 8192) -> Workload:
    """Random images of ``shape`` for ``model`` (a conf/model option); a small test set,
    since evaluation is not what is measured."""
    overrides = ("dataset=synthetic", f"dataset.shape=[{','.join(map(str, shape))}]",
                 f"dataset.train_size={train_size}", "dataset.test_size=64", f"model={model}",
                 *model_args)
    return Workload(" ".join([f"synthetic {'x'.join(map(str, shape))}", model, *model_args]),
                    overrides, shape, train_size)


@dataclass(frozen=True)
class Timing:
    """How long a run is: warm-up steps (not measured), then intervals of log_every steps."""

    log_every: int = 5
    warmup_steps: int = 10
    intervals: int = 6

    @property
    def steps(self) -> int:
        return self.warmup_steps + self.log_every * self.intervals


@dataclass(frozen=True)
class Setup:
    engine: str
    workers: int
    batch: int  # per worker
    threads: int = 1  # per worker

    @property
    def label(self) -> str:
        return f"{self.engine} x {self.workers}"

    @property
    def slug(self) -> str:
        return f"{self.engine}-w{self.workers}-b{self.batch}-t{self.threads}"


@dataclass
class Run:
    setup: Setup
    per_worker: list[float]  # img/s per worker of every measured interval
    command: str
    dir: str

    def to_json(self) -> dict:
        return {**asdict(self.setup), "per_worker": self.per_worker, "command": self.command,
                "dir": self.dir}


def launch_command(launcher: str, nproc: int, args: list[str],
                   module: str = "spotring.trainer") -> list[str]:
    """launch.commands' local_command, torchrun as `python -m torch.distributed.run` where
    this Python's folder has no torchrun script (a system Python's torch, as on a GPU
    machine that has the bundle of `make gpu-bundle`)."""
    command = local_command(launcher, nproc, args, module)
    if launcher == "torchrun" and not Path(command[0]).exists():
        command[:1] = [sys.executable, "-m", "torch.distributed.run"]
    return command


def shown(command: list[str], env: dict[str, str] | None = None) -> str:
    """The command as a user would type it in the checkout: paths made relative."""
    def short(arg: str) -> str:
        return arg.replace(str(BIN) + "/", ".venv/bin/").replace(str(REPO) + "/", "")
    return shlex.join([*(f"{k}={v}" for k, v in (env or {}).items()), *map(short, command)])


def _command(setup: Setup, workload: Workload, timing: Timing, run_dir: Path) -> list[str]:
    engine = ENGINES[setup.engine]
    launcher = engine.launcher if setup.workers > 1 else "single"
    if engine.program == "plain":
        return launch_command(launcher, setup.workers, [
            "--batch-size", str(setup.batch), "--threads", str(setup.threads),
            "--steps", str(timing.steps), "--log-every", str(timing.log_every)],
            module="spotring.benchmarks.plain_loop")
    return launch_command(launcher, setup.workers, [
        f"hydra.run.dir={run_dir}", "telemetry.progress=false",
        f"telemetry.log_every={timing.log_every}", f"train.max_steps={timing.steps}",
        f"train.batch_size={setup.batch}", f"train.threads={setup.threads}",
        *engine.args, *workload.overrides])


def run_together(commands: list[list[str]], env: dict[str, str] | None = None,
                 timeout: float = 1800) -> list[str]:
    """Start ``commands`` at once, wait for all; their stdouts. A failure, or a command
    still running after ``timeout`` seconds (then killed, with its ranks), raises with the
    command and the end of its output; processes.Stopped where the benchmark is stopping
    (benchmarks/processes.py). None of them outlives the call."""
    procs: list[subprocess.Popen] = []
    try:
        for command in commands:
            procs.append(processes.start(
                command, cwd=REPO, env=local_environment(**(env or {})),
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        outputs = [p.communicate(timeout=timeout) for p in procs]
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"not finished within {timeout:g} s, killed: {shown(e.cmd, env)}") \
            from e
    finally:  # timed out, interrupted, or one would not start
        for p in procs:
            if p.returncode is None:
                processes.kill(p)
                p.communicate()
    for proc, (out, err) in zip(procs, outputs, strict=True):
        if proc.returncode != 0:
            raise RuntimeError(f"failed (exit {proc.returncode}): {shown(proc.args, env)}"
                               f"\n{(out + err)[-3000:]}")
    return [out for out, _ in outputs]


def json_line(stdout: str, key: str) -> dict:
    """The last JSON object of ``stdout`` that has ``key``: what a rank-side program
    printed, under horovodrun too, which prefixes rank 0's lines with "[0]<stdout>:"."""
    line = next(x for x in reversed(stdout.splitlines()) if f'"{key}"' in x)
    return json.loads(line[line.index("{"):])


def intervals_of(program: str, run_dir: Path, stdout: str) -> list[tuple[int, float]]:
    """(step, total img/s) of every interval a run logged: the trainer's metrics.jsonl
    (training steps only: evaluation and checkpoints are outside its stopwatch), or the
    plain loop's JSON line, kept as stdout.json."""
    if program == "plain":
        (run_dir / "stdout.json").write_text(stdout)
        records = json_line(stdout, "intervals")["intervals"]
    else:
        records = trainer_records(run_dir, "train")
    return [(r["step"], r["images_per_second"]) for r in records]


@contextlib.contextmanager
def started(command: list[str], log: Path, **env: str) -> Iterator[subprocess.Popen]:
    """A process of ``command`` (its output into ``log``), killed with everything under
    it when the block ends, whether it ended or not."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        proc = processes.start(command, cwd=REPO, env=local_environment(**env), stdout=out,
                               stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        processes.kill(proc)


def steps_logged(run_dir: Path) -> int:
    """The newest step a trainer run's rank 0 logged in metrics.jsonl (0: none yet; a
    line still being written is left out)."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return max((json.loads(line)["step"] for line in lines if line.endswith("}")), default=0)


def wait_for(done, proc: subprocess.Popen, what: str, timeout: float) -> None:
    """Wait until ``done()``, the event ``what`` of the process ``proc``; raises
    RuntimeError where ``proc`` ended first or ``timeout`` seconds passed."""
    deadline = time.monotonic() + timeout
    while not done():
        if proc.poll() is not None or time.monotonic() > deadline:
            how = (f"ended first (exit {proc.returncode})" if proc.poll() is not None
                   else f"not within {timeout:g} s")
            raise RuntimeError(f"{what}: {how}: {shown(proc.args)}")
        time.sleep(0.01)


def until_step(proc: subprocess.Popen, run_dir: Path, step: int, timeout: float) -> None:
    """Wait until the trainer run ``proc`` (into ``run_dir``) has logged ``step``."""
    wait_for(lambda: steps_logged(run_dir) >= step, proc, f"the run in {run_dir} to step {step}",
             timeout)


def shown_dir(path: Path) -> str:
    """A run's folder as results.json gives it: relative to the checkout where it is in it."""
    return str(path.relative_to(REPO) if path.is_relative_to(REPO) else path)


def drop_heavy(run_dir: Path) -> None:
    """A trainer run's checkpoints and TensorBoard files, deleted: they are not
    measurements, and results folders are for committing."""
    for heavy in ("checkpoints", "tensorboard"):
        shutil.rmtree(run_dir / heavy, ignore_errors=True)


def trainer_records(run_dir: Path, kind: str) -> list[dict]:
    """The records of ``kind`` (train, epoch, test) in a trainer run's metrics.jsonl; its
    heavy files are dropped (drop_heavy)."""
    drop_heavy(run_dir)
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").open()) if r["kind"] == kind]


def measure(setup: Setup, workload: Workload, timing: Timing, run_dir: Path,
            timeout: float = 1800) -> Run:
    """Run ``setup`` once; img/s per worker of the intervals after the warm-up."""
    run_dir.mkdir(parents=True, exist_ok=True)
    command = _command(setup, workload, timing, run_dir)
    (out,) = run_together([command], timeout=timeout)
    per_worker = [rate / setup.workers for step, rate in
                  intervals_of(ENGINES[setup.engine].program, run_dir, out)
                  if step > timing.warmup_steps]
    return Run(setup, per_worker, shown(command), shown_dir(run_dir))


def check_workload(workload: Workload) -> dict[str, int]:
    """The workload's model as the trainer builds it: its gradient's bytes, what every step
    allreduces. A bad override raises spotring.exits.ConfigError before anything runs."""
    from spotring.trainer.config import compose
    from spotring.trainer.models import build_model

    cfg = compose(list(workload.overrides))
    model = build_model(cfg.model, workload.shape, cfg.dataset.get("num_classes", 10))
    return {"gradient_bytes": sum(p.numel() * p.element_size() for p in model.parameters()
                                  if p.requires_grad)}
