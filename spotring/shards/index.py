"""The shards of a dataset and their index: WebDataset's tar format, and spotring's
index.json beside the shards.

A dataset is every ``*.tar`` object under a store's prefix (its URI), in name order; a
sample is the tar members that share a key, the member name up to the first dot of its
last path component (``000123.png`` and ``000123.cls``: sample ``000123``, files ``png``
and ``cls``), as WebDataset reads them. Its members must follow each other.

``index.json`` (written last, by `spotring shards write` or `spotring shards index`) says,
for each shard: its name, size and sha256; each sample's key and byte offset (a sample
runs from its first member's header to the next sample's; the last entry is where the
last sample ends); and the crc32 of each block of ``block_samples`` consecutive samples,
the unit of reading (spotring/shards/order.py). A reader fetches any run of samples of
a shard with one ranged GET and checks the bytes against the crc; the sha256 keys the
local cache, so a shard written again is never served from an old copy. ``classes``
(the largest ``.cls`` label + 1) and ``shape`` (of the first image) are what a trainer
needs to build its model.

Shards written elsewhere (img2dataset, WebDataset's ShardWriter, `tar`) need no
conversion: `build` streams each once to index it.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
import tempfile
import zlib
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from spotring.exits import ConfigError
from spotring.stores import Store

INDEX = "index.json"
FORMAT = "spotring.shards/1"
BLOCK_SAMPLES = 64  # samples per block where the index's writer chose none
IMAGES = ("png", "jpg", "jpeg")
_TAR_BLOCK = 512


class ShardError(RuntimeError):
    """A shard that cannot be read as its index says, after the retries: named."""


@dataclass
class Shard:
    """One shard's entry of the index (see the module docstring)."""

    name: str
    size: int
    sha256: str
    keys: list[str]
    offsets: list[int]  # len(keys) + 1
    crc32: list[int]  # per block

    def block_range(self, block: int, block_samples: int) -> tuple[int, int]:
        """Byte range [start, end) of the shard's block number ``block``."""
        first = block * block_samples
        return self.offsets[first], self.offsets[min(first + block_samples, len(self.keys))]


@dataclass
class Index:
    block_samples: int
    shards: list[Shard]
    classes: int | None = None
    shape: list[int] | None = None
    format: str = field(default=FORMAT)

    @property
    def counts(self) -> list[int]:
        return [len(s.keys) for s in self.shards]

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Index:
        try:
            raw = json.loads(data)
            if raw.get("format") != FORMAT:
                raise ValueError(f"format {raw.get('format')!r}, not {FORMAT!r}")
            raw["shards"] = [Shard(**s) for s in raw["shards"]]
            return cls(**raw)
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise ConfigError(f"{where} is not an index of spotring's shards ({e}). Fix: "
                              "write it again with `spotring shards index URI`") from e

    def check(self, listing: dict[str, int], where: str) -> None:
        """ConfigError (exit 2) where the store's ``listing`` (name -> size) lacks an
        indexed shard, holds one of another size (changed since it was indexed), or holds
        a shard the index does not know: named, with what to do."""
        rebuild = f"Fix: index the shards again: spotring shards index {where}"
        for shard in self.shards:
            if shard.name not in listing:
                raise ConfigError(f"dataset {where}: shard {shard.name} is in its index but "
                                  "not in the store (deleted, or the prefix is wrong). "
                                  f"{rebuild}, or put the shard back")
            if listing[shard.name] != shard.size:
                raise ConfigError(f"dataset {where}: shard {shard.name} is "
                                  f"{listing[shard.name]} bytes, its index says {shard.size}: "
                                  f"it changed since it was indexed. {rebuild}")
        extra = sorted(set(shard_names(listing)) - {s.name for s in self.shards})
        if extra:
            raise ConfigError(f"dataset {where}: {len(extra)} shards are not in its index "
                              f"({', '.join(extra[:3])}{', ...' if len(extra) > 3 else ''}). "
                              f"{rebuild}")


def shard_names(listing: Iterable[str]) -> list[str]:
    """The dataset's shards among a prefix's objects, in order."""
    return sorted(name for name in listing if name.endswith(".tar"))


def split_name(name: str) -> tuple[str, str]:
    """A member's (key, extension): WebDataset's split at the first dot of the last path
    component."""
    folder, _, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), ext


def members(data: bytes, where: Callable[[], str]) -> dict[str, bytes]:
    """The files of one sample's tar bytes (``data``: from its first header to the next
    sample's, already checked against the index's crc32), extension -> bytes, with
    "__key__". ShardError naming ``where()`` for bytes that are not tar headers."""
    files: dict[str, bytes] = {}
    position, long_name = 0, None
    while position + _TAR_BLOCK <= len(data):
        header = data[position:position + _TAR_BLOCK]
        if not header.strip(b"\0"):  # the end-of-archive blocks
            break
        try:
            name, size, kind = _header(header)
        except ValueError as e:
            raise ShardError(f"{where()}: not a tar header at byte {position} ({e})") from e
        start = position + _TAR_BLOCK
        body = data[start:start + size]
        position = start + -(-size // _TAR_BLOCK) * _TAR_BLOCK
        if kind == tarfile.XHDTYPE:  # pax: "LEN key=value\n" records
            for record in body.decode("utf-8", "surrogateescape").splitlines():
                key, _, value = record.partition(" ")[2].partition("=")
                if key == "path":
                    long_name = value
        elif kind == tarfile.GNUTYPE_LONGNAME:
            long_name = body.rstrip(b"\0").decode("utf-8", "surrogateescape")
        else:
            name, long_name = long_name or name, None
            if kind in tarfile.REGULAR_TYPES:
                key, ext = split_name(name)
                files["__key__"] = key
                files[ext] = body
    return files


def _header(header: bytes) -> tuple[str, int, bytes]:
    """(name, size, type) of a 512-byte tar header, read as tarfile writes them (ustar,
    GNU, pax): a few slices, where tarfile's TarInfo.frombuf parses every field."""
    name = header[:100].split(b"\0", 1)[0]
    if header[257:263] == b"ustar\0" and header[345] != 0:  # POSIX: a prefix field
        name = header[345:500].split(b"\0", 1)[0] + b"/" + name
    field = header[124:136]
    if field[0] & 0x80:  # GNU's base-256 for sizes of 8 GiB and more
        size = int.from_bytes(field[1:], "big")
    else:
        size = int(field.split(b"\0", 1)[0].strip() or b"0", 8)
    return name.decode("utf-8", "surrogateescape"), size, header[156:157]


def index_file(path: Path, name: str, block_samples: int) -> tuple[Shard, int | None,
                                                                   list[int] | None]:
    """The index entry of the shard in the local file ``path``, stored as ``name``; with
    the largest .cls label in it (None: none) and the shape of its first image (None: no
    image). ShardError naming the shard where it does not read as a tar of samples."""
    keys, offsets, seen, largest, shape = [], [], set(), None, None
    end = 0
    try:
        with tarfile.open(path, "r:") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                key, ext = split_name(member.name)
                if not keys or keys[-1] != key:
                    if key in seen:
                        raise ShardError(f"{name}: the members of sample {key} are not together")
                    seen.add(key)
                    keys.append(key)
                    offsets.append(member.offset)
                end = member.offset_data + -(-member.size // _TAR_BLOCK) * _TAR_BLOCK
                if ext == "cls":
                    label = int(tar.extractfile(member).read())
                    largest = label if largest is None else max(largest, label)
                elif shape is None and ext in IMAGES:
                    shape = image_shape(tar.extractfile(member).read())
    except (tarfile.TarError, ValueError, OSError) as e:
        raise ShardError(f"{name}: not a readable tar of samples ({e})") from e
    offsets.append(end)
    digest, crcs = hashlib.sha256(), []
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
        for first in range(0, len(keys), block_samples):
            start = offsets[first]
            f.seek(start)
            crcs.append(zlib.crc32(f.read(offsets[min(first + block_samples, len(keys))] - start)))
    shard = Shard(name, path.stat().st_size, digest.hexdigest(), keys, offsets, crcs)
    return shard, largest, shape


def image_shape(data: bytes) -> list[int]:
    """[C, H, W] of an encoded image."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        return [len(image.getbands()), image.height, image.width]


def assemble(entries: list[tuple[Shard, int | None, list[int] | None]],
             block_samples: int) -> Index:
    """The index of shards indexed one by one (index_file's results), in name order."""
    labels = [largest for _, largest, _ in entries if largest is not None]
    shape = next((s for _, _, s in entries if s is not None), None)
    return Index(block_samples, sorted((s for s, _, _ in entries), key=lambda s: s.name),
                 max(labels) + 1 if labels else None, shape)


def build(store: Store, block_samples: int = BLOCK_SAMPLES, *, tries: int = 3,
          progress: Callable[[Iterable[Any], int], Iterable[Any]] = lambda it, total: it
          ) -> Index:
    """Index every shard of ``store`` by streaming it once to a temporary file: for shards
    written without spotring. A shard that does not read as a tar (corrupt, or its read
    cut) is read again, ``tries`` times in all, then ShardError names it. ``progress``
    wraps the iteration over the shards (a tqdm)."""
    names = shard_names(store.sizes(""))
    if not names:
        raise ConfigError(f"dataset {store.where}: no shards (*.tar objects) there")
    entries = []
    for name in progress(names, len(names)):
        for attempt in range(1, tries + 1):
            try:
                entries.append(_streamed(store, name, block_samples))
                break
            except FileNotFoundError as e:
                raise ShardError(f"{store.location(name)}: gone while indexing ({e})") from e
            except Exception as e:  # a cut read, a corrupt tar: the client's or tarfile's
                if attempt == tries:
                    raise ShardError(f"{store.location(name)}: not indexed after {tries} "
                                     f"tries; the last: {type(e).__name__}: {e}") from e
    return assemble(entries, block_samples)


def _streamed(store: Store, name: str, block_samples: int
              ) -> tuple[Shard, int | None, list[int] | None]:
    with tempfile.NamedTemporaryFile(suffix=".tar") as spool:
        for chunk in store.chunks(name):
            spool.write(chunk)
        spool.flush()
        return index_file(Path(spool.name), name, block_samples)
