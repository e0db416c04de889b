"""Where a job stands in its data: the one protocol the job reads its step from, the one
a job in place splits its batches anew through, and the one rule for a checkpoint of
another global batch.

    class Position(Protocol):      epoch, offset, global_batch, steps_per_epoch, step
    class Resharded(Protocol):     accumulation, before_step, reshard(rank, world_size)

spotring.DataLoader is one, and so is the built-in trainer's position
(trainer/loop.py); a job tracks one (``job.track(loader=loader)``, or made by
``job.loader``), and its step count, the checkpoints' epoch and offset and the summary's
epochs come from it. Its state_dict is saved in every checkpoint, and load_state_dict
continues from there on any world size, refusing another global batch
(``refuse_another_global_batch``): step i of a run is global batch i of its order, so a
run continued with another global batch would group other samples from then on, and a
streamed dataset's order depends on the global batch itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

from spotring.exits import ConfigError


@runtime_checkable
class Position(Protocol):
    """Where a job stands: in ``epoch`` (0-based), ``offset`` samples of its order
    consumed, global batches of ``global_batch`` samples, ``steps_per_epoch`` of them an
    epoch, and ``step`` optimizer steps taken since the run began."""

    @property
    def epoch(self) -> int: ...

    @property
    def offset(self) -> int: ...

    @property
    def global_batch(self) -> int: ...

    @property
    def steps_per_epoch(self) -> int: ...

    @property
    def step(self) -> int: ...


@runtime_checkable
class Resharded(Protocol):
    """A tracked object that follows the workers of a job in place (spotring/elastic/):
    spotring.DataLoader, or the built-in trainer's position. At every change of workers
    the job calls ``reshard`` with this process's new place, before the next step
    starts; the steps go on from the position as it stands, each worker taking its share
    of the same global batches in ``accumulation`` micro-steps (the tracked position's
    count is the job's). ``before_step``, where the job sets it, is called before the
    first micro-batch of each step is drawn: where the job takes in the processes that
    join it, which may split the batches anew."""

    before_step: Callable[[], None] | None

    @property
    def accumulation(self) -> int: ...

    def reshard(self, rank: int, world_size: int) -> None: ...


def refuse_another_global_batch(saved: int, current: int, key: str = "global_batch") -> None:
    """ConfigError where a checkpoint's global batch ``saved`` is not the run's
    ``current`` one, naming both and ``key``, the setting that keeps it."""
    if saved != current:
        raise ConfigError(
            f"the checkpoint was trained with a global batch of {saved} samples, and this "
            f"run has {current}: its steps would group other samples from here on. Keep "
            f"{key}={saved} to continue it (any number of workers can: the global batch "
            "is split over them), or start a new run in another checkpoint directory")
