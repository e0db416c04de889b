"""Start one measured training run and read back its img/s per interval.

A run is a Setup (which engine, how many workers, batch per worker, threads per
worker) of a Workload (dataset and model), started the way users start it:

    engine         N workers
    ddp            torchrun --nproc-per-node N -m trainer engine=ddp
    ddp-mpi        mpirun -np N python -m trainer engine=ddp engine.backend=mpi
    horovod-gloo   horovodrun --gloo -np N -H localhost:N python -m trainer engine=horovod
    horovod-mpi    mpirun -np N python -m trainer engine=horovod engine.backend=mpi
    plain          torchrun --nproc-per-node N -m benchmarks.plain_loop

and one worker alone as `python -m trainer` or `python -m benchmarks.plain_loop`,
whatever the engine: a single worker has nothing to average.

``independent=True`` starts N single-worker runs at once instead: the same work per
worker on a host equally busy, without any communication. It is the compute-only
reference that splits a step into compute and communication; it logs every step (the
same steps in all), so that it also tells how much a worker's step time varies: in a
synchronous step every worker waits for the slowest.

Each run writes into its own folder (metrics.jsonl, summary.json, train.log of the
trainer; stdout.json of the plain loop); checkpoints and TensorBoard files are deleted
once read, they are not measurements.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from launch.commands import BIN, local_command, local_environment

if TYPE_CHECKING:  # starting runs needs no torch; building a model imports it
    import torch

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Engine:
    program: str  # trainer | plain
    launcher: str  # for more than one worker
    args: tuple[str, ...] = ()


ENGINES = {
    "ddp": Engine("trainer", "torchrun", ("engine=ddp",)),
    "ddp-mpi": Engine("trainer", "mpirun", ("engine=ddp", "engine.backend=mpi")),
    "horovod-gloo": Engine("trainer", "horovodrun", ("engine=horovod", "engine.backend=gloo")),
    "horovod-mpi": Engine("trainer", "mpirun", ("engine=horovod", "engine.backend=mpi")),
    "plain": Engine("plain", "torchrun"),
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
    classes: int = 10
    plain: bool = False  # benchmarks.plain_loop trains the same network on the same data


MNIST = Workload("mnist convnet", plain=True)  # the default job; the plain loop copies it


def synthetic(model: str, shape: tuple[int, int, int], *model_args: str,
              train_size: int = 8192) -> Workload:
    """Random images of ``shape`` for ``model`` (a conf/model option, or a Hydra sweep of
    them: "convnet,lenet"); a small test set, since evaluation is not what is measured."""
    overrides = ("dataset=synthetic", f"dataset.shape=[{','.join(map(str, shape))}]",
                 f"dataset.train_size={train_size}", "dataset.test_size=64", f"model={model}",
                 *model_args)
    return Workload(" ".join([f"synthetic {'x'.join(map(str, shape))}", model, *model_args]),
                    overrides, shape)


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
    independent: bool = False  # N single-worker runs at once: compute only

    @property
    def label(self) -> str:
        if self.independent:
            return f"{self.engine} {self.workers} x 1 worker, no communication"
        return f"{self.engine} x {self.workers}"

    @property
    def slug(self) -> str:
        kind = "apart" if self.independent else "w"
        return f"{self.engine}-{kind}{self.workers}-b{self.batch}-t{self.threads}"


@dataclass
class Run:
    setup: Setup
    per_worker: list[float]  # img/s per worker of every measured interval
    commands: list[str]
    dirs: list[str] = field(default_factory=list)
    # CPU cores the engine's threads took beside the training loop, the busiest rank's
    # (the trainer's summary.json); None for the plain loop and compute-only runs.
    other_threads_cores: float | None = None

    def to_json(self) -> dict:
        return {**asdict(self.setup), "per_worker": self.per_worker, "commands": self.commands,
                "dirs": self.dirs, "other_threads_cores": self.other_threads_cores}


def shown(command: list[str], env: dict[str, str] | None = None) -> str:
    """The command as a user would type it in the repository: paths made relative."""
    def short(arg: str) -> str:
        return (arg.replace(str(BIN) + "/", ".venv/bin/").replace(str(REPO) + "/", "")
                .replace("=" + str(REPO) + "/", "="))
    prefix = [f"{k}={v}" for k, v in (env or {}).items()]
    return shlex.join([*prefix, *map(short, command)])


def _trainer_args(setup: Setup, workload: Workload, timing: Timing, run_dir: Path) -> list[str]:
    return [f"hydra.run.dir={run_dir}", "telemetry.progress=false",
            f"telemetry.log_every={timing.log_every}", f"train.max_steps={timing.steps}",
            f"train.batch_size={setup.batch}", f"train.threads={setup.threads}",
            *ENGINES[setup.engine].args, *workload.overrides]


def _plain_args(setup: Setup, timing: Timing) -> list[str]:
    return ["--batch-size", str(setup.batch), "--threads", str(setup.threads),
            "--max-steps", str(timing.steps), "--log-every", str(timing.log_every)]


def _command(setup: Setup, workers: int, workload: Workload, timing: Timing,
             run_dir: Path) -> list[str]:
    engine = ENGINES[setup.engine]
    launcher = engine.launcher if workers > 1 else "single"
    if engine.program == "plain":
        if not workload.plain:
            raise ValueError(f"the plain loop trains MNIST's convnet only, not {workload.name}")
        return local_command(launcher, workers, _plain_args(setup, timing),
                             module="benchmarks.plain_loop")
    return local_command(launcher, workers, _trainer_args(setup, workload, timing, run_dir))


def run_together(commands: list[list[str]], env: dict[str, str] | None = None,
                 timeout: float = 1800) -> list[str]:
    """Start ``commands`` at once in the repository, wait for all; their stdouts. Any
    failure raises with the command and the end of its output."""
    shown_env = env or {}
    procs = [subprocess.Popen(c, cwd=REPO, env=local_environment(**shown_env),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for c in commands]
    outputs = [p.communicate(timeout=timeout) for p in procs]
    for proc, (out, err) in zip(procs, outputs, strict=True):
        if proc.returncode != 0:
            raise RuntimeError(f"failed (exit {proc.returncode}): {shown(proc.args, shown_env)}"
                               f"\n{(out + err)[-3000:]}")
    return [out for out, _ in outputs]


def json_line(stdout: str, key: str) -> dict:
    """The last JSON object of ``stdout`` that has ``key``: what a rank-side program
    printed, under horovodrun too, which prefixes rank 0's lines with "[0]<stdout>:"."""
    line = next(x for x in reversed(stdout.splitlines()) if f'"{key}"' in x)
    return json.loads(line[line.index("{"):])


def trainer_metrics(run_dir: Path) -> list[dict]:
    """The records of a trainer run's metrics.jsonl. Its checkpoints and TensorBoard files
    are deleted: they are not measurements, and a results folder stays small."""
    for heavy in ("checkpoints", "tensorboard"):
        shutil.rmtree(run_dir / heavy, ignore_errors=True)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]


def plain_result(run_dir: Path, stdout: str) -> dict:
    """The JSON line the plain loop prints, kept as run_dir/stdout.json."""
    (run_dir / "stdout.json").write_text(stdout)
    return json.loads(stdout.strip().splitlines()[-1])


def intervals_of(program: str, run_dir: Path, stdout: str) -> list[tuple[int, float]]:
    """(step, total img/s) of every interval the run logged."""
    if program == "plain":
        return [(r["step"], r["images_per_second"])
                for r in plain_result(run_dir, stdout)["intervals"]]
    return [(r["step"], r["images_per_second"]) for r in trainer_metrics(run_dir)
            if r["kind"] == "train"]


def measure(setup: Setup, workload: Workload, timing: Timing, run_dir: Path) -> Run:
    """Run ``setup`` once; img/s per worker of the intervals after the warm-up."""
    copies = setup.workers if setup.independent else 1
    workers = 1 if setup.independent else setup.workers
    if setup.independent:  # every step an interval: step-time jitter, for the predictor
        timing = Timing(1, timing.warmup_steps, timing.log_every * timing.intervals)
    dirs = [run_dir / str(i) for i in range(copies)] if copies > 1 else [run_dir]
    commands = [_command(setup, workers, workload, timing, d) for d in dirs]
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
    per_worker: list[float] = []
    for out, d in zip(run_together(commands), dirs, strict=True):
        per_worker += [rate / workers for step, rate in intervals_of(
            ENGINES[setup.engine].program, d, out) if step > timing.warmup_steps]
    others = None
    if ENGINES[setup.engine].program == "trainer" and not setup.independent:
        others = max(json.loads((run_dir / "summary.json").read_text())["other_threads_cores"])
    return Run(setup, per_worker, [shown(c) for c in commands],
               [str(d.relative_to(REPO)) if d.is_relative_to(REPO) else str(d) for d in dirs],
               others)


def gradient_of(model: torch.nn.Module) -> dict[str, int]:
    """One full gradient of ``model``, what every step allreduces: its bytes, and how many
    tensors hold them (Horovod sends each as backward makes it)."""
    trained = [p for p in model.parameters() if p.requires_grad]
    return {"gradient_bytes": sum(p.numel() * p.element_size() for p in trained),
            "gradient_tensors": len(trained)}


def gradient(workload: Workload) -> dict[str, int]:
    """gradient_of the workload's model, as the trainer builds it."""
    from hydra import compose, initialize_config_dir

    from trainer.config import register
    from trainer.models import build_model

    register()
    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[o for o in workload.overrides
                                           if o.startswith("model")])
    return gradient_of(build_model(cfg.model, workload.shape, workload.classes))
