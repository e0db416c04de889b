"""Checkpoints: written by rank 0, complete-or-invisible, verified before use.

A checkpoint is two objects, in checkpoint.dir and (with checkpoint.uri) in S3:

    ckpt-000001200.pt    torch.save of the tracked state (model, optimizer, data
                         position...), every rank's RNG state and the gradient scaler
    ckpt-000001200.json  its manifest: the format number, sha256 and size of the .pt,
                         step, epoch, world size, global batch and the job's annotations

This module is the one place that knows those names: whoever else looks for checkpoints
(the launcher bringing a run's newest back, a sweep, the benchmarks) asks it
(``manifests``, ``files_of``, ``payload_name``, ``newest_valid``).

Each store makes each object complete-or-invisible (stores.py), and the .pt is
written before its manifest: a checkpoint without a manifest does not exist for a
reader, so a crash or a cut upload at any point leaves the previous checkpoint the
newest. A save reads back what a reader will find (the .pt's stored size before the
manifest goes up, then the manifest itself), so a checkpoint save() returned is on
every store. Before a checkpoint is used its bytes are checked against the manifest,
because torch.load accepts a file with flipped bytes and returns wrong weights; a
truncated or corrupt one is reported and skipped, and the next older one is tried.
resume=auto takes the newest valid checkpoint of all stores.

A manifest of a newer format than FORMAT is refused (ConfigError, exit 2): this spotring
cannot know what it holds, and skipping it would resume from an older checkpoint.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spotring.exits import ConfigError
from spotring.stores import DirectoryStore, S3Store

log = logging.getLogger(__name__)

FORMAT = 1  # of the manifest and the .pt; a reader refuses a newer one
_MANIFEST = re.compile(r"^ckpt-(\d{9})\.json$")
_PAYLOAD, _PREFIX = "ckpt-{step:09d}.pt", "ckpt-"


def payload_name(step: int) -> str:
    """The name of step ``step``'s checkpoint file (the .pt), in any store."""
    return _PAYLOAD.format(step=step)


def manifest_name(step: int) -> str:
    """The name of step ``step``'s manifest, whose presence makes the checkpoint exist."""
    return _manifest_name(payload_name(step))


def manifests(names: Iterable[str]) -> list[str]:
    """The manifests among a store's (or a directory's) ``names``, newest first."""
    return sorted((n for n in names if _MANIFEST.match(n)), reverse=True)


def files_of(manifest: str) -> tuple[str, str]:
    """(manifest, .pt): the two objects of the checkpoint a manifest names."""
    return manifest, manifest.removesuffix(".json") + ".pt"


def newest_valid(directory: str | Path, uri: str | None = None) -> Checkpoint | None:
    """The newest checkpoint of ``directory`` (and of S3 ``uri``) whose bytes match its
    manifest, verified, not yet loaded; None where there is none."""
    return Checkpoints(directory, keep=1, uri=uri).newest_valid()

Store = DirectoryStore | S3Store


@dataclass
class Checkpoint:
    """A verified checkpoint: its manifest, and its bytes (not yet unpickled)."""

    location: str
    manifest: dict[str, Any]
    payload: bytes

    def load(self) -> dict[str, Any]:
        import torch  # here, not at the top: launchers read the layout without torch

        # weights_only: a checkpoint holds tensors and plain containers, nothing to execute.
        return torch.load(io.BytesIO(self.payload), map_location="cpu", weights_only=True)

    def check_matches(self, annotations: dict[str, Any]) -> None:
        """Refuse (ConfigError) a checkpoint whose manifest gives any of ``annotations``
        (Job.annotate's fields: what the run trains) another value; a field the manifest
        lacks (a bare .pt, an older run) is not checked."""
        differ = {key: (self.manifest[key], value) for key, value in annotations.items()
                  if key in self.manifest and self.manifest[key] != value}
        if differ:
            lines = "; ".join(f"{key}: {theirs} there, {ours} here"
                              for key, (theirs, ours) in differ.items())
            raise ConfigError(
                f"checkpoint {self.location} was written for another run ({lines}). Use the "
                "settings it was trained with, resume=never with another checkpoint "
                "directory, or another checkpoint.")


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
                 for name in manifests(store.names())]
        found.sort(key=lambda f: (f[0], -f[1]), reverse=True)
        return [(name, store) for name, _, store in found]

    def save(self, state: dict[str, Any], meta: dict[str, Any]) -> Saved:
        """Write ``state`` as the checkpoint of step ``meta['step']`` to every store, one
        after the other, local first; then drop the oldest beyond checkpoint.keep.
        Raises CheckpointNotSaved, naming the object, when a store holds other than what
        was written (a .pt stored short gets no manifest), and whatever a store raises;
        either way the checkpoints before are all kept."""
        started = time.perf_counter()
        blob = payload_name(meta["step"])
        buffer = io.BytesIO()
        import torch

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
        keep = {name for manifest in manifests(store.names())[: self.keep]
                for name in files_of(manifest)}
        for name in store.names():
            if name.startswith(_PREFIX) and name not in keep:
                store.delete(name)

    def verify(self, manifest_name: str, store: Store) -> Checkpoint:
        """The checkpoint of a manifest if its bytes match, else CorruptCheckpoint."""
        where = store.location(manifest_name)
        try:
            manifest = json.loads(store.read(manifest_name))
            _check_format(manifest, where)
            blob = manifest["file"]
            payload = store.read(blob)
        except ConfigError:
            raise
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


def _check_format(manifest: dict[str, Any], where: str) -> None:
    written = manifest.get("format")
    if isinstance(written, int) and written > FORMAT:
        raise ConfigError(
            f"checkpoint {where} is in checkpoint format {written}, written by a newer "
            f"spotring; this spotring reads format {FORMAT} and older. Upgrade spotring "
            "(pip install -U spotring) to resume from it, or start anew with resume=never "
            "and another checkpoint directory.")


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
