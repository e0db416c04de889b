"""Checkpoints: written by rank 0, complete-or-invisible, verified before use.

A checkpoint is two objects, in checkpoint.dir and (with checkpoint.uri) in S3:

    ckpt-000001200.pt    torch.save of model, optimizer, schedule step, data position
                         (epoch, sample offset), every rank's RNG state and the config
    ckpt-000001200.json  its manifest: sha256 and size of the .pt, step, epoch, model,
                         dataset, world size and global batch

Each store makes each object complete-or-invisible (stores.py), and the .pt is
written before its manifest: a checkpoint without a manifest does not exist for a
reader, so a crash or a cut upload at any point leaves the previous checkpoint the
newest. A save reads back what a reader will find (the .pt's stored size before the
manifest goes up, then the manifest itself), so a checkpoint save() returned is on
every store. Before a checkpoint is used its bytes are checked against the manifest,
because torch.load accepts a file with flipped bytes and returns wrong weights; a
truncated or corrupt one is reported and skipped, and the next older one is tried.
resume=auto takes the newest valid checkpoint of all stores.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from spotring.exits import ConfigError
from spotring.stores import DirectoryStore, S3Store

log = logging.getLogger(__name__)

FORMAT = 1
_MANIFEST = re.compile(r"^ckpt-(\d{9})\.json$")

Store = DirectoryStore | S3Store


@dataclass
class Checkpoint:
    """A verified checkpoint: its manifest, and its bytes (not yet unpickled)."""

    location: str
    manifest: dict[str, Any]
    payload: bytes

    def load(self) -> dict[str, Any]:
        # weights_only: a checkpoint holds tensors and plain containers, nothing to execute.
        return torch.load(io.BytesIO(self.payload), map_location="cpu", weights_only=True)


class CorruptCheckpoint(Exception):
    pass


class CheckpointNotSaved(Exception):
    """A store holds other than what a save wrote to it; the message names the object."""


@dataclass
class Saved:
    """A checkpoint as Checkpoints.save left it: complete and read back on every store."""

    location: str  # the local copy
    bytes: int  # the .pt's size
    serialise_seconds: float  # torch.save and sha256, before any store
    # Per store (its `where`, in the order written: local first): seconds to write the
    # .pt and its manifest and read them back, and time.time() once that was done.
    seconds: dict[str, float]
    done_at: dict[str, float]

    @property
    def complete_at(self) -> float:
        """time.time() once the checkpoint was complete and read back on every store."""
        return max(self.done_at.values())

    def describe(self) -> str:
        """One line, e.g. "205.4 MB: serialised in 0.61 s, DIR in 0.28 s (733.6 MB/s),
        s3://b/p in 2.10 s (97.8 MB/s)"; MB are 10^6 bytes, and a store's MB/s counts its
        small requests for the manifest and the read-back too."""
        stores = [f"{where} in {s:.2f} s ({self.bytes / 1e6 / max(s, 1e-9):.1f} MB/s)"
                  for where, s in self.seconds.items()]
        return (f"{self.bytes / 1e6:.1f} MB: serialised in {self.serialise_seconds:.2f} s, "
                + ", ".join(stores))


class Checkpoints:
    """The checkpoints of a run: rank 0's directory, and S3 when a uri is given."""

    def __init__(self, directory: str | Path, keep: int, uri: str | None = None) -> None:
        self.local = DirectoryStore(directory)
        self.remote = S3Store(uri) if uri else None
        self.stores: list[Store] = [self.local] + ([self.remote] if self.remote else [])
        self.keep = keep

    @property
    def where(self) -> str:
        return " and ".join(store.where for store in self.stores)

    def manifests(self) -> list[tuple[str, Store]]:
        """(manifest name, store), newest (highest step) first; local before S3."""
        found = [(name, i, store) for i, store in enumerate(self.stores)
                 for name in store.names() if _MANIFEST.match(name)]
        found.sort(key=lambda f: (f[0], -f[1]), reverse=True)
        return [(name, store) for name, _, store in found]

    def save(self, state: dict[str, Any], meta: dict[str, Any]) -> Saved:
        """Write ``state`` as the checkpoint of step ``meta['step']`` to every store, one
        after the other, local first; then drop the oldest beyond checkpoint.keep.
        Raises CheckpointNotSaved, naming the object, when a store holds other than what
        was written (a .pt stored short gets no manifest), and whatever a store raises;
        either way the checkpoints before are all kept."""
        started = time.perf_counter()
        blob = f"ckpt-{meta['step']:09d}.pt"
        buffer = io.BytesIO()
        torch.save(state, buffer)
        payload = buffer.getvalue()
        manifest = json.dumps({
            "format": FORMAT,
            "file": blob,
            "bytes": len(payload),
            "sha256": hashlib.sha256(payload).hexdigest(),
            "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **meta,
        }, indent=1).encode()
        serialised = time.perf_counter() - started
        seconds, done_at = {}, {}
        for store in self.stores:
            started = time.perf_counter()
            _put(store, blob, payload, manifest)
            seconds[store.where], done_at[store.where] = time.perf_counter() - started, time.time()
        for store in self.stores:
            self._drop_old(store)
        return Saved(self.local.location(blob), len(payload), serialised, seconds, done_at)

    def _drop_old(self, store: Store) -> None:
        kept = sorted((n for n in store.names() if _MANIFEST.match(n)), reverse=True)
        kept = kept[: self.keep]
        keep = set(kept) | {n.replace(".json", ".pt") for n in kept}
        for name in store.names():
            if name.startswith("ckpt-") and name not in keep:
                store.delete(name)

    def verify(self, manifest_name: str, store: Store) -> Checkpoint:
        """The checkpoint of a manifest if its bytes match, else CorruptCheckpoint."""
        where = store.location(manifest_name)
        try:
            manifest = json.loads(store.read(manifest_name))
            blob = manifest["file"]
            payload = store.read(blob)
        except Exception as e:  # missing object, bad JSON, S3 errors: all mean unusable
            raise CorruptCheckpoint(f"{where}: unreadable ({e})") from e
        location = store.location(blob)
        if len(payload) != manifest["bytes"]:
            raise CorruptCheckpoint(
                f"{location}: truncated, {len(payload)} of {manifest['bytes']} bytes")
        if hashlib.sha256(payload).hexdigest() != manifest["sha256"]:
            raise CorruptCheckpoint(f"{location}: corrupt, sha256 does not match its manifest")
        return Checkpoint(location, manifest, payload)

    def newest_valid(self) -> Checkpoint | None:
        for name, store in self.manifests():
            try:
                return self.verify(name, store)
            except CorruptCheckpoint as e:
                log.warning("skipping checkpoint: %s", e)
        return None


def _manifest_name(blob: str) -> str:
    return blob.removesuffix(".pt") + ".json"


def _put(store: Store, blob: str, payload: bytes, manifest: bytes) -> None:
    """Write a checkpoint to ``store`` and read back what a reader will find: the .pt's
    stored size before its manifest goes up, so that a short .pt never gets one, then the
    manifest as written. The sha256 is checked where a checkpoint is used (verify):
    reading the .pt back here would double the time a spot notice leaves for the upload."""
    store.write(blob, payload)
    if (stored := store.size(blob)) != len(payload):
        raise CheckpointNotSaved(
            f"{store.location(blob)}: {stored} bytes stored of the {len(payload)} written")
    name = _manifest_name(blob)
    store.write(name, manifest)
    if store.read(name) != manifest:
        raise CheckpointNotSaved(f"{store.location(name)}: reads back other than written")


def find_resume(resume: str, checkpoints: Checkpoints) -> Checkpoint | None:
    """What ``resume=auto|never|PATH`` resolves to; the file is verified, not yet loaded."""
    if resume == "never":
        if found := checkpoints.manifests():
            name, store = found[0]
            raise ConfigError(
                f"resume=never, but {store.where} already holds checkpoints (newest: "
                f"{name}); new ones would mix with them. Pass resume=auto to continue from "
                "them, or choose another checkpoint.dir (and checkpoint.uri).")
        return None
    if resume == "auto":
        return checkpoints.newest_valid()
    path = Path(resume).expanduser()
    if not path.is_file():
        raise ConfigError(f"resume={resume}: no such checkpoint file")
    if path.with_suffix(".json").is_file():
        try:
            return checkpoints.verify(path.with_suffix(".json").name,
                                      DirectoryStore(path.parent))
        except CorruptCheckpoint as e:
            raise ConfigError(f"resume={resume}: {e}") from e
    # A bare .pt (copied without its manifest): usable, but nothing to verify it against.
    log.warning("resume=%s has no manifest beside it; its contents cannot be verified", path)
    return Checkpoint(str(path), {"file": path.name}, path.read_bytes())


def check_compatible(found: Checkpoint, model_cfg: dict[str, Any], dataset: str) -> None:
    """Refuse a checkpoint of another network or dataset before anything starts."""
    manifest = found.manifest
    if "model" not in manifest:
        return  # a bare file: the state dict load will say what does not fit
    theirs = {k: v for k, v in manifest["model"].items() if k != "l1"}
    ours = {k: v for k, v in model_cfg.items() if k != "l1"}
    if theirs != ours or manifest.get("dataset") != dataset:
        raise ConfigError(
            f"checkpoint {found.location} was written for model {theirs} on dataset "
            f"{manifest.get('dataset')}, but this run has model {ours} on dataset {dataset}. "
            "Use the model it was trained with, resume=never with another checkpoint.dir, "
            "or another checkpoint.")
