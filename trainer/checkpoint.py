"""Checkpoints: written by rank 0, complete-or-invisible, verified before use.

A checkpoint is two files in ``checkpoint.dir``:

    ckpt-000001200.pt    torch.save of model, optimizer, schedule step, data position
                         (epoch, sample offset), every rank's RNG state and the config
    ckpt-000001200.json  its manifest: sha256 and size of the .pt, step, epoch, model,
                         dataset, world size and global batch

Each file is written to a temporary name, flushed to disk and renamed, the .pt
first and the manifest last: a checkpoint without a manifest does not exist for a
reader, so a crash at any point leaves the previous checkpoint the newest. Before a
checkpoint is used its bytes are checked against the manifest, because torch.load
accepts a file with flipped bytes and returns wrong weights; a truncated or corrupt
one is reported and skipped, and the next older one is tried.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.config import ConfigError

log = logging.getLogger(__name__)

FORMAT = 1
_NAME = re.compile(r"^ckpt-(\d{9})\.json$")


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the new one, whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class Checkpoint:
    """A verified checkpoint: its manifest, and its bytes (not yet unpickled)."""

    path: Path
    manifest: dict[str, Any]
    payload: bytes

    def load(self) -> dict[str, Any]:
        # weights_only: a checkpoint holds tensors and plain containers, nothing to execute.
        return torch.load(io.BytesIO(self.payload), map_location="cpu", weights_only=True)


class CorruptCheckpoint(Exception):
    pass


class Checkpoints:
    """The checkpoints in one directory."""

    def __init__(self, directory: str | Path, keep: int) -> None:
        self.dir = Path(directory)
        self.keep = keep

    def manifests(self) -> list[Path]:
        """Manifest paths, newest (highest step) first."""
        if not self.dir.is_dir():
            return []
        found = [p for p in self.dir.iterdir() if _NAME.match(p.name)]
        return sorted(found, key=lambda p: p.name, reverse=True)

    def save(self, state: dict[str, Any], meta: dict[str, Any]) -> Path:
        """Write ``state`` as the checkpoint of step ``meta['step']``; drop the oldest."""
        step = meta["step"]
        blob = self.dir / f"ckpt-{step:09d}.pt"
        buffer = io.BytesIO()
        torch.save(state, buffer)
        payload = buffer.getvalue()
        write_atomic(blob, payload)
        manifest = {
            "format": FORMAT,
            "file": blob.name,
            "bytes": len(payload),
            "sha256": hashlib.sha256(payload).hexdigest(),
            "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **meta,
        }
        write_atomic(blob.with_suffix(".json"), json.dumps(manifest, indent=1).encode())
        self._drop_old()
        return blob

    def _drop_old(self) -> None:
        kept = self.manifests()[: self.keep]
        keep_files = {p.name for p in kept} | {p.with_suffix(".pt").name for p in kept}
        for path in self.dir.glob("ckpt-*"):
            if path.name not in keep_files:
                path.unlink(missing_ok=True)

    def verify(self, manifest_path: Path) -> Checkpoint:
        """The checkpoint of ``manifest_path`` if its bytes match, else CorruptCheckpoint."""
        try:
            manifest = json.loads(manifest_path.read_text())
            blob = manifest_path.with_name(manifest["file"])
            payload = blob.read_bytes()
        except (OSError, ValueError, KeyError) as e:
            raise CorruptCheckpoint(f"{manifest_path}: unreadable ({e})") from e
        if len(payload) != manifest["bytes"]:
            raise CorruptCheckpoint(
                f"{blob}: truncated, {len(payload)} of {manifest['bytes']} bytes")
        if hashlib.sha256(payload).hexdigest() != manifest["sha256"]:
            raise CorruptCheckpoint(f"{blob}: corrupt, sha256 does not match its manifest")
        return Checkpoint(blob, manifest, payload)

    def newest_valid(self) -> Checkpoint | None:
        for manifest_path in self.manifests():
            try:
                return self.verify(manifest_path)
            except CorruptCheckpoint as e:
                log.warning("skipping checkpoint: %s", e)
        return None


def find_resume(resume: str, checkpoints: Checkpoints) -> Checkpoint | None:
    """What ``resume=auto|never|PATH`` resolves to; the file is verified, not yet loaded."""
    if resume == "never":
        if checkpoints.manifests():
            raise ConfigError(
                f"resume=never, but checkpoint.dir={checkpoints.dir} already holds checkpoints "
                f"(newest: {checkpoints.manifests()[0].stem}); new ones would mix with them. "
                "Pass resume=auto to continue from them, or choose another checkpoint.dir.")
        return None
    if resume == "auto":
        return checkpoints.newest_valid()
    path = Path(resume).expanduser()
    if not path.is_file():
        raise ConfigError(f"resume={resume}: no such checkpoint file")
    manifest_path = path.with_suffix(".json")
    if manifest_path.is_file():
        try:
            return checkpoints.verify(manifest_path)
        except CorruptCheckpoint as e:
            raise ConfigError(f"resume={resume}: {e}") from e
    # A bare .pt (copied without its manifest): usable, but nothing to verify it against.
    log.warning("resume=%s has no manifest beside it; its contents cannot be verified", path)
    return Checkpoint(path, {"file": path.name}, path.read_bytes())


def check_compatible(found: Checkpoint, model_cfg: dict[str, Any], dataset: str) -> None:
    """Refuse a checkpoint of another network or dataset before anything starts."""
    manifest = found.manifest
    if "model" not in manifest:
        return  # a bare file: the state dict load will say what does not fit
    theirs = {k: v for k, v in manifest["model"].items() if k != "l1"}
    ours = {k: v for k, v in model_cfg.items() if k != "l1"}
    if theirs != ours or manifest.get("dataset") != dataset:
        raise ConfigError(
            f"checkpoint {found.path} was written for model {theirs} on dataset "
            f"{manifest.get('dataset')}, but this run has model {ours} on dataset {dataset}. "
            "Use the model it was trained with, resume=never with another checkpoint.dir, "
            "or another checkpoint.")
