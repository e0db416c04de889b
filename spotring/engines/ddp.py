"""engine=ddp: PyTorch DistributedDataParallel over NCCL (GPUs) or Gloo (CPUs).

DDP averages gradients in buckets of ``bucket_mb`` (DDPOptions) as backward produces them,
overlapping the ring allreduce with the rest of backward. The process group is
joined as engines/process_group.py says, and every rank starts from rank 0's weights and
optimizer state.

engine.backend=mpi (CPU, under mpirun): the gradient buckets are summed by MPI
through mpi4py instead of Gloo (a DDP communication hook; each rank's loss is divided by
the world size first, so the sum is the average), and so are the loop's small
sums (the per-step preemption vote, metrics); the process group stays Gloo for the
rest (object broadcasts, the final barrier). On one host MPI moves them through shared
memory, several times faster than Gloo's TCP (`spotring bench` measures both). The hook
waits until its bucket is reduced, so buckets do not overlap with the rest of backward:
worth it while a bucket's MPI allreduce is shorter than Gloo's. A watchdog holds MPI calls to
engine.timeout_s (engines/mpi.py), so a hung rank fails the others as under Gloo.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from spotring import torch_compat
from spotring.engines import is_collective_failure, register
from spotring.engines.base import Engine, OptimizerFactory, built
from spotring.engines.mpi import MPISums, sum_hook
from spotring.engines.process_group import Group, ProcessGroupEngine, backend_of
from spotring.exits import exit_peer_lost
from spotring.options import EngineOptions, positive
from spotring.runtime import Launch

# The first bucket DDP fills holds this much; torch.compile's DDPOptimizer refuses later
# buckets smaller than it.
_FIRST_BUCKET_MB = 1.0


@dataclass
class DDPOptions(EngineOptions):
    """engine="ddp": PyTorch DistributedDataParallel (EngineOptions has the common fields).

    bucket_mb: megabytes of gradients per bucket: each bucket's allreduce starts as soon
        as backward has filled it, overlapping the rest of backward.
    sync_bn: BatchNorm layers become SyncBatchNorm, whose batch statistics span all
        workers (as one worker's over the whole global batch would).
    """

    name: str = "ddp"
    bucket_mb: float = 25.0
    sync_bn: bool = False

    def problems(self, prefix: str = "", *, compile: bool = False,
                 precision: str = "fp32") -> list[str]:
        """EngineOptions.problems (``prefix``, ``compile``, ``precision``), and
        bucket_mb's."""
        found = super().problems(prefix, compile=compile, precision=precision) + positive(
            prefix, bucket_mb=self.bucket_mb)
        if compile and 0 < self.bucket_mb < _FIRST_BUCKET_MB:
            found.append(
                f"{prefix}bucket_mb={self.bucket_mb} with torch.compile: DDP's first bucket "
                f"holds {_FIRST_BUCKET_MB:g} MB, and torch.compile's DDPOptimizer refuses "
                f"later buckets smaller than that; valid with compile: {_FIRST_BUCKET_MB:g} "
                "or more")
        return found


class SingleProcess(Engine):
    """engine=ddp with one process. Nothing to average, so no process group (its Gloo
    thread would wake 100 times a second and take turns with the compute threads on
    the cores), no DDP wrapper (its bucket copies), and every collective is the
    identity."""

    name = "ddp"

    def __init__(self, options: DDPOptions, launch: Launch, device: torch.device) -> None:
        self.rank, self.world_size, self.local_rank = 0, 1, launch.local_rank
        self.device, self.backend = device, backend_of(options, device)

    def prepare(self, model: nn.Module, optimizer: Optimizer | OptimizerFactory,
                accumulation: int, *, precision: str = "fp32") -> tuple[nn.Module, Optimizer]:
        return model, built(optimizer, model)

    def all_reduce_sum(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        return tensor

    def broadcast_object(self, obj: Any) -> Any:
        return obj

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def shutdown(self) -> None:
        pass


# In place: how long DDP's bucket-order broadcast waits for a rank (a blocking wait, which
# the job cannot give up as it gives up the allreduce: spotring/engines/process_group.py).
# A rank silent for longer (its host cut off) is taken as lost; one only slow answers the
# roll call, and the step is taken again.
REBUILD_TIMEOUT_S = 30.0


class DDPEngine(ProcessGroupEngine):
    name = "ddp"

    def __init__(self, options: DDPOptions, launch: Launch, device: torch.device,
                 group: Group | None = None) -> None:
        super().__init__(options, launch, device, group)
        self._wrapped: nn.Module | None = None  # what prepare returned
        if self.backend == "mpi":
            from mpi4py import MPI

            self._mpi_sums = MPISums(MPI.COMM_WORLD, options.timeout_s, self._mpi_timed_out)
            self.loss_scale = 1 / self.world_size  # the hook sums; this makes it the mean

    def prepare(self, model: nn.Module, optimizer: Optimizer | OptimizerFactory,
                accumulation: int, *, precision: str = "fp32") -> tuple[nn.Module, Optimizer]:
        if self.options.sync_bn:
            # The new SyncBatchNorm modules keep the same Parameter objects, so the
            # optimizer built over the old ones still steps them.
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        optimizer = built(optimizer, model)
        # DDP's constructor broadcasts rank 0's parameters and buffers to all ranks;
        # rank 0 loaded the checkpoint on resume, so everyone resumes from it.
        wrapped = (InPlaceDDP(model, self._ddp_of, self.failed) if self.in_place
                   else self._ddp_of(model))
        self._broadcast_optimizer_state(optimizer)
        self._wrapped = wrapped
        return wrapped, optimizer

    def _ddp_of(self, model: nn.Module, init_sync: bool = True) -> DistributedDataParallel:
        """DDP over ``model`` in this group; ``init_sync``: its constructor checks the
        ranks' parameter shapes and sends rank 0's parameters and buffers to all."""
        in_place: dict[str, Any] = {}
        if self.in_place:
            # The gradients' allreduce is the hook's, in the job's group: it survives a
            # lost worker. DDP's own collective after its constructor's, the broadcast of
            # rank 0's bucket order at its second forward, runs in a group of its own,
            # which waits at most REBUILD_TIMEOUT_S for a rank once the job has regrouped
            # (the constructor's checks at the start wait as long as any collective).
            # Buffers (BatchNorm's statistics) are each rank's own, as under FSDP.
            timeout = self.timeout if init_sync else timedelta(seconds=REBUILD_TIMEOUT_S)
            in_place = {"process_group": dist.new_group(timeout=timeout),
                        **torch_compat.no_buffer_sync_in_forward()}
        ddp = DistributedDataParallel(
            model,
            init_sync=init_sync,
            device_ids=[self.device.index] if self.device.type == "cuda" else None,
            bucket_cap_mb=self.options.bucket_mb,
            gradient_as_bucket_view=True,
            **in_place,
        )
        if self.backend == "mpi":
            ddp.register_comm_hook(self._mpi_sums, sum_hook)
        elif self.in_place:
            ddp.register_comm_hook(self, _mean_or_failed)
        return ddp

    def drop_group(self) -> None:
        if isinstance(self._wrapped, InPlaceDDP):
            self._wrapped.drop()  # its reducer holds the group
        super().drop_group()

    def regroup(self, group: Group) -> None:
        super().regroup(group)
        if isinstance(self._wrapped, InPlaceDDP):
            self._wrapped.regroup()

    def _broadcast_optimizer_state(self, optimizer: Optimizer) -> None:
        # DDP syncs the module, not the optimizer: momentum buffers come from rank 0 too.
        optimizer.load_state_dict(self.broadcast_object(optimizer.state_dict()))

    def _let_go(self) -> None:
        if isinstance(self._wrapped, InPlaceDDP):  # its reducer holds the group: freed
            self._wrapped.drop()  # now, not at interpreter exit (shutdown says why)
        super()._let_go()

    def no_sync(self, model: nn.Module):
        if isinstance(model, DistributedDataParallel | InPlaceDDP):
            return model.no_sync()
        return super().no_sync(model)

    def all_reduce_sum(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        if self.backend == "mpi":  # the per-step vote: microseconds over MPI, ms over Gloo
            return self._mpi_sums.sum_(tensor)
        return super().all_reduce_sum(tensor, name)

    def start_sum(self, tensor: torch.Tensor, name: str) -> Callable[[], torch.Tensor]:
        if self.backend == "mpi":
            return Engine.start_sum(self, tensor, name)  # sums at once
        return super().start_sum(tensor, name)

    def _mpi_timed_out(self, message: str) -> None:
        """The MPI watchdog's verdict (on its thread, while this rank is stuck in MPI)."""
        exit_peer_lost(self.describe_failure(dist.DistBackendError(message)))


class InPlaceDDP(nn.Module):
    """The model under DDP in a job in place: a DDP made anew over each process group the
    job forms (``regroup``), every rank's the same as a fresh one (its buckets laid out
    alike: a DDP kept from before would lay them out by its own history, and the ranks'
    allreduce would add up unlike gradients), around the same ``module`` (its
    parameters, the optimizer's, stay). ``module`` is the plain model, as DDP's is."""

    def __init__(self, module: nn.Module, make: Callable[..., DistributedDataParallel],
                 failed: Callable[[BaseException], None]) -> None:
        super().__init__()
        self.module, self._make, self._failed = module, make, failed
        object.__setattr__(self, "_ddp", make(module))  # not a submodule: module is
        object.__setattr__(self, "_broken", False)  # its collective failed: until regroup

    def regroup(self) -> None:
        """DDP over the process group formed now, each rank's parameters left as they
        are: the job in place sends the state of the rank that has taken the most steps,
        which need not be rank 0 (spotring/elastic/in_place.py)."""
        object.__setattr__(self, "_ddp", self._make(self.module, init_sync=False))
        object.__setattr__(self, "_broken", False)

    def drop(self) -> None:
        """Let go of the DDP of a group that is broken (and of the group with it)."""
        object.__setattr__(self, "_ddp", None)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """DDP's forward; where its one collective fails (the second forward of a DDP
        shares rank 0's bucket order: a worker lost then, or silent for
        REBUILD_TIMEOUT_S), the plain module's, and the
        failure kept by the engine: the step is not applied, and taken again once the
        group is formed anew (spotring/elastic/in_place.py)."""
        if self._broken or self._ddp is None:  # the rest of the step's micro-steps; closed
            return self.module(*args, **kwargs)
        try:
            return self._ddp(*args, **kwargs)
        except RuntimeError as e:
            if not is_collective_failure(e):
                raise
            self._failed(e)
            object.__setattr__(self, "_broken", True)
            return self.module(*args, **kwargs)

    def no_sync(self):
        return self._ddp.no_sync()


def _mean_or_failed(engine: DDPEngine, bucket):  # DDP checks no annotation here
    """DDP's allreduce of a bucket in place: the mean over the current group, or, where a
    worker is lost (the allreduce fails, or is given up: ProcessGroupEngine.give_up),
    zeros and the failure kept by the engine (the step is then taken again once the group
    is formed anew: spotring/elastic/in_place.py)."""
    buffer, size = bucket.buffer(), engine.world_size
    result: torch.futures.Future = torch.futures.Future()
    lock = threading.Lock()

    def end(value: torch.Tensor | None) -> None:
        with lock:
            if not result.done():
                result.set_result(torch.zeros_like(buffer) if value is None else value)

    if engine.failure is not None:  # a bucket before failed: the group is broken
        end(None)
        return result
    landed, number = engine.in_flight(lambda: end(None)), engine.group_number

    def done(future: torch.futures.Future) -> None:
        landed()
        try:
            value = future.value()[0].div_(size)
        except Exception as e:
            engine.failed(e, number)
            value = None
        end(None if engine.failure is not None else value)

    dist.all_reduce(buffer, async_op=True).get_future().add_done_callback(done)
    return result


def _create(options: DDPOptions, launch: Launch, device: torch.device,
            group: Group | None = None) -> Engine:
    # In place, even one worker forms a group: another may join it.
    if launch.world_size == 1 and group is None:
        return SingleProcess(options, launch, device)
    return DDPEngine(options, launch, device, group)


register("ddp", DDPOptions, create=_create, in_place=True)
