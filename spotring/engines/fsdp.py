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

In a job in place (spotring/elastic/), HSDP goes on by whole groups: it runs as FSDP
within each group, and each gradient shard is averaged over the groups in FSDP's
all-reduce hook, through the engine's collective that a lost group does not break
(native HSDP's would raise inside the script's backward). ``prepare`` keeps a skeleton
of the model on the meta device and returns InPlaceFSDP around the sharded model;
``regroup`` shards a new one from the skeleton over the new groups, each rank keeping its
shards, and ``send_model``/``send_optimizer`` give a group that joins its shards.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from spotring.engines import register
from spotring.engines.base import OptimizerFactory, built
from spotring.engines.process_group import Group, ProcessGroupEngine
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

    def in_place_problem(self, world_size: int) -> str | None:
        """Why a job of ``world_size`` workers cannot go on in place, or None: a lost
        worker's shards go with it unless another replica holds them (HSDP)."""
        if world_size == 1 or self.shard_size and world_size // self.shard_size >= 2:
            return None  # (a process alone: it may be one that joins such a job)
        return (f"engine=fsdp engine.shard_size={self.shard_size} with {world_size} workers: "
                "a lost worker's shards would go with it; in place, FSDP needs replicas of "
                f"them (HSDP: engine.shard_size=n with at least 2 groups of n workers)")


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

    def __init__(self, options: FSDPOptions, launch: Launch, device: torch.device,
                 group: Group | None = None) -> None:
        super().__init__(options, launch, device, group)
        self._in_place_model: InPlaceFSDP | None = None  # prepare's, in place
        self._optimizer: Optimizer | None = None
        self._replicas: Any = None  # in place: the group of this rank's copies of its shard
        self._precision = "fp32"  # prepare's

    @property
    def replica_size(self) -> int:
        return self.options.shard_size if self.in_place else 1

    def prepare(self, model: nn.Module, optimizer: Optimizer | OptimizerFactory,
                accumulation: int, *, precision: str = "fp32") -> tuple[nn.Module, Optimizer]:
        blocks_of(model, self.options.blocks)  # a name no class has: refused before a collective
        names = _parameter_names(model, optimizer) if isinstance(optimizer, Optimizer) else None
        self._broadcast_from_rank_0(model)
        skeleton = _skeleton(model) if self.in_place else None
        self._precision = precision
        self._shard(model)
        if names is None:
            optimizer = built(optimizer, model)
        else:
            sharded = dict(model.named_parameters())
            for group in optimizer.param_groups:  # in place: schedulers hold the optimizer
                group["params"] = [sharded[names[id(p)]] for p in group["params"]]
        if skeleton is None:
            return model, optimizer
        self._in_place_model, self._optimizer = InPlaceFSDP(model, skeleton), optimizer
        return self._in_place_model, optimizer

    def _shard(self, model: nn.Module) -> None:
        """fully_shard ``model``'s blocks and then the model itself over this group's
        mesh; in place, each with the hook that averages its gradient shards over the
        replicas."""
        # Imported once the engine is chosen: every engine's module is imported to list
        # the engines, and a job under DDP loads no FSDP.
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

        mesh = self._mesh()
        dtype = _PARAM_DTYPES.get(self._precision)
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
        for block in blocks_of(model, self.options.blocks):
            fully_shard(block, mesh=mesh, mp_policy=policy,
                        reshard_after_forward=self.options.reshard_after_forward)
        # The root takes the parameters no block holds; FSDP keeps a root's gathered after
        # forward, since backward needs them first.
        fully_shard(model, mesh=mesh, mp_policy=policy)
        if self.in_place:
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.set_all_reduce_hook(self._mean_over_replicas)

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
        torch's default 10 or 30 minutes. In place, HSDP is FSDP within this rank's group
        (1-D), and the gradient shards' mean over the replicas is the hook's
        (``_mean_over_replicas``), in a collective that a lost replica does not break; a
        process alone, which is to join such a job, shards over itself."""
        from torch.distributed.device_mesh import DeviceMesh

        size = min(self.options.shard_size or self.world_size, self.world_size)
        if size == self.world_size:
            self._replicas = None
            return DeviceMesh.from_group(dist.group.WORLD, self.device.type,
                                         mesh_dim_names=("shard",))
        rows = torch.arange(self.world_size).view(-1, size)  # rows shard, columns replicate
        shard, _ = dist.new_subgroups_by_enumeration(rows.tolist(), timeout=self.timeout)
        replicate, _ = dist.new_subgroups_by_enumeration(rows.T.tolist(), timeout=self.timeout)
        if self.in_place:
            self._replicas = replicate
            return DeviceMesh.from_group(shard, self.device.type, mesh_dim_names=("shard",))
        return DeviceMesh.from_group([replicate, shard], self.device.type, mesh=rows,
                                     mesh_dim_names=("replicate", "shard"))

    def _mean_over_replicas(self, shard: torch.Tensor) -> None:
        """(FSDP's all-reduce hook, in place.) ``shard``, this rank's gradient shard
        averaged within its group, averaged over the replicas too; where a replica is
        lost, this rank's own (the engine keeps the failure: the step is not applied)."""
        replicas = self.world_size // self.replica_size
        if replicas > 1:
            # The group stays until the optimizer's step (InPlace.watch drops it): the rest
            # of the backward gathers and reduces in this rank's group, which stands.
            self._sum(shard, self._replicas, drop=False)()
            shard.div_(replicas)

    # ---------------------------------------------------------------------- in place

    def regroup(self, group: Group) -> None:
        """In place: the group formed anew (ProcessGroupEngine.regroup), and the model
        sharded anew over it from its skeleton, each rank keeping the shards it held
        where it holds the same ones (the members of the replicas that stay), and the
        optimizer stepping the new parameters with the same state. A process joining
        takes its shards from the others next (``send_model``, ``send_optimizer``)."""
        super().regroup(group)
        if self._in_place_model is None:
            return
        wrapped, optimizer = self._in_place_model, self._optimizer
        old, new = wrapped.module, copy.deepcopy(wrapped.skeleton).to_empty(device=self.device)
        self._shard(new)
        fresh, moved = dict(new.named_parameters()), {}
        with torch.no_grad():
            for name, param in old.named_parameters():
                moved[param] = fresh[name]
                if fresh[name].to_local().shape == param.to_local().shape:
                    fresh[name].to_local().copy_(param.to_local())
            for mine, kept in zip(new.buffers(), old.buffers(), strict=True):
                mine.copy_(kept)
        for params in optimizer.param_groups:  # in place: schedulers hold the optimizer
            params["params"] = [moved[p] for p in params["params"]]
        states = list(optimizer.state.items())
        optimizer.state.clear()
        for param, state in states:
            optimizer.state[moved[param]] = {
                k: _sharded_as(v.to_local(), moved[param]) if isinstance(v, DTensor) else v
                for k, v in state.items()}
        wrapped.module = new

    def send_model(self, model: nn.Module, source: int) -> None:
        """In place: every rank's shards of the parameters from the copy in ``source``'s
        group (a broadcast within each column of replicas), the buffers from ``source``."""
        src = self._in_column(source)
        with torch.no_grad():
            for param in model.parameters():
                dist.broadcast(param.to_local(), src=src, group=self._replicas)
            for buffer in model.buffers():
                dist.broadcast(buffer, src=source)

    def send_optimizer(self, optimizer: Optimizer, source: int) -> None:
        """In place: ``optimizer``'s hyperparameters and state as ``source``'s group holds
        them: the sharded state from the copy in that group, the rest (step counts) as
        ``source``'s."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        said = [([{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
                 [{k: None if isinstance(v, DTensor) else v
                   for k, v in optimizer.state.get(p, {}).items()} for p in params])]
        dist.broadcast_object_list(said, src=source)
        hyper, states = said[0]
        for group, options in zip(optimizer.param_groups, hyper, strict=True):
            group.update(options)
        src = self._in_column(source)
        for param, state in zip(params, states, strict=True):
            mine = optimizer.state[param]
            for key, value in state.items():
                if value is None:  # sharded as the parameter is
                    kept = mine.get(key)
                    local = (kept.to_local() if isinstance(kept, DTensor)
                             else torch.zeros_like(param.to_local()))
                    dist.broadcast(local, src=src, group=self._replicas)
                    mine[key] = _sharded_as(local, param)
                else:
                    mine[key] = value

    def _in_column(self, rank: int) -> int:
        """The rank of ``rank``'s group that holds this rank's shard."""
        size = self.replica_size
        return rank // size * size + self.rank % size

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        # FSDP accumulates the whole gradients, unreduced, until a backward with sync.
        sharded = model.module if isinstance(model, InPlaceFSDP) else model
        sharded.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            sharded.set_requires_gradient_sync(True)


class InPlaceFSDP(nn.Module):
    """The model under FSDP in a job in place: the sharded ``module``, made anew from
    ``skeleton`` (the model's structure, its tensors on the meta device: no memory) over
    each process group the job forms (FSDPEngine.regroup). ``module`` is the FSDP model
    (``Job.unwrap`` returns it), the one to save, evaluate and gather the weights of."""

    def __init__(self, module: nn.Module, skeleton: nn.Module) -> None:
        super().__init__()
        self.module = module
        object.__setattr__(self, "skeleton", skeleton)  # not a submodule: not saved

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


def _skeleton(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are on the meta device."""
    memo: dict[int, Any] = {}
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        meta = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = (nn.Parameter(meta, requires_grad=tensor.requires_grad)
                            if isinstance(tensor, nn.Parameter) else meta)
    return copy.deepcopy(model, memo)


def _sharded_as(local: torch.Tensor, param: Any) -> Any:
    """An optimizer's state of ``param`` from this rank's ``local`` shard of it: a DTensor
    sharded as ``param`` is (its shape given: shards of uneven rows differ)."""
    return DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape,
                              stride=param.stride())


def check_shard_size(options: FSDPOptions, launch: Launch, device: torch.device) -> None:
    """Refuse a shard_size that does not divide the world size, naming those that do (a
    process alone shards over itself)."""
    size, world = options.shard_size, launch.world_size
    if size and world > 1 and world % size:
        valid = [0] + [n for n in range(1, world + 1) if world % n == 0]
        raise ConfigError(
            f"engine.shard_size={size} with {world} workers: HSDP shards within groups of "
            "shard_size workers and replicates across the groups, so the world size must be "
            f"a multiple of it; valid with {world} workers: {', '.join(map(str, valid))} "
            "(0: shard across all)")


register("fsdp", FSDPOptions, create=FSDPEngine, check=check_shard_size, in_place=True)
