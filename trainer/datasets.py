"""Dataset files -> uint8 tensors in memory, decoded once per worker.

MNIST and CIFAR-10 are small enough (47 MB and 150 MB as uint8) that every worker
holds the whole training set and slices its batches straight out of a tensor: no
DataLoader processes, no per-sample Python, nothing to wait for between steps.

Where the files are looked for (``data.root``, default: this repository's data/):

    mnist     ROOT/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]
              (this repository ships the four .gz files, so the default run is offline)
    cifar10   ROOT/cifar-10-batches-py/{data_batch_1..5,test_batch}
              (the python version from https://www.cs.toronto.edu/~kriz/cifar.html)
    synthetic nothing: random images of ``dataset.shape``

A missing dataset is downloaded with torchvision when ``data.download=true`` and the
machine is online; otherwise the error says where it looked and how to fix it.
"""

from __future__ import annotations

import fcntl
import gzip
import logging
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig

from trainer.config import ConfigError

log = logging.getLogger(__name__)

DEFAULT_ROOT = Path(__file__).resolve().parents[1] / "data"


class DataError(ConfigError):
    """The dataset is not where it was looked for and could not be fetched."""


@dataclass
class Split:
    """One split. ``images`` may hold fewer rows than ``labels`` (synthetic data reuses
    a small pool of random images), so a sample i is ``images[i % len(images)]``."""

    images: torch.Tensor  # uint8, N x C x H x W
    labels: torch.Tensor  # int64, N

    def __len__(self) -> int:
        return len(self.labels)

    def take(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[index % len(self.images)], self.labels[index]


@dataclass
class Dataset:
    name: str
    train: Split
    test: Split
    num_classes: int
    mean: tuple[float, ...]  # per channel, of images scaled to [0, 1]
    std: tuple[float, ...]

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.train.images.shape[1:])


def root_of(data_cfg: DictConfig) -> Path:
    return Path(data_cfg.root).expanduser().resolve() if data_cfg.root else DEFAULT_ROOT


def load(dataset_cfg: DictConfig, data_cfg: DictConfig, seed: int) -> Dataset:
    """Find (or fetch) the dataset named in ``dataset_cfg`` and decode it into tensors."""
    if dataset_cfg.name == "synthetic":
        return _synthetic(dataset_cfg, seed)
    root = root_of(data_cfg)
    reader, missing, fetch = _READERS[dataset_cfg.name]
    if missing(root):
        if not data_cfg.download:
            raise _not_found(dataset_cfg.name, root, missing(root), "data.download=false")
        _download(dataset_cfg.name, root, missing, fetch)
    return reader(root)


# ------------------------------------------------------------------------------ MNIST

_MNIST_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def _mnist_path(root: Path, name: str) -> Path | None:
    for candidate in (root / "MNIST" / "raw" / name, root / "MNIST" / "raw" / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    return None


def _mnist_missing(root: Path) -> list[str]:
    names = [n for pair in _MNIST_FILES.values() for n in pair]
    return [f"MNIST/raw/{n}[.gz]" for n in names if _mnist_path(root, n) is None]


def _read_idx(path: Path) -> torch.Tensor:
    """The IDX format of LeCun's MNIST files: magic (0, 0, dtype 0x08, ndim), big-endian
    uint32 sizes, then uint8 data."""
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    if raw[:3] != b"\x00\x00\x08":
        raise DataError(f"{path} is not an IDX uint8 file (first bytes {raw[:4].hex()})")
    ndim = raw[3]
    dims = np.frombuffer(raw, dtype=">u4", count=ndim, offset=4).astype(int)
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        raise DataError(f"{path} is truncated: {data.size} values, header says {tuple(dims)}")
    return torch.from_numpy(data.reshape(tuple(dims)).copy())


def _read_mnist(root: Path) -> Dataset:
    splits = {}
    for split, (images, labels) in _MNIST_FILES.items():
        x = _read_idx(_mnist_path(root, images)).unsqueeze(1)  # N x 1 x 28 x 28
        y = _read_idx(_mnist_path(root, labels)).long()
        splits[split] = Split(x, y)
    return Dataset("mnist", splits["train"], splits["test"], 10, (0.1307,), (0.3081,))


def _fetch_mnist(root: Path) -> None:
    import torchvision

    for train in (True, False):
        torchvision.datasets.MNIST(root, train=train, download=True)


# --------------------------------------------------------------------------- CIFAR-10

_CIFAR_DIR = "cifar-10-batches-py"
_CIFAR_TRAIN = [f"data_batch_{i}" for i in range(1, 6)]
_CIFAR_TEST = ["test_batch"]


def _cifar_missing(root: Path) -> list[str]:
    return [f"{_CIFAR_DIR}/{n}" for n in _CIFAR_TRAIN + _CIFAR_TEST
            if not (root / _CIFAR_DIR / n).is_file()]


def _read_cifar_batches(root: Path, names: list[str]) -> Split:
    """The python version of CIFAR-10: pickled dicts with ``data`` (N x 3072 uint8, the
    1024 red, then green, then blue values of each 32x32 image) and ``labels``."""
    images, labels = [], []
    for name in names:
        path = root / _CIFAR_DIR / name
        try:
            with path.open("rb") as f:
                batch = pickle.load(f, encoding="bytes")
            data, batch_labels = batch[b"data"], batch[b"labels"]
        except (pickle.UnpicklingError, EOFError, KeyError, TypeError) as e:
            raise DataError(f"{path} is not a CIFAR-10 python batch file ({e!r})") from e
        images.append(torch.as_tensor(np.asarray(data, dtype=np.uint8)).view(-1, 3, 32, 32))
        labels.append(torch.as_tensor(batch_labels, dtype=torch.long))
    return Split(torch.cat(images), torch.cat(labels))


def _read_cifar10(root: Path) -> Dataset:
    return Dataset(
        "cifar10",
        _read_cifar_batches(root, _CIFAR_TRAIN),
        _read_cifar_batches(root, _CIFAR_TEST),
        10,
        (0.4914, 0.4822, 0.4465),
        (0.2470, 0.2435, 0.2616),
    )


def _fetch_cifar10(root: Path) -> None:
    import torchvision

    torchvision.datasets.CIFAR10(root, train=True, download=True)


# -------------------------------------------------------------------------- synthetic


def _synthetic(cfg: DictConfig, seed: int) -> Dataset:
    """Random uint8 images and labels. A pool of at most 256 distinct images stands for
    every sample, so a 224x224 'ImageNet' costs 38 MB rather than its full size."""
    g = torch.Generator().manual_seed(seed)
    shape = tuple(cfg.shape)

    def split(n: int) -> Split:
        pool = torch.randint(0, 256, (min(n, 256), *shape), dtype=torch.uint8, generator=g)
        return Split(pool, torch.randint(0, cfg.num_classes, (n,), generator=g))

    channels = shape[0]
    # The mean and standard deviation of uniform integers 0..255, scaled to [0, 1].
    return Dataset("synthetic", split(cfg.train_size), split(cfg.test_size), cfg.num_classes,
                   (0.5,) * channels, (0.2887,) * channels)


# --------------------------------------------------------------------------- fetching

_READERS: dict[str, tuple[Callable[[Path], Dataset], Callable[[Path], list[str]],
                          Callable[[Path], None]]] = {
    "mnist": (_read_mnist, _mnist_missing, _fetch_mnist),
    "cifar10": (_read_cifar10, _cifar_missing, _fetch_cifar10),
}


def _not_found(name: str, root: Path, missing: list[str], why: str) -> DataError:
    return DataError(
        f"dataset {name} not found: looked in {root} and did not find "
        f"{', '.join(missing)}; could not download it ({why}). "
        f"Fix: put the files there, point data.root=PATH at a folder that has them, "
        f"or run once on a machine with internet access and data.download=true."
    )


def _download(name: str, root: Path, missing: Callable[[Path], list[str]],
              fetch: Callable[[Path], None]) -> None:
    """Download with torchvision, one process per machine at a time: workers on the
    same host share ``root``, and the first to take the lock fetches for all."""
    root.mkdir(parents=True, exist_ok=True)
    with (root / f".{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not missing(root):
            return
        log.info("downloading %s into %s", name, root)
        try:
            fetch(root)
        except Exception as e:  # torchvision raises URLError, RuntimeError, OSError...
            raise _not_found(name, root, missing(root), f"download failed: {e}") from e
