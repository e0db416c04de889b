"""The world-size-invariant sample order, for any map-style dataset.

The invariant (docs/design.md, "Why N workers take the same steps as one"):

    epoch e's order is ONE permutation of the N samples, seeded by (seed, e);
    global batch i is permutation[offset + i*G : offset + (i+1)*G], G = the global batch;
    inside it, micro-step k of rank r takes the slice number k*W + r of size B
    (G = B x W x K for W workers and K accumulation steps).

So global batch i of epoch e is the same set of samples for any number of workers, and
a run that lost nodes resumes mid-epoch on fewer (keeping G with more accumulation) and
sees exactly the samples it would have seen. An epoch has floor(N/G) steps: the last
N mod G samples are dropped (a different few each epoch), so every optimizer step
averages exactly G samples.

`micro_batches` is the one implementation of that order; `GlobalBatchSampler` (for
torch's DataLoader, see spotring/loader.py) and the trainer's in-memory batches
(trainer/data.py) both take their indices from it. `split_global_batch`
(spotring/global_batch.py) is the one home of the rule that keeps G on W workers.

The permutation is pluggable (an ``Order``): any function of (seed, epoch, G) alone that
returns a permutation of the N samples keeps the invariant, whatever else it does. The
default is `epoch_order`, uniform; spotring.Shards gives one that reads a store's shards
in long runs (spotring/shards/order.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch.utils.data import Sampler

from spotring.exits import ConfigError
from spotring.global_batch import check_world_size
from spotring.position import refuse_another_global_batch


def seeded_generator(*key: int) -> torch.Generator:
    """A torch.Generator seeded by the integers ``key``, the same in every process and run
    (Python's tuple hash of ints is stable), for randomness that must not depend on the
    rank or the world size: an epoch's order, a global batch's augmentation."""
    return torch.Generator().manual_seed(hash(key) & 0x7FFF_FFFF_FFFF_FFFF)


def epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The sample order of one epoch: the same on every rank, for every world size."""
    return torch.randperm(n, generator=seeded_generator(seed, epoch))


# An epoch's order as a function of (seed, epoch, global batch G): a permutation of the
# dataset's N sample indices, the same in every process; global batch i is its i-th slice
# of G. It may depend on G (spotring.Shards cuts the epoch into G streams), never on the
# world size, the rank or the accumulation. It is called as each epoch's iteration begins
# (spotring.Shards.start_epoch learns the epoch so).
Order = Callable[[int, int, int], torch.Tensor]


def steps_in_epoch(n: int, global_batch: int, offset: int = 0) -> int:
    """Full global batches left in an epoch from sample ``offset`` on (the tail is dropped)."""
    return (n - offset) // global_batch


def shard(batch: torch.Tensor, rank: int, world_size: int,
          accumulation: int) -> list[torch.Tensor]:
    """This rank's micro-batches of one global batch: slice k*W + r for micro-step k."""
    parts = batch.chunk(world_size * accumulation)
    return [parts[k * world_size + rank] for k in range(accumulation)]


def micro_batches(n: int, global_batch: int, *, rank: int, world_size: int, accumulation: int,
                  seed: int, epoch: int, offset: int = 0, order: Order | None = None
                  ) -> Iterator[tuple[int, list[torch.Tensor]]]:
    """This rank's part of every global batch of ``epoch`` from sample ``offset`` on: for
    each, the offset after it (the resume position) and its K micro-batches of indices
    into the ``n`` samples, micro-step 0 first. G must be a multiple of W x K. ``order``:
    the epoch's permutation (default `epoch_order`), computed by this call, not at the
    first batch: a dataset that follows its order (spotring.Shards) learns the epoch
    before torch's DataLoader copies it into its worker processes."""
    permutation = (order(seed, epoch, global_batch) if order is not None
                   else epoch_order(n, seed, epoch))
    return _slices(permutation, n, global_batch, rank, world_size, accumulation, offset)


def _slices(order: torch.Tensor, n: int, global_batch: int, rank: int, world_size: int,
            accumulation: int, offset: int) -> Iterator[tuple[int, list[torch.Tensor]]]:
    for _ in range(steps_in_epoch(n, global_batch, offset)):
        end = offset + global_batch
        yield end, shard(order[offset:end], rank, world_size, accumulation)
        offset = end


class GlobalBatchSampler(Sampler[list[int]]):
    """This rank's micro-batches (lists of dataset indices) in spotring's order, for
    ``torch.utils.data.DataLoader(dataset, batch_sampler=...)``.

    Iterating yields the micro-batches of the current epoch from the current offset on,
    micro-step 0..K-1 of each global batch in turn; the tail shorter than G is dropped.
    Iterating does not move the position (epoch, offset in samples): DataLoader workers
    fetch ahead of the training loop, so the consumer moves it with `seek`, as
    spotring.DataLoader does after every K micro-batches it hands out.

    num_samples: the dataset's length. global_batch: G, a multiple of world_size x
    accumulation. rank, world_size: this worker's place. accumulation: K, micro-steps
    per global batch (spotring.split_global_batch chooses one). seed: of the order.
    order: the epoch's permutation as a function of (seed, epoch, G) (an ``Order``);
    default `epoch_order`.
    ConfigError for values that do not fit together, naming what would.
    """

    def __init__(self, num_samples: int, global_batch: int, *, rank: int, world_size: int,
                 accumulation: int = 1, seed: int = 0, order: Order | None = None) -> None:
        if global_batch > num_samples:
            raise ConfigError(f"the global batch of {global_batch} samples is larger than the "
                              f"dataset ({num_samples} samples): an epoch would have no step")
        self.num_samples, self.global_batch, self.seed = num_samples, global_batch, seed
        self.order = order
        self.epoch = self.offset = 0
        self.reshard(rank, world_size, accumulation)

    def reshard(self, rank: int, world_size: int, accumulation: int) -> None:
        """Be ``rank`` of ``world_size`` workers, ``accumulation`` micro-steps each, from
        the current position on (a job in place whose workers changed). ConfigError for
        values that do not fit together, naming what would."""
        global_batch = self.global_batch
        check_world_size(global_batch, world_size)
        if accumulation < 1 or global_batch % (world_size * accumulation):
            raise ConfigError(
                f"the global batch of {global_batch} samples does not split into {world_size} "
                f"workers x {accumulation} accumulation steps of equal micro-batches "
                "(spotring.split_global_batch chooses a split that does)")
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is not one of the {world_size} workers "
                              f"(0..{world_size - 1})")
        self.rank, self.world_size, self.accumulation = rank, world_size, accumulation
        self.batch_size = global_batch // (world_size * accumulation)  # B, per micro-step

    @property
    def position(self) -> tuple[int, int]:
        """(epoch, offset): the epoch and the samples of its order already consumed."""
        return self.epoch, self.offset

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps (global batches) in a whole epoch."""
        return steps_in_epoch(self.num_samples, self.global_batch)

    def seek(self, epoch: int, offset: int) -> None:
        """Stand at sample ``offset`` of ``epoch``'s order (any world size's offset)."""
        if epoch < 0 or not 0 <= offset <= self.num_samples:
            raise ConfigError(f"no position at sample {offset} of epoch {epoch}: the epoch "
                              f"counts from 0 and its offset from 0 to {self.num_samples}")
        self.epoch, self.offset = epoch, offset

    def set_epoch(self, epoch: int) -> None:
        """Stand in ``epoch``: at its start, unless already in it (a resumed run calls
        set_epoch(start_epoch) and continues mid-epoch)."""
        if epoch != self.epoch:
            self.seek(epoch, 0)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed,
                "global_batch": self.global_batch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Stand where ``state`` was taken, on any world size and accumulation. Refuses
        (ConfigError) another seed or global batch (spotring.position's rule): the sample
        sequence would not be the same."""
        if int(state["seed"]) != self.seed:
            raise ConfigError(
                f"the data position was saved with seed {int(state['seed'])}, this run has "
                f"seed {self.seed}: the sample sequence would differ; keep "
                f"seed={int(state['seed'])} to continue it")
        refuse_another_global_batch(int(state["global_batch"]), self.global_batch)
        self.seek(int(state["epoch"]), int(state["offset"]))

    def __iter__(self) -> Iterator[list[int]]:
        # The arguments bind the position now, not at the first fetch.
        steps = micro_batches(self.num_samples, self.global_batch, rank=self.rank,
                              world_size=self.world_size, accumulation=self.accumulation,
                              seed=self.seed, epoch=self.epoch, offset=self.offset,
                              order=self.order)
        return (index.tolist() for _, micro in steps for index in micro)

    def __len__(self) -> int:
        """Micro-batches left in the current epoch from the current offset."""
        return steps_in_epoch(self.num_samples, self.global_batch, self.offset) \
            * self.accumulation
