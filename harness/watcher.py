"""The notice watcher (spotring.preemption.Preemption) driven alone, as the training
loop drives it, with no process group: ``OneRank``, the engine of a job of one rank, and
``next_decision``, the watcher's first decision other than "go on" (tests/test_spot.py,
tests/test_notices.py, benchmarks/results/notice-gap/measure.py)."""

from __future__ import annotations

import time

import torch

from spotring.preemption import Decision


class OneRank:
    """The engine of a job of one rank, where the vote's sum is the rank's own vote."""

    device = torch.device("cpu")
    world_size = 1

    def start_sum(self, tensor, name):
        return lambda: tensor


def next_decision(watcher, timeout=10.0):
    """The first decision other than "go on", polled as the loop does at each step."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        decision = watcher.decide()
        if decision != Decision(None, False):
            return decision
        time.sleep(0.02)
    raise AssertionError(f"no decision within {timeout} s")
