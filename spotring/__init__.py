"""spotring: synchronous data-parallel PyTorch training on clusters of spot GPU instances.

Your own script, a few lines added (docs/api.md; examples/):

    import spotring

    with spotring.init() as job:                         # rank, device, process group
        loader = job.loader(dataset, global_batch=256)   # the same samples on any W
        model, optimizer = job.wrap(model, optimizer)    # DDP, FSDP or Horovod
        job.track(model=model, optimizer=optimizer, loader=loader)
        job.restore()
        ...
        if job.should_stop():                            # a spot notice on any rank
            job.save_and_exit()                          # checkpoint, exit 75

Options, typed: ``spotring.init(engine=spotring.DDPOptions(bucket_mb=50),
checkpoint=spotring.CheckpointOptions(keep=5))``, or the same as keywords.

The package is also the base the rest of spotring stands on: trainer/ (the built-in
Hydra trainer) uses these modules, launch/ starts jobs and acts on their exit codes
(spotring/exits.py), benchmarks/ measures them. The ``spotring`` command is
spotring/cli.py. Names below are imported on first use, so that the command (and
``import spotring`` in a launcher) does not load torch. The torch it supports:
spotring/versions.py.
"""

import importlib as _importlib
import typing as _typing

from spotring import versions as _versions

# An unsupported torch is refused here, before any of it is imported: ImportError for a
# script, exit 2 for a command, naming the torch needed and the one installed.
_versions.require_torch(_versions.installed_torch())

# public name: module that defines it
_EXPORTS = {
    "init": "spotring.job",
    "Job": "spotring.job",
    "EngineOptions": "spotring.options",
    "DDPOptions": "spotring.engines.ddp",
    "FSDPOptions": "spotring.engines.fsdp",
    "HorovodOptions": "spotring.engines.horovod",
    "CheckpointOptions": "spotring.options",
    "PreemptionOptions": "spotring.options",
    "ElasticOptions": "spotring.options",
    "DataLoader": "spotring.loader",
    "GlobalBatchSampler": "spotring.sampler",
    "Shards": "spotring.shards.dataset",
    "split_global_batch": "spotring.global_batch",
    "scaled_lr": "spotring.lr",
    "warmup_schedule": "spotring.lr",
    "ConfigError": "spotring.exits",
    "Diverged": "spotring.exits",
    "EXIT_OK": "spotring.exits",
    "EXIT_CONFIG": "spotring.exits",
    "EXIT_DIVERGED": "spotring.exits",
    "EXIT_PEER_LOST": "spotring.exits",
    "EXIT_PREEMPTED": "spotring.exits",
}

__all__ = list(_EXPORTS)

if _typing.TYPE_CHECKING:  # what type checkers see; "X as X": a re-export (PEP 484)
    from spotring.engines.ddp import DDPOptions as DDPOptions
    from spotring.engines.fsdp import FSDPOptions as FSDPOptions
    from spotring.engines.horovod import HorovodOptions as HorovodOptions
    from spotring.exits import EXIT_CONFIG as EXIT_CONFIG
    from spotring.exits import EXIT_DIVERGED as EXIT_DIVERGED
    from spotring.exits import EXIT_OK as EXIT_OK
    from spotring.exits import EXIT_PEER_LOST as EXIT_PEER_LOST
    from spotring.exits import EXIT_PREEMPTED as EXIT_PREEMPTED
    from spotring.exits import ConfigError as ConfigError
    from spotring.exits import Diverged as Diverged
    from spotring.global_batch import split_global_batch as split_global_batch
    from spotring.job import Job as Job
    from spotring.job import init as init
    from spotring.loader import DataLoader as DataLoader
    from spotring.lr import scaled_lr as scaled_lr
    from spotring.lr import warmup_schedule as warmup_schedule
    from spotring.options import CheckpointOptions as CheckpointOptions
    from spotring.options import ElasticOptions as ElasticOptions
    from spotring.options import EngineOptions as EngineOptions
    from spotring.options import PreemptionOptions as PreemptionOptions
    from spotring.sampler import GlobalBatchSampler as GlobalBatchSampler
    from spotring.shards.dataset import Shards as Shards


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'spotring' has no attribute {name!r}")
    return getattr(_importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    """The public API (what tab completion and help() offer), not this module's helpers."""
    return sorted(__all__)
