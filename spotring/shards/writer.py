"""Writing shards: any map-style dataset into WebDataset tar shards and their index, in any
store, with progress.

    spotring.shards.write(dataset, "s3://bucket/mnist/train", samples_per_shard=5000)

Sample i gets the key of its index, zero-padded (000123), so the keys sort as the
dataset does; its files follow from the item (``sample_files``): (image, label) pairs
become ``KEY.png`` and ``KEY.cls``, a dict is written as it is. Each shard is built in a
temporary file, indexed (spotring/shards/index.py) and uploaded; index.json goes last,
so a reader sees the whole dataset or none of it. The tar headers carry no time, owner
or mode of this machine: the same data writes the same bytes.
"""

from __future__ import annotations

import io
import tarfile
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from spotring.exits import ConfigError
from spotring.shards.index import BLOCK_SAMPLES, INDEX, Index, assemble, index_file, shard_names
from spotring.stores import open_store

SAMPLES_PER_SHARD = 1000


def write(dataset: Any, uri: str, *, samples_per_shard: int = SAMPLES_PER_SHARD,
          block_samples: int = BLOCK_SAMPLES, prefix: str = "shard", overwrite: bool = False,
          progress: bool = True, key: str = "uri") -> Index:
    """Write ``dataset`` (len and [i]; items as ``sample_files`` takes them) to the store at
    ``uri`` as shards of ``samples_per_shard`` samples named PREFIX-000000.tar..., blocks
    of ``block_samples`` (the unit a reader fetches: spotring/shards/order.py), and
    index.json; returns the index. ConfigError (exit 2), before anything is written,
    for bad sizes or a URI that already holds shards (``overwrite``: replace them; the
    old index goes first, so no reader mixes old and new)."""
    for name, value in (("samples_per_shard", samples_per_shard),
                        ("block_samples", block_samples)):
        if value < 1:
            raise ConfigError(f"{name}={value}: give 1 or more samples")
    store = open_store(uri, key=key, paths=True)
    store.check_access()
    existing = store.sizes("")
    old = [n for n in existing if n == INDEX or n.endswith(".tar")]
    if old and not overwrite:
        raise ConfigError(f"{key}={uri} already holds shards ({', '.join(sorted(old)[:3])}"
                          f"{', ...' if len(old) > 3 else ''}): write elsewhere, or replace "
                          "them (overwrite=True, --overwrite)")
    if INDEX in existing:
        store.delete(INDEX)
    total = len(dataset)
    width = max(6, len(str(total - 1)))
    entries = []
    with tempfile.TemporaryDirectory() as folder, _bar(total, uri, progress) as bar:
        for first in range(0, total, samples_per_shard):
            path = Path(folder) / f"{prefix}-{first // samples_per_shard:06d}.tar"
            with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
                for i in range(first, min(total, first + samples_per_shard)):
                    for ext, data in sample_files(dataset[i]).items():
                        info = tarfile.TarInfo(f"{i:0{width}d}.{ext}")
                        info.size, info.mode = len(data), 0o644
                        tar.addfile(info, io.BytesIO(data))
                    bar.update()
            entries.append(index_file(path, path.name, block_samples))
            store.upload(path.name, path)
            path.unlink()
    written = {shard.name for shard, _, _ in entries}
    for stale in shard_names(existing):
        if stale not in written:
            store.delete(stale)
    index = assemble(entries, block_samples)
    store.write(INDEX, index.to_json())
    return index


def sample_files(item: Any) -> dict[str, bytes]:
    """One item's files by extension: an (image, label) pair gives png and cls (the
    image a PIL image or a uint8 or [0, 1] float tensor, C x H x W or H x W; the label an
    int); a mapping gives its own (bytes as they are, str as UTF-8, an int as its digits,
    an image under png as above)."""
    if isinstance(item, Mapping):
        return {ext: _encoded(ext, value) for ext, value in item.items()}
    if isinstance(item, tuple | list) and len(item) == 2:
        return {"png": _encoded("png", item[0]), "cls": _encoded("cls", item[1])}
    raise TypeError(f"a sample to write is (image, label) or a dict of files by extension, "
                    f"not {type(item).__name__}")


def _encoded(ext: str, value: Any) -> bytes:
    if isinstance(value, bytes | bytearray):
        return bytes(value)
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, int) or (isinstance(value, torch.Tensor) and value.dim() == 0):
        return str(int(value)).encode()
    if ext == "png":
        from PIL import Image

        if not isinstance(value, Image.Image):  # a tensor C x H x W or H x W
            image = value if value.dim() == 3 else value.unsqueeze(0)
            if image.is_floating_point():
                image = (image.clamp(0, 1) * 255).round()
            pixels = image.to(torch.uint8).permute(1, 2, 0).numpy()
            value = Image.fromarray(pixels[:, :, 0] if pixels.shape[2] == 1 else pixels)
        out = io.BytesIO()
        value.save(out, "PNG")
        return out.getvalue()
    raise TypeError(f"cannot write a {type(value).__name__} as .{ext}: give bytes")


def _bar(total: int, uri: str, progress: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=f"writing {uri}", unit="sample", disable=not progress)
