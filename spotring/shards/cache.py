"""Blocks of shards on this node's disk, at most ``limit`` bytes, shared by every process
of the node that reads the same dataset (the DataLoader workers of a rank, the ranks).

A block is a file named by its content (the shard's sha256 from the index, the block's
number), so a process started again on the node finds what the last one fetched, and a
shard written again, which has another sha256, is never served from an old copy.

- One download per block: a process that wants a block not yet there takes the block's
  lock (one of LOCK_STRIPES lock files, by the block's name, held with flock and, within
  the process, a thread lock), looks again, and only then downloads; the others wait on
  the lock and then find the file.
- The bound: before a download, under the folder's eviction lock, the blocks least
  recently used are deleted until the blocks there, the downloads in flight and this one
  fit in ``limit``; the download's temporary file is created at its full size there, so
  that every process counts it. Every use of a block marks it used (its mtime). The
  folder is scanned only when its running total (the file .usage, kept under the same
  lock, never below the truth) says the new block may not fit.
- A temporary file whose process is gone (killed mid-download) is deleted by the next
  eviction. A reader that holds a block open keeps reading it after another process
  evicted it (POSIX keeps the inode until it is closed).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

log = logging.getLogger("spotring")

LOCK_STRIPES = 64
_EVICTION_LOCK = ".eviction.lock"
_USAGE = ".usage"
_LOCKS = ".locks"


class BlockCache:
    """The blocks under ``folder`` (created), at most ``limit`` bytes in all. Safe in
    threads and across processes; make one per process (its thread locks are this
    process's: a forked copy may hold one its parent's thread held)."""

    def __init__(self, folder: Path, limit: int) -> None:
        self.folder, self.limit = folder, limit
        (folder / _LOCKS).mkdir(parents=True, exist_ok=True)
        self._stripes = [threading.Lock() for _ in range(LOCK_STRIPES)]
        self._eviction = threading.Lock()
        self._warned = False

    def path(self, name: str) -> Path:
        return self.folder / name

    def get(self, name: str, size: int, download: Callable[[], bytes]) -> Path:
        """The block ``name`` of ``size`` bytes on disk, downloaded (``download()``) if it
        is not there yet, once for all the processes that ask at the same time; marked
        used. Whatever ``download`` raises goes to the caller, and nothing is left."""
        path = self.path(name)
        if touch(path):
            return path
        with self._locked(name):
            if touch(path):  # another process downloaded it while this one waited
                return path
            temporary = self._reserve(name, size)
            try:
                data = download()
                with open(temporary, "r+b") as f:
                    f.write(data)
                with self._counted():  # a scan of the folder never sees it half renamed
                    os.replace(temporary, path)
            except BaseException:
                temporary.unlink(missing_ok=True)
                raise
        return path

    def used(self) -> int:
        """Bytes in the cache now: blocks and downloads in flight."""
        return sum(size for _, size, _ in self._entries())

    @contextlib.contextmanager
    def _locked(self, name: str) -> Iterator[None]:
        stripe = zlib.crc32(name.encode()) % LOCK_STRIPES
        with self._stripes[stripe], flock(self.folder / _LOCKS / str(stripe)):
            yield

    def _reserve(self, name: str, size: int) -> Path:
        """Make room for ``size`` bytes (evicting the least recently used blocks), and the
        download's temporary file, at that size."""
        with self._counted():
            usage = self.folder / _USAGE
            total = int(usage.read_text() or 0) if usage.exists() else self.limit
            if total + size > self.limit:  # perhaps: count, and evict what must go
                entries = self._entries()
                total = sum(s for _, s, _ in entries)
                for path, block_size, _ in sorted((e for e in entries if e[2] is not None),
                                                  key=lambda e: e[2]):
                    if total + size <= self.limit:
                        break
                    path.unlink(missing_ok=True)
                    total -= block_size
            if total + size > self.limit and not self._warned:
                self._warned = True
                log.warning("the shard cache %s holds %d bytes in downloads under way, over "
                            "its cache_limit of %d bytes with this block: raise cache_limit",
                            self.folder, total + size, self.limit)
            temporary = self.folder / f".{name}.{os.getpid()}.{threading.get_ident()}.tmp"
            with open(temporary, "wb") as f:
                f.truncate(size)
            usage.write_text(str(total + size))
        return temporary

    @contextlib.contextmanager
    def _counted(self) -> Iterator[None]:
        """The folder's lock for what changes its count: reserving (and evicting),
        and renaming a download to its block, which a scan running meanwhile could
        miss (a directory listing is not atomic)."""
        with self._eviction, flock(self.folder / _EVICTION_LOCK):
            yield

    def _entries(self) -> list[tuple[Path, int, float | None]]:
        """(path, size, last use) of every block, and of every download in flight (last
        use None); the temporary files of processes that are gone are deleted."""
        entries = []
        for entry in os.scandir(self.folder):
            with contextlib.suppress(FileNotFoundError):  # evicted meanwhile
                if not entry.is_file() or entry.name.startswith(".eviction"):
                    continue
                stat = entry.stat()
                if not entry.name.startswith("."):
                    entries.append((Path(entry.path), stat.st_size, stat.st_mtime))
                elif entry.name.endswith(".tmp"):
                    if _alive(int(entry.name.rsplit(".", 3)[-3])):
                        entries.append((Path(entry.path), stat.st_size, None))
                    else:
                        os.unlink(entry.path)
        return entries


def touch(path: Path) -> bool:
    """Mark ``path`` used now; False where it is not there."""
    try:
        os.utime(path)
    except FileNotFoundError:
        return False
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


@contextlib.contextmanager
def flock(path: Path) -> Iterator[None]:
    """An exclusive flock on ``path`` (created) until the block ends."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
