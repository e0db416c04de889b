"""The learning rate against Goyal et al. 2017's formulas, at chosen iterations."""

from __future__ import annotations

import math

import pytest

from spotring.lr import LRSchedule
from spotring.trainer.schedule import lr_schedule
from tests.conftest import compose_config


def schedule(*overrides: str, global_batch: int, steps_per_epoch: int) -> LRSchedule:
    return lr_schedule(compose_config(*overrides), global_batch, steps_per_epoch)


def test_goyal_imagenet_schedule():
    # The paper's setting: base 0.1 per 256 images, k=32 (8192 images, 256 GPUs x 32),
    # 5 warmup epochs, /10 at 30, 60, 80; 156 steps per epoch of 1.28 M images.
    lr = schedule("schedule=goyal", "optim.lr=0.1", "optim.reference_batch=256",
                  "train.epochs=90", global_batch=8192, steps_per_epoch=156)
    eta, k, warmup = 0.1, 32, 5 * 156
    assert lr(0) == pytest.approx(eta)
    for t in (1, 100, 390, 779):
        assert lr(t) == pytest.approx(eta + (k * eta - eta) * t / warmup)  # +constant per step
    assert lr(warmup) == pytest.approx(k * eta)  # reached after 5 epochs
    assert lr(29 * 156) == pytest.approx(3.2)
    assert lr(30 * 156) == pytest.approx(0.32)
    assert lr(60 * 156 + 5) == pytest.approx(0.032)
    assert lr(80 * 156) == pytest.approx(0.0032)
    assert lr(90 * 156 - 1) == pytest.approx(0.0032)


def test_cosine_after_warmup():
    lr = schedule("schedule=cosine", "schedule.warmup_epochs=2", "optim.lr=0.05",
                  "optim.reference_batch=128", "train.epochs=10",
                  global_batch=512, steps_per_epoch=100)
    peak = 0.05 * 512 / 128
    assert lr(100) == pytest.approx(0.05 + (peak - 0.05) * 100 / 200)
    assert lr(200) == pytest.approx(peak)
    assert lr(600) == pytest.approx(peak / 2)  # half way through the decay
    t = 750
    assert lr(t) == pytest.approx(peak * (1 + math.cos(math.pi * (t - 200) / 800)) / 2)
    assert lr(1000) == pytest.approx(0.0, abs=1e-12)


def test_batch_below_the_reference_scales_down_without_warmup():
    lr = schedule("schedule=cosine", "schedule.warmup_epochs=1", "optim.lr=0.1",
                  "optim.reference_batch=256", "train.epochs=4",
                  global_batch=64, steps_per_epoch=10)
    assert lr(0) == lr(5) == lr(10) == pytest.approx(0.025)


def test_constant_schedule_is_the_scaled_lr():
    lr = schedule("schedule=constant", "optim.lr=0.01", "optim.reference_batch=100",
                  global_batch=300, steps_per_epoch=10)
    assert lr(0) == lr(19) == pytest.approx(0.03)
