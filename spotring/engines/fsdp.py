"""engine=fsdp: PyTorch's FSDP2 (fully_shard) over NCCL (GPUs) or Gloo (CPUs): each
worker holds 1/N of the parameters, gradients and optimizer state.

Before a block's forward its parameters are all-gathered from the workers' shards, and
freed after it (FSDPOptions.reshard_after_forward); backward gathers them again and
reduce-scatters the block's gradients, so that each worker keeps the mean gradient of its
own shard, and the optimizer steps the shards. The arithmetic is DDP's: the same global
batch, the same mean gradient, the same step (tests/test_fsdp.py holds them to 1e-10 in
float64). What FSDPOptions chooses:

    blocks        the submodules sharded each on its own, so that one block's parameters
                  at a time are whole (blocks_of); the root module takes the rest
    shard_size    0: shard across all workers; n: within groups of n ranks, replicated
                  across the groups (HSDP), on a 2-D device mesh ("replicate", "shard")
    precision     wrap's bf16: parameters gathered and gradients reduced in bfloat16, the
                  shards and the optimizer in float32 (MixedPrecisionPolicy); fp16 is
                  refused (its gradient scaler would have to agree across the shards)

The process group is engine=ddp's (engines/process_group.py: the same rendezvous under
every launcher, engine.timeout_s on every collective, the roll call naming lost ranks).
One process alone joins a group of one and shards too: a script gets the same model back
alone as on N workers (DTensor parameters, the same mixed precision), at the cost of
FSDP's copies and a Gloo thread on a CPU, where engine=ddp (no group alone) is faster.

fully_shard turns the model's parameters into sharded DTensors in place, so an optimizer
built over the old ones would step stale tensors: ``prepare`` points its param groups at
the new parameters of the same names, in place (an LR scheduler built on it stays valid),
or builds it from wrap's factory. The module stays itself (its class gains FSDPModule), so
Job.unwrap returns it; its state_dict holds DTensors (``full_tensor()`` is the whole).
Buffers (BatchNorm's running statistics) are each rank's own after the start, as with
DDP's broadcast_buffers=False.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from spotring.engines import register
from spotring.engines.base import OptimizerFactory, built
from spotring.engines.process_group import ProcessGroupEngine
from spotring.exits import ConfigError
from spotring.options import EngineOptions, one_of
from spotring.runtime import Launch

# FSDP gathers and reduces in this where wrap's precision names it.
_PARAM_DTYPES = {"bf16": torch.bfloat16}
# What "auto" looks for the blocks in: the containers of repeated layers.
_CONTAINERS = (nn.ModuleList, nn.Sequential)


@dataclass
class FSDPOptions(EngineOptions):
    """engine="fsdp": PyTorch's FSDP2, fully_shard (EngineOptions has the common fields;
    backend auto, nccl or gloo: FSDP's collectives run over the process group, not MPI).

    blocks: the submodules sharded each on its own: each gathers its parameters whole only
        around its own forward and backward; the root module takes the rest. "auto": the
        modules that hold parameters and sit in an nn.ModuleList or nn.Sequential (not
        themselves one: those are looked into), the outermost such (a transformer's list
        of blocks, a ResNet stage's blocks, each layer of a Sequential network); a list of
        class names (the trainer's engine.blocks=[Block]); from Python also a list of
        classes, or a function module -> bool (every submodule it is true of).
    shard_size: 0: the parameters are sharded across all workers (FSDP); n: within
        groups of n consecutive ranks and replicated across the groups (HSDP): set it to
        the GPUs per node, so that the all-gathers stay within a node and only the
        gradients' all-reduce crosses the network. The world size must be a multiple of it.
    reshard_after_forward: each block frees its gathered parameters after its forward and
        gathers them again for backward (less memory); False keeps them until backward
        (one all-gather less per block). The root's stay gathered, needed first by backward.
    """

    name: str = "fsdp"
    blocks: Any = "auto"
    shard_size: int = 0
    reshard_after_forward: bool = True

    def problems(self, prefix: str = "", *, compile: bool = False,
                 precision: str = "fp32") -> list[str]:
        """EngineOptions.problems (``prefix``, ``compile``, ``precision``), and those of
        blocks, shard_size, the backend, fp16 and torch.compile with FSDP."""
        found = super().problems(prefix, compile=compile, precision=precision)
        if self.backend == "mpi":
            found.append(f"{prefix}backend=mpi: FSDP's all-gathers and reduce-scatters run "
                         "over the process group; valid with engine=fsdp: auto, nccl, gloo")
        if not (isinstance(self.shard_size, int) and self.shard_size >= 0):
            found.append(f"{prefix}shard_size={self.shard_size}: must be 0 (shard across all "
                         "workers) or the size n >= 1 of the groups that shard (HSDP)")
        if why := _blocks_problem(self.blocks):
            found.append(f"{prefix}blocks={self.blocks!r}: {why}")
        if precision == "fp16":
            found.append(
                "precision=fp16 with engine=fsdp: float16 needs a gradient scaler whose "
                "overflow check spans every worker's gradient shards, which spotring does not "
                "run; bf16 has float32's range and needs none: use bf16 (parameters gathered "
                "and gradients reduced in bfloat16, the shards and the optimizer in float32); "
                "valid with fsdp: auto, fp32, bf16")
        if compile:
            found.append("torch.compile with engine=fsdp: the model would be compiled before "
                         "it is sharded, which spotring does not support yet; valid with "
                         "fsdp: compile off")
        return found


def _blocks_problem(blocks: Any) -> str | None:
    """Why ``blocks`` is not a value FSDPOptions.blocks takes, or None."""
    if blocks == "auto" or (callable(blocks) and not isinstance(blocks, type)):
        return None
    if isinstance(blocks, Sequence) and not isinstance(blocks, str) and all(
            isinstance(b, str) or (isinstance(b, type) and issubclass(b, nn.Module))
            for b in blocks):
        return None
    return ('expected "auto", a list of class names such as [Block] (or of nn.Module '
            "classes), or a function module -> bool")


def _holds_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _auto_blocks(module: nn.Module) -> Iterator[nn.Module]:
    """FSDPOptions.blocks "auto" under ``module``: its submodules that hold parameters and
    sit in a container without being one, the outermost such."""
    for child in module.children():
        if isinstance(module, _CONTAINERS) and not isinstance(child, _CONTAINERS) \
                and _holds_parameters(child):
            yield child
        else:
            yield from _auto_blocks(child)


def _is(module: nn.Module, wanted: str | type[nn.Module]) -> bool:
    if isinstance(wanted, str):
        return type(module).__name__ == wanted
    return isinstance(module, wanted)


def blocks_of(model: nn.Module, blocks: Any) -> list[nn.Module]:
    """The submodules of ``model`` that ``blocks`` (FSDPOptions.blocks) names and that
    hold parameters, each once, children before their parents (the order fully_shard
    takes them in). ConfigError naming a class name or class that no submodule of
    ``model`` is, with the classes that are (containers left out)."""
    submodules = [m for m in model.modules() if m is not model and _holds_parameters(m)]
    if blocks == "auto":
        chosen = list(_auto_blocks(model))
    elif callable(blocks):
        chosen = [m for m in submodules if blocks(m)]
    else:
        chosen = []
        for wanted in blocks:
            found = [m for m in submodules if _is(m, wanted)]
            if not found:
                classes = sorted({type(m).__name__ for m in submodules
                                  if not isinstance(m, _CONTAINERS)})
                name = wanted if isinstance(wanted, str) else wanted.__name__
                raise ConfigError(f"{one_of('engine.blocks', name, classes)} (the classes of "
                                  f"{type(model).__name__}'s layers that hold parameters)")
            chosen += found
    ids = {id(m) for m in chosen}
    return [m for m in reversed(list(model.modules())) if id(m) in ids]


def _parameter_names(model: nn.Module, optimizer: Optimizer) -> dict[int, str]:
    """The name in ``model`` of each parameter ``optimizer`` steps, by id, before
    fully_shard replaces them; ConfigError where the optimizer cannot follow them: it holds
    state for the old ones, or steps tensors that are not the model's."""
    factory = "job.wrap(model, lambda params: torch.optim.AdamW(params, ...))"
    if optimizer.state:
        raise ConfigError(
            "engine=fsdp: the optimizer holds state already (it has stepped, or loaded a "
            "state dict): FSDP replaces the model's parameters with sharded ones, and that "
            "state belongs to the old ones. Wrap before the first step and restore after "
            f"wrap, or give wrap a function that builds the optimizer: {factory}")
    names = {id(p): name for name, p in model.named_parameters()}
    foreign = [p for group in optimizer.param_groups for p in group["params"]
               if id(p) not in names]
    if foreign:
        raise ConfigError(
            f"engine=fsdp: the optimizer steps {len(foreign)} tensors that are not the "
            f"model's parameters (shapes {', '.join(str(list(p.shape)) for p in foreign[:3])}"
            f"{', ...' if len(foreign) > 3 else ''}): FSDP replaces the model's parameters "
            "with sharded ones, and the optimizer can follow only those. Build it over "
            f"model.parameters(), or give wrap a function that builds it: {factory}")
    return names


class FSDPEngine(ProcessGroupEngine):
    name = "fsdp"
    # Each parameter is sharded along its first dimension and gathered whole, contiguous:
    # with train.channels_last only the batches are NHWC.
    contiguous_only = True

    def prepare(self, model: nn.Module, optimizer: Optimizer | OptimizerFactory,
                accumulation: int, *, precision: str = "fp32") -> tuple[nn.Module, Optimizer]:
        # Imported once the engine is chosen: every engine's module is imported to list
        # the engines, and a job under DDP loads no FSDP.
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        blocks = blocks_of(model, self.options.blocks)
        names = _parameter_names(model, optimizer) if isinstance(optimizer, Optimizer) else None
        self._broadcast_from_rank_0(model)
        mesh = self._mesh()
        dtype = _PARAM_DTYPES.get(precision)
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
        for block in blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy,
                        reshard_after_forward=self.options.reshard_after_forward)
        # The root takes the parameters no block holds; FSDP keeps a root's gathered after
        # forward, since backward needs them first.
        fully_shard(model, mesh=mesh, mp_policy=policy)
        if names is None:
            return model, built(optimizer, model)
        sharded = dict(model.named_parameters())
        for group in optimizer.param_groups:  # in place: schedulers hold the optimizer
            group["params"] = [sharded[names[id(p)]] for p in group["params"]]
        return model, optimizer

    def _broadcast_from_rank_0(self, model: nn.Module) -> None:
        """Every rank's parameters and buffers become rank 0's, as DDP's constructor makes
        them, before each rank keeps its shard of them."""
        with torch.no_grad():
            for tensor in itertools.chain(model.parameters(), model.buffers()):
                dist.broadcast(tensor.detach(), src=0)

    def _mesh(self) -> Any:
        """The ranks FSDP shards over: all of them (1-D), or groups of shard_size
        consecutive ranks, replicated across the groups (2-D, HSDP). Built from groups
        made here with engine.timeout_s: init_device_mesh's own would wait for a lost rank
        torch's default 10 or 30 minutes."""
        from torch.distributed.device_mesh import DeviceMesh

        size = self.options.shard_size or self.world_size
        if size == self.world_size:
            return DeviceMesh.from_group(dist.group.WORLD, self.device.type,
                                         mesh_dim_names=("shard",))
        rows = torch.arange(self.world_size).view(-1, size)  # rows shard, columns replicate
        shard, _ = dist.new_subgroups_by_enumeration(rows.tolist(), timeout=self.timeout)
        replicate, _ = dist.new_subgroups_by_enumeration(rows.T.tolist(), timeout=self.timeout)
        return DeviceMesh.from_group([replicate, shard], self.device.type, mesh=rows,
                                     mesh_dim_names=("replicate", "shard"))

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        # FSDP accumulates the whole gradients, unreduced, until a backward with sync.
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)


def check_shard_size(options: FSDPOptions, launch: Launch, device: torch.device) -> None:
    """Refuse a shard_size that does not divide the world size, naming those that do."""
    size, world = options.shard_size, launch.world_size
    if size and world % size:
        valid = [0] + [n for n in range(1, world + 1) if world % n == 0]
        raise ConfigError(
            f"engine.shard_size={size} with {world} workers: HSDP shards within groups of "
            "shard_size workers and replicates across the groups, so the world size must be "
            f"a multiple of it; valid with {world} workers: {', '.join(map(str, valid))} "
            "(0: shard across all)")


register("fsdp", FSDPOptions, create=FSDPEngine, check=check_shard_size)
