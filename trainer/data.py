"""Batches ready on the device: from dataset tensors held in memory (`Batches`), or from
Datasets read item by item through a spotring.DataLoader (`LoaderBatches`).

The order is spotring's world-size-invariant one (spotring/sampler.py; docs/design.md,
"Why N workers take the same steps as one"): epoch e's order is one permutation seeded
by (seed, e), global batch i is its i-th slice of G samples, micro-step k of rank r
takes part k*W + r, and the tail shorter than G is dropped. `Batches.train` takes its
indices from `spotring.sampler.micro_batches`, the same code that orders
`spotring.DataLoader`, and gathers them straight out of the uint8 tensors: no loader
processes, no per-sample Python. Evaluation is not batched globally: the test set is
cut into W contiguous shards, so every test sample counts exactly once.

Augmentation (random crop with 4 px zero padding, horizontal flip) draws its
randomness per global batch from (seed, epoch, offset) and gives each rank its
slice of it: the augmented images are world-size-invariant too.

`LoaderBatches` serves the loop the same interface and the same order for a
`MapDataset` (dataset=image_folder, dataset._target_): a spotring.DataLoader takes each
micro-batch's indices from the same `micro_batches`, ``data.workers`` loader processes
read and transform the items, and every training item is read with torch's RNG seeded
by (seed, epoch, index): a random transform of a sample is the same in whichever
process, rank or world size reads it. (Transforms that draw from Python's `random` or
NumPy instead stay random per process.)
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils.data

from spotring.loader import DataLoader
from spotring.sampler import micro_batches, seeded_generator, steps_in_epoch
from spotring.trainer.datasets import Dataset, MapDataset, Split

PAD = 4  # pixels of zero padding for the random crop


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

    def reshard(self, rank: int, world_size: int, accumulation: int) -> None:
        """Take ``rank``'s share of the same global batches among ``world_size`` workers,
        in ``accumulation`` micro-batches, from the next ``train`` or ``test`` on."""
        self.rank, self.world_size, self.accumulation = rank, world_size, accumulation

    def steps_left(self, offset: int) -> int:
        return steps_in_epoch(len(self.dataset.train), self.global_batch, offset)

    def train(self, epoch: int, offset: int = 0) -> Iterator[Batch]:
        """The steps of ``epoch`` from sample ``offset`` on."""
        steps = micro_batches(len(self.dataset.train), self.global_batch, rank=self.rank,
                              world_size=self.world_size, accumulation=self.accumulation,
                              seed=self.seed, epoch=epoch, offset=offset)
        for end, indices in steps:
            flips = crops = None
            if self.augment:
                g = seeded_generator(self.seed, epoch, end - self.global_batch)
                crops = torch.randint(0, 2 * PAD + 1, (self.global_batch, 2), generator=g)
                flips = torch.rand(self.global_batch, generator=g) < 0.5
            micro = []
            for k, index in enumerate(indices):
                x, y = self._to_device(self.dataset.train, index)
                if self.augment:
                    # The same slice of the global batch's crops and flips as of its samples.
                    start = (k * self.world_size + self.rank) * len(index)
                    part = slice(start, start + len(index))
                    x = crop_and_flip(x, crops[part].to(self.device), flips[part].to(self.device))
                micro.append((self._normalise(x), y))
            yield Batch(epoch, end, micro)

    def test(self, batch_size: int, samples: int | None = None
             ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's contiguous shard of the test set (of its first ``samples``), in
        batches (``evaluation_batches``)."""
        for index in evaluation_batches(len(self.dataset.test), samples, batch_size,
                                        self.rank, self.world_size):
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


class LoaderBatches:
    """The `Batches` interface over a MapDataset: this rank's micro-batches, read by
    ``workers`` loader processes (pinned memory on GPUs), on the device in ``dtype`` and
    ``memory_format``. The items come normalised from the Datasets' own transforms."""

    def __init__(self, dataset: MapDataset, *, global_batch: int, rank: int,
                 world_size: int, accumulation: int, seed: int, device: torch.device,
                 dtype: torch.dtype = torch.float32,
                 memory_format: torch.memory_format = torch.contiguous_format,
                 workers: int = 2) -> None:
        self.dataset, self.global_batch, self.seed = dataset, global_batch, seed
        self.workers = workers
        self.device, self.dtype, self.memory_format = device, dtype, memory_format
        self.items = SeededItems(dataset.train, seed)
        self.loader: DataLoader | None = None
        self.reshard(rank, world_size, accumulation)

    @property
    def steps_per_epoch(self) -> int:
        return self.loader.steps_per_epoch

    def reshard(self, rank: int, world_size: int, accumulation: int) -> None:
        """`Batches.reshard`: a loader of ``rank``'s share, where it changed."""
        if self.loader is not None and (
                self.rank, self.world_size, self.loader.accumulation) == (
                rank, world_size, accumulation):
            return
        self.rank, self.world_size = rank, world_size
        # batch_size B = G / (W x K) makes the loader split G into K micro-steps. The order
        # is the dataset's own where it has one (spotring.Shards: the order that reads each
        # rank's share of the shards), spotring's permutation otherwise.
        self.loader = DataLoader(self.items, self.global_batch,
                                 batch_size=self.global_batch // (world_size * accumulation),
                                 seed=self.seed, rank=rank, world_size=world_size,
                                 num_workers=self.workers, pin_memory=self.device.type == "cuda",
                                 order=getattr(self.dataset.train, "start_epoch", None))

    def steps_left(self, offset: int) -> int:
        return steps_in_epoch(len(self.dataset.train), self.global_batch, offset)

    def train(self, epoch: int, offset: int = 0) -> Iterator[Batch]:
        """The steps of ``epoch`` from sample ``offset`` on."""
        self.items.epoch = epoch  # before the loader processes start, which copy it
        self.loader.load_state_dict(self.loader.state_dict() | {"epoch": epoch,
                                                                "offset": offset})
        micro = []
        for x, y in self.loader:
            micro.append(self._to_device(x, y))
            if self.loader.is_step_boundary:
                yield Batch(epoch, self.loader.offset, micro)
                micro = []

    def test(self, batch_size: int, samples: int | None = None
             ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's contiguous shard of the test set (of its first ``samples``), in
        batches, as `Batches.test`."""
        test = self.dataset.test
        batches = evaluation_batches(len(test), samples, batch_size, self.rank, self.world_size)
        loader = torch.utils.data.DataLoader(
            test, batch_sampler=[index.tolist() for index in batches],
            num_workers=self.workers, pin_memory=self.device.type == "cuda")
        for x, y in loader:
            yield self._to_device(x, y)

    def _to_device(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (x.to(self.device, self.dtype, non_blocking=True, memory_format=self.memory_format),
                y.to(self.device, torch.long, non_blocking=True))


def evaluation_batches(size: int, samples: int | None, batch_size: int, rank: int,
                 world_size: int) -> list[torch.Tensor]:
    """The indices of ``rank``'s contiguous shard of the first ``samples`` (default all)
    of a test set of ``size``, in batches of at most ``batch_size``, as many on every rank:
    under engine=fsdp each forward pass gathers parameters from every rank, which must
    all run it as often. The shards differ by one sample at most, so the batches do too."""
    shards = torch.arange(min(samples or size, size)).tensor_split(world_size)
    count = -(-len(shards[0]) // batch_size)  # the first shard is the largest
    return list(shards[rank].tensor_split(count)) if count else []


class SeededItems(torch.utils.data.Dataset):
    """``dataset``'s items, each read with torch's global RNG seeded by (seed, epoch,
    index) (and restored after): the same random transforms of a sample in any process.
    Set ``epoch`` before the loader processes of an epoch start: they copy it then."""

    def __init__(self, dataset: torch.utils.data.Dataset, seed: int) -> None:
        self.dataset, self.seed, self.epoch = dataset, seed, 0

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seeded_generator(self.seed, self.epoch, index).initial_seed())
            return self.dataset[index]


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
