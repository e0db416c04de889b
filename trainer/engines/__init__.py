"""Engines average gradients across workers; the training loop sees only this interface.

    engine = create(cfg.engine, launch, device)   # joins the process group
    model, optimizer = engine.prepare(model, optimizer, accumulation)
    with engine.no_sync(model): ...backward...    # micro-steps before the last
    engine.step(optimizer, scaler)                # gradients are averaged by now; the
                                                  # fp16 scaler unscales them first
    engine.all_reduce_sum(metrics, "metrics")     # numbers for the logs
    wait = engine.start_sum(votes, "preemption")  # the same, waited for a step later

PyTorch DDP (engine=ddp) averages in backward hooks over bucketed gradients; Horovod
(engine=horovod) does it in its DistributedOptimizer. Both run a ring allreduce,
NCCL on GPUs, Gloo (or MPI, for Horovod) on CPUs.
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from trainer.engines.base import Engine
from trainer.runtime import Launch

__all__ = ["Engine", "create"]


def create(cfg: DictConfig, launch: Launch, device: torch.device) -> Engine:
    if cfg.name == "horovod":
        from trainer.engines.horovod import HorovodEngine

        return HorovodEngine(cfg, launch, device)
    from trainer.engines.ddp import DDPEngine, SingleProcess

    return (SingleProcess if launch.world_size == 1 else DDPEngine)(cfg, launch, device)
