"""spotring.Shards: a map-style Dataset over WebDataset shards in any store, read by
ranged GETs into a bounded cache on the node's disk, in an order that is the same on any
number of workers and reads each rank's share in long runs.

    shards = spotring.Shards("s3://bucket/mnist/train", decode=spotring.shards.ImageAndLabel())
    loader = job.loader(shards, global_batch=256, num_workers=4)

``len(shards)`` is the number of samples, ``shards[i]`` sample i (shard after shard, in
name order) decoded by ``decode``, and ``shards.start_epoch`` gives the order spotring's
DataLoader follows (spotring/shards/order.py): through it, each loader worker learns the
epoch (a few integers in shared memory) and fetches, beside the blocks of the batch in
hand, the block each of its streams reads next, in background threads, so that the
store is waited for only at the start. Every read is counted (GET requests, bytes) per
epoch, in shared memory that the loader workers add to; ``reads()`` gives the counts, and
job.finish puts every rank's in summary.json (``gather_reads``) for the datasets the job
reads (spotring.Job.count_reads: a loader's, made by job.loader or tracked, count).
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import os
import re
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.utils.data

from spotring.exits import ConfigError
from spotring.shards import index as shard_index
from spotring.shards.cache import BlockCache, flock, touch
from spotring.shards.index import IMAGES, INDEX, Index, ShardError, members
from spotring.shards.order import Layout, block_starts, layout
from spotring.stores import Store, open_store, write_atomic

log = logging.getLogger("spotring")

DEFAULT_CACHE_LIMIT = 16 * 2**30  # bytes of blocks kept on a node's disk, per dataset
RETRIES = 3  # tries of a block's read, the first included
FETCH_THREADS = 8  # downloads at once, per process
OPEN_BLOCKS = 256  # block files a process keeps open
_ROWS = 128  # read counters: the main process, then one row per loader worker


def cache_root() -> Path:
    """Where shard blocks are cached by default: $SPOTRING_CACHE_DIR, else the user's
    cache folder (XDG_CACHE_HOME, ~/.cache) /spotring/shards."""
    if found := os.environ.get("SPOTRING_CACHE_DIR"):
        return Path(found)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "spotring" / "shards"


class Shards(torch.utils.data.Dataset):
    """The samples of the shards under ``uri`` (s3://, gs://, az://, file:// or a
    directory's path: spotring.stores), with their index (spotring/shards/index.py).

    decode: sample -> item, where a sample is a dict of the member files' bytes by
        extension ("png", "cls", ...) and "__key__"; None gives the dict itself.
        ``ImageAndLabel()`` decodes images and .cls labels by WebDataset's conventions.
        Must pickle (loader workers may be spawned): a module-level function or class.
    cache_dir: this node's cache (default cache_root()); the dataset's blocks go into a
        folder of their own there, shared by every process of the node that reads them.
    cache_limit: the most bytes of blocks kept there; the least recently used go first.
        It must hold the blocks being read, about two per stream that the node's ranks
        read at once (G / W streams per rank), or blocks are fetched more than once.
    retries: tries of each read (the first included) before a ShardError names the shard.
    key: the option the URI came from, which messages name.

    Made before training: ConfigError (exit 2), naming it, for a store out of reach, a
    listing that cannot be read, a shard of the index missing or changed, shards without
    an index that cannot be indexed. Shards without an index are indexed once by
    streaming each (logged), the index kept in the cache; `spotring shards index URI`
    stores it beside them instead.
    """

    def __init__(self, uri: str, decode: Callable[[dict[str, Any]], Any] | None = None, *,
                 cache_dir: str | os.PathLike | None = None,
                 cache_limit: int = DEFAULT_CACHE_LIMIT, retries: int = RETRIES,
                 key: str = "uri") -> None:
        if retries < 1:
            raise ConfigError(f"retries={retries}: give 1 or more tries per read")
        self.uri, self.decode, self.retries, self.option = uri, decode, retries, key
        store = open_store(uri, key=key, paths=True)
        store.check_access()
        try:
            listing = store.sizes("")
        except Exception as e:  # each client's own errors: refused, unreachable
            raise ConfigError(f"{key}={uri}: the shards cannot be listed "
                              f"({type(e).__name__}: {e}). Check the URI and the "
                              "credentials") from e
        self.where = store.where
        digest = hashlib.sha256(store.where.encode()).hexdigest()[:12]
        slug = re.sub(r"[^A-Za-z0-9._-]+", "-", store.where.rstrip("/").rsplit("/", 1)[-1])
        self.cache_dir = Path(cache_dir or cache_root()) / f"{slug}-{digest}"
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self.index = _index(store, listing, self.cache_dir, key)
        self.index.check(listing, uri)
        self.block_samples = self.index.block_samples
        largest = max((end - start for shard in self.index.shards
                       for start, end in _block_ranges(shard, self.block_samples)), default=0)
        if cache_limit < 2 * largest:
            raise ConfigError(f"cache_limit={cache_limit} bytes cannot hold the blocks being "
                              f"read: {uri}'s blocks are up to {largest} bytes; give at "
                              f"least {2 * largest}, better a few per stream read at once")
        self.cache_limit = cache_limit
        counts = self.index.counts
        self._shard_starts = [0]
        self._block_base = [0]
        for count in counts:
            self._shard_starts.append(self._shard_starts[-1] + count)
            self._block_base.append(self._block_base[-1] - (-count // self.block_samples))
        self._blocks = block_starts(counts, self.block_samples)
        # (seed, epoch, G) of the epoch the loader iterates, -1 before one; and the reads.
        self._plan = torch.full((3,), -1, dtype=torch.long).share_memory_()
        self._counts = torch.zeros(_ROWS, 2, dtype=torch.long).share_memory_()
        self._epoch: int | None = None
        self._reads: dict[int | None, list[int]] = {}
        self._accounted = [0, 0]
        self._local: _Local | None = None

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__ | {"_local": None}

    def __len__(self) -> int:
        return self._shard_starts[-1]

    def key(self, index: int) -> str:
        """The key of sample ``index``."""
        shard, local = self._locate(index)
        return self.index.shards[shard].keys[local]

    def __getitem__(self, index: int) -> Any:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """The decoded samples ``indices`` (torch's DataLoader asks for a micro-batch at
        once): their blocks fetched side by side, and the next block of each stream they
        belong to fetched in the background."""
        here = self._here()
        located = [self._locate(i) for i in indices]
        blocks = [self._block_base[s] + local // self.block_samples for s, local in located]
        wanted = [here.fetch(b) for b in dict.fromkeys(blocks) if b not in here.files]
        if (plan := self._current()) is not None:
            upcoming = set(plan.following[torch.as_tensor(indices)].tolist())
            for block in upcoming - {-1} - here.present:
                here.fetch(block)
        for future in wanted:
            future.result()
        files = {b: here.open(b) for b in dict.fromkeys(blocks)}
        items = []
        for (s, local), b in zip(located, blocks, strict=True):
            shard = self.index.shards[s]
            first = shard.offsets[local - local % self.block_samples]
            start, end = shard.offsets[local], shard.offsets[local + 1]
            data = os.pread(files[b], end - start, start - first)
            sample = members(data, lambda s=shard, k=local: (
                f"{self._location(s)}: sample {s.keys[k]}"))
            items.append(sample if self.decode is None else self.decode(sample))
        return items

    def start_epoch(self, seed: int, epoch: int, global_batch: int) -> torch.Tensor:
        """Begin ``epoch``: from now on this process's reads count for it and the loader
        workers prefetch for it. Returns its order for ``seed`` and a global batch of
        ``global_batch`` samples (spotring.sampler.Order; order.py), which spotring's
        DataLoader follows: it calls this as each epoch's iteration begins."""
        self._account()
        self._epoch = epoch
        self._reads.setdefault(epoch, [0, 0])
        self._plan.copy_(torch.tensor([seed, epoch, global_batch]))
        return self._here().layout(seed, epoch, global_batch).epoch_order()

    def reads(self) -> dict[int | None, tuple[int, int]]:
        """(GET requests, bytes) of block reads by this process and its loader workers,
        per epoch iterated (None: outside any epoch's order, such as evaluation's)."""
        self._account()
        return {epoch: (gets, size) for epoch, (gets, size) in self._reads.items()}

    # ----------------------------------------------------------------------- internals

    def _account(self) -> None:
        total = self._counts.sum(0).tolist()
        delta = [t - a for t, a in zip(total, self._accounted, strict=True)]
        if any(delta):
            counted = self._reads.setdefault(self._epoch, [0, 0])
            counted[0], counted[1] = counted[0] + delta[0], counted[1] + delta[1]
        self._accounted = total

    def _here(self) -> _Local:
        """This process's clients, threads and open files (made again after a fork)."""
        if self._local is None or self._local.pid != os.getpid():
            self._local = _Local(self)
        return self._local

    def _current(self) -> Layout | None:
        seed, epoch, global_batch = self._plan.tolist()
        return None if epoch < 0 else self._here().layout(seed, epoch, global_batch)

    def _locate(self, index: int) -> tuple[int, int]:
        """(shard, sample within it) of sample ``index``."""
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} of {len(self)} in {self.uri}")
        shard = bisect.bisect_right(self._shard_starts, index) - 1
        return shard, index - self._shard_starts[shard]

    def _location(self, shard: shard_index.Shard) -> str:
        return f"{self.where.rstrip('/')}/{shard.name}"

    def _download(self, store: Store, block: int) -> bytes:
        """Block ``block``'s bytes, checked against the index (length, crc32); a read that
        fails, comes back short or differs is tried again, up to ``retries`` in all."""
        shard_number = bisect.bisect_right(self._block_base, block) - 1
        shard = self.index.shards[shard_number]
        number = block - self._block_base[shard_number]
        start, end = shard.block_range(number, self.block_samples)
        problem = ""
        for attempt in range(1, self.retries + 1):
            data = b""
            try:
                data = store.read_range(shard.name, start, end - start)
            except FileNotFoundError as e:
                raise ShardError(f"{self._location(shard)}: the shard is gone from the store "
                                 f"(it was there when the run started): {e}") from e
            except Exception as e:  # the client's: a connection cut, a timeout, a 5xx
                problem = f"{type(e).__name__}: {e}"
            else:
                if len(data) != end - start:
                    problem = f"{len(data)} bytes came, not {end - start}"
                elif zlib.crc32(data) != shard.crc32[number]:
                    problem = "the bytes differ from the index's crc32"
                else:
                    problem = ""
            self._count(len(data))
            if not problem:
                return data
            if attempt < self.retries:
                time.sleep(0.1 * 2 ** attempt)
        raise ShardError(
            f"{self._location(shard)}: bytes {start}..{end} (block {number}) could not be "
            f"read whole in {self.retries} tries; the last: {problem}. A shard that changed "
            f"since it was indexed needs its index again (spotring shards index {self.uri})")

    def _count(self, size: int) -> None:
        info = torch.utils.data.get_worker_info()
        row = 0 if info is None else 1 + info.id % (_ROWS - 1)
        with self._here().counting:
            self._counts[row, 0] += 1
            self._counts[row, 1] += size


class _Local:
    """A process's side of a Shards: its store client, cache, download threads, open
    block files and epoch layouts."""

    def __init__(self, shards: Shards) -> None:
        self.pid, self.shards = os.getpid(), shards
        self.store = open_store(shards.uri, key=shards.option, paths=True)
        self.cache = BlockCache(shards.cache_dir, shards.cache_limit)
        self.threads = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="shards")
        self.lock, self.counting = threading.Lock(), threading.Lock()
        self.pending: dict[int, Future[Path]] = {}
        self.present: set[int] = set()  # fetched by this process (perhaps evicted since)
        self.files: OrderedDict[int, tuple[int, Path]] = OrderedDict()
        self.layouts: dict[tuple[int, int, int], Layout] = {}

    def fetch(self, block: int) -> Future[Path]:
        """The block on disk, as a future: one download at a time per block."""
        with self.lock:
            future = self.pending.get(block)
            if future is None or (future.done() and future.exception() is not None):
                future = self.pending[block] = self.threads.submit(self._get, block)
            return future

    def _get(self, block: int) -> Path:
        shards = self.shards
        shard_number = bisect.bisect_right(shards._block_base, block) - 1
        shard = shards.index.shards[shard_number]
        number = block - shards._block_base[shard_number]
        start, end = shard.block_range(number, shards.block_samples)
        try:
            path = self.cache.get(f"{shard.sha256[:20]}-{number:06d}", end - start,
                                  lambda: shards._download(self.store, block))
            self.present.add(block)
            return path
        finally:
            with self.lock:  # later asks look on disk again: it may be evicted by then
                self.pending.pop(block, None)

    def open(self, block: int) -> int:
        """A file descriptor of the block, fetched first where it is not on disk."""
        if block in self.files:
            self.files.move_to_end(block)
            fd, path = self.files[block]
            touch(path)  # used (an evicted block stays readable while it is open)
            return fd
        while True:
            path = self.fetch(block).result()
            try:
                fd = os.open(path, os.O_RDONLY)
                break
            except FileNotFoundError:  # evicted between its fetch and now
                continue
        self.files[block] = fd, path
        if len(self.files) > OPEN_BLOCKS:
            os.close(self.files.popitem(last=False)[1][0])
        return fd

    def layout(self, seed: int, epoch: int, global_batch: int) -> Layout:
        key = (seed, epoch, global_batch)
        if key not in self.layouts:
            self.layouts = {key: layout(self.shards._blocks, seed, epoch, global_batch)}
        return self.layouts[key]


def _block_ranges(shard: shard_index.Shard, block_samples: int) -> list[tuple[int, int]]:
    return [shard.block_range(n, block_samples)
            for n in range(-(-len(shard.keys) // block_samples))]


def _index(store: Store, listing: dict[str, int], cache_dir: Path, key: str) -> Index:
    """The dataset's index: index.json in the store, else one built here once (kept in the
    cache, under a lock: one process of the node builds it)."""
    if INDEX in listing:
        try:
            data = store.read(INDEX)
        except Exception as e:
            raise ConfigError(f"{key}={store.where}: its {INDEX} cannot be read "
                              f"({type(e).__name__}: {e})") from e
        return Index.from_json(data, store.location(INDEX))
    tars = sorted((n, s) for n, s in listing.items() if n.endswith(".tar"))
    if not tars:
        raise ConfigError(f"{key}={store.where}: no shards there (no *.tar objects, no "
                          f"{INDEX}). Write some with `spotring shards write SOURCE URI`")
    built = cache_dir / f".index-{hashlib.sha256(repr(tars).encode()).hexdigest()[:16]}.json"
    with flock(cache_dir / ".index.lock"):
        if built.exists():
            return Index.from_json(built.read_bytes(), str(built))
        log.warning("%s has no %s: indexing its %d shards once, reading each whole, into %s "
                    "(`spotring shards index %s` stores the index beside them instead)",
                    store.where, INDEX, len(tars), built, store.where)
        try:
            index = shard_index.build(store, progress=progress("indexing"))
        except ShardError as e:
            raise ConfigError(f"{key}={store.where}: cannot index its shards: {e}") from e
        write_atomic(built, index.to_json())
    return index


def progress(what: str) -> Callable[[Any, int], Any]:
    """A progress bar (tqdm, on stderr) for ``what`` is done to each of some items."""
    from tqdm import tqdm

    return lambda items, total: tqdm(items, total=total, desc=what, unit="shard")


class ImageAndLabel:
    """``decode=`` for image classification shards, by WebDataset's conventions: the
    sample's .png, .jpg or .jpeg as a float tensor C x H x W in [0, 1] (normalised by
    ``mean`` and ``std`` per channel where given), and its .cls as an int."""

    def __init__(self, mean: Sequence[float] = (), std: Sequence[float] = ()) -> None:
        self.mean, self.std = list(mean), list(std)
        # x / 255 normalised, as one multiply-add of the uint8 image.
        std_ = torch.tensor(self.std or [1.0]).view(-1, 1, 1)
        self._scale = 1 / (255 * std_)
        self._shift = -torch.tensor(self.mean or [0.0]).view(-1, 1, 1) / std_

    def __call__(self, sample: dict[str, Any]) -> tuple[torch.Tensor, int]:
        ext = next((e for e in IMAGES if e in sample), None)
        if ext is None or "cls" not in sample:
            raise ShardError(f"sample {sample.get('__key__')}: ImageAndLabel needs an image "
                             f"({', '.join(IMAGES)}) and a .cls; it has "
                             f"{', '.join(k for k in sample if k != '__key__')}")
        return torch.addcmul(self._shift, decode_image(sample[ext]), self._scale), int(
            sample["cls"])


def decode_image(data: bytes) -> torch.Tensor:
    """An encoded image (PNG, JPEG, anything Pillow reads) as a uint8 tensor C x H x W:
    one channel for a grey image, else three (RGB)."""
    import io

    import numpy as np
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        pixels = np.asarray(image if image.mode in ("L", "RGB") else image.convert("RGB"))
    tensor = torch.from_numpy(pixels.copy())
    return tensor.unsqueeze(0) if tensor.dim() == 2 else tensor.permute(2, 0, 1)


def gather_reads(job: Any, datasets: Sequence[Any]) -> dict[str, Any]:
    """The reads of ``datasets`` (those that count theirs, as Shards does: ``reads()``,
    ``uri``) on every rank of ``job`` (a spotring.Job), for its summary: {"data_reads":
    [{"dataset", "epoch" (None: outside an epoch's order, e.g. evaluation), "rank",
    "gets", "bytes"}, ...]}, or {} where no rank has any. A collective (two small
    all-reduces) with several ranks: every rank calls it, with its own datasets (the same
    ones on every rank, or nothing is lined up)."""
    if not datasets and job.world_size == 1:
        return {}  # with more ranks, all take part in the collectives: one may have some
    reads = [d.reads() for d in datasets]
    epochs = max((e for r in reads for e in r if e is not None), default=-1) + 1
    shape = torch.zeros(job.world_size, 2)
    shape[job.rank] = torch.tensor([len(datasets), epochs])
    shape = job.all_reduce(shape, "sum").cpu()
    counts, epochs = {int(c) for c in shape[:, 0]}, int(shape[:, 1].max())
    if len(counts) != 1 or not datasets:  # none, or different ones: nothing to line up
        return {}
    table = torch.zeros(len(datasets), epochs + 1, job.world_size, 2, dtype=torch.float64)
    for d, counted in enumerate(reads):
        for epoch, (gets, size) in counted.items():
            table[d, epochs if epoch is None else epoch, job.rank] = torch.tensor(
                [gets, size], dtype=torch.float64)
    table = job.all_reduce(table, "sum").cpu()
    rows = []
    for d, dataset in enumerate(datasets):
        for slot in range(epochs + 1):
            if slot < epochs or table[d, slot].any():
                rows += [{"dataset": dataset.uri, "epoch": None if slot == epochs else slot,
                          "rank": rank, "gets": int(table[d, slot, rank, 0]),
                          "bytes": int(table[d, slot, rank, 1])}
                         for rank in range(job.world_size)]
    return {"data_reads": rows}
