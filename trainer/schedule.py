"""The optimizer, and its learning rate at every step: the linear scaling rule with
gradual warmup, then decay (spotring/lr.py has the formulas), set in epochs by the
config. With E the steps per epoch:

    k      = global_batch / optim.reference_batch,  lr = optim.lr
    T_w    = schedule.warmup_epochs * E
    T      = round(train.epochs * E), at least 1
    milestones (decay=step)  schedule.milestones * E
    end    = k * optim.lr * schedule.final_lr_fraction

The horizon T does not depend on ``train.max_steps``: a run stopped early and resumed
follows the same curve as one that never stopped.
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig
from torch.optim import Optimizer

from spotring.lr import LRSchedule


def build_optimizer(cfg: DictConfig, params) -> Optimizer:
    """SGD (momentum, optionally Nesterov) or AdamW. The LR is set by LRSchedule every step."""
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
                               weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                             weight_decay=cfg.weight_decay)


def lr_schedule(cfg: DictConfig, global_batch: int, steps_per_epoch: int) -> LRSchedule:
    """The run's schedule from the composed config (optim, schedule, train.epochs)."""
    return LRSchedule.linear_scaling(
        cfg.optim.lr, reference_batch=cfg.optim.reference_batch, global_batch=global_batch,
        warmup_steps=cfg.schedule.warmup_epochs * steps_per_epoch,
        total_steps=max(1, round(cfg.train.epochs * steps_per_epoch)),
        decay=str(cfg.schedule.decay),
        milestones=[epoch * steps_per_epoch for epoch in cfg.schedule.milestones],
        gamma=cfg.schedule.gamma, final_lr_fraction=cfg.schedule.final_lr_fraction)
