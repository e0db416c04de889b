"""train.precision, train.channels_last and train.compile (docs/gpu.md), on CPU workers.

Each option trains 2 workers x batch 32 under torchrun, and the weights are compared with
1 worker x batch 64 at the same step, as a ratio: ||two - one|| / ||one - initial||,
the difference relative to how far the weights moved (harness/weights.py's
distance_ratios).

Tolerances. channels_last and compile run in train.dtype=float64, as the equality
tests of test_equivalence.py do, and are held to 1e-10 (measured: about 1e-15): in
float64 the reassociation of sums (two halves averaged by the allreduce, against one
sum over the whole batch; inductor's fused kernels against eager ones) stays far
below anything that could flip a max-pool or ReLU decision. In float32 the same pair
agrees to about 1e-5 of the update (measured), which is all fp32 reassociation costs.
bf16 cannot run in float64 (autocast would compute in less than float64, and is
refused), and its 8-bit mantissa rounds every activation and every weight it casts:
after one step the two runs differ by 0.3% of the update (measured), from the
roundings of the two half-batch gradient sums against the one of the whole batch
(2^-9 each); from the second step on, weights that differ by any amount round to
different bf16 values, so the difference grows by bf16's own error per step (measured:
4% after 10 steps, 6% after 20; bf16 itself is 6-10% of the update away from the
float64 run at every step). So 1% after step 1, 10% after 10 steps and 20% after
20: a broken average (a sum, or no allreduce) is off by about 100%.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from harness.commands import call
from harness.scaler import scaler_steps
from harness.weights import distance_ratios
from spotring import DDPOptions, Job, engines, init, runtime
from spotring.checkpoint.layout import Checkpoint, Checkpoints
from spotring.checkpoint.parts import load_whole
from spotring.cli import main
from spotring.exits import ConfigError
from spotring.trainer import datasets
from spotring.trainer.loop import Trainer
from spotring.trainer.models import build_model
from spotring.trainer.validation import validate
from tests.conftest import PARITY, REPO, Run, compose_config, run_trainer

# PARITY: real MNIST, 20 steps, seed 11, a checkpoint after every step, float64, NCHW.
F64 = PARITY
BF16 = [o for o in F64 if o != "train.dtype=float64"] + ["train.precision=bf16"]
TWO = {"launcher": "spawned", "nproc": 2}  # harness/ranks.py: no launcher is tested here


def ratio(run: Run, reference: Run, step: int | None = None) -> float:
    """The largest per-tensor ||run - reference|| / ||reference - initial|| at ``step``."""
    exact = {k: v.double() for k, v in reference.params(step).items()}
    other = {k: v.double() for k, v in run.params(step).items()}
    return max(distance_ratios(exact, other).values())


def checkpoint_of(run: Run, step: int) -> Checkpoint:
    """The checkpoint of ``step`` in ``run``'s checkpoint directory (resume=its location)."""
    (found,) = (c for c in run.checkpoints() if c.step == step)
    return found


def losses(run: Run) -> list[float]:
    """The training loss of each metrics.jsonl record (every telemetry.log_every steps)."""
    records = [json.loads(line) for line in (run.dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r["kind"] == "train"]


def check_trained(run: Run, **options) -> None:
    """20 steps, the options recorded in summary.json and the log, the loss falling (over
    the whole run where it started at step 0), plain keys in the checkpoint."""
    assert run.summary["steps"] == 20
    for key, value in options.items():
        assert run.summary[key] == value, key
    assert "precision {precision}, channels_last {channels_last}, compile {compile}".format(
        **{k: str(v).lower() for k, v in options.items()}) in run.output
    curve = losses(run)
    if run.summary["steps_this_run"] == 20:
        assert len(curve) == 4 and curve[-1] < 0.9 * curve[0], curve  # from ln 10 = 2.30
    assert run.summary["test_accuracy"] > 0.3  # chance is 0.1
    names = run.params().keys()
    assert all(not k.startswith(("_orig_mod.", "module.")) for k in names)
    assert names == build_model(compose_config().model, (1, 28, 28), 10).state_dict().keys()


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> Run:
    return run_trainer(tmp_path_factory.mktemp("compiled") / "run", *F64, "train.batch_size=32",
                       "train.compile=true", **TWO)


@pytest.fixture(scope="module")
def bf16_two(tmp_path_factory) -> Run:
    return run_trainer(tmp_path_factory.mktemp("bf16") / "run", *BF16, "train.batch_size=32",
                       **TWO)


@pytest.mark.slow
def test_bf16_two_workers_take_the_steps_of_one_within_bf16_rounding(train, bf16_two):
    one = train("one", *BF16, "train.batch_size=64", launcher="spawned")
    check_trained(bf16_two, precision="bf16", channels_last=False, compile=False)
    assert one.summary["precision"] == "bf16"
    for step, tolerance in [(1, 0.01), (10, 0.1), (20, 0.2)]:
        assert 0 < ratio(bf16_two, one, step) <= tolerance, step


@pytest.mark.slow
def test_channels_last_two_workers_equal_one_worker(train, one_worker):
    two = train("two", *F64, "train.batch_size=32", "train.channels_last=true", **TWO)
    check_trained(two, precision="fp32", channels_last=True, compile=False)
    assert ratio(two, one_worker) <= 1e-10


@pytest.mark.slow
def test_compiled_two_workers_equal_one_eager_worker(compiled, one_worker):
    check_trained(compiled, precision="fp32", channels_last=False, compile=True)
    assert ratio(compiled, one_worker) <= 1e-10
    summary = compiled.summary
    # The compiling step is timed apart: the other 19 make train_seconds and img/s.
    assert summary["compile_steps"] == 1 and summary["compile_seconds"] > 0
    assert summary["images_per_second"] == pytest.approx(19 * 64 / summary["train_seconds"])
    assert "s compiling (first steps, not counted)" in compiled.output


@pytest.mark.slow
def test_a_compiled_run_resumes_uncompiled_with_channels_last(train, compiled):
    start = checkpoint_of(compiled, 10)
    resumed = train("resumed", *F64, "train.batch_size=32", f"resume={start.location}",
                    "train.channels_last=true", **TWO)
    assert "resumed at step 10" in resumed.output
    assert resumed.summary["steps_this_run"] == 10 and not resumed.summary["compile"]
    assert ratio(resumed, compiled) <= 1e-10


@pytest.mark.slow
def test_a_bf16_run_resumes_compiled_with_channels_last(train, bf16_two):
    """All three options at once, from a checkpoint of a run with bf16 alone; the
    compiled kernels round bf16 differently from the eager ones, so this is held to the
    bf16 tolerance of 10 steps."""
    start = checkpoint_of(bf16_two, 10)
    resumed = train("resumed", *BF16, "train.batch_size=32", f"resume={start.location}",
                    "train.channels_last=true", "train.compile=true", **TWO)
    assert "resumed at step 10" in resumed.output
    check_trained(resumed, precision="bf16", channels_last=True, compile=True)
    assert resumed.summary["steps_this_run"] == 10
    assert ratio(resumed, bf16_two) <= 0.1


# ------------------------------------------------------------------ fp16's scaler

def check_scaler_steps(result: dict) -> None:
    assert result["finite_exact"] and result["finite_moved"]
    assert result["finite_scale"] == 2.0**10  # no overflow: unchanged (growth after 2000)
    assert not result["overflow_moved"] and result["overflow_scale"] == 2.0**9


def test_fp16_scaler_unscales_and_skips_overflowing_steps_under_ddp():
    launch = runtime.detect({})
    check_scaler_steps(scaler_steps(engines.create(DDPOptions(), launch,
                                                   torch.device("cpu"))))


@pytest.mark.slow(cores=1)
def test_fp16_scaler_follows_horovods_synchronize_pattern():
    # In a process of its own: Horovod's threads stay out of pytest's. Warnings are
    # errors, so Horovod's "step() called without skip_synchronize()" would fail it.
    proc = subprocess.run(
        [sys.executable, "-W", "error::UserWarning", "-m", "harness.scaler"],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_scaler_steps(json.loads(proc.stdout.strip().splitlines()[-1]))


@pytest.mark.slow
def test_fp16_scaler_state_is_checkpointed_and_restored(tmp_path):
    """The training loop itself with fp16 on the CPU, in this process (validate refuses
    fp16 on the CPU for runs): the scaler's state goes into the checkpoint and comes
    back on resume."""
    cfg = compose_config("dataset=synthetic", "dataset.shape=[1,28,28]",
                         "dataset.train_size=256", "dataset.test_size=64",
                         "train.batch_size=32", "train.max_steps=3", "train.precision=fp16",
                         "telemetry.progress=false", "preemption.notices=none",
                         f"checkpoint.dir={tmp_path / 'checkpoints'}")
    dataset = datasets.load(cfg.dataset, cfg.data, cfg.train.seed)
    checkpoints = Checkpoints(cfg.checkpoint.dir, cfg.checkpoint.keep)

    def job() -> Job:  # as the trainer starts one (trainer/job.py)
        return init(engine=OmegaConf.to_object(cfg.engine), device="cpu", run_dir=tmp_path,
                    checkpoint=OmegaConf.to_object(cfg.checkpoint),
                    preemption=OmegaConf.to_object(cfg.preemption), seed=cfg.train.seed)

    first = job()
    trainer = Trainer(cfg, first, dataset, build_model(cfg.model, dataset.shape, 10))
    first.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127)  # overflows at once
    assert trainer.fit()["precision"] == "fp16"
    first.close()
    saved = load_whole(checkpoints.newest_valid())
    # Three overflowing steps, three halvings (none moved the weights).
    assert saved["spotring"]["scaler"]["scale"] == 2.0**124
    second = job()
    Trainer(cfg, second, dataset, build_model(cfg.model, dataset.shape, 10))
    assert second.restore() == 3
    assert second.scaler.state_dict() == saved["spotring"]["scaler"]
    second.close()


def test_a_float64_run_is_scored_in_float64(tmp_path):
    """The test loss of a train.dtype=float64 run is the model's own float64 cross entropy
    (a float32 one would differ from it by about 1e-8 of itself)."""
    cfg = compose_config("dataset=synthetic", "dataset.shape=[1,28,28]",
                         "dataset.train_size=128", "dataset.test_size=64",
                         "train.batch_size=32", "train.max_steps=1", "train.dtype=float64",
                         "train.channels_last=false", "telemetry.progress=false",
                         "preemption.notices=none", f"checkpoint.dir={tmp_path / 'ckpt'}")
    dataset = datasets.load(cfg.dataset, cfg.data, cfg.train.seed)
    job = init(device="cpu", run_dir=tmp_path, preemption=OmegaConf.to_object(cfg.preemption),
               checkpoint=OmegaConf.to_object(cfg.checkpoint), seed=cfg.train.seed)
    try:
        trainer = Trainer(cfg, job, dataset, build_model(cfg.model, dataset.shape, 10))
        scored = trainer.fit()["test_loss"]
        with torch.no_grad():
            trainer.raw_model.eval()
            pairs = list(trainer.batches.test(cfg.train.eval_batch_size,
                                              cfg.train.eval_samples))
            total = sum(nn.functional.cross_entropy(trainer.raw_model(x), y, reduction="sum")
                        for x, y in pairs)
            n = sum(len(y) for _, y in pairs)
    finally:
        job.close()
    assert pairs[0][0].dtype == torch.float64
    assert abs(scored - float(total) / n) <= 1e-12 * abs(scored)


# ------------------------------------------------------------- refused before a run

def problems(*overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        validate(compose_config(*overrides))
    return str(e.value)


def test_the_default_run_takes_auto_precision_and_channels_last_and_the_options_combine():
    cfg = compose_config()
    assert (cfg.train.precision, cfg.train.channels_last, cfg.train.compile) == \
        ("auto", True, False)
    validate(compose_config("train.precision=bf16", "train.channels_last=true",
                            "train.compile=true", "train.device=cpu"))
    validate(compose_config("train.channels_last=true", "train.dtype=float64",
                            "model=resnet20", "dataset=cifar10"))


@pytest.mark.parametrize("overrides, expected", [
    (["train.precision=fp16", "train.device=cpu"],
     "train.precision=fp16 on the CPU (train.device=cpu): float16 with a gradient scaler is "
     "a GPU path; valid on the CPU: fp32, bf16"),
    (["train.precision=bf16", "train.dtype=float64"],
     "train.precision=bf16 with train.dtype=float64: autocast would compute in less than the "
     "float64 the run asks for; valid with float64: fp32"),
    (["train.compile=true", "engine.bucket_mb=0.5"],
     "engine.bucket_mb=0.5 with torch.compile: DDP's first bucket holds 1 MB"),
])
def test_combinations_the_options_cannot_run_are_refused(overrides, expected):
    assert expected in problems(*overrides)


def test_fp16_on_auto_without_a_gpu_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "train.precision=fp16 on the CPU (train.device=auto, and torch sees no GPU)" in \
        problems("train.precision=fp16")


def test_compile_without_a_cpp_compiler_is_refused():
    from torch._inductor import config as inductor_config

    # inductor's own patch: monkeypatch's undo leaves the key unreadable in this process.
    with inductor_config.patch({"cpp.cxx": (None, "/nonexistent/g++")}):
        text = problems("train.compile=true", "train.device=cpu")
    assert "train.compile=true: inductor compiles C++ for the CPU and finds no C++ compiler " \
           "here (looked for /nonexistent/g++; set CXX or install g++); valid here: " \
           "train.compile=false" in text


@pytest.mark.parametrize("overrides, named", [
    (["train.precision=fp16", "train.device=cpu"], "train.precision=fp16 on the CPU"),
    (["train.precision=bf16", "train.dtype=float64"], "train.precision=bf16 with train.dtype"),
    (["train.precision=int8"], "train.precision=int8: Invalid value 'int8', expected one of "
                               "[auto, fp32, bf16, fp16]"),
])
def test_bad_options_exit_2_before_a_run_directory_exists(tmp_path, overrides, named):
    run_dir = tmp_path / "run"
    done = call(main, "train", *overrides, f"hydra.run.dir={run_dir}")
    assert done.code == 2, done.err[-3000:]
    assert named in done.err and "Traceback" not in done.err
    assert not run_dir.exists()
