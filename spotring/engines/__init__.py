"""Engines average gradients across workers; the training loop sees only this interface.

    check(cfg, launch, device)                    # bad input: ConfigError, nothing started
    engine = create(cfg, launch, device)          # joins the process group
    model, optimizer = engine.prepare(model, optimizer, accumulation)
    with engine.no_sync(model): ...backward...    # micro-steps before the last
    engine.step(optimizer, scaler)                # gradients are averaged by now; the
                                                  # fp16 scaler unscales them first
    engine.all_reduce_sum(metrics, "metrics")     # numbers for the logs
    wait = engine.start_sum(votes, "preemption")  # the same, waited for a step later

``cfg`` is anything with the engine's attributes (trainer/config.py's EngineConfig, or
the namespace spotring.init builds): name, backend, timeout_s, sync_bn, and bucket_mb
(ddp) or compression, op, timeline (horovod).

PyTorch DDP (engine=ddp) averages in backward hooks over bucketed gradients; Horovod
(engine=horovod) does it in its DistributedOptimizer. Both run a ring allreduce,
NCCL on GPUs, Gloo (or MPI, for Horovod) on CPUs.
"""

from __future__ import annotations

import torch

from spotring.engines.base import Engine
from spotring.exits import ConfigError
from spotring.runtime import Launch

__all__ = ["Engine", "check", "create", "is_collective_failure"]


def check(cfg, launch: Launch, device: torch.device) -> None:
    """Refuse an engine this launch cannot run, before any process group exists."""
    if cfg.name == "horovod":
        from spotring.engines.horovod import require_horovod

        require_horovod(cfg, launch)
    if cfg.backend == "mpi" and (launch.launcher != "mpi" or device.type == "cuda"):
        raise ConfigError(
            f"engine.backend=mpi averages gradients over MPI on CPUs: start the job with "
            f"mpirun on CPU workers (here: {launch.launcher}, {device.type}); on GPUs NCCL "
            "is the fast path (engine.backend=auto)")


def create(cfg, launch: Launch, device: torch.device) -> Engine:
    if cfg.name == "horovod":
        from spotring.engines.horovod import HorovodEngine

        return HorovodEngine(cfg, launch, device)
    from spotring.engines.ddp import DDPEngine, SingleProcess

    return (SingleProcess if launch.world_size == 1 else DDPEngine)(cfg, launch, device)


def is_collective_failure(error: BaseException) -> bool:
    """Whether ``error`` means a peer is gone (exit 69) rather than a bug (exit 1)."""
    if isinstance(error, torch.distributed.DistError):
        return True
    name = type(error).__name__
    text = str(error).lower()
    # DDP's reducer raises a plain RuntimeError with the transport's message, such as
    # "Application timeout caused pair closure" when an earlier collective on the same
    # connection (the vote in flight) timed out first.
    return name == "HorovodInternalError" or (
        isinstance(error, RuntimeError)
        and any(s in text for s in ("gloo", "nccl", "connection closed", "timed out",
                                    "pair closure")))
