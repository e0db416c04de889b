"""`spotring shards`: write a dataset as shards into a store, or index shards already there.

    spotring shards write mnist s3://bucket/mnist                  # .../train, .../test
    spotring shards write cifar10 gs://bucket/cifar10 --data-root data
    spotring shards write /data/imagenet az://container/imagenet   # ImageFolder: train/, val/
    spotring shards index s3://bucket/laion/part-0                 # shards written elsewhere

SOURCE is mnist or cifar10 (torchvision's files under --data-root; --download fetches
them where online), or an ImageFolder directory (train/ and val/ or test/ of class
folders, or class folders alone), whose image files are copied byte for byte, with their
class's number as .cls. A source with two splits is written to URI/train and URI/test;
the last lines say the trainer's arguments that read them. Exit 0 done, 2 bad input
(named in one paragraph, before anything is written), 1 a failure on the way.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from spotring.exits import EXIT_CONFIG, EXIT_FAILED, EXIT_OK, ConfigError
from spotring.shards.index import BLOCK_SAMPLES, INDEX, ShardError, build
from spotring.shards.writer import SAMPLES_PER_SHARD, write
from spotring.stores import open_store

TORCHVISION = ("mnist", "cifar10")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="spotring shards", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    writing = commands.add_parser("write", help="write a dataset as shards and their index")
    writing.add_argument("source", help="mnist, cifar10, or an ImageFolder directory")
    writing.add_argument("uri", help="where: s3://, gs://, az://, file:// or a directory")
    writing.add_argument("--samples-per-shard", type=int, default=SAMPLES_PER_SHARD)
    writing.add_argument("--block-samples", type=int, default=BLOCK_SAMPLES,
                         help="samples a reader fetches at once (default %(default)s)")
    writing.add_argument("--data-root", default="data", help="where mnist and cifar10 are")
    writing.add_argument("--download", action="store_true",
                         help="let torchvision download mnist or cifar10 where missing")
    writing.add_argument("--overwrite", action="store_true", help="replace shards there")
    indexing = commands.add_parser("index", help="index shards written elsewhere, in place")
    indexing.add_argument("uri")
    indexing.add_argument("--block-samples", type=int, default=BLOCK_SAMPLES)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2), printed by argparse
        return e.code if isinstance(e.code, int) else 0
    try:
        if args.command == "write":
            _write(args)
        else:
            _index(args.uri, args.block_samples)
    except ConfigError as e:
        print(f"spotring shards: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except (ShardError, OSError) as e:
        print(f"spotring shards: failed: {e}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def _write(args: argparse.Namespace) -> None:
    splits = _source(args.source, Path(args.data_root), args.download)
    base = args.uri.rstrip("/")
    uris = {split: f"{base}/{split}" if len(splits) > 1 else base for split in splits}
    for split, dataset in splits.items():
        index = write(dataset, uris[split], samples_per_shard=args.samples_per_shard,
                      block_samples=args.block_samples, overwrite=args.overwrite)
        print(f"{uris[split]}: {sum(index.counts)} samples in {len(index.shards)} shards, "
              f"{sum(s.size for s in index.shards)} bytes")
    test = f" dataset.test_uri={uris['test']}" if "test" in uris else ""
    print(f"train on them: spotring train dataset=shards dataset.uri={uris['train']}{test}")


def _index(uri: str, block_samples: int) -> None:
    from spotring.shards.dataset import progress

    store = open_store(uri, key="URI", paths=True)
    store.check_access()
    index = build(store, block_samples, progress=progress("indexing"))
    store.write(INDEX, index.to_json())
    print(f"{store.location(INDEX)}: {sum(index.counts)} samples in {len(index.shards)} shards")


def _source(source: str, root: Path, download: bool) -> dict[str, Any]:
    """The source's splits by name (train, test): map-style datasets of items that
    writer.sample_files takes."""
    if source in TORCHVISION:
        from torchvision.datasets import CIFAR10, MNIST

        kind = {"mnist": MNIST, "cifar10": CIFAR10}[source]
        try:
            return {split: kind(str(root), train=split == "train", download=download)
                    for split in ("train", "test")}
        except RuntimeError as e:  # torchvision's "Dataset not found or corrupted"
            raise ConfigError(f"{source} is not in {root} ({e}). Fix: --data-root DIR where "
                              f"it is, or --download where online") from e
    folder = Path(source)
    if not folder.is_dir():
        raise ConfigError(f"SOURCE {source}: neither {' nor '.join(TORCHVISION)} nor a "
                          "directory (an ImageFolder: train/ and val/ of class folders)")
    test = next((folder / d for d in ("val", "test") if (folder / d).is_dir()), None)
    if (folder / "train").is_dir() and test is not None:
        return {"train": ImageFiles(folder / "train"), "test": ImageFiles(test)}
    return {"train": ImageFiles(folder)}


class ImageFiles:
    """An ImageFolder's image files as samples: the file's bytes under its extension, and
    its class's number (sorted folder names, as torchvision's ImageFolder numbers them)
    as cls."""

    def __init__(self, folder: Path) -> None:
        from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset

        try:
            self.samples = make_dataset(str(folder), find_classes(str(folder))[1],
                                        IMG_EXTENSIONS)
        except FileNotFoundError as e:  # no class folders, or no images in them
            raise ConfigError(f"SOURCE {folder}: {e}") from e

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, Any]:
        path, label = self.samples[index]
        ext = Path(path).suffix.lower().lstrip(".")
        return {"jpg" if ext == "jpeg" else ext: Path(path).read_bytes(), "cls": label}
