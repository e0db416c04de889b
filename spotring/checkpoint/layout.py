"""What a checkpoint is, in any store: its folder of parts and its manifest, their
names, their format, and finding the newest one whose parts are whole. Torch-free: the
launchers, sweeps and benchmarks read it; saving and restoring is spotring/checkpoint/manager.py.

A checkpoint is a folder of parts and a manifest, in the checkpoint directory and (with
checkpoint.uri) in a store every host reaches (spotring/stores/: S3, GCS, Azure Blob, a
shared mount):

    ckpt-000001200/            its parts: each rank's __RANK_0.distcp and DCP's .metadata
                               (spotring/checkpoint/parts.py), and spotring.pt (rank 0: the data
                               position, every rank's RNG state, the gradient scaler)
    ckpt-000001200.json        its manifest: the format number, the size and sha256 of
                               every part, step, epoch, world size, global batch and the
                               job's annotations

This module is the one place that knows those names: whoever else looks for checkpoints
(the launcher bringing a run's newest back, a sweep, the benchmarks) asks it
(``manifests``, ``files_of``, ``folder_name``, ``newest_valid``, ``directory_of``).

The manifest is written last, once every part is written, read back and stored: a
checkpoint without a manifest does not exist for a reader, so a rank killed at any point
of a save leaves the previous checkpoint the newest, and the next save removes what no
manifest lists (``Checkpoints.drop_old``). Before a checkpoint is used its parts are
checked against the manifest, because torch.load accepts a file with flipped bytes and
returns wrong weights: a checkpoint with a part missing, short or corrupt is reported,
naming the part, and skipped for the next older one. resume=auto takes the newest valid
checkpoint of all stores.

Format 1, a single ckpt-NNNNNNNNN.pt beside its manifest (one file of the whole state),
is read too; a manifest of a newer format than FORMAT is refused
(ConfigError, exit 2): this spotring cannot know what it holds, and skipping it would
resume from an older checkpoint.
"""

from __future__ import annotations

import copy
import json
import logging
import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spotring.exits import ConfigError
from spotring.stores import DirectoryStore, Store, open_store, write_atomic

log = logging.getLogger(__name__)

FORMAT = 2  # of the manifest and the parts; a reader refuses a newer one
SINGLE_FILE = 1  # the format of one .pt beside its manifest, still read
EXTRAS = "spotring.pt"  # the part rank 0 writes beside DCP's
_MANIFEST = re.compile(r"^ckpt-(\d{9})\.json$")
_FOLDER, _PREFIX = "ckpt-{step:09d}", "ckpt-"
# Rank 0's note in its run directory of where the run's checkpoints are, for whoever
# finds the run by its directory (a launcher fetching it, a sweep resuming it).
WHERE = "checkpoints.json"


def folder_name(step: int) -> str:
    """The name of step ``step``'s folder of parts, in any store."""
    return _FOLDER.format(step=step)


def manifest_name(step: int) -> str:
    """The name of step ``step``'s manifest, whose presence makes the checkpoint exist."""
    return folder_name(step) + ".json"


def manifests(names: Iterable[str]) -> list[str]:
    """The manifests among a store's (or a directory's) ``names``, newest first."""
    return sorted((n for n in names if _MANIFEST.match(n)), reverse=True)


def files_of(manifest: str) -> tuple[str, str, str]:
    """(manifest, folder, single file): what a checkpoint's manifest names, its folder of
    parts (format 2) or its single .pt (format 1); a store holds one of the two."""
    stem = manifest.removesuffix(".json")
    return manifest, stem, stem + ".pt"


def newest_valid(directory: str | Path, uri: str | None = None) -> Checkpoint | None:
    """The newest checkpoint of ``directory`` (and of the store ``uri`` names) whose parts
    match its manifest, verified here in this one process, not yet loaded; None where
    there is none."""
    return Checkpoints(directory, keep=1, uri=uri).newest_valid()


def note_where(run_dir: str | Path, checkpoints: Checkpoints) -> None:
    """Leave in ``run_dir`` the note of where ``checkpoints`` are (rank 0, at the start)."""
    remote = checkpoints.remote.where if checkpoints.remote is not None else None
    write_atomic(Path(run_dir) / WHERE, json.dumps(
        {"dir": str(Path(checkpoints.local.path).absolute()), "uri": remote}).encode())


def directory_of(run_dir: str | Path, note: str | None = None) -> Path:
    """The checkpoint directory of the run that wrote in ``run_dir``: as its note says
    (checkpoint.dir, wherever it was), else the default, ``run_dir``/checkpoints. ``note``:
    the note's text, read on the host that holds ``run_dir``; default: read it here."""
    try:
        if note is None:
            note = (Path(run_dir) / WHERE).read_text()
        return Path(json.loads(note)["dir"])
    except (OSError, ValueError, KeyError, TypeError):
        return Path(run_dir) / "checkpoints"


class CorruptCheckpoint(Exception):
    """A checkpoint that cannot be used; the message names the part."""


class CheckpointNotSaved(Exception):
    """A store holds other than what a save wrote to it; the message names the object."""


@dataclass
class Checkpoint:
    """A checkpoint found in ``store``: its manifest read, its parts not yet checked.

    location: its folder (or .pt) where a reader finds it; name: its manifest's name in
    the store (None: a bare .pt, no manifest)."""

    location: str
    manifest: dict[str, Any]
    store: Store
    name: str | None

    @property
    def format(self) -> int:
        return int(self.manifest.get("format", SINGLE_FILE))

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    @property
    def folder(self) -> str:
        """Its folder of parts in the store (format 2)."""
        return files_of(self.name or "")[1]

    def parts(self) -> dict[str, dict[str, Any]]:
        """Each part's name in the store: {"bytes", "sha256"} (None: nothing to check it
        against, a bare .pt)."""
        if self.format == SINGLE_FILE:
            return {self.manifest["file"]: {"bytes": self.manifest.get("bytes"),
                                           "sha256": self.manifest.get("sha256")}}
        return {f"{self.folder}/{name}": part for name, part in self.manifest["parts"].items()}

    def problems(self, hashed: Iterable[str] = ()) -> list[str]:
        """What is wrong with it, one line per part naming it: any part missing or of
        another size than its manifest says (every part), or whose sha256 differs (the
        parts in ``hashed``; across the ranks of a restore each hashes its share)."""
        parts = self.parts()
        try:
            sizes = self.store.sizes(self.folder + "/" if self.format != SINGLE_FILE
                                     else next(iter(parts)))
        except Exception as e:  # a store's error, a directory gone: all mean unusable
            return [f"{self.location}: unreadable ({e})"]
        found = []
        for name, part in parts.items():
            where = self.store.location(name)
            if name not in sizes:
                found.append(f"{where}: missing")
            elif part["bytes"] is not None and sizes[name] != part["bytes"]:
                found.append(f"{where}: truncated, {sizes[name]} of {part['bytes']} bytes")
        if found:
            return found
        for name in hashed:
            expected = parts[name]["sha256"]
            if expected is not None and self.store.sha256(name) != expected:
                found.append(f"{self.store.location(name)}: corrupt, sha256 does not match "
                             "its manifest")
        return found

    def verify(self) -> None:
        """Check every part here (CorruptCheckpoint naming them where any is wrong)."""
        if problems := self.problems(self.parts()):
            raise CorruptCheckpoint("; ".join(problems))

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


def manifest_bytes(parts: dict[str, dict[str, Any]], meta: dict[str, Any]) -> bytes:
    """The manifest of a checkpoint of format FORMAT: its ``parts`` (name in its folder ->
    {"bytes", "sha256"}) and ``meta`` (step, world size, position, the job's annotations)."""
    return json.dumps({
        "format": FORMAT,
        "parts": parts,
        "bytes": sum(p["bytes"] for p in parts.values()),
        "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **meta,
    }, indent=1).encode()


@dataclass
class Saved:
    """A checkpoint as it was published (spotring/checkpoint/manager.py): every part written,
    read back and stored by the rank that wrote it, the manifest last.

    location: the checkpoint's folder in the checkpoint directory (or in the uri's store,
    where the ranks do not share a disk); bytes: of all parts; rank_bytes: the most one
    rank wrote; parts: how many; seconds, done_at: per store (its ``where``, local first),
    the slowest rank's seconds from the start of the save to its parts written and read
    back (stored and their size seen, for the uri's store; the manifest's write
    included), and the time.time() by which every rank was done there."""

    location: str
    bytes: int
    rank_bytes: int
    parts: int
    seconds: dict[str, float] = field(default_factory=dict)
    done_at: dict[str, float] = field(default_factory=dict)

    @property
    def complete_at(self) -> float:
        """time.time() once the checkpoint was complete and read back on every store."""
        return max(self.done_at.values())

    def describe(self) -> str:
        """One line, e.g. "205.4 MB in 3 parts (at most 68.5 MB from one rank): DIR in
        0.28 s (733.6 MB/s), gs://b/p in 2.10 s (97.8 MB/s)"; MB are 10^6 bytes, and a
        store's MB/s counts its small requests for the manifest and the read-back too."""
        stores = [f"{where} in {s:.2f} s ({self.bytes / 1e6 / max(s, 1e-9):.1f} MB/s)"
                  for where, s in self.seconds.items()]
        return (f"{self.bytes / 1e6:.1f} MB in {self.parts} parts (at most "
                f"{self.rank_bytes / 1e6:.1f} MB from one rank): " + ", ".join(stores))


class Checkpoints:
    """The checkpoints of a run: each host's checkpoint directory, and the store a uri
    names (spotring.stores.open_store: S3, GCS, Azure Blob, a shared mount), which every
    rank of every host reaches, where one is given; opened, not yet asked anything.

    keep: checkpoints kept in each store. background, sharded: how a job saves them
    (spotring.CheckpointOptions, whose ``open`` makes one). key: where ``uri`` came from,
    which a refusal of it names (ConfigError: a uri without a scheme is refused)."""

    def __init__(self, directory: str | Path, keep: int, uri: str | None = None, *,
                 background: bool = True, sharded: bool | None = None,
                 key: str = "checkpoint.uri") -> None:
        self.local = DirectoryStore(directory)
        self.remote = open_store(uri, key=key) if uri else None
        self.keep, self.background, self.sharded = keep, background, sharded
        self._checked = False

    @property
    def stores(self) -> list[Store]:
        """The directory, then the uri's store where there is one."""
        return [self.local] + ([self.remote] if self.remote else [])

    @property
    def where(self) -> str:
        return " and ".join(store.where for store in self.stores)

    def check_access(self) -> None:
        """Ask the uri's store, once, whether it is in reach with these credentials:
        ConfigError (exit 2) naming it where not."""
        if self.remote is not None and not self._checked:
            self.remote.check_access()
            self._checked = True

    def in_directory(self, directory: str | Path) -> Checkpoints:
        """The same stores with the local copies in ``directory`` (rank 0's, which every
        rank of a job takes: the others' defaults may name a folder of their own)."""
        moved = copy.copy(self)
        moved.local = DirectoryStore(directory)
        return moved

    def manifests(self) -> list[tuple[str, Store]]:
        """(manifest name, store), newest (highest step) first; the directory's first."""
        found = [(name, i, store) for i, store in enumerate(self.stores)
                 for name in manifests(store.names())]
        found.sort(key=lambda f: (f[0], -f[1]), reverse=True)
        return [(name, store) for name, _, store in found]

    def found(self, stores: Sequence[Store] | None = None) -> list[Checkpoint]:
        """Every checkpoint of ``stores`` (default all) whose manifest reads, newest first,
        parts not checked; an unreadable manifest is reported and skipped, one of a newer
        format refused (ConfigError)."""
        checkpoints = []
        for name, store in self.manifests():
            if stores is not None and store not in stores:
                continue
            try:
                manifest = json.loads(store.read(name))
            except Exception as e:  # cut, or gone meanwhile
                log.warning("skipping checkpoint: %s: unreadable (%s)", store.location(name), e)
                continue
            _check_format(manifest, store.location(name))
            checkpoints.append(_checkpoint(name, manifest, store))
        return checkpoints

    def newest_valid(self) -> Checkpoint | None:
        """The newest checkpoint whose every part matches its manifest, all checked here."""
        for checkpoint in self.found():
            try:
                checkpoint.verify()
                return checkpoint
            except CorruptCheckpoint as e:
                log.warning("skipping checkpoint: %s", e)
        return None

    def drop_old(self, store: Store) -> None:
        """Delete what the newest checkpoint.keep manifests of ``store`` do not list: older
        checkpoints, and the parts of saves that never got a manifest."""
        names = store.names()
        keep = set()
        for name in manifests(names)[: self.keep]:
            try:
                checkpoint = _checkpoint(name, json.loads(store.read(name)), store)
            except Exception:  # cut, or removed meanwhile by another host's cleaner
                continue
            keep |= {name, *checkpoint.parts()}
        for name in names:
            if name.startswith(_PREFIX) and name not in keep:
                store.delete(name)


def _checkpoint(name: str, manifest: dict[str, Any], store: Store) -> Checkpoint:
    if int(manifest.get("format", SINGLE_FILE)) == SINGLE_FILE:
        return Checkpoint(store.location(manifest["file"]), manifest, store, name)
    return Checkpoint(store.location(files_of(name)[1]), manifest, store, name)


def _check_format(manifest: dict[str, Any], where: str) -> None:
    written = manifest.get("format")
    if isinstance(written, int) and written > FORMAT:
        raise ConfigError(
            f"checkpoint {where} is in checkpoint format {written}, written by a newer "
            f"spotring; this spotring reads format {FORMAT} and older. Upgrade spotring "
            "(pip install -U spotring) to resume from it, or start anew with resume=never "
            "and another checkpoint directory.")


def find_resume(resume: str, checkpoints: Checkpoints) -> list[Checkpoint]:
    """What ``resume=auto|never|PATH`` names: the checkpoints to try, newest first, their
    manifests read and their parts not yet checked (a restore checks them, all ranks
    together). PATH: a manifest (ckpt-N.json), a checkpoint's folder, or a format-1 .pt."""
    if resume == "never":
        if found := checkpoints.manifests():
            name, store = found[0]
            raise ConfigError(
                f"resume=never, but {store.where} already holds checkpoints (newest: "
                f"{name}); new ones would mix with them. Pass resume=auto to continue from "
                "them, or choose another checkpoint.dir (and checkpoint.uri).")
        return []
    if resume == "auto":
        return checkpoints.found()
    path = Path(resume).expanduser()
    manifest = path.with_suffix(".json") if path.suffix in (".pt", "") else path
    if not path.exists():
        raise ConfigError(f"resume={resume}: no such checkpoint (a ckpt-N.json manifest, "
                          "its folder, or a .pt)")
    store = DirectoryStore(path.parent)
    if manifest.is_file():
        try:
            found = json.loads(manifest.read_text())
        except ValueError as e:
            raise ConfigError(f"resume={resume}: its manifest {manifest} is unreadable "
                              f"({e})") from e
        _check_format(found, str(manifest))
        return [_checkpoint(manifest.name, found, store)]
    if path.suffix != ".pt":
        raise ConfigError(f"resume={resume}: no manifest {manifest} beside it")
    # A bare .pt (copied without its manifest): usable, but nothing to verify it against.
    log.warning("resume=%s has no manifest beside it; its contents cannot be verified", path)
    return [Checkpoint(str(path), {"format": SINGLE_FILE, "file": path.name}, store, None)]
