"""The learning rate at every step: linear scaling rule, gradual warmup, then decay.

Goyal et al. 2017, "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour":
multiply the batch by k, multiply the learning rate by k; start at the small-batch
rate and raise it by a constant amount every iteration until it reaches k times that
rate, then decay it as the small-batch run would. With t the optimizer step (0-based),
lr the rate that suits ``reference_batch``, T_w the warmup steps and T the total:

    k      = global_batch / reference_batch
    peak   = lr * k
    t < T_w          lr_t = start + (peak - start) * t / T_w,  start = min(lr, peak)
    decay=none       lr_t = peak
    decay=step       lr_t = peak * gamma ** (milestones <= t; milestones in steps)
    decay=cosine     lr_t = end + (peak - end) * (1 + cos(pi * min((t - T_w) / (T - T_w), 1))) / 2,
                     end = peak * final_lr_fraction

(A global batch below the reference one, k < 1, needs no warmup: start = peak.)

The LR is a pure function of t: resuming needs only t, and a run stopped early and
resumed follows the same curve as one that never stopped.

For your own script and optimizer, ``warmup_schedule`` is this rule as a torch
scheduler; ``scaled_lr`` is the rule's peak. The built-in trainer reads the same
settings from its config in epochs (trainer/schedule.py).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable
from dataclasses import dataclass

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from spotring.exits import ConfigError

DECAYS = ("none", "step", "cosine")


def scaled_lr(lr: float, reference_batch: int, global_batch: int) -> float:
    """The linear scaling rule: ``lr`` suits ``reference_batch`` samples per step, so
    ``global_batch`` samples per step take lr x global_batch / reference_batch. Raises
    ConfigError if a batch is not positive."""
    for name, batch in (("reference_batch", reference_batch), ("global_batch", global_batch)):
        if batch <= 0:
            raise ConfigError(f"{name}={batch}: must be a positive number of samples")
    return lr * global_batch / reference_batch


@dataclass(frozen=True)
class LRSchedule:
    """The LR of step t (``schedule(t)``), by the formulas of this module's docstring.
    Raises ConfigError for a decay not in DECAYS, or decay=step without milestones."""

    base_lr: float  # at step 0: start
    peak_lr: float  # from the end of warmup until the decay
    warmup_steps: float  # T_w, may be fractional
    total_steps: int  # T: cosine reaches final_lr here
    decay: str = "cosine"
    milestones: tuple[float, ...] = ()  # steps, sorted; for decay=step
    gamma: float = 0.1  # factor at each milestone
    final_lr: float = 0.0  # end, for decay=cosine

    def __post_init__(self) -> None:
        if self.decay not in DECAYS:
            raise ConfigError(f"decay={self.decay!r}: must be one of {', '.join(DECAYS)}")
        if self.decay == "step" and not self.milestones:
            raise ConfigError("milestones=(): decay='step' needs at least one step to decay at")

    @classmethod
    def linear_scaling(cls, lr: float, *, reference_batch: int, global_batch: int,
                       warmup_steps: float, total_steps: int, decay: str = "cosine",
                       milestones: Iterable[float] = (), gamma: float = 0.1,
                       final_lr_fraction: float = 0.0) -> LRSchedule:
        """The schedule for ``lr`` at ``reference_batch`` run at ``global_batch``."""
        peak = scaled_lr(lr, reference_batch, global_batch)
        return cls(base_lr=min(lr, peak), peak_lr=peak, warmup_steps=warmup_steps,
                   total_steps=total_steps, decay=decay, milestones=tuple(sorted(milestones)),
                   gamma=gamma, final_lr=peak * final_lr_fraction)

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.base_lr + (self.peak_lr - self.base_lr) * step / self.warmup_steps
        if self.decay == "step":
            return self.peak_lr * self.gamma ** bisect.bisect_right(self.milestones, step)
        if self.decay == "cosine":
            span = max(self.total_steps - self.warmup_steps, 1)
            progress = min((step - self.warmup_steps) / span, 1.0)
            return self.final_lr + (self.peak_lr - self.final_lr) * (
                1 + math.cos(math.pi * progress)) / 2
        return self.peak_lr

    def apply(self, optimizer: Optimizer, step: int) -> float:
        """Set every param group's LR to that of ``step``; returns it."""
        lr = self(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr


def warmup_schedule(optimizer: Optimizer, *, reference_batch: int, global_batch: int,
                    warmup_steps: float, total_steps: int, decay: str = "cosine",
                    milestones: Iterable[float] = (), gamma: float = 0.1,
                    final_lr_fraction: float = 0.0) -> LambdaLR:
    """The linear scaling rule with gradual warmup for any optimizer, as a torch scheduler.

    Build ``optimizer`` with the LR (each param group its own) that suits
    ``reference_batch`` samples per step; the scheduler multiplies each group's LR by
    the rule's factor: min(1, k) at step 0, linearly up to k = global_batch /
    reference_batch over ``warmup_steps`` optimizer steps, then ``decay`` (none, step:
    x ``gamma`` at each of ``milestones``, in steps; cosine: down to
    ``final_lr_fraction`` x k at ``total_steps``). Call ``scheduler.step()`` once after
    each ``optimizer.step()``. Its state_dict holds the step (not these arguments): to
    resume, build optimizer and scheduler as before, then load both state dicts.

    Raises ConfigError, naming the value and what is valid, for a batch that is not
    positive, total_steps below 1, warmup_steps outside [0, total_steps], a decay not
    in none|step|cosine, or decay=step without milestones.
    """
    if total_steps < 1:
        raise ConfigError(f"total_steps={total_steps}: must be positive")
    if not 0 <= warmup_steps <= total_steps:
        raise ConfigError(f"warmup_steps={warmup_steps}: must be between 0 and "
                          f"total_steps={total_steps}")
    factor = LRSchedule.linear_scaling(
        1.0, reference_batch=reference_batch, global_batch=global_batch,
        warmup_steps=warmup_steps, total_steps=total_steps, decay=decay,
        milestones=milestones, gamma=gamma, final_lr_fraction=final_lr_fraction)

    # A function, not the schedule object: LambdaLR would save a callable object's
    # fields in its state_dict and load them back over the arguments given here.
    def lr_lambda(step: int) -> float:
        return factor(step)

    return LambdaLR(optimizer, lr_lambda)
