"""The interface every engine implements (spotring/engines/__init__.py says how the loop
uses it); ddp.py and horovod.py implement it."""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer


class Engine(abc.ABC):
    name: str
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str  # the transport of the gradient allreduce: nccl, gloo, mpi
    # The loop multiplies every loss by this. An engine whose allreduce sums gradients
    # instead of averaging them sets 1 / world_size: one scalar division per
    # micro-step instead of one per gradient value (Horovod's prescale_factor).
    loss_scale: float = 1.0
    # The engine's collectives take contiguous tensors only (Horovod's do): with
    # train.channels_last the parameters then stay contiguous, and only the batches are
    # NHWC; convolutions still run NHWC when their input is.
    contiguous_only: bool = False

    @abc.abstractmethod
    def prepare(self, model: nn.Module, optimizer: Optimizer,
                accumulation: int) -> tuple[nn.Module, Optimizer]:
        """Make every rank start from rank 0's state and average gradients from now on."""

    def step(self, optimizer: Optimizer, scaler: torch.amp.GradScaler) -> None:
        """optimizer.step() on the averaged gradients. With train.precision=fp16 the
        scaler is enabled: it unscales them, skips the step where they overflowed, and
        adapts its scale; disabled, it just calls optimizer.step()."""
        scaler.step(optimizer)
        scaler.update()

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Around the backward passes that only accumulate (all but the last micro-step)."""
        return contextlib.nullcontext()

    @abc.abstractmethod
    def all_reduce_sum(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """Sum over ranks, in place. ``name`` tells Horovod which tensor this is."""

    def start_sum(self, tensor: torch.Tensor, name: str) -> Callable[[], torch.Tensor]:
        """Start all_reduce_sum; the returned function waits for it and returns the sum.
        This default sums at once: for engines whose small sums take microseconds."""
        self.all_reduce_sum(tensor, name)
        return lambda: tensor

    @abc.abstractmethod
    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (picklable objects; checkpoints on resume)."""

    @abc.abstractmethod
    def all_gather_object(self, obj: Any) -> list[Any]: ...

    def describe_failure(self, error: BaseException) -> str:
        """What went wrong in a collective, naming the lost ranks where that can be known."""
        return str(error)

    @abc.abstractmethod
    def shutdown(self) -> None: ...
