"""Where checkpoint files live: a local directory, and optionally S3.

Both stores hold objects by name, a name being a file of the top level or one inside a
checkpoint's folder ("ckpt-000001200/__0_0.distcp"). S3 shows an object only once its
(multipart) upload completed, so an upload cut off midway leaves nothing a reader can
list; the directory's small objects are written to a temporary file and renamed. Ordering
the writes (every part first, the manifest last; see checkpoint.py) makes a whole
checkpoint complete-or-invisible on top of that. The temporary file of a writer killed
mid-write stays until the directory's next completed write removes it
(DirectoryStore.write), and parts no manifest lists go with the next completed save.

    checkpoint.dir=PATH                     always: rank 0's local copies
    checkpoint.uri=s3://bucket/prefix       also: every checkpoint uploaded, so a new
                                            node can resume after the old one vanished

S3 is reached with boto3's usual configuration: credentials from the environment,
~/.aws or the instance profile, AWS_ENDPOINT_URL for another endpoint (tests use a
moto server on 127.0.0.1).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import re
import secrets
from pathlib import Path
from urllib.parse import urlparse

from spotring.exits import ConfigError

# Large checkpoints go up in parts of this size, several at a time.
PART_BYTES = 16 * 1024 * 1024
# Read in chunks of this size to hash an object.
_CHUNK_BYTES = 4 * 1024 * 1024
# write_atomic's temporary files, beside their object: ".NAME.PID.HEX.tmp".
_TEMPORARY = re.compile(r"^\..+\.\d+\.[0-9a-f]{8}\.tmp$")


class DirectoryStore:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.where = str(self.path)

    def names(self) -> list[str]:
        """The objects: the top level's files, and the files inside its folders (a
        checkpoint's parts, dot files such as DCP's .metadata included) as FOLDER/FILE;
        the top level's dot files (temporary files) are not objects."""
        if not self.path.is_dir():
            return []
        found = []
        for entry in self.path.iterdir():
            if entry.name.startswith("."):
                continue
            if entry.is_dir():
                found += [f"{entry.name}/{f.name}" for f in entry.iterdir() if f.is_file()]
            else:
                found.append(entry.name)
        return found

    def read(self, name: str) -> bytes:
        return (self.path / name).read_bytes()

    def size(self, name: str) -> int:
        return (self.path / name).stat().st_size

    def sizes(self, prefix: str) -> dict[str, int]:
        """The size of each object whose name starts with ``prefix``."""
        return {name: self.size(name) for name in self.names() if name.startswith(prefix)}

    def sha256(self, name: str) -> str:
        with open(self.path / name, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()

    def write(self, name: str, data: bytes) -> None:
        """Write ``name`` whole (write_atomic), then remove the temporary files of writes
        that will never complete (_remove_abandoned)."""
        path = self.path / name
        write_atomic(path, data)
        self._remove_abandoned(path.stat().st_mtime_ns)

    def _remove_abandoned(self, completed_ns: int) -> None:
        """Delete write_atomic's temporary files last modified before ``completed_ns``, the
        time of an object this store has just completed. A writer killed mid-write (SIGKILL,
        a spot instance taken) leaves its temporary file behind, names() never lists it, and
        on a fleet that is killed often the disk would fill with them.

        The rule: a directory has one writer at a time (checkpoint.dir: rank 0 of the run,
        or of the run restarted after it), which completes one write before it begins the
        next; so a temporary file older than an object completed since was begun by a
        writer that is gone. It holds on a directory shared by hosts (NFS, a SLURM job
        requeued on another node), where the pid in the name says nothing of another
        host's processes, and the times are the file server's. A second live writer, which
        this rule does not expect, loses its temporary file: its rename fails loudly, and
        no reader ever sees part of an object."""
        for path in self.path.iterdir():
            if _TEMPORARY.match(path.name):
                with contextlib.suppress(FileNotFoundError):  # gone meanwhile
                    if path.stat().st_mtime_ns < completed_ns:
                        path.unlink()

    def delete(self, name: str) -> None:
        """Remove object ``name``, and its folder once that is empty. Several processes
        may clean one directory at once (the ranks of one host): what another removed
        first is not an error."""
        path = self.path / name
        path.unlink(missing_ok=True)
        if path.parent != self.path:
            with contextlib.suppress(OSError):  # not empty, or gone already
                path.parent.rmdir()

    def location(self, name: str) -> str:
        return str(self.path / name)


class S3Store:
    def __init__(self, uri: str) -> None:
        import boto3
        from boto3.s3.transfer import TransferConfig

        from spotring.aws import retries

        parsed = urlparse(uri)
        if parsed.scheme != "s3" or not parsed.netloc:
            raise ConfigError(f"checkpoint.uri={uri}: expected s3://bucket/prefix")
        self.bucket = parsed.netloc
        self.prefix = parsed.path.strip("/")
        self.where = uri.rstrip("/")
        self.client = boto3.client("s3", config=retries())
        self.transfer = TransferConfig(multipart_threshold=PART_BYTES,
                                       multipart_chunksize=PART_BYTES)

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def check_access(self) -> None:
        """Fail before training, not at the first checkpoint, when S3 is out of reach."""
        import botocore.exceptions

        try:
            self.client.head_bucket(Bucket=self.bucket)
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as e:
            raise ConfigError(
                f"checkpoint.uri={self.where}: cannot reach bucket {self.bucket} ({e}). "
                "Check the bucket name, the AWS credentials (environment, ~/.aws, or the "
                "instance profile) and AWS_ENDPOINT_URL if you use another endpoint.") from e

    def names(self) -> list[str]:
        return list(self.sizes(""))

    def sizes(self, prefix: str) -> dict[str, int]:
        """The size of each object whose name starts with ``prefix``: one listing."""
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self._key(prefix))
        start = len(self._key(""))
        return {obj["Key"][start:]: obj["Size"]
                for page in pages for obj in page.get("Contents", [])}

    def read(self, name: str) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=self._key(name))["Body"].read()

    def size(self, name: str) -> int:
        """The stored object's length, asked of S3 without reading the object."""
        return self.client.head_object(Bucket=self.bucket, Key=self._key(name))["ContentLength"]

    def sha256(self, name: str) -> str:
        """The object's sha256, read as a stream (never whole in memory)."""
        digest = hashlib.sha256()
        body = self.client.get_object(Bucket=self.bucket, Key=self._key(name))["Body"]
        for chunk in body.iter_chunks(_CHUNK_BYTES):
            digest.update(chunk)
        return digest.hexdigest()

    def read_range(self, name: str, start: int, length: int) -> bytes:
        """``length`` bytes of the object from ``start`` (fewer at its end)."""
        if length <= 0:
            return b""
        return self.client.get_object(Bucket=self.bucket, Key=self._key(name),
                                      Range=f"bytes={start}-{start + length - 1}")["Body"].read()

    def write(self, name: str, data: bytes | io.RawIOBase) -> None:
        body = io.BytesIO(data) if isinstance(data, bytes) else data
        # Multipart above PART_BYTES; a failed upload is aborted and never listed.
        self.client.upload_fileobj(body, self.bucket, self._key(name), Config=self.transfer)

    def upload(self, name: str, path: Path) -> None:
        """The file at ``path`` as object ``name``, in parts uploaded side by side."""
        with open(path, "rb") as f:
            self.write(name, f)

    def delete(self, name: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(name))

    def location(self, name: str) -> str:
        return f"s3://{self.bucket}/{self._key(name)}"


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the new one, whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # A name of our own, opened exclusively: unlike mkstemp's 0600, the file gets the
    # permissions of any other file the user writes (the umask's). Keep it a _TEMPORARY.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
