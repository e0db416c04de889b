"""Datasets in object storage, streamed in shards, with the same samples at any world size
(docs/streaming.md).

    import spotring

    shards = spotring.Shards("s3://bucket/mnist/train", decode=spotring.shards.ImageAndLabel())
    loader = job.loader(shards, global_batch=256, num_workers=4)

    spotring.shards.write(my_dataset, "gs://bucket/mine")          # or: spotring shards write

    index.py    WebDataset's tar shards and spotring's index.json beside them
    order.py    the epoch's order: blocks permuted, cut into G streams (one per place of
                the global batch), a function of (seed, epoch, shards, G) alone
    cache.py    blocks on the node's disk: bounded, least recently used out, one download
    dataset.py  Shards: the map-style Dataset, its ranged GETs, prefetch and counters
    writer.py   any map-style dataset into shards and an index, in any store
    command.py  `spotring shards write|index`
"""

from spotring.cli import Command

# What this package adds to the `spotring` command (spotring/cli.py).
COMMANDS = {
    "shards": Command("spotring.shards.command:main",
                      "write a dataset as shards into a store (s3, gs, az, a directory), "
                      "or index shards there"),
}


def __getattr__(name: str) -> object:
    """The package's API, imported on first use (importing the package for its COMMANDS
    loads neither torch nor a store's client)."""
    import importlib

    where = {"Shards": "dataset", "ImageAndLabel": "dataset", "gather_reads": "dataset",
             "write": "writer", "ShardError": "index"}
    if name not in where:
        raise AttributeError(f"module 'spotring.shards' has no attribute {name!r}")
    return getattr(importlib.import_module(f"spotring.shards.{where[name]}"), name)
