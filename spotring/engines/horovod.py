"""engine=horovod: Horovod's DistributedOptimizer, over Gloo or MPI on CPUs, NCCL on GPUs.

Horovod averages gradients with a ring allreduce started from per-parameter hooks
during backward, fused into buffers; ``optimizer.step()`` waits for them. Its own
rendezvous (horovodrun's, or MPI's under mpirun) replaces the store of engine=ddp.
Build Horovod with `make horovod` (see docs/horovod.md).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from spotring.engines import register
from spotring.engines.base import Engine, OptimizerFactory, built
from spotring.exits import ConfigError
from spotring.options import EngineOptions, choices
from spotring.runtime import Launch

Compression = choices("Compression", "none fp16")
ReduceOp = choices("ReduceOp", "average adasum")


@dataclass
class HorovodOptions(EngineOptions):
    """engine="horovod": Horovod's DistributedOptimizer (EngineOptions has the common
    fields; backend=mpi or auto under mpirun, gloo or auto under horovodrun --gloo).

    compression: fp16: gradients travel as float16 (half the bytes), averaged in float32.
    op: average; adasum: Horovod's Adasum reduction instead of the mean.
    timeline: PATH where rank 0 writes a Horovod timeline (a Chrome trace); None: none.
    """

    name: str = "horovod"
    compression: Compression = Compression.none
    op: ReduceOp = ReduceOp.average
    timeline: str | None = None

BUILD_HINT = (
    "Build it against this environment's torch with `make horovod` (about 5 minutes; "
    "the wheel is cached, see docs/horovod.md), or use engine=ddp.")


def require_horovod(options: HorovodOptions, launch: Launch, device: torch.device) -> None:
    """Fail before anything starts when Horovod cannot run this job: not importable, or
    asked for its Gloo operations under mpirun. Those need its Gloo controller, which
    only horovodrun --gloo starts; without one Horovod 0.28 segfaults."""
    try:
        import horovod.torch  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"engine=horovod, but Horovod is not installed here ({e}). "
                          f"{BUILD_HINT}") from e
    if options.backend == "gloo" and launch.launcher == "mpi":
        raise ConfigError(
            "engine=horovod engine.backend=gloo needs Horovod's Gloo controller: start the "
            "job with horovodrun --gloo; under mpirun Horovod averages over MPI "
            "(engine.backend=mpi or auto)")


class HorovodEngine(Engine):
    name = "horovod"
    contiguous_only = True  # its broadcasts and allreduces refuse channels_last tensors

    def __init__(self, options: HorovodOptions, launch: Launch, device: torch.device) -> None:
        import horovod.torch as hvd

        self.options, self.hvd, self.device = options, hvd, device
        # Horovod reads these at init: how long a peer may be silent before the job
        # fails (Gloo's timeout, and the stall check that ends a stuck collective).
        timeout = str(int(options.timeout_s))
        os.environ.setdefault("HOROVOD_GLOO_TIMEOUT_SECONDS", timeout)
        os.environ.setdefault("HOROVOD_STALL_CHECK_TIME_SECONDS",
                              str(int(options.timeout_s / 2)))
        os.environ.setdefault("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", timeout)
        if options.backend in ("gloo", "mpi"):
            os.environ["HOROVOD_CPU_OPERATIONS"] = str(options.backend).upper()
        if options.timeline:
            # Only the coordinator (rank 0) writes the timeline; the path must be absolute
            # because Horovod opens it from its background thread.
            os.environ["HOROVOD_TIMELINE"] = str(Path(options.timeline).resolve())
        hvd.init()
        self.rank, self.world_size, self.local_rank = hvd.rank(), hvd.size(), hvd.local_rank()
        if device.type == "cuda":
            self.backend = "nccl" if hvd.nccl_built() else "mpi"
        else:  # CPU tensors go the controller's way: MPI under mpirun, else Gloo
            self.backend = "mpi" if hvd.mpi_enabled() else "gloo"
        if self.world_size > 1:
            # Sharded checkpoints plan, verify and publish their parts over a
            # torch.distributed process group (spotring/checkpoint/manager.py): a Gloo one beside
            # Horovod's, found through engine=ddp's rendezvous, which knows horovodrun's
            # and mpirun's.
            from spotring.engines.process_group import rendezvous

            timeout = timedelta(seconds=options.timeout_s)
            dist.init_process_group("gloo", store=dist.PrefixStore("pg", rendezvous(
                launch, timeout)), rank=self.rank, world_size=self.world_size,
                timeout=timeout)

    def prepare(self, model: nn.Module, optimizer: Optimizer | OptimizerFactory,
                accumulation: int, *, precision: str = "fp32") -> tuple[nn.Module, Optimizer]:
        hvd = self.hvd
        optimizer = built(optimizer, model)
        # Every rank starts from rank 0's weights, which hold the checkpoint on resume.
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        if optimizer.state_dict()["state"]:
            # Only a resumed optimizer has state to share. On a fresh one Horovod would
            # first take a zero-gradient step to create it, which with weight decay
            # moves the weights and breaks parity with engine=ddp.
            hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        optimizer = hvd.DistributedOptimizer(
            optimizer,
            named_parameters=model.named_parameters(),
            compression=hvd.Compression.fp16 if self.options.compression == "fp16"
            else hvd.Compression.none,
            op=hvd.Adasum if self.options.op == "adasum" else hvd.Average,
            # Accumulation: allreduce after the K-th backward pass only.
            backward_passes_per_step=accumulation,
        )
        return model, optimizer

    def step(self, optimizer: Optimizer, scaler: torch.amp.GradScaler) -> None:
        # The scaler must see the averaged gradients, which exist only once the
        # allreduce finished: Horovod's documented pattern for anything that reads
        # gradients between backward and step (docs/gpu.md). A disabled scaler makes
        # this optimizer.step(), which synchronizes the same way.
        optimizer.synchronize()
        scaler.unscale_(optimizer)
        with optimizer.skip_synchronize():
            scaler.step(optimizer)
        scaler.update()

    def all_reduce_sum(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        return self.hvd.allreduce_(tensor, op=self.hvd.Sum, name=f"spotring.{name}")

    def start_sum(self, tensor: torch.Tensor, name: str) -> Callable[[], torch.Tensor]:
        handle = self.hvd.allreduce_async_(tensor, op=self.hvd.Sum, name=f"spotring.{name}")
        return lambda: self.hvd.synchronize(handle)

    # Explicit names: Horovod's default is the object's type name, which differs when
    # rank 0 sends a checkpoint (a dict) and the others pass None, and then they wait
    # for each other's differently named broadcasts forever.
    def broadcast_object(self, obj: Any) -> Any:
        return self.hvd.broadcast_object(obj, root_rank=0, name="spotring.object")

    def all_gather_object(self, obj: Any) -> list[Any]:
        return self.hvd.allgather_object(obj, name="spotring.objects")

    def describe_failure(self, error: BaseException) -> str:
        return (f"rank {self.rank}: a Horovod collective failed; horovodrun or mpirun names "
                f"the rank that exited first. Cause: {error}")

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        self.hvd.shutdown()


register("horovod", HorovodOptions, create=HorovodEngine, check=require_horovod)
