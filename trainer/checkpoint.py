"""Checkpoints: written by rank 0, complete-or-invisible, verified before use.

A checkpoint is two objects, in checkpoint.dir and (with checkpoint.uri) in S3:

    ckpt-000001200.pt    torch.save of model, optimizer, schedule step, data position
                         (epoch, sample offset), every rank's RNG state and the config
    ckpt-000001200.json  its manifest: sha256 and size of the .pt, step, epoch, model,
                         dataset, world size and global batch

Each store makes each object complete-or-invisible (stores.py), and the .pt is
written before its manifest: a checkpoint without a manifest does not exist for a
reader, so a crash or a cut upload at any point leaves the previous checkpoint the
newest. Before a checkpoint is used its bytes are checked against the manifest,
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

from trainer.config import ConfigError
from trainer.stores import DirectoryStore, S3Store

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

    def save(self, state: dict[str, Any], meta: dict[str, Any]) -> str:
        """Write ``state`` as the checkpoint of step ``meta['step']`` to every store;
        drop the oldest beyond checkpoint.keep. Returns where the local copy is."""
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
        for store in self.stores:
            store.write(blob, payload)
            store.write(_manifest_name(blob), manifest)
            self._drop_old(store)
        return self.local.location(blob)

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
