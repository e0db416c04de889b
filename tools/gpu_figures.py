"""The figures tools/gpu-check measures beside its tests, each with a benchmark of
spotring.benchmarks: how large each is (Mode: FULL, or TINY), where it writes (Kit), and
each figure's function ``figure(kit, row)``, which fills the kit's row (its figures,
summary and commands) as it goes and returns when it ran, or raises Failed (it ran and its
result is wrong) or Skipped (it cannot run here; the trainer's own words where it refuses):

    throughput VARIANT   img/s and peak memory of one process per precision, memory
                         order and compilation (VARIANTS)
    allreduce            nccl-tests' bus bandwidth against message size on every device
    fsdp                 tokens/s and peak memory of one rank, engine=fsdp against ddp
    checkpoint           the stall of a background save against a blocking one
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from spotring.benchmarks import allreduce as allreduce_bench
from spotring.benchmarks.allreduce import KIB, size_label
from spotring.benchmarks.runs import REPO, Setup, Timing, measure, synthetic
from spotring.benchmarks.stats import mean_ci

# Hydra composes through one global instance: checks that run at once take turns.
COMPOSING = threading.Lock()


@dataclass(frozen=True)
class Mode:
    """How large each figure's run is."""

    name: str  # full | tiny
    model: tuple[str, ...]  # the throughput runs': a conf/model option and its keys
    shape: tuple[int, int, int]
    batch: int
    timing: Timing
    allreduce_sizes: tuple[int, ...]
    allreduce_budget: float  # seconds of timed calls per size
    fsdp: tuple[str, ...]  # benchmarks/fsdp_ranks.py's model and steps
    checkpoint: tuple[float, int, int]  # GB, steps, steps between saves
    parallel: int  # checks at once
    run_timeout: float  # seconds a command may take

    @property
    def workload(self) -> str:
        """The throughput runs' workload, in words."""
        return (f"{' '.join(self.model)} on synthetic {'x'.join(map(str, self.shape))} "
                f"images, batch {self.batch}, one process")


FULL = Mode("full", model=("torchvision", "model.arch=resnet50"), shape=(3, 224, 224),
            batch=128, timing=Timing(log_every=10, warmup_steps=10, intervals=6),
            allreduce_sizes=tuple(allreduce_bench.sizes(KIB, 256 * KIB**2, 4)),
            allreduce_budget=0.5,
            fsdp=("--size", "gpt2", "--batch", "8", "--seq", "1024", "--warmup", "3",
                  "--steps", "10", "--precision", "auto"),
            checkpoint=(4, 12, 5), parallel=1, run_timeout=300)
# A few steps each, three at once: on a CPU they show the kit works, not its figures.
TINY = Mode("tiny", model=("cifar_convnet", "model.depth=1", "model.width=8"),
            shape=(3, 32, 32), batch=32, timing=Timing(log_every=2, warmup_steps=2, intervals=2),
            allreduce_sizes=tuple(allreduce_bench.sizes(KIB, 64 * KIB, 4)),
            allreduce_budget=0.02,
            fsdp=("--size", "tiny", "--batch", "2", "--seq", "16", "--warmup", "1", "--steps",
                  "2", "--precision", "auto"),
            checkpoint=(0.02, 12, 5), parallel=3, run_timeout=180)


@dataclass
class Kit:
    """Where the figures go, on which device, how many of them, how large."""

    out: Path
    device: str  # cuda | cpu
    devices: int  # GPUs; on the CPU, 2 workers stand in for them
    mode: Mode

    def run_dir(self, name: str) -> Path:
        """OUTDIR/runs/``name``, emptied: a trainer run appends to the metrics.jsonl it
        finds, which an earlier kit's run may have left there."""
        path = self.out / "runs" / name
        shutil.rmtree(path, ignore_errors=True)
        return path

    @property
    def threads(self) -> int:
        """Torch threads of a one-process run: one where checks share the cores."""
        return 1 if self.mode.parallel > 1 else len(os.sched_getaffinity(0))


class Failed(Exception):
    """The check ran and its result is wrong; the message says how."""


class Skipped(Exception):
    """The check cannot run here; the message says why."""


def rate(stat: dict[str, float]) -> str:
    """img/s as the table shows it: mean ± 95% half-width, the mean alone for one value."""
    return f"{stat['mean']:.0f}" + (f" ± {stat['ci95']:.0f}" if stat["n"] > 1 else "") + " img/s"


def refused(overrides: list[str]) -> list[str]:
    """What the trainer would refuse about ``overrides`` here (its exit 2): its own words."""
    from spotring.trainer.config import compose
    from spotring.trainer.validation import gpu_path_problems

    with COMPOSING:
        return gpu_path_problems(compose(list(overrides)))


# The throughput runs: precision, memory order, compilation.
VARIANTS = {
    "fp32": ("train.precision=fp32", "train.channels_last=false"),
    "bf16": ("train.precision=bf16", "train.channels_last=false"),
    "bf16 channels_last": ("train.precision=bf16", "train.channels_last=true"),
    "bf16 channels_last compile": ("train.precision=bf16", "train.channels_last=true",
                                   "train.compile=true"),
    "fp16": ("train.precision=fp16", "train.channels_last=false"),
}


def throughput(kit: Kit, result, variant: str) -> None:
    """img/s of one process over the measured intervals (warm-up and compilation left
    out), and its peak memory."""
    mode = kit.mode
    model, *model_args = mode.model
    workload = synthetic(model, mode.shape, *model_args, f"train.device={kit.device}",
                         *VARIANTS[variant], train_size=mode.timing.steps * mode.batch)
    if problems := refused(workload.overrides):
        raise Skipped("; ".join(problems))
    run = measure(Setup("ddp", 1, mode.batch, kit.threads), workload, mode.timing,
                  kit.run_dir(f"throughput-{variant.replace(' ', '-')}"),
                  timeout=mode.run_timeout)
    result.commands.append(run.command)
    summary = json.loads((Path(REPO, run.dir) / "summary.json").read_text())
    per_second = mean_ci(run.per_worker)
    result.figures = {"images_per_second": per_second, "intervals": run.per_worker,
                      "peak_memory_mb": summary["peak_memory_mb"],
                      "precision": summary["precision"],
                      "compile_seconds": summary["compile_seconds"]}
    compiling = (f", {summary['compile_seconds']:.0f} s compiling" if summary["compile"]
                 else "")
    result.summary = f"{rate(per_second)}, peak {summary['peak_memory_mb']:.0f} MiB{compiling}"


def allreduce(kit: Kit, result) -> None:
    """benchmarks/allreduce.py's measurement on every device."""
    transport = "nccl" if kit.device == "cuda" else "gloo"
    section = allreduce_bench.measure([transport], kit.devices, list(kit.mode.allreduce_sizes),
                                      kit.mode.allreduce_budget, 1, timeout=kit.mode.run_timeout)
    result.commands.append(section["commands"][transport])
    rows = section["transports"][transport]
    best = max(rows, key=lambda r: r["busbw_gbps"])
    result.figures = {"transport": transport, "ranks": kit.devices, "sizes": rows}
    result.summary = (f"{transport}, {kit.devices} ranks: busbw {best['busbw_gbps']:.2f} GB/s "
                      f"at {size_label(best['bytes'])}, {rows[0]['seconds'] * 1e6:.0f} µs at "
                      f"{size_label(rows[0]['bytes'])}")


def fsdp(kit: Kit, result) -> None:
    """benchmarks/fsdp_ranks.py as one rank under torchrun with engine=ddp, then with
    engine=fsdp: tokens/s and peak memory. Alone, FSDP shards over a group of one, so this
    is what its machinery costs (gathers and reduce-scatters through the group, its
    bfloat16 copies, its hooks), not what it saves across workers (fsdp_memory.py)."""
    from spotring.benchmarks.fsdp_memory import fsdp_run

    runs = {engine: fsdp_run(engine, 1, [*kit.mode.fsdp, "--device", kit.device],
                             kit.run_dir(f"fsdp-{engine}"), timeout=kit.mode.run_timeout)
            for engine in ("ddp", "fsdp")}
    result.commands += [run["command"] for run in runs.values()]
    result.figures = runs
    said = [f"{e} {r['tokens_per_second']:.0f} tokens/s, peak "
            f"{r['ranks'][0]['peak_memory_mib']:.0f} MiB" for e, r in runs.items()]
    run = runs["fsdp"]
    result.summary = (f"{run['parameters'] / 1e6:.3g}M parameters, {run['batch']} x "
                      f"{run['seq']} tokens, {run['precision']}: {'; '.join(said)}")


def checkpoint(kit: Kit, result) -> None:
    """benchmarks/checkpoint_scaling.py's periodic run on every device: a state of the
    mode's size saved every few steps to local disk, in the background (each rank's share
    copied to pinned memory on a GPU, written while training goes on) and blocking by
    turns; each kind's stall (its step less a quiet one), the blocking save's GB/s."""
    from spotring.benchmarks.checkpoint_scaling import periodic_once
    from spotring.benchmarks.checkpoint_scaling_report import stalls

    gigabytes, steps, every = kit.mode.checkpoint
    run = periodic_once(gigabytes, kit.run_dir("checkpoint"), steps, every, kit.devices,
                        kit.device)
    result.commands.append(run["command"])
    found = stalls(run)
    if set(found) != {"background", "blocking"}:
        raise Failed(f"the run saved {sorted(found)}, not both kinds; see {run['dir']}")
    background, blocking = found["background"]["stall"], found["blocking"]["stall"]
    result.figures = {"state_bytes": run["state_bytes"], "world_size": run["world_size"],
                      "save_every": run["save_every"], **found}
    result.summary = (
        f"{run['state_bytes'] / 1e9:.2g} GB on {run['world_size']} ranks: a blocking save "
        f"stalls a step {blocking:.2f} s ({run['state_bytes'] / 1e9 / max(blocking, 1e-9):.2f}"
        f" GB/s), a background one {background:.2f} s "
        f"({background / max(blocking, 1e-9):.2f}x)")


# Each figure's function, and whether it needs 2 devices or more.
FIGURES = {**{f"throughput {v}": (partial(throughput, variant=v), False) for v in VARIANTS},
           "allreduce": (allreduce, True), "fsdp": (fsdp, False),
           "checkpoint": (checkpoint, False)}
