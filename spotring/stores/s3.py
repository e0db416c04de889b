"""A store under s3://bucket/prefix, through boto3 (a dependency of spotring itself).

Credentials and endpoint come from boto3's usual chain: the environment
(AWS_ACCESS_KEY_ID..., AWS_PROFILE), ~/.aws, the instance profile; AWS_ENDPOINT_URL for
another endpoint (MinIO, GCS's S3 interoperability, the tests' moto server). Retries are
botocore's adaptive mode (spotring/stores/aws.py).

A large file goes up as a multipart upload, PART_BYTES a part, several parts at once;
S3 shows the object only once the upload completes, so one cut midway is never listed.
A failed upload is aborted by boto3, which deletes its parts; one whose process was
killed leaves its parts stored, and billed, but unlisted until the bucket's lifecycle
rule AbortIncompleteMultipartUpload removes them (set one: docs/api.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from spotring.stores.base import (
    CHECK_ATTEMPTS,
    CHUNK_BYTES,
    CONNECT_TIMEOUT_S,
    PARALLEL_PARTS,
    READ_TIMEOUT_S,
    BucketStore,
)

# S3's error codes for a missing object (HEAD has no body, so only its status), and for a
# range that starts at or past the object's end.
_MISSING = ("404", "NoSuchKey", "NotFound")
_PAST_THE_END = "InvalidRange"


class S3Store(BucketStore):
    scheme = "s3"

    def __init__(self, uri: str, **kwargs) -> None:
        import boto3
        from boto3.s3.transfer import TransferConfig

        super().__init__(uri, **kwargs)
        self.client = boto3.client("s3", config=_config())
        self.transfer = TransferConfig(multipart_threshold=self.part_bytes,
                                       multipart_chunksize=self.part_bytes,
                                       max_concurrency=PARALLEL_PARTS)

    def check_access(self) -> None:
        import boto3
        import botocore.exceptions

        client = boto3.client("s3", config=_config(CHECK_ATTEMPTS))
        try:
            client.head_bucket(Bucket=self.bucket)
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as e:
            raise self._unreachable(e, "Check the bucket name, the AWS credentials "
                                    "(environment, ~/.aws, or the instance profile) and "
                                    "AWS_ENDPOINT_URL if you use another endpoint.") from e

    def sizes(self, prefix: str = "") -> dict[str, int]:
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self._key(prefix),
            PaginationConfig={"PageSize": self.list_page})
        return {self._name(obj["Key"]): obj["Size"]
                for page in pages for obj in page.get("Contents", [])}

    def size(self, name: str) -> int:
        with self._errors(name):
            return self.client.head_object(Bucket=self.bucket,
                                           Key=self._key(name))["ContentLength"]

    def read(self, name: str) -> bytes:
        with self._errors(name):
            return self.client.get_object(Bucket=self.bucket, Key=self._key(name))["Body"].read()

    def read_range(self, name: str, start: int, length: int) -> bytes:
        if length <= 0:
            return b""
        data = b""
        with self._errors(name, past_the_end=True):
            data = self.client.get_object(
                Bucket=self.bucket, Key=self._key(name),
                Range=f"bytes={start}-{start + length - 1}")["Body"].read()
        return data

    def chunks(self, name: str) -> Iterator[bytes]:
        with self._errors(name):
            body = self.client.get_object(Bucket=self.bucket, Key=self._key(name))["Body"]
        yield from body.iter_chunks(CHUNK_BYTES)

    def write(self, name: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._key(name), Body=data)

    def upload(self, name: str, path: str | Path) -> None:
        # Multipart above part_bytes, parts side by side; a failed upload is aborted.
        self.client.upload_file(str(path), self.bucket, self._key(name), Config=self.transfer)

    def delete(self, name: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(name))

    @contextlib.contextmanager
    def _errors(self, name: str, past_the_end: bool = False) -> Iterator[None]:
        """The call's errors in the store's terms: a missing object is FileNotFoundError
        naming it; with ``past_the_end``, a range from the object's end on is no error
        (the caller's result stays empty)."""
        import botocore.exceptions

        try:
            yield
        except botocore.exceptions.ClientError as e:
            code = e.response.get("Error", {}).get("Code")
            if code in _MISSING:
                raise self._missing(name) from e
            if not (past_the_end and code == _PAST_THE_END):
                raise


def _config(attempts: int | None = None):
    """botocore's config of a client: spotring's retries (``attempts`` in all, where
    given) and the stores' timeouts."""
    from botocore.config import Config

    from spotring.stores.aws import retries

    config = retries().merge(Config(connect_timeout=CONNECT_TIMEOUT_S,
                                    read_timeout=READ_TIMEOUT_S))
    if attempts is not None:
        config = config.merge(Config(retries={"total_max_attempts": attempts}))
    return config
