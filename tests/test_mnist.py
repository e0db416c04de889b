"""The main job, end to end: `make train`'s default config with 2 workers on real MNIST."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_default_config_with_two_workers_reaches_99_percent(train):
    run = train("mnist", launcher="torchrun", nproc=2, timeout=900)
    summary = run.summary
    assert summary["dataset"] == "mnist" and summary["world_size"] == 2
    assert summary["epochs"] == 2.0
    assert summary["test_accuracy"] >= 0.99, summary
    assert f"test accuracy {100 * summary['test_accuracy']:.2f}%" in run.output
