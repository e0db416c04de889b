"""What rank 0 leaves behind, read back the way users read it."""

from __future__ import annotations

import io
import json

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from spotring.telemetry import Progress, Telemetry
from spotring.trainer.models import build_model
from spotring.trainer.schedule import lr_schedule
from tests.conftest import compose_config

# 640 synthetic samples, 2 workers x 32: 10 steps per epoch, 2 epochs.
SMALL = ["dataset=synthetic", "dataset.shape=[1,28,28]", "dataset.train_size=640",
         "dataset.test_size=100", "train.batch_size=32", "train.epochs=2",
         "telemetry.log_every=5", "schedule.warmup_epochs=1"]


@pytest.mark.slow
def test_tensorboard_and_metrics_hold_every_scalar_written_by_rank_0_only(train):
    run = train("run", *SMALL, "telemetry.progress=true", launcher="spawned", nproc=2)
    events = list((run.dir / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1  # one writer: rank 0
    tb = EventAccumulator(str(run.dir / "tensorboard"))
    tb.Reload()
    scalars = tb.Tags()["scalars"]
    for tag in ["train/loss", "train/accuracy", "train/lr", "train/images_per_second",
                "epoch/seconds", "epoch/images_per_second", "test/loss", "test/accuracy"]:
        assert tag in scalars, tag

    # The LR of every one of the 20 steps, as the schedule's formula gives it.
    lr = tb.Scalars("train/lr")
    assert [e.step for e in lr] == list(range(1, 21))
    schedule = lr_schedule(compose_config(*SMALL), global_batch=64, steps_per_epoch=10)
    for event in lr:
        assert event.value == pytest.approx(schedule(event.step - 1), rel=1e-6)
    assert [e.step for e in tb.Scalars("train/loss")] == [5, 10, 15, 20]
    assert [e.step for e in tb.Scalars("test/accuracy")] == [10, 20]
    assert len(tb.Scalars("epoch/seconds")) == 2

    records = [json.loads(line) for line in (run.dir / "metrics.jsonl").read_text().splitlines()]
    kinds = [r["kind"] for r in records]
    assert kinds.count("train") == 4 and kinds.count("epoch") == 2 and kinds.count("test") == 2
    final = [r for r in records if r["kind"] == "test"][-1]
    assert final["accuracy"] == run.summary["test_accuracy"]
    assert tb.Scalars("test/accuracy")[-1].value == pytest.approx(final["accuracy"])
    assert run.summary["final_lr"] == pytest.approx(schedule(19))

    # Only rank 0 writes: one run directory, and rank 1 prints nothing of its own.
    assert run.output.count("test accuracy") == 3  # two epoch lines and the summary
    assert run.output.count("20/20 [") == 1  # one progress bar, ended
    assert sorted(p.name for p in run.dir.iterdir()) == [
        ".hydra", "checkpoints", "checkpoints.json", "metrics.jsonl", "summary.json",
        "tensorboard", "train.log"]


@pytest.mark.slow(cores=1)
def test_summary_has_what_users_and_benchmarks_read(train):
    run = train("run", *SMALL, "train.max_steps=7", launcher="spawned")
    summary = run.summary
    for key in ["test_accuracy", "test_loss", "train_seconds", "images_per_second",
                "world_size", "global_batch", "steps", "epochs", "engine", "final_lr"]:
        assert key in summary
    assert summary["steps"] == 7 and summary["epochs"] == pytest.approx(7 / 20)
    assert summary["world_size"] == 1 and summary["global_batch"] == 32
    assert summary["engine"] == "ddp" and summary["images_per_second"] > 0
    # What ran: the model option (several share the builder "convnet"), here the default.
    assert summary["model"] == "fast_convnet" and summary["model_builder"] == "convnet"
    assert "spotring: fast_convnet on synthetic: test accuracy" in run.output
    assert f"summary     {run.dir / 'summary.json'}" in run.output
    assert "img/s" in run.output and "tensorboard" in run.output

    # The model's size, and the most memory the process held (on the CPU: its peak RSS).
    cfg = compose_config(*SMALL)
    model = build_model(cfg.model, tuple(cfg.dataset.shape), cfg.dataset.num_classes)
    parameters = sum(p.numel() for p in model.parameters())
    assert summary["parameters"] == parameters
    assert summary["parameter_mb"] == pytest.approx(parameters * 4 / 2**20)  # float32
    assert summary["peak_memory_mb"] > 0


def test_progress_in_a_log_is_plain_lines_and_ends_with_the_last_step():
    log = io.StringIO()  # not a terminal, as in CI
    progress = Progress(total=50, done=10, stream=log)  # a run resumed at step 10
    for step in range(11, 51):
        progress.update(step)
        if step % 10 == 0:
            progress.describe(f"loss {1 / step:.4f}")
    progress.close()
    text = log.getvalue()
    assert "\r" not in text and "\x1b" not in text  # no redraws, no terminal codes
    lines = text.splitlines()
    assert lines[0].startswith("20%") and "10/50" in lines[0]
    assert lines[-1].startswith("100%") and "50/50" in lines[-1] and "loss 0.0200" in lines[-1]
    assert len(lines) == 2  # in well under telemetry.LOG_LINE_SECONDS: the first and last


def test_an_epoch_is_counted_from_1_wherever_a_user_reads_it(tmp_path):
    # 10 steps per epoch; the loop passes its 0-based position, as a checkpoint holds it.
    telemetry = Telemetry(tmp_path, enabled=True, progress=True, total_steps=20, done_steps=0)
    for step, epoch in ((5, 0), (10, 0), (15, 1)):
        telemetry.train(step, epoch, lr=0.1, loss=1.0, accuracy=0.5, images_per_second=100.0)
        if step == 10:
            telemetry.epoch(step, epoch, seconds=2.0, images_per_second=100.0)
    bar = telemetry.progress.bar.postfix
    telemetry.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"], r["epoch"]) for r in records] == [
        ("train", 5, 1), ("train", 10, 1), ("epoch", 10, 1), ("train", 15, 2)]
    assert bar.startswith("epoch 2 loss")
    tb = EventAccumulator(str(tmp_path / "tensorboard"))
    tb.Reload()
    assert [e.step for e in tb.Scalars("epoch/seconds")] == [1]
