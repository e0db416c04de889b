"""The main job, end to end: `make train`'s default config with 2 workers on real MNIST:
99% test accuracy after one epoch, bf16 autocast where the CPU computes in bf16."""

from __future__ import annotations

import pytest
import torch

from spotring.runtime import pick_precision


@pytest.mark.slow
def test_default_config_with_two_workers_reaches_99_percent(train):
    run = train("mnist", launcher="spawned", nproc=2, timeout=900)
    summary = run.summary
    assert summary["dataset"] == "mnist" and summary["world_size"] == 2
    assert summary["epochs"] == 1.0
    assert summary["test_accuracy"] >= 0.99, summary
    assert f"test accuracy {100 * summary['test_accuracy']:.2f}%" in run.output
    # train.precision=auto, resolved as this machine allows, and recorded as resolved.
    assert summary["precision"] == pick_precision("auto", torch.device("cpu"), "float32")
    assert summary["channels_last"] is True
