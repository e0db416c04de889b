"""The optimizer, and its learning rate at every step: linear scaling rule, gradual
warmup, then decay.

Goyal et al. 2017, "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour":
multiply the batch by k, multiply the learning rate by k; start at the small-batch
rate and raise it by a constant amount every iteration until it reaches k times
that rate after a few epochs. With t the optimizer step (0-based), E the steps per
epoch and T = round(train.epochs * E) (at least 1):

    k      = global_batch / optim.reference_batch
    peak   = optim.lr * k
    T_w    = schedule.warmup_epochs * E
    t < T_w          lr = start + (peak - start) * t / T_w,  start = min(optim.lr, peak)
    decay=none       lr = peak
    decay=step       lr = peak * gamma ** (milestones passed; milestones in epochs)
    decay=cosine     lr = end + (peak - end) * (1 + cos(pi * (t - T_w) / (T - T_w))) / 2,
                     end = peak * final_lr_fraction

(A global batch below the reference one, k < 1, needs no warmup: start = peak.)

The LR is a pure function of t, so a checkpoint needs only t to resume it, and the
horizon T does not depend on ``train.max_steps``: a run stopped early and resumed
follows the same curve as one that never stopped.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import torch
from omegaconf import DictConfig
from torch.optim import Optimizer


def build_optimizer(cfg: DictConfig, params) -> Optimizer:
    """SGD (momentum, optionally Nesterov) or AdamW. The LR is set by LRSchedule every step."""
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
                               weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                             weight_decay=cfg.weight_decay)


@dataclass(frozen=True)
class LRSchedule:
    base_lr: float
    peak_lr: float
    warmup_steps: float
    total_steps: int
    steps_per_epoch: int
    decay: str
    milestones: tuple[float, ...]  # in epochs
    gamma: float
    final_lr: float

    @classmethod
    def from_config(cls, cfg: DictConfig, global_batch: int, steps_per_epoch: int) -> LRSchedule:
        peak = cfg.optim.lr * global_batch / cfg.optim.reference_batch
        return cls(
            base_lr=min(cfg.optim.lr, peak),
            peak_lr=peak,
            warmup_steps=cfg.schedule.warmup_epochs * steps_per_epoch,
            total_steps=max(1, round(cfg.train.epochs * steps_per_epoch)),
            steps_per_epoch=steps_per_epoch,
            decay=cfg.schedule.decay,
            milestones=tuple(sorted(cfg.schedule.milestones)),
            gamma=cfg.schedule.gamma,
            final_lr=peak * cfg.schedule.final_lr_fraction,
        )

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.base_lr + (self.peak_lr - self.base_lr) * step / self.warmup_steps
        if self.decay == "step":
            passed = bisect.bisect_right(self.milestones, step / self.steps_per_epoch)
            return self.peak_lr * self.gamma**passed
        if self.decay == "cosine":
            span = max(self.total_steps - self.warmup_steps, 1)
            progress = min((step - self.warmup_steps) / span, 1.0)
            return self.final_lr + (self.peak_lr - self.final_lr) * (
                1 + math.cos(math.pi * progress)) / 2
        return self.peak_lr

    def apply(self, optimizer: Optimizer, step: int) -> float:
        lr = self(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr
