"""The world-size-invariant sample order, and batches ready on the device.

The invariant (docs/design.md, "Why N workers take the same steps as one"):

    epoch e's order is ONE permutation of the training set, seeded by (seed, e);
    global batch i is permutation[offset + i*G : offset + (i+1)*G], G = the global batch;
    inside it, micro-step k of rank r takes the slice number k*W + r of size B
    (G = B x W x K for W workers and K accumulation steps).

So global batch i of epoch e is the same set of samples for any number of workers,
and a run that lost nodes resumes mid-epoch on fewer (keeping G with more
accumulation) and sees exactly the samples it would have seen.

Uneven tails: an epoch has floor(N/G) steps and drops the last N mod G samples
(a different few each epoch, because the permutation changes). Every optimizer step
then averages exactly G samples, which keeps the LR scaling exact and the step of
W workers identical to the step of one. Evaluation is not batched globally: the test
set is cut into W contiguous shards, so every test sample counts exactly once.

Augmentation (random crop with 4 px zero padding, horizontal flip) draws its
randomness per global batch from (seed, epoch, offset) and gives each rank its
slice of it: the augmented images are world-size-invariant too.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trainer.datasets import Dataset, Split

PAD = 4  # pixels of zero padding for the random crop


def _generator(*key: int) -> torch.Generator:
    # A 63-bit seed from the key; Python's tuple hash of ints is stable across runs.
    return torch.Generator().manual_seed(hash(key) & 0x7FFF_FFFF_FFFF_FFFF)


def epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The sample order of one epoch: the same on every rank, for every world size."""
    return torch.randperm(n, generator=_generator(seed, epoch))


def steps_in_epoch(n: int, global_batch: int, offset: int = 0) -> int:
    """Full global batches left in an epoch from sample ``offset`` on (the tail is dropped)."""
    return (n - offset) // global_batch


def shard(batch: torch.Tensor, rank: int, world_size: int,
          accumulation: int) -> list[torch.Tensor]:
    """This rank's micro-batches of one global batch: slice k*W + r for micro-step k."""
    parts = batch.chunk(world_size * accumulation)
    return [parts[k * world_size + rank] for k in range(accumulation)]


@dataclass
class Batch:
    """One optimizer step's data for this rank: ``accumulation`` micro-batches."""

    epoch: int
    offset: int  # sample offset in the epoch's order after this step (the resume position)
    micro: list[tuple[torch.Tensor, torch.Tensor]]  # (images, labels) on the device


class Batches:
    """Training and evaluation batches of one dataset for one rank."""

    def __init__(self, dataset: Dataset, *, global_batch: int, rank: int, world_size: int,
                 accumulation: int, seed: int, augment: bool, device: torch.device,
                 dtype: torch.dtype = torch.float32,
                 memory_format: torch.memory_format = torch.contiguous_format) -> None:
        if global_batch > len(dataset.train):
            raise ValueError(f"global batch {global_batch} is larger than the training set "
                             f"({len(dataset.train)} samples)")
        self.dataset = dataset
        self.global_batch = global_batch
        self.rank, self.world_size, self.accumulation = rank, world_size, accumulation
        self.seed, self.augment, self.device = seed, augment, device
        self.memory_format = memory_format  # of every image batch (train.channels_last)
        mean = torch.tensor(dataset.mean, device=device, dtype=dtype).view(1, -1, 1, 1)
        std = torch.tensor(dataset.std, device=device, dtype=dtype).view(1, -1, 1, 1)
        # uint8 -> normalised float in one multiply-add: x / 255 / std - mean / std.
        self._scale, self._shift = 1 / (255 * std), -mean / std

    @property
    def steps_per_epoch(self) -> int:
        return self.steps_left(0)

    def steps_left(self, offset: int) -> int:
        return steps_in_epoch(len(self.dataset.train), self.global_batch, offset)

    def train(self, epoch: int, offset: int = 0) -> Iterator[Batch]:
        """The steps of ``epoch`` from sample ``offset`` on."""
        order = epoch_order(len(self.dataset.train), self.seed, epoch)
        for _ in range(self.steps_left(offset)):
            batch = order[offset: offset + self.global_batch]
            flips = crops = None
            if self.augment:
                g = _generator(self.seed, epoch, offset)
                crops = torch.randint(0, 2 * PAD + 1, (self.global_batch, 2), generator=g)
                flips = torch.rand(self.global_batch, generator=g) < 0.5
            micro = []
            for k, index in enumerate(shard(batch, self.rank, self.world_size,
                                            self.accumulation)):
                x, y = self._to_device(self.dataset.train, index)
                if self.augment:
                    # The same slice of the global batch's crops and flips as of its samples.
                    start = (k * self.world_size + self.rank) * len(index)
                    part = slice(start, start + len(index))
                    x = crop_and_flip(x, crops[part].to(self.device), flips[part].to(self.device))
                micro.append((self._normalise(x), y))
            offset += self.global_batch
            yield Batch(epoch, offset, micro)

    def test(self, batch_size: int, samples: int | None = None
             ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's contiguous shard of the test set (of its first ``samples``), in
        batches."""
        n = min(samples or len(self.dataset.test), len(self.dataset.test))
        mine = torch.arange(n).tensor_split(self.world_size)[self.rank]
        for index in mine.split(batch_size):
            x, y = self._to_device(self.dataset.test, index)
            yield self._normalise(x), y

    def _to_device(self, split: Split, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = split.take(index)
        if self.device.type == "cuda":  # copy uint8 (4x fewer bytes) and convert there
            x, y = x.pin_memory(), y.pin_memory()
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def _normalise(self, x: torch.Tensor) -> torch.Tensor:
        # The float copy is made in the batch's memory format, and addcmul keeps it.
        x = x.to(self._scale.dtype, memory_format=self.memory_format)
        return torch.addcmul(self._shift, x, self._scale)


def crop_and_flip(x: torch.Tensor, crops: torch.Tensor, flips: torch.Tensor) -> torch.Tensor:
    """Random crops of a zero-padded batch (offsets ``crops``: B x 2 in [0, 2*PAD]) and
    horizontal flips where ``flips`` is true, as one gather on any device."""
    b, c, h, w = x.shape
    padded = F.pad(x, (PAD, PAD, PAD, PAD))
    rows = (crops[:, 0:1] + torch.arange(h, device=x.device)).view(b, 1, h, 1)
    cols = (crops[:, 1:2] + torch.arange(w, device=x.device)).view(b, 1, 1, w)
    cols = torch.where(flips.view(b, 1, 1, 1), cols.flip(3), cols)
    return padded[torch.arange(b, device=x.device).view(b, 1, 1, 1),
                  torch.arange(c, device=x.device).view(1, c, 1, 1), rows, cols]
