"""spotring: synchronous data-parallel PyTorch training on clusters of spot GPU instances.

Your own script, a few lines added (docs/api.md; examples/):

    import spotring

    with spotring.init() as job:                         # rank, device, process group
        loader = job.loader(dataset, global_batch=256)   # the same samples on any W
        model, optimizer = job.wrap(model, optimizer)    # DDP or Horovod
        job.track(model=model, optimizer=optimizer, loader=loader)
        job.restore()
        ...
        if job.should_stop():                            # a spot notice on any rank
            job.save_and_exit()                          # checkpoint, exit 75

The package is also the base the rest of spotring stands on: trainer/ (the built-in
Hydra trainer) uses these modules, launch/ starts jobs and acts on their exit codes
(spotring/exits.py), benchmarks/ measures them. The ``spotring`` command is
spotring/cli.py. Names below are imported on first use, so that the command (and
``import spotring`` in a launcher) does not load torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name: module that defines it
_EXPORTS = {
    "init": "spotring.job",
    "Job": "spotring.job",
    "DataLoader": "spotring.loader",
    "GlobalBatchSampler": "spotring.sampler",
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

if TYPE_CHECKING:
    from spotring.exits import (  # noqa: F401
        EXIT_CONFIG,
        EXIT_DIVERGED,
        EXIT_OK,
        EXIT_PEER_LOST,
        EXIT_PREEMPTED,
        ConfigError,
        Diverged,
    )
    from spotring.global_batch import split_global_batch  # noqa: F401
    from spotring.job import Job, init  # noqa: F401
    from spotring.loader import DataLoader  # noqa: F401
    from spotring.lr import scaled_lr, warmup_schedule  # noqa: F401
    from spotring.sampler import GlobalBatchSampler  # noqa: F401


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'spotring' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
