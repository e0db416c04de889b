"""Dataset files -> uint8 tensors in memory, decoded once per worker; or your own data,
read item by item.

MNIST and CIFAR-10 are small enough (47 MB and 150 MB as uint8) that every worker
holds the whole training set and slices its batches straight out of a tensor: no
DataLoader processes, no per-sample Python, nothing to wait for between steps.
torchvision.datasets reads the files, and fetches them. Other data comes as a
`MapDataset`, two map-style torch Datasets that trainer/data.py's LoaderBatches read
through a spotring.DataLoader with ``data.workers`` processes:

    dataset=image_folder   torchvision's ImageFolder: dataset.root=DIR holding
                           train/<class>/*.jpg|png and val/<class>/... (or test/)
    dataset=shards         WebDataset shards in a store, streamed by spotring.Shards in
                           its own order (dataset.uri=s3://..., docs/streaming.md)
    dataset._target_=mypkg.data.build   your own; hydra.utils.instantiate calls

        build(**added, root=DATA_ROOT, seed=train.seed) -> (train, test)

    where ``added`` are the keys you add (``+dataset.size=64``; dataset.num_classes too),
    DATA_ROOT is data.root as an absolute path, and train and test are map-style
    torch.utils.data.Datasets whose items are (image: float tensor C x H x W, label:
    int). The number of classes is len(train.classes) (torchvision's datasets have it),
    else +dataset.num_classes=N. The builder runs on every rank before any process group
    exists; a target that fails or returns anything else ends the run with exit code 2,
    naming it and what it returned (its first items are read to check them). Random
    transforms that draw from torch's RNG (torchvision's do) are seeded per sample
    (trainer/data.py), so they too are the same on any number of workers.

Where the files are looked for: ``data.root``, by default ``data`` relative to the
working directory. From a checkout (``make train``, the launchers' workdir) that is the
checkout's data/, which holds MNIST; an installed ``spotring train`` elsewhere uses (or
downloads into) a data/ folder where it runs.

    mnist     ROOT/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte
              read as they are, their IDX headers checked (sizes, type, dimensions).
              Where only the .gz files are there (this repository ships them, so the
              default run is offline), each is decompressed beside itself once, with
              no network.
    cifar10   ROOT/cifar-10-batches-py/{data_batch_1..5,test_batch,batches.meta}
              (the python version). Every file's md5 is checked against the published
              CIFAR-10's; a copy that differs is refused, naming the files.
    synthetic nothing: random images of ``dataset.shape``

A dataset that is not there is downloaded by torchvision (the downloads' md5 checked)
when ``data.download=true`` and the machine is online; otherwise the error (exit 2)
says where it looked and what to do. Every rank of a host reads the same root at once:
each checks, extracts or downloads holding a lock (ROOT/.NAME.lock), so one fetches for
all and none reads a half-written file.
"""

from __future__ import annotations

import contextlib
import fcntl
import gzip
import logging
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.utils.data
from omegaconf import DictConfig

from spotring.exits import ConfigError
from spotring.stores import write_atomic
from spotring.trainer.targets import describe, instantiate

log = logging.getLogger(__name__)


class DataError(ConfigError):
    """The dataset is not where it was looked for, could not be fetched, or is damaged."""


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


@dataclass
class MapDataset:
    """Two map-style torch Datasets of (float image C x H x W, int label) items, read item
    by item (trainer/data.py LoaderBatches): image_folder's, or a dataset._target_'s."""

    name: str  # image_folder, or the target
    train: torch.utils.data.Dataset
    test: torch.utils.data.Dataset
    num_classes: int
    shape: tuple[int, int, int]  # of train[0]'s image


def root_of(data_cfg: DictConfig) -> Path:
    return Path(data_cfg.root).expanduser().resolve()


def load(dataset_cfg: DictConfig, data_cfg: DictConfig, seed: int) -> Dataset | MapDataset:
    """Find (or fetch) the dataset named in ``dataset_cfg`` and decode it into tensors, or
    build and check the Datasets of image_folder or of a _target_."""
    if dataset_cfg.get("_target_"):  # (a config of the schema has the key; a plain one not)
        return _from_target(dataset_cfg, data_cfg, seed)
    if dataset_cfg.name == "image_folder":
        return _image_folder(dataset_cfg)
    if dataset_cfg.name == "shards":
        return _shards(dataset_cfg)
    if dataset_cfg.name == "synthetic":
        return _synthetic(dataset_cfg, seed)
    name, root = dataset_cfg.name, root_of(data_cfg)
    files = _FILES[name]
    if data_cfg.download and not root.is_dir():
        try:
            root.mkdir(parents=True, exist_ok=True)  # the other ranks of this host too
        except OSError as e:
            raise _not_found(name, root, files.missing(root), f"cannot create it: {e}") from e
    with _one_at_a_time(root, name):
        if not files.ready(root):
            _fetch(name, root, files, data_cfg.download)
    return files.read(root)


def _one_at_a_time(root: Path, name: str) -> contextlib.AbstractContextManager:
    """An exclusive lock on ROOT/.NAME.lock, released when the context ends. None where
    root is missing or read-only: nobody can be writing there then."""
    try:
        lock = (root / f".{name}.lock").open("a")
    except OSError:
        return contextlib.nullcontext()
    fcntl.flock(lock, fcntl.LOCK_EX)
    return lock  # closing the file releases the lock


@dataclass(frozen=True)
class _Files:
    """What torchvision needs of a dataset under ROOT, and reading it."""

    missing: Callable[[Path], list[str]]  # what is neither there nor to be had offline
    ready: Callable[[Path], bool]  # whether torchvision can read the files as they are
    fetch: Callable[[Path], None]  # extract what is there, download the rest
    read: Callable[[Path], Dataset]


def _fetch(name: str, root: Path, files: _Files, download: bool) -> None:
    missing = files.missing(root)
    if missing and not download:
        raise _not_found(name, root, missing, "data.download=false")
    log.info("%s %s in %s", "downloading" if missing else "extracting", name, root)
    try:
        files.fetch(root)
    except Exception as e:  # torchvision raises URLError, RuntimeError, OSError...
        reason = " ".join(str(e).split())  # its messages span lines
        if not (missing := files.missing(root)):  # all there, but not to be extracted
            raise DataError(f"dataset {name} in {root}: could not extract it ({reason}). "
                            f"Fix: delete the damaged files to download them again, or "
                            f"point data.root=PATH at an intact copy.") from e
        raise _not_found(name, root, missing, f"download failed: {reason}") from e


def _not_found(name: str, root: Path, missing: list[str], why: str) -> DataError:
    return DataError(
        f"dataset {name} not found: looked in {root} and did not find "
        f"{', '.join(missing)}; could not download it ({why}). "
        f"Fix: put the files there, point data.root=PATH at a folder that has them, "
        f"or run once on a machine with internet access and data.download=true."
    )


# ------------------------------------------------------------------------------ MNIST


def _mnist_raw(root: Path) -> Path:
    return root / "MNIST" / "raw"


def _mnist_names() -> list[str]:
    from torchvision.datasets import MNIST

    return [gz.removesuffix(".gz") for gz, _ in MNIST.resources]


def _mnist_missing(root: Path) -> list[str]:
    raw = _mnist_raw(root)
    return [f"MNIST/raw/{name}[.gz]" for name in _mnist_names()
            if not (raw / name).is_file() and not (raw / f"{name}.gz").is_file()]


def _mnist_ready(root: Path) -> bool:
    return all((_mnist_raw(root) / name).is_file() for name in _mnist_names())


def _mnist_fetch(root: Path) -> None:
    """Decompress the .gz files that are there (whole or not at all), download the rest.
    The .gz are not held to the published md5: this repository's copies were compressed
    again; what they hold is checked when it is read."""
    from torchvision.datasets import MNIST

    raw = _mnist_raw(root)
    for name in _mnist_names():
        if not (raw / name).is_file() and (raw / f"{name}.gz").is_file():
            write_atomic(raw / name, gzip.decompress((raw / f"{name}.gz").read_bytes()))
    if not _mnist_ready(root):
        MNIST(root, download=True)  # all four files, whichever split it names


def _read_mnist(root: Path) -> Dataset:
    from torchvision.datasets import MNIST

    try:
        train, test = (MNIST(root, train=split) for split in (True, False))
    except (RuntimeError, ValueError, TypeError, AssertionError) as e:  # its IDX checks
        raise DataError(
            f"dataset mnist in {_mnist_raw(root)} is not readable as MNIST ({e!r}). Fix: "
            f"delete the damaged files (the .gz are decompressed again), or point "
            f"data.root=PATH at an intact copy.") from e
    return Dataset("mnist", Split(train.data.unsqueeze(1), train.targets),
                   Split(test.data.unsqueeze(1), test.targets), 10, (0.1307,), (0.3081,))


# --------------------------------------------------------------------------- CIFAR-10


def _cifar_files(root: Path) -> list[tuple[Path, str]]:
    """(path, published md5) of every file torchvision reads."""
    from torchvision.datasets import CIFAR10

    folder = root / CIFAR10.base_folder
    return [(folder / name, md5) for name, md5 in
            [*CIFAR10.train_list, *CIFAR10.test_list,
             (CIFAR10.meta["filename"], CIFAR10.meta["md5"])]]


def _shown(root: Path, path: Path) -> str:
    return str(path.relative_to(root))


def _cifar_missing(root: Path) -> list[str]:
    return [_shown(root, path) for path, _ in _cifar_files(root) if not path.is_file()]


def _cifar_fetch(root: Path) -> None:
    from torchvision.datasets import CIFAR10

    CIFAR10(root, download=True)


def _read_cifar10(root: Path) -> Dataset:
    from torchvision.datasets import CIFAR10
    from torchvision.datasets.utils import check_integrity

    try:
        train, test = (CIFAR10(root, train=split) for split in (True, False))
    except RuntimeError as e:  # "Dataset not found or corrupted": its md5 checks
        differ = [_shown(root, p) for p, md5 in _cifar_files(root) if not check_integrity(p, md5)]
        raise DataError(
            f"dataset cifar10 in {root}: {', '.join(differ) or e} differ from the published "
            f"CIFAR-10 files (md5). Fix: delete them to download CIFAR-10 again "
            f"(data.download=true), or point data.root=PATH at an intact copy.") from e

    def split(part) -> Split:  # torchvision holds N x H x W x C numpy arrays
        return Split(torch.from_numpy(part.data).permute(0, 3, 1, 2).contiguous(),
                     torch.tensor(part.targets, dtype=torch.long))

    return Dataset("cifar10", split(train), split(test), 10,
                   (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))


_FILES = {
    "mnist": _Files(_mnist_missing, _mnist_ready, _mnist_fetch, _read_mnist),
    "cifar10": _Files(_cifar_missing, lambda root: not _cifar_missing(root), _cifar_fetch,
                      _read_cifar10),
}


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


# ------------------------------------------------------ datasets read item by item


def _from_target(cfg: DictConfig, data_cfg: DictConfig, seed: int) -> MapDataset:
    target = cfg._target_
    built = instantiate("dataset", cfg, root=str(root_of(data_cfg)), seed=seed)
    what = f"dataset._target_={target}"
    if not (isinstance(built, tuple | list) and len(built) == 2):
        raise ConfigError(f"{what} returned {describe(built)}, not a pair (train, test) of "
                          "map-style torch.utils.data.Datasets")
    return _checked(target, what, *built, cfg.get("num_classes"))


def _image_folder(cfg: DictConfig) -> MapDataset:
    """torchvision's ImageFolder over root/train and root/val (or root/test), with the
    usual transforms: RandomResizedCrop(size) and a horizontal flip for training where
    ``augment``, else (and for evaluation) Resize to size x 256/224 (ImageNet's 256 for
    224) and CenterCrop(size); then ToTensor and Normalize(mean, std)."""
    from torchvision import transforms as T
    from torchvision.datasets import ImageFolder

    root = Path(cfg.root).expanduser().resolve()
    test_dir = next((root / d for d in ("val", "test") if (root / d).is_dir()), None)
    if not (root / "train").is_dir() or test_dir is None:
        raise DataError(f"dataset image_folder: {root} holds no "
                        f"{'train/' if test_dir else 'train/ and val/ (or test/)'} folder. "
                        "Fix: point dataset.root=DIR at a folder holding train/<class>/*.jpg|png "
                        "and val/<class>/... (torchvision's ImageFolder layout).")
    normalise = [T.ToTensor(), T.Normalize(list(cfg.mean), list(cfg.std))]
    evaluation = T.Compose([T.Resize(round(cfg.size * 256 / 224)), T.CenterCrop(cfg.size),
                            *normalise])
    training = T.Compose([T.RandomResizedCrop(cfg.size), T.RandomHorizontalFlip(),
                          *normalise]) if cfg.augment else evaluation
    try:
        train, test = ImageFolder(root / "train", training), ImageFolder(test_dir, evaluation)
    except FileNotFoundError as e:  # no class folders, or no image files in them
        raise DataError(f"dataset image_folder in {root}: {e}") from e
    if train.classes != test.classes:
        raise DataError(f"dataset image_folder in {root}: train/ has classes {train.classes} "
                        f"but {test_dir.name}/ has {test.classes}; the labels are the class "
                        "folders' sorted positions, so both need the same folders")
    return _checked("image_folder", f"dataset=image_folder in {root}", train, test, None)


def _shards(cfg: DictConfig) -> MapDataset:
    """spotring.Shards of dataset.uri (and dataset.test_uri), images decoded and
    normalised by dataset.mean and dataset.std; the shape and the classes from the index.
    Every store problem (out of reach, a shard missing) is a ConfigError here, before
    any process group exists."""
    from spotring.shards import ImageAndLabel, Shards

    if cfg.uri is None:
        raise ConfigError("dataset=shards needs dataset.uri=URI: the training shards' "
                          "s3://bucket/prefix, gs://, az:// or directory (write them with "
                          "`spotring shards write SOURCE URI`)")
    if cfg.cache_limit_gb <= 0:
        raise ConfigError(f"dataset.cache_limit_gb={cfg.cache_limit_gb}: must be positive")

    def shards(key: str) -> Shards:
        return Shards(cfg[key], cache_dir=cfg.cache_dir,
                      cache_limit=int(cfg.cache_limit_gb * 2**30), key=f"dataset.{key}")

    train = shards("uri")
    test = shards("test_uri") if cfg.test_uri else train
    if cfg.test_uri is None:
        log.warning("no dataset.test_uri: evaluating on the training shards %s", cfg.uri)
    channels = (train.index.shape or [0])[0]
    if train.index.classes is None or not channels:
        raise DataError(f"dataset.uri={cfg.uri}: the trainer needs images (.png, .jpg) and "
                        f"labels (.cls) in every sample; its index says "
                        f"{'no labels' if train.index.classes is None else 'no images'}")
    for key in ("mean", "std"):
        if cfg[key] is not None and len(cfg[key]) != channels:
            raise ConfigError(f"dataset.{key}={list(cfg[key])}: the shards' images have "
                              f"{channels} channels; give one value per channel")
    train.decode = test.decode = ImageAndLabel(cfg.mean or [0.5] * channels,
                                               cfg.std or [0.25] * channels)
    return _checked("shards", f"dataset=shards at {cfg.uri}", train, test,
                    train.index.classes)


def _checked(name: str, what: str, train: Any, test: Any,
             num_classes: int | None) -> MapDataset:
    """``train`` and ``test`` as a MapDataset, after checking what they are and their first
    items; ``num_classes``: the config's, where train has no ``classes``."""
    if getattr(train, "classes", None) is not None:
        num_classes = len(train.classes)
    if num_classes is None:
        raise ConfigError(f"{what}: the number of classes is not known: its train Dataset has "
                          "no `classes` (torchvision's datasets have one) and the config no "
                          "dataset.num_classes. Fix: add +dataset.num_classes=N")
    shapes = {}
    for split, data in (("train", train), ("test", test)):
        if not (isinstance(data, torch.utils.data.Dataset) and hasattr(data, "__len__")
                and not isinstance(data, torch.utils.data.IterableDataset)):
            raise ConfigError(f"{what}: its {split} set is {describe(data)}, not a map-style "
                              "torch.utils.data.Dataset (with __len__ and __getitem__)")
        if len(data) == 0:
            raise ConfigError(f"{what}: its {split} set is empty")
        item = data[0]
        if not _is_sample(item):
            raise ConfigError(f"{what}: {split}[0] is {describe(item)}; expected (image, "
                              "label): a float tensor C x H x W and an int")
        if not 0 <= item[1] < num_classes:
            raise ConfigError(f"{what}: {split}[0] has label {int(item[1])}, not one of the "
                              f"{num_classes} classes 0..{num_classes - 1}")
        shapes[split] = tuple(int(n) for n in item[0].shape)
    if shapes["train"] != shapes["test"]:
        raise ConfigError(f"{what}: train[0] is an image of {list(shapes['train'])} but "
                          f"test[0] of {list(shapes['test'])}; the model takes one shape")
    return MapDataset(name, train, test, num_classes, shapes["train"])


def _is_sample(item: Any) -> bool:
    """(float tensor C x H x W, int label); a 0-d integer tensor counts as an int."""
    if not (isinstance(item, tuple | list) and len(item) == 2):
        return False
    image, label = item
    is_int = (isinstance(label, numbers.Integral) and not isinstance(label, bool)) or (
        isinstance(label, torch.Tensor) and label.dim() == 0 and not label.is_floating_point())
    return (isinstance(image, torch.Tensor) and image.is_floating_point() and image.dim() == 3
            and is_int)
