"""How far one run's weights are from another's, relative to how far they moved: the
measure of the runs that cannot agree to rounding (fp16 compression under Horovod,
tests/test_horovod.py; bf16 and the other fast paths, tests/test_precision.py). Where
they started: the trainer's default model at the parity runs' seed (tests/conftest.py's
PARITY: train.seed=11)."""

from __future__ import annotations

import torch

from spotring.trainer.config import compose
from spotring.trainer.models import build_model


def distance_ratios(exact: dict, approximate: dict) -> dict[str, float]:
    """||approximate - exact|| / ||exact - initial|| per tensor: the error relative to
    how far the weights moved."""
    torch.manual_seed(11)
    initial = build_model(compose([]).model, (1, 28, 28), 10).state_dict()
    return {n: float((approximate[n] - exact[n]).norm() / (exact[n] - initial[n]).norm())
            for n in exact}
