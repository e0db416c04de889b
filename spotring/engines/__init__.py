"""Engines average gradients across workers; the training loop sees only this interface.

    check(options, launch, device)                # bad input: ConfigError, nothing started
    engine = create(options, launch, device)      # joins the process group
    model, optimizer = engine.prepare(model, optimizer, accumulation, precision=...)
    with engine.no_sync(model): ...backward...    # micro-steps before the last
    engine.step(optimizer, scaler)                # gradients are averaged by now; the
                                                  # fp16 scaler unscales them first
    engine.all_reduce_sum(metrics, "metrics")     # numbers for the logs
    wait = engine.start_sum(votes, "preemption")  # the same, waited for a step later

Each engine is one module of this package that registers itself when imported:

    register("ddp", DDPOptions, create=..., check=...)

its name (spotring.init's ``engine="ddp"``, the trainer's ``engine=ddp``), its options
class (an EngineOptions, spotring/options.py) and how to check and create it. The
package imports its modules on the first question about engines (``registry``), so a new
engine is a new module here (and, for the built-in trainer, its conf/engine/NAME.yaml):
every list of valid engines comes from the registry.

PyTorch DDP (engine=ddp) averages in backward hooks over bucketed gradients; Horovod
(engine=horovod) does it in its DistributedOptimizer. Both run a ring allreduce,
NCCL on GPUs, Gloo (or MPI, for Horovod) on CPUs. FSDP (engine=fsdp) shards the
parameters, gradients and optimizer state: it all-gathers each block's parameters around
its forward and backward and reduce-scatters its gradients, over the process group that
engine=ddp joins too (process_group.py).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from spotring.engines.base import Engine, OptimizerFactory
from spotring.exits import ConfigError
from spotring.options import EngineOptions, require_one_of
from spotring.runtime import Launch

__all__ = ["Engine", "OptimizerFactory", "Registered", "check", "create", "in_place_problem",
           "is_collective_failure", "options_for", "register", "registry"]


@dataclass(frozen=True)
class Registered:
    """An engine as its module registered it.

    options: its EngineOptions class. create(options, launch, device): the engine,
    joined. check(options, launch, device): raises ConfigError where this launch or
    device cannot run it, before anything starts (None: nothing beyond the options).
    in_place: it can form its process group anew, in place, as workers leave and join
    (spotring/elastic/): create then takes the group to join, a process_group.Group."""

    name: str
    options: type[EngineOptions]
    create: Callable[..., Engine]
    check: Callable[[Any, Launch, torch.device], None] | None = None
    in_place: bool = False


_registered: dict[str, Registered] = {}
_discovered = False


def register(name: str, options: type[EngineOptions], create: Callable[..., Engine],
             check: Callable[[Any, Launch, torch.device], None] | None = None, *,
             in_place: bool = False) -> None:
    """Make engine ``name`` known (an engine module calls this when imported); the
    ``name`` of its options class defaults to it."""
    if options().name != name:
        raise TypeError(f"{options.__name__}.name must default to {name!r}")
    _registered[name] = Registered(name, options, create, check, in_place)


def registry() -> dict[str, Registered]:
    """Every engine, sorted by name (the order every list of valid engines shows,
    whichever module was imported first), once each module of this package has been
    imported."""
    global _discovered
    if not _discovered:
        _discovered = True
        for module in pkgutil.iter_modules(__path__):
            if not module.name.startswith("_"):
                importlib.import_module(f"{__name__}.{module.name}")
    return dict(sorted(_registered.items()))


def _engine(options: EngineOptions) -> Registered:
    """The registered engine ``options`` are for, or ConfigError naming the valid ones."""
    require_one_of("engine", options.name, registry())
    found = _registered[options.name]
    if not isinstance(options, found.options):
        raise ConfigError(f"engine={options.name} takes {found.options.__name__}, not "
                          f"{type(options).__name__}")
    return found


def options_for(engine: str | EngineOptions, **values: Any) -> EngineOptions:
    """The options of ``engine`` (a name: its class's defaults), with ``values`` (those not
    None) in their place. ConfigError for an engine that is not registered, an option it
    does not have, or a value its class refuses."""
    if isinstance(engine, str):
        require_one_of("engine", engine, registry())
        engine = _registered[engine].options()
    _engine(engine)
    options = engine.replaced(f"engine={engine.name}", **values)
    if problems := options.problems():
        raise ConfigError("; ".join(problems))
    return options  # type: ignore[return-value]


def check(options: EngineOptions, launch: Launch, device: torch.device) -> None:
    """Refuse an engine this launch cannot run, before any process group exists."""
    engine = _engine(options)
    if options.backend == "mpi" and (launch.launcher != "mpi" or device.type == "cuda"):
        raise ConfigError(
            f"engine.backend=mpi averages gradients over MPI on CPUs: start the job with "
            f"mpirun on CPU workers (here: {launch.launcher}, {device.type}); on GPUs NCCL "
            "is the fast path (engine.backend=auto)")
    if engine.check is not None:
        engine.check(options, launch, device)


def create(options: EngineOptions, launch: Launch, device: torch.device,
           group: Any = None) -> Engine:
    """The engine ``options`` name, joined to the job's other ranks: the launcher's, or
    where ``group`` is given (a process_group.Group, for an engine that runs in place),
    those of that group."""
    if group is None:
        return _engine(options).create(options, launch, device)
    return _engine(options).create(options, launch, device, group=group)


def in_place_problem(options: EngineOptions, world_size: int) -> str | None:
    """Why engine ``options`` cannot run a job of ``world_size`` workers in place
    (spotring.ElasticOptions), or None."""
    if _engine(options).in_place:
        return options.in_place_problem(world_size)
    able = ", ".join(n for n, r in registry().items() if r.in_place)
    return (f"engine={options.name} cannot form its process group anew as workers leave "
            f"and join (Horovod's controller goes with a lost worker); valid in place: "
            f"{able}")


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
