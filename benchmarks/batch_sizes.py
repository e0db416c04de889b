"""img/s per batch size per model: the batch-size table of the Chameleon Cloud talk.

One worker with every core of the host (a node, as the talk's 1-GPU column), synthetic
data of each model's input shape, the trainer itself: each group of models of one shape
is one Hydra sweep (benchmarks/trainer_sweep.py) over models x batch sizes. img/s is the
mean over the measured intervals after the warm-up, with its 95% confidence interval, as
in benchmarks/throughput.py; with repeats, sweeps are repeated and intervals pooled.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from spotring.benchmarks.runs import Timing, intervals_of, run_together, shown, synthetic
from spotring.benchmarks.stats import mean_ci
from spotring.launch.commands import local_command


@dataclass(frozen=True)
class Group:
    """Models of one input shape, swept together; the timing suits their step times."""

    shape: tuple[int, int, int]
    models: tuple[str, ...]
    timing: Timing
    extra: tuple[str, ...] = ()  # e.g. model.arch=resnet50
    train_size: int = 8192
    batches: tuple[int, ...] | None = None  # None: the sweep's batch sizes


GROUPS = [
    Group((1, 28, 28), ("convnet", "mnist_convnet", "lenet"), Timing(5, 10, 5)),
    Group((3, 32, 32), ("cifar_convnet", "resnet20"), Timing(1, 3, 5)),
]
# ResNet-50 at ImageNet size, the talk's model: a few img/s on a CPU, so the full run only.
RESNET50 = Group((3, 224, 224), ("torchvision",), Timing(1, 2, 5), ("model.arch=resnet50",),
                 train_size=256, batches=(8, 16, 32))
QUICK_BATCHES = [32, 64, 128]
FULL_BATCHES = [16, 32, 64, 128, 256]


def label(overrides: dict[str, str]) -> str:
    model = overrides["model"]
    return overrides.get("model.arch", model) if model == "torchvision" else model


def _sweep(group: Group, batches: list[int], threads: int, sweep_dir: Path) -> str:
    workload = synthetic(",".join(group.models), group.shape, *group.extra,
                         train_size=group.train_size)
    t = group.timing
    args = ["-m", *workload.overrides, f"train.batch_size={','.join(map(str, batches))}",
            f"train.threads={threads}", f"train.max_steps={t.steps}",
            f"telemetry.log_every={t.log_every}", "telemetry.progress=false",
            f"hydra.sweep.dir={sweep_dir}"]
    command = local_command("single", 1, args, module = "spotring.benchmarks.trainer_sweep")
    run_together([command], timeout=3600)
    return shown(command)


def measure(groups: list[Group], batches: list[int], threads: int, repeats: int,
            folder: Path) -> dict:
    """The batch_sizes section of results.json."""
    intervals: dict[tuple[str, str, int], list[float]] = {}
    commands = []
    for repeat in range(repeats):
        for g, group in enumerate(groups):
            sweep_dir = folder / "runs" / f"batch-sizes-{g}-r{repeat}"
            commands.append(_sweep(group, list(group.batches or batches), threads, sweep_dir))
            shape = "x".join(map(str, group.shape))
            for point in sorted(sweep_dir.glob("[0-9]*")):
                overrides = dict(o.split("=", 1) for o in
                                 yaml.safe_load((point / ".hydra" / "overrides.yaml").read_text()))
                key = (label(overrides), shape, int(overrides["train.batch_size"]))
                intervals.setdefault(key, []).extend(
                    rate for step, rate in intervals_of("trainer", point, "")
                    if step > group.timing.warmup_steps)
            print(f"[{repeat + 1}/{repeats}] batch sizes of {', '.join(group.models)}: done",
                  flush=True)
    rows = [{"model": model, "shape": shape, "batch": batch,
             "images_per_second": mean_ci(values), "intervals": values}
            for (model, shape, batch), values in intervals.items()]
    return {"threads": threads, "repeats": repeats, "commands": commands, "rows": rows}
