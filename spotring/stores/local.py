"""A store in a directory: a local disk, or a file system every host mounts (NFS).

An object is a file at any depth under the directory, named by its relative path; the
temporary files of writes in progress and hidden folders are not objects. A write goes
to a temporary file beside its object, synced and renamed over it (write_atomic), so a
reader sees the old object or the new one, whole, and a writer killed midway leaves
only its temporary file, which no listing shows. Such a file stays until the next
completed write in its folder removes it (DirectoryStore._remove_abandoned), or the
folder's last object is deleted.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO
from urllib.parse import urlparse
from urllib.request import url2pathname

from spotring.exits import ConfigError
from spotring.stores.base import CHUNK_BYTES, PART_BYTES, Store

# write_atomic's temporary files, beside their object: ".NAME.PID.HEX.tmp".
_TEMPORARY = re.compile(r"^\..+\.\d+\.[0-9a-f]{8}\.tmp$")


class DirectoryStore(Store):
    """The objects under directory ``path``; ``key`` is the option that named it, which
    messages name; an upload copies ``part_bytes`` at a time."""

    def __init__(self, path: str | Path, *, key: str = "checkpoint.dir",
                 part_bytes: int = PART_BYTES) -> None:
        self.path = Path(path)
        self.where = str(self.path)
        self.key, self.part_bytes = key, part_bytes

    @classmethod
    def from_uri(cls, uri: str, *, key: str, part_bytes: int) -> DirectoryStore:
        """``uri``: a path, or file:///path."""
        parsed = urlparse(uri)
        return cls(url2pathname(parsed.path) if parsed.scheme == "file" else uri, key=key,
                   part_bytes=part_bytes)

    def sizes(self, prefix: str = "") -> dict[str, int]:
        # Only the folder the prefix ends in is read, and below it only the entries that
        # start with the prefix's last part: a store rooted in a large directory (a
        # resume=PATH's parent) costs one scan of the checkpoint's folder, not a walk.
        folder, _, start = prefix.rpartition("/")
        found: dict[str, int] = {}
        pending = [(self.path / folder, folder, start)]
        while pending:
            directory, base, start = pending.pop()
            try:
                entries = list(os.scandir(directory))
            except (FileNotFoundError, NotADirectoryError):
                continue  # nothing there yet, or removed meanwhile
            for entry in entries:
                if not entry.name.startswith(start) or _TEMPORARY.match(entry.name):
                    continue
                name = f"{base}/{entry.name}" if base else entry.name
                with contextlib.suppress(FileNotFoundError):  # removed meanwhile
                    if entry.is_dir(follow_symlinks=False):
                        if not entry.name.startswith("."):
                            pending.append((Path(entry.path), name, ""))
                    elif entry.is_file():
                        found[name] = entry.stat().st_size
        return found

    def size(self, name: str) -> int:
        return (self.path / name).stat().st_size

    def read(self, name: str) -> bytes:
        return (self.path / name).read_bytes()

    def read_range(self, name: str, start: int, length: int) -> bytes:
        with open(self.path / name, "rb") as f:
            f.seek(start)
            return f.read(max(length, 0))

    def chunks(self, name: str) -> Iterator[bytes]:
        with open(self.path / name, "rb") as f:
            while chunk := f.read(CHUNK_BYTES):
                yield chunk

    def write(self, name: str, data: bytes) -> None:
        """Write ``name`` whole (write_atomic), then remove the temporary files of writes
        that will never complete (_remove_abandoned)."""
        self._completed(write_atomic(self.path / name, data))

    def upload(self, name: str, path: str | Path) -> None:
        """A copy of the file at ``path``, written as ``write`` writes."""
        # Unbuffered: each read is one system call, after which a signal's handler runs
        # (a buffered read of a pipe loops in C, where a SIGINT waits for its next byte).
        with open(path, "rb", buffering=0) as source:
            self._completed(_replace(self.path / name,
                                     lambda f: shutil.copyfileobj(source, f, self.part_bytes)))

    def _completed(self, path: Path) -> None:
        self._remove_abandoned(path.parent, path.stat().st_mtime_ns)

    @staticmethod
    def _remove_abandoned(folder: Path, completed_ns: int) -> None:
        """Delete the temporary files in ``folder`` last modified before ``completed_ns``,
        the time of an object just completed there. A writer killed mid-write (SIGKILL,
        a spot instance taken) leaves its temporary file behind, no listing shows it,
        and on a fleet that is killed often the disk would fill with them.

        The rule: a folder has one writer at a time (checkpoint.dir: rank 0 of the run,
        or of the run restarted after it), which completes one write before it begins the
        next; so a temporary file older than an object completed since was begun by a
        writer that is gone. It holds on a directory shared by hosts (NFS, a SLURM job
        requeued on another node), where the pid in the name says nothing of another
        host's processes, and the times are the file server's. A second live writer, which
        this rule does not expect, loses its temporary file: its rename fails loudly, and
        no reader ever sees part of an object."""
        for path in folder.iterdir():
            if _TEMPORARY.match(path.name):
                with contextlib.suppress(FileNotFoundError):  # gone meanwhile
                    if path.stat().st_mtime_ns < completed_ns:
                        path.unlink()

    def delete(self, name: str) -> None:
        """Remove object ``name``, and each folder above it that this leaves with no
        object (the temporary files of writes abandoned there with it). Several
        processes may clean one directory at once (the ranks of one host): what another
        removed first is not an error."""
        path = self.path / name
        path.unlink(missing_ok=True)
        folder = path.parent
        while folder != self.path and folder.is_relative_to(self.path):
            try:
                left = list(folder.iterdir())
            except FileNotFoundError:  # removed by another cleaner
                return
            if any(not _TEMPORARY.match(p.name) for p in left):
                return
            for temporary in left:
                temporary.unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # a write begun meanwhile, or gone already
                folder.rmdir()
            folder = folder.parent

    def location(self, name: str) -> str:
        return str(self.path / name)

    def check_access(self) -> None:
        """The directory lists, or, where it does not exist yet, the nearest folder above
        it that does is one this user can create it in."""
        nearest = self.path
        while not nearest.exists() and nearest != nearest.parent:
            nearest = nearest.parent
        try:
            if nearest == self.path:
                os.scandir(self.path).close()
            elif not nearest.is_dir() or not os.access(nearest, os.W_OK | os.X_OK):
                raise PermissionError(f"cannot create a folder in {nearest}")
        except OSError as e:
            raise ConfigError(f"{self.key}={self.where}: not a directory this user can "
                              f"list or create ({e}). Give a writable directory.") from e


def write_atomic(path: Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` so that readers see the old file or the new one, whole;
    returns ``path``."""
    return _replace(path, lambda f: f.write(data))


def _replace(path: Path, fill: Callable[[BinaryIO], object]) -> Path:
    """Replace ``path`` by a file ``fill`` writes, through a temporary file beside it:
    synced, renamed over ``path``, the folder synced; on any failure removed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # A name of our own, opened exclusively: unlike mkstemp's 0600, the file gets the
    # permissions of any other file the user writes (the umask's). Keep it a _TEMPORARY.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "xb") as f:
            fill(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
