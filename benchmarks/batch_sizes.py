"""img/s per batch size per model: the batch-size table of the Chameleon Cloud talk.

One worker with every core of the host (a node, as the talk's 1-GPU column), synthetic
data of each model's input shape, the trainer itself: one run per model and batch size
(benchmarks/runs.py's measure), warm-up left out, the repeats' intervals pooled into the
mean and its 95% confidence interval, the runs of a repeat interleaved as throughput's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from spotring.benchmarks import runs
from spotring.benchmarks.runs import Setup, Timing, synthetic
from spotring.benchmarks.stats import interleaved, mean_ci


@dataclass(frozen=True)
class Group:
    """Models of one input shape; the timing suits their step times."""

    shape: tuple[int, int, int]
    models: tuple[str, ...]
    timing: Timing
    extra: tuple[str, ...] = ()  # e.g. model.arch=resnet50
    train_size: int = 8192
    batches: tuple[int, ...] | None = None  # None: the run's batch sizes


GROUPS = [
    Group((1, 28, 28), ("convnet", "mnist_convnet", "lenet"), Timing(5, 10, 5)),
    Group((3, 32, 32), ("cifar_convnet", "resnet20"), Timing(1, 3, 5)),
]
# ResNet-50 at ImageNet size, the talk's model: a few img/s on a CPU, so the full run only.
RESNET50 = Group((3, 224, 224), ("torchvision",), Timing(1, 2, 5), ("model.arch=resnet50",),
                 train_size=256, batches=(8, 16, 32))
QUICK_BATCHES = [32, 64, 128]
FULL_BATCHES = [16, 32, 64, 128, 256]


def label(model: str, extra: tuple[str, ...]) -> str:
    """The table's name of a model: a torchvision model's architecture."""
    arch = [o.split("=", 1)[1] for o in extra if o.startswith("model.arch=")]
    return arch[0] if model == "torchvision" and arch else model


def measure(groups: list[Group], batches: list[int], threads: int, repeats: int,
            folder: Path) -> dict:
    """The batch_sizes section of results.json."""
    points = [(group, model, batch) for group in groups for model in group.models
              for batch in group.batches or batches]
    intervals: dict[tuple[str, str, int], list[float]] = {}
    commands = []
    for repeat, (group, model, batch) in interleaved(points, repeats):
        name, shape = label(model, group.extra), "x".join(map(str, group.shape))
        run = runs.measure(Setup("ddp", 1, batch, threads),
                           synthetic(model, group.shape, *group.extra,
                                     train_size=group.train_size),
                           group.timing, folder / "runs" / f"batch-sizes-{name}-b{batch}-r{repeat}")
        intervals.setdefault((name, shape, batch), []).extend(run.per_worker)
        commands.append(run.command)
        stats = mean_ci(run.per_worker)
        print(f"[{len(commands)}/{repeats * len(points)}] batch sizes {name}, batch {batch}: "
              f"{stats['mean']:.0f} ± {stats['ci95']:.0f} img/s", flush=True)
    rows = [{"model": model, "shape": shape, "batch": batch,
             "images_per_second": mean_ci(values), "intervals": values}
            for (model, shape, batch), values in intervals.items()]
    return {"threads": threads, "repeats": repeats, "commands": commands, "rows": rows}
