"""spotring's GPU paths, proved on the devices at hand (marked gpu): the default run reaches
its accuracy on one rank and on all; N ranks equal one process with the N-fold batch;
channels_last and torch.compile take the plain run's steps; SIGTERM mid-run, then the same
command resumes to the uninterrupted run's weights bit for bit; FSDP shards the model
over the devices.

One fixture, ``devices``, picks the device and the size. tools/gpu-check runs this file on
a GPU machine's GPUs at full size (over NCCL; tools/gpu_tests.py's --gpu-device cuda
--gpu-size full); without those options, as in `make test`, it runs at tiny size on the
CPU, two CPU workers over Gloo standing in for N GPUs, so that it cannot rot. Each test
gives the kit's report its figures through record_property. No conftest fixture: the kit
runs this file with --noconftest where only pytest and the bundle's packages are.
"""

from __future__ import annotations

import contextlib
import json
import signal
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from spotring.benchmarks.runs import (
    drop_heavy,
    json_line,
    launch_command,
    run_together,
    started,
    trainer_records,
    until_step,
)
from spotring.benchmarks.time_to_accuracy import (
    EVALUATIONS,
    eval_interval,
    seconds_to,
    trainer_steps,
)
from spotring.checkpoint import layout
from spotring.checkpoint.parts import load_whole
from spotring.exits import EXIT_PREEMPTED
from spotring.trainer.config import compose
from spotring.trainer.validation import gpu_path_problems

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

DETERMINISTIC = Path(__file__).resolve().parents[1] / "harness" / "deterministic_trainer.py"
RTOL = 1e-10  # float64: what N ranks and the fast paths are held to
PER_RANK = 32  # batch of each rank in the float64 comparisons


@dataclass(frozen=True)
class Size:
    seeds: tuple[int, ...]
    target: float  # the test accuracy every seed of the default run reaches
    mnist_steps: int | None  # None: the default run whole
    evaluations: int  # of each run of the default run, about
    eval_samples: int | None  # None: the whole test set
    compare_steps: int  # of the float64 comparisons
    preemption_steps: int  # of the default run
    sigterm_after: int  # steps
    fsdp: tuple[str, ...]  # benchmarks/fsdp_ranks.py's model and step
    timeout: float  # seconds a command may take


SIZES = {
    "full": Size(seeds=(0, 1, 2), target=0.99, mnist_steps=None, evaluations=EVALUATIONS,
                 eval_samples=None, compare_steps=20, preemption_steps=300, sigterm_after=50,
                 fsdp=("--size", "gpt2", "--seq", "128"), timeout=300),
    # A few steps each: on a CPU they show the tests work, not what a GPU does.
    "tiny": Size(seeds=(0,), target=0.7, mnist_steps=30, evaluations=3, eval_samples=500,
                 compare_steps=8, preemption_steps=24, sigterm_after=6,
                 fsdp=("--size", "tiny", "--seq", "16"), timeout=180),
}


@dataclass(frozen=True)
class Devices:
    kind: str  # cuda | cpu
    count: int  # GPUs; on the CPU, 2 workers stand in for them
    size: Size

    def trainer(self, run_dir: Path, *overrides: str) -> list[str]:
        """The trainer's arguments for a run into ``run_dir`` on these devices (one thread
        per CPU worker: the workers share the cores)."""
        threads = ["train.threads=1"] if self.kind == "cpu" else []
        return [f"hydra.run.dir={run_dir}", "telemetry.progress=false",
                f"train.device={self.kind}", *threads, *overrides]

    def float64(self, run_dir: Path, *overrides: str) -> list[str]:
        """A run of the float64 comparisons: no rounding to flip a max-pool's near-tie, so
        the same steps agree to RTOL (tests/test_equivalence.py says why)."""
        return self.trainer(run_dir, "train.dtype=float64", "train.channels_last=false",
                            f"train.max_steps={self.size.compare_steps}", "train.seed=11",
                            "train.eval_samples=1000", *overrides)

    def run(self, *commands: list[str]) -> list[str]:
        """``commands`` at once; their stdouts (a failure raises, naming the command)."""
        return run_together(list(commands), timeout=self.size.timeout)


@pytest.fixture(scope="module")
def devices(request) -> Devices:
    kind = request.config.getoption("gpu_device", None) or "cpu"
    if kind == "cuda" and not torch.cuda.is_available():
        pytest.fail("--gpu-device cuda: torch sees no GPU here")
    size = SIZES[request.config.getoption("gpu_size", None) or "tiny"]
    return Devices(kind, torch.cuda.device_count() if kind == "cuda" else 2, size)


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The model of a trainer run's newest checkpoint."""
    return load_whole(layout.newest_valid(run_dir / "checkpoints"))["model"]


def relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest of ||a - b|| / ||b|| over the tensors, in float64."""
    assert a.keys() == b.keys()
    return max(((a[k].double() - b[k].double()).norm()
                / b[k].double().norm().clamp_min(1e-12)).item() for k in a)


# One rank keeps one process busy (tests/conftest.py's cores); all of them, every core.
@pytest.mark.parametrize("ranks", [pytest.param("one", marks=pytest.mark.slow(cores=1)), "all"])
def test_the_default_run_reaches_its_target_on_every_seed(devices, ranks, tmp_path,
                                                          record_property):
    workers = 1 if ranks == "one" else devices.count
    if ranks == "all" and workers < 2:
        pytest.skip(f"needs 2 {devices.kind} devices or more; this machine has 1")
    size = devices.size
    every = eval_interval(trainer_steps(workers, size.mnist_steps)["steps"], size.evaluations)
    capped = [] if size.mnist_steps is None else [f"train.max_steps={size.mnist_steps}"]
    seconds, summaries = [], []
    for seed in size.seeds:
        run_dir = tmp_path / f"seed{seed}"
        devices.run(launch_command("torchrun", workers, devices.trainer(
            run_dir, f"train.seed={seed}", f"train.eval_every_steps={every}",
            f"train.eval_samples={'null' if size.eval_samples is None else size.eval_samples}",
            *capped)))
        curve = [(r["step"], r["train_seconds"], r["accuracy"])
                 for r in trainer_records(run_dir, "test")]
        seconds.append(seconds_to(curve, size.target))
        summaries.append(json.loads((run_dir / "summary.json").read_text()))
    reached = [s for s in seconds if s is not None]
    record_property("target", size.target)
    record_property("seeds_reached", f"{len(reached)}/{len(seconds)}")
    if reached:
        record_property("seconds_to_target_mean", statistics.fmean(reached))
        record_property("seconds_to_target_worst", max(reached))
    record_property("images_per_second",
                    statistics.fmean(s["images_per_second"] for s in summaries))
    record_property("backend", summaries[0]["backend"])
    record_property("precision", summaries[0]["precision"])
    assert summaries[0]["world_size"] == workers
    assert len(reached) == len(seconds), [s["test_accuracy"] for s in summaries]


@pytest.fixture(scope="module")
def plain(devices, tmp_path_factory) -> Path:
    """One process with the N-fold batch, in float64, without channels_last or compile:
    the run the others are compared with."""
    run_dir = tmp_path_factory.mktemp("plain") / "run"
    devices.run(launch_command("single", 1, devices.float64(
        run_dir, f"train.batch_size={PER_RANK * devices.count}")))
    return run_dir


def test_n_ranks_equal_one_process_with_the_n_fold_batch(devices, plain, tmp_path,
                                                        record_property):
    if devices.count < 2:
        pytest.skip(f"needs 2 {devices.kind} devices or more; this machine has 1")
    devices.run(launch_command("torchrun", devices.count, devices.float64(
        tmp_path, f"train.batch_size={PER_RANK}")))
    assert json.loads((tmp_path / "summary.json").read_text())["world_size"] == devices.count
    difference = relative_difference(final_weights(tmp_path), final_weights(plain))
    record_property("relative_difference", difference)
    assert difference <= RTOL


@pytest.mark.slow(cores=1)  # one process
@pytest.mark.parametrize("option", ["channels_last", "compile"])
def test_channels_last_and_compile_take_the_steps_of_the_plain_run(devices, plain, option,
                                                                   tmp_path, record_property):
    overrides = devices.float64(tmp_path, f"train.batch_size={PER_RANK * devices.count}",
                                f"train.{option}=true")
    # What the trainer refuses here, in its own words (compile without Triton...).
    if problems := gpu_path_problems(compose([o for o in overrides
                                              if not o.startswith("hydra.")])):
        pytest.skip("; ".join(problems))
    devices.run(launch_command("single", 1, overrides))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary[option] is True
    difference = relative_difference(final_weights(tmp_path), final_weights(plain))
    record_property("relative_difference", difference)
    if option == "compile":
        record_property("compile_seconds", summary["compile_seconds"])
        assert summary["compile_steps"] >= 1  # it compiled, and timed that apart
    assert difference <= RTOL


def test_sigterm_mid_run_then_the_same_command_resumes_bit_for_bit(devices, tmp_path,
                                                                   record_property):
    """One run stopped by SIGTERM exits 75 with a checkpoint, and the same command resumes
    it to the weights of an uninterrupted run started beside it, bit for bit."""
    size = devices.size

    def command(run_dir: Path) -> list[str]:
        # A record every step, so that the signal goes as soon as the step is logged.
        return [sys.executable, str(DETERMINISTIC), *devices.trainer(
            run_dir, "telemetry.log_every=1", "preemption.notices=none",
            f"train.max_steps={size.preemption_steps}")]

    whole, cut = tmp_path / "whole", tmp_path / "cut"
    with contextlib.ExitStack() as stack:
        procs = [stack.enter_context(started(command(d), d / "output.log"))
                 for d in (whole, cut)]
        until_step(procs[1], cut, size.sigterm_after, size.timeout)
        procs[1].send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=size.timeout) for p in procs]
    assert codes == [0, EXIT_PREEMPTED], f"see {whole}/output.log, {cut}/output.log"
    stopped = json.loads((cut / "preempted.json").read_text())["step"]
    devices.run(command(cut))  # the same command again: it resumes
    total = json.loads((whole / "summary.json").read_text())["steps"]
    resumed = json.loads((cut / "summary.json").read_text())
    a, b = final_weights(cut), final_weights(whole)
    record_property("stopped_at", stopped)
    record_property("steps", total)
    record_property("relative_difference", relative_difference(a, b))
    assert size.sigterm_after <= stopped < total
    assert resumed["resumed_from"] and resumed["steps_this_run"] == total - stopped
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_fsdp_shards_the_model_over_the_devices(devices, tmp_path, record_property):
    """engine=fsdp on every device at precision auto (bf16 where the device computes in
    it): each rank holds its share of the parameters, together the whole model."""
    command = launch_command("torchrun", devices.count, [
        "--engine", "fsdp", *devices.size.fsdp, "--precision", "auto", "--device",
        devices.kind, "--run-dir", str(tmp_path)], module="spotring.benchmarks.fsdp_ranks")
    (stdout,) = devices.run(command)
    drop_heavy(tmp_path)
    run = json_line(stdout, "fsdp_ranks")["fsdp_ranks"]
    held = [r["parameter_bytes"] for r in run["ranks"]]
    record_property("precision", run["precision"])
    record_property("tokens_per_second", run["tokens_per_second"])
    record_property("peak_memory_mib", max(r["peak_memory_mib"] for r in run["ranks"]))
    assert run["world_size"] == devices.count and run["backend"] == (
        "nccl" if devices.kind == "cuda" else "gloo")
    assert sum(held) == 4 * run["parameters"]  # float32, the tied output layer once
    assert max(held) <= 1.05 * sum(held) / devices.count
