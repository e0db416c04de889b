"""The interface every engine implements (spotring/engines/__init__.py says how the loop
uses it); ddp.py, fsdp.py and horovod.py implement it."""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from spotring.exits import ConfigError

# What wrap takes in place of an optimizer: a function of the parameters it is to step
# (an iterator, as model.parameters() gives), called once the engine has them.
OptimizerFactory = Callable[[Iterator[nn.Parameter]], Optimizer]


def built(optimizer: Optimizer | OptimizerFactory, model: nn.Module) -> Optimizer:
    """``optimizer`` itself, or the one the factory ``optimizer`` builds over ``model``'s
    parameters (ConfigError where it builds something else)."""
    if isinstance(optimizer, Optimizer):
        return optimizer
    made = optimizer(model.parameters())
    if not isinstance(made, Optimizer):
        raise ConfigError(f"the optimizer factory {optimizer!r} returned a "
                          f"{type(made).__name__}, not a torch.optim.Optimizer")
    return made


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
    # In place (ProcessGroupEngine): this step's failed collective, the step then to be
    # taken again. Every other engine raises instead, so it stays None there.
    failure: BaseException | None = None

    @abc.abstractmethod
    def prepare(self, model: nn.Module, optimizer: Optimizer | OptimizerFactory,
                accumulation: int, *, precision: str = "fp32") -> tuple[nn.Module, Optimizer]:
        """Make every rank start from rank 0's state and average gradients from now on.

        model: on this rank's device. optimizer: built over its parameters, or a factory
        (``built``). accumulation: micro-steps per optimizer step. precision: wrap's,
        resolved ("fp32", "bf16" or "fp16"); the loop autocasts the forward pass, and an
        engine that casts parameters itself reads it. Returns the model and optimizer
        to train with."""

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
