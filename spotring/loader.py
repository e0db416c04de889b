"""torch's DataLoader over any map-style Dataset, in spotring's world-size-invariant order.

    loader = spotring.DataLoader(dataset, global_batch=256, batch_size=64, num_workers=4,
                                 pin_memory=True)
    loader.load_state_dict(checkpoint["data"])          # on any number of workers
    for epoch in range(loader.epoch, epochs):
        loader.set_epoch(epoch)                          # keeps a resumed run's offset
        for x, y in loader:                              # this rank's micro-batches
            with (nullcontext() if loader.is_step_boundary else model.no_sync()):
                loss_fn(model(x), y).backward()
            if loader.is_step_boundary:                  # the global batch is complete
                optimizer.step(); optimizer.zero_grad()
                checkpoint["data"] = loader.state_dict()

Global batch i of an epoch is the same G samples whatever the number of workers W
(spotring/sampler.py); each worker takes B per micro-step over K accumulation steps,
G = B x W x K, with B at most ``batch_size``. The position a state_dict records is the
training loop's, not the sampler's: workers fetch ahead, so the loader counts what it
hands out and moves the offset by G after every K micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch.utils.data

from spotring.exits import ConfigError
from spotring.global_batch import split_global_batch
from spotring.runtime import detect
from spotring.sampler import GlobalBatchSampler, Order

# torch's options that would choose the order, which is spotring's.
REFUSED = ("shuffle", "sampler", "batch_sampler", "drop_last")


class DataLoader(torch.utils.data.DataLoader):
    """This rank's micro-batches of ``dataset`` in spotring's order. Iterate it once per
    epoch after `set_epoch` (or through `epochs`); an epoch iterated to its end leaves the
    loader there (``len(loader) == 0``) until the next `set_epoch`.

    dataset: a map-style Dataset (__len__ and __getitem__); an IterableDataset is refused.
    global_batch: G, samples per optimizer step over all workers; the world size must
        divide it (ConfigError naming the worker counts that can).
    batch_size: the most samples this worker takes per micro-step; the fewest micro-steps
        (accumulation) that keep to it. Default: its whole share in one.
    seed: of the order, one permutation per epoch seeded by (seed, epoch).
    order: the epoch's permutation as a function of (seed, epoch, G)
        (spotring.sampler.Order); default the dataset's own ``start_epoch`` method where
        it has one (spotring.Shards: long runs of its shards, and the epoch its reads
        count for), else a uniform permutation.
    rank, world_size: this worker's place; default the launcher's environment
        (spotring.runtime.detect).
    kwargs: to torch's DataLoader (num_workers, pin_memory, persistent_workers,
        collate_fn, prefetch_factor, ...); shuffle, sampler, batch_sampler and drop_last
        are refused: the order is spotring's.
    """

    def __init__(self, dataset: torch.utils.data.Dataset, global_batch: int, *,
                 batch_size: int | None = None, seed: int = 0, rank: int | None = None,
                 world_size: int | None = None, order: Order | None = None,
                 **kwargs: Any) -> None:
        refused = [name for name in REFUSED if name in kwargs]
        if refused:
            raise ConfigError(
                f"spotring.DataLoader takes no {', '.join(refused)}: the order is spotring's "
                "(one permutation per epoch seeded by (seed, epoch), cut into global batches, "
                "the tail shorter than a global batch dropped), the same on any number of "
                "workers; give seed= for another order and set_epoch(e) for each epoch")
        if isinstance(dataset, torch.utils.data.IterableDataset):
            raise ConfigError("spotring.DataLoader orders a map-style Dataset (with __len__ "
                              "and __getitem__); an IterableDataset has no indices to order")
        if rank is None or world_size is None:
            launch = detect()
            rank = launch.rank if rank is None else rank
            world_size = launch.world_size if world_size is None else world_size
        micro, accumulation = split_global_batch(global_batch, world_size, batch_size)
        sampler = GlobalBatchSampler(len(dataset), global_batch, rank=rank,
                                     world_size=world_size, accumulation=accumulation, seed=seed,
                                     order=order or getattr(dataset, "start_epoch", None))
        super().__init__(dataset, batch_sampler=sampler, **kwargs)
        # torch leaves batch_size None under a batch_sampler and then refuses to set it;
        # every batch of this one has B samples, which is what batch_size means to readers.
        object.__setattr__(self, "batch_size", micro)
        self.batch_size_cap = batch_size  # the most samples per micro-step asked for
        self._handed = 0  # micro-batches of the current global batch handed out (0..K)
        # The iteration in progress goes on from the position as it stands now (set
        # again, or split over other workers): taken up at its next micro-batch.
        self._restart = False
        # Called before the first micro-batch of each global batch is drawn: where a job
        # in place takes in the processes that join it (spotring.Job sets it).
        self.before_step: Callable[[], None] | None = None

    @property
    def global_batch(self) -> int:
        return self.batch_sampler.global_batch

    @property
    def accumulation(self) -> int:
        """K: micro-batches per global batch on this worker."""
        return self.batch_sampler.accumulation

    @property
    def epoch(self) -> int:
        return self.batch_sampler.epoch

    @property
    def offset(self) -> int:
        """Samples of this epoch's order in the global batches handed out completely."""
        return self.batch_sampler.offset

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps (global batches) in a whole epoch."""
        return self.batch_sampler.steps_per_epoch

    @property
    def step(self) -> int:
        """Optimizer steps taken since the run began: the global batches handed out
        completely, the same on any number of workers (spotring.position.Position)."""
        return self.epoch * self.steps_per_epoch + self.offset // self.global_batch

    @property
    def is_step_boundary(self) -> bool:
        """True right after the last micro-batch of a global batch was handed out: the
        gradients are complete once it is backpropagated; step the optimizer then."""
        return self._handed == self.accumulation

    def set_epoch(self, epoch: int) -> None:
        """Stand in ``epoch``: at its start, or where the loader already is if it stands
        in it (a resumed run calls set_epoch(start_epoch) and continues mid-epoch)."""
        self.batch_sampler.set_epoch(epoch)
        self._handed = 0

    def epochs(self, epochs: int) -> Iterator[int]:
        """The epochs still to train, each set with `set_epoch` before it is handed out:
        ``for epoch in loader.epochs(n)`` starts at the restored epoch, mid-epoch, and
        skips one restored at its end (its per-epoch work was done before that
        checkpoint), so the same command run again after the last epoch trains nothing."""
        for epoch in range(self.epoch, epochs):
            self.set_epoch(epoch)
            if len(self) == 0:
                continue
            yield epoch

    def state_dict(self) -> dict[str, int]:
        """{"epoch", "offset", "seed", "global_batch"}: the position after the last
        complete global batch handed out, in samples of the epoch's order."""
        return self.batch_sampler.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue where ``state`` was taken, on any world size and accumulation; raises
        ConfigError for another seed or global batch (the samples would differ). An
        iteration in progress goes on from there."""
        self.batch_sampler.load_state_dict(state)
        self._handed = 0
        self._restart = True

    def reshard(self, rank: int, world_size: int) -> None:
        """Be ``rank`` of ``world_size`` workers from the current position on, each taking
        its share of the same global batches (more micro-steps where batch_size caps it):
        a job in place whose workers changed. An iteration in progress goes on so."""
        micro, accumulation = split_global_batch(self.global_batch, world_size,
                                                 self.batch_size_cap)
        self.batch_sampler.reshard(rank, world_size, accumulation)
        object.__setattr__(self, "batch_size", micro)
        self._handed = 0
        self._restart = True

    def __iter__(self) -> Iterator[Any]:
        # A new iteration restarts at the offset, the start of a global batch.
        self._handed = 0
        self._restart = False
        return self._counted()

    def _counted(self) -> Iterator[Any]:
        sampler, epoch = self.batch_sampler, self.epoch
        batches = super().__iter__()
        while True:
            while True:
                # Only before a step there is: none is taken at the epoch's end (a job in
                # place then takes a joiner in at the next epoch's first step).
                if (self._handed % self.accumulation == 0 and self.before_step is not None
                        and len(sampler)):
                    self.before_step()  # may split the batches anew: _restart
                if self._restart:
                    break
                try:
                    batch = next(batches)
                except StopIteration:
                    return
                self._handed = self._handed % self.accumulation + 1
                if self._handed == self.accumulation:
                    sampler.seek(sampler.epoch, sampler.offset + self.global_batch)
                yield batch
            # Set again (or split anew) between two steps: the batches from there on,
            # within this epoch; a position in another one ends this epoch's iteration.
            # The end of the epoch before is this one's start: where a job in place takes
            # again the first step of this epoch, from the position kept before it.
            self._restart, self._handed = False, 0
            if self.epoch == epoch - 1 and len(sampler) == 0:
                sampler.set_epoch(epoch)
            if self.epoch != epoch:
                return
            batches = super().__iter__()

    def __len__(self) -> int:
        """Micro-batches left in the current epoch."""
        return len(self.batch_sampler) - self._handed % self.accumulation
