"""A user's model and data for the built-in trainer (``model._target_=harness.held_data.net``,
``dataset._target_=harness.held_data.data``) whose training reads wait while a file
exists: a test holds the trainer's steps with it until an event (a process that joins has
asked to), instead of racing the job's length.

    spotring train model._target_=harness.held_data.net +model.width=8 \\
        dataset._target_=harness.held_data.data +dataset.train_size=3200 \\
        +dataset.hold=/tmp/hold data.workers=0 ...
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn


def net(input_shape: tuple[int, int, int], num_classes: int, width: int) -> nn.Module:
    c, h, w = input_shape
    return nn.Sequential(nn.Flatten(), nn.Linear(c * h * w, width), nn.ReLU(),
                         nn.Linear(width, num_classes))


class Held(torch.utils.data.Dataset):
    """``n`` seeded noise images (2 x 5 x 5) of ``classes``; each read but a process's first
    (the trainer's check of the items, before it joins a job) waits while ``hold`` exists
    (None: never)."""

    def __init__(self, n: int, seed: int, hold: str | None) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 2, 5, 5, generator=g)
        self.y = torch.randint(0, 3, (n,), generator=g).tolist()
        self.hold = None if hold is None else Path(hold)
        self._checked = False

    classes = ["a", "b", "c"]

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        while self._checked and self.hold is not None and self.hold.exists():
            time.sleep(0.01)  # the event is the test's: the file removed
        self._checked = True
        return self.x[i], self.y[i]


def data(root: str, seed: int, train_size: int, hold: str) -> tuple[Held, Held]:
    """The training set (its reads held by ``hold``) and a test set of 40."""
    return Held(train_size, seed, hold), Held(40, seed + 1, None)
