"""What every store gives: the contract of spotring.stores, and what the bucket stores
(S3, GCS, Azure Blob) share.

A store holds objects by name under its root (a directory, or a bucket's prefix): a
name is a relative path with "/" between its parts ("ckpt-000001200/__0_0.distcp",
"train/shard-000017.tar"). Every method names the object in its errors: a missing one
raises FileNotFoundError with its location, whatever the client library's own error.
"""

from __future__ import annotations

import abc
import contextlib
import functools
import hashlib
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

from spotring.exits import ConfigError

# Large files go up in parts of this size, several at a time (S3's multipart upload,
# Azure's blocks; GCS's resumable upload sends them one after the other).
PART_BYTES = 16 * 1024 * 1024
# A local file, or an S3 object's stream, is read in chunks of this size to hash it.
CHUNK_BYTES = 4 * 1024 * 1024
# Parts of one upload in flight at once (S3's multipart upload, Azure's blocks).
PARALLEL_PARTS = 8
# Every request of a bucket store: seconds to connect, and to wait for the next bytes of
# an answer. A store that stops answering fails the call, after the client's bounded
# retries, rather than hang.
CONNECT_TIMEOUT_S = 10
READ_TIMEOUT_S = 60
# check_access's attempts in all, the first included: the probe at init is answered in
# seconds, so that an endpoint nothing listens on is reported at once, not after the
# minutes of retries a save gets.
CHECK_ATTEMPTS = 3


class Store(abc.ABC):
    """The objects under one root. ``where`` is the root as a user names it (a path, or
    s3://bucket/prefix), ``location(name)`` one object's full name there.

    Writes are complete or invisible: ``write`` and ``upload`` show the object to a
    lister, ``sizes`` and ``names``, only once all of it is stored; one cut midway (the
    process killed, the connection lost) shows nothing."""

    where: str

    @classmethod
    def from_uri(cls, uri: str, *, key: str, part_bytes: int) -> Store:
        """The store of ``uri`` (spotring.stores.open_store's call): ``key`` the option
        it came from, ``part_bytes`` the size of an upload's parts."""
        return cls(uri, key=key, part_bytes=part_bytes)

    @abc.abstractmethod
    def sizes(self, prefix: str = "") -> dict[str, int]:
        """Name -> size in bytes of every object whose name starts with ``prefix``, at any
        depth (all the pages of the listing)."""

    def names(self) -> list[str]:
        """Every object's name."""
        return list(self.sizes(""))

    @abc.abstractmethod
    def size(self, name: str) -> int:
        """The stored object's length, without reading it."""

    @abc.abstractmethod
    def read(self, name: str) -> bytes:
        """The whole object (a small one: a manifest, a journal)."""

    @abc.abstractmethod
    def read_range(self, name: str, start: int, length: int) -> bytes:
        """``length`` bytes of the object from ``start``: fewer at its end, none from
        its end on."""

    @abc.abstractmethod
    def chunks(self, name: str) -> Iterator[bytes]:
        """The object from start to end, in chunks of a few MB: never whole in memory."""

    def sha256(self, name: str) -> str:
        """The object's sha256 (hex), read as a stream."""
        digest = hashlib.sha256()
        for chunk in self.chunks(name):
            digest.update(chunk)
        return digest.hexdigest()

    @abc.abstractmethod
    def write(self, name: str, data: bytes) -> None:
        """Store ``data`` as ``name`` (replacing it) in one request: small objects."""

    @abc.abstractmethod
    def upload(self, name: str, path: str | Path) -> None:
        """Store the file at ``path`` as ``name`` (replacing it), in parts of
        ``part_bytes`` where the store takes parts: a large file, such as a rank's part of
        a checkpoint, from the process that wrote it."""

    @abc.abstractmethod
    def delete(self, name: str) -> None:
        """Remove ``name``; one already gone is not an error (another host's cleaner)."""

    @abc.abstractmethod
    def location(self, name: str) -> str:
        """``name``'s full name, as a user would look it up."""

    @abc.abstractmethod
    def check_access(self) -> None:
        """Raise ConfigError, naming the store and what to check, where it cannot be
        listed: unreachable, no such bucket, credentials missing or refused. Called at
        init, so that a run fails before training rather than at its first save."""


class BucketStore(Store):
    """A store under ``scheme://bucket/prefix``: what S3, GCS and Azure Blob share.
    ``key`` is the option the URI came from, which messages name ("checkpoint.uri").
    Pickled as its URI (a client holds connections, which do not pickle): the process
    that unpickles it builds its own client."""

    scheme: str  # "s3", "gs", "az"
    bucket_word = "bucket"  # Azure says "container"
    list_page = 1000  # objects a listing asks for per request (each cloud's own most)

    def __init__(self, uri: str, *, key: str = "checkpoint.uri",
                 part_bytes: int = PART_BYTES) -> None:
        parsed = urlparse(uri)
        if parsed.scheme != self.scheme or not parsed.netloc:
            raise ConfigError(f"{key}={uri}: expected {self.scheme}://{self.bucket_word}"
                              "/prefix")
        self.uri, self.key, self.part_bytes = uri, key, part_bytes
        self.bucket = parsed.netloc
        self.prefix = parsed.path.strip("/")
        self.where = uri.rstrip("/")

    def __reduce__(self):
        return functools.partial(type(self), key=self.key, part_bytes=self.part_bytes), (
            self.uri,)

    def _key(self, name: str) -> str:
        """The object's key in the bucket."""
        return f"{self.prefix}/{name}" if self.prefix else name

    def _name(self, key: str) -> str:
        """The object's name under the prefix: _key's inverse."""
        return key[len(self._key("")):]

    def location(self, name: str) -> str:
        return f"{self.scheme}://{self.bucket}/{self._key(name)}"

    def chunks(self, name: str) -> Iterator[bytes]:
        """The object as ranged reads of ``part_bytes``, one request each."""
        start = 0
        while True:
            chunk = self.read_range(name, start, self.part_bytes)
            if chunk:
                yield chunk
            if len(chunk) < self.part_bytes:  # the last
                return
            start += len(chunk)

    @contextlib.contextmanager
    def _as_missing(self, name: str, *kinds: type[BaseException]) -> Iterator[None]:
        """The client's errors of ``kinds`` (its "no such object") raised as
        FileNotFoundError naming the object."""
        try:
            yield
        except kinds as e:
            raise self._missing(name) from e

    def _missing(self, name: str) -> FileNotFoundError:
        return FileNotFoundError(f"{self.location(name)}: no such object")

    def _unreachable(self, error: BaseException, check: str) -> ConfigError:
        """check_access's refusal: the store, the client's error (its code where it has
        one, and its first line: some carry the service's whole answer), what to check."""
        code = getattr(error, "error_code", None)  # Azure's, a str or an enum of them
        code = getattr(code, "value", code)
        detail = (str(error).splitlines() or [""])[0]
        return ConfigError(f"{self.key}={self.where}: cannot reach {self.bucket_word} "
                           f"{self.bucket} ({type(error).__name__}: "
                           f"{f'{code}: ' if code else ''}{detail}). {check}")


def missing_extra(uri: str, key: str, extra: str, package: str) -> ConfigError:
    """The refusal of a store whose client library is not installed."""
    return ConfigError(f"{key}={uri} needs {package} (not installed): "
                       f"pip install 'spotring[{extra}]'")
