"""A store under gs://bucket/prefix, through google-cloud-storage (spotring[gcp]).

Credentials come from Google's Application Default Credentials:
GOOGLE_APPLICATION_CREDENTIALS (a service account's key file), `gcloud auth
application-default login`, or the VM's service account from the metadata server.
STORAGE_EMULATOR_HOST points the client at an emulator instead, with anonymous
credentials (the tests' gcp-storage-emulator).

A file of over 8 MB goes up as one resumable upload in chunks of ``part_bytes``, one
after the other (a smaller one in one request): GCS makes the object only when the last
chunk arrives, so an upload cut midway is never listed; its session keeps the bytes
sent, as no object, until it expires a week later. (GCS's XML multipart upload would
send parts side by side, but neither emulator that installs here implements it, so it
could not be tested.) Every call is retried by the library's default policy, for at
most 120 s, with the stores' timeouts per request.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

from spotring.exits import ConfigError
from spotring.stores.base import (
    CHECK_ATTEMPTS,
    CONNECT_TIMEOUT_S,
    READ_TIMEOUT_S,
    BucketStore,
    missing_extra,
)

_TIMEOUT = (CONNECT_TIMEOUT_S, READ_TIMEOUT_S)
# google-api-core bounds retries by time, not by count: check_access's retries stop after
# this many seconds, about CHECK_ATTEMPTS tries (the waits start at 1 s and double).
_CHECK_RETRY_S = float(2 ** (CHECK_ATTEMPTS - 1) - 1)


def _check_retry():
    """The library's default retry policy, bounded for check_access."""
    from google.cloud.storage.retry import DEFAULT_RETRY

    return DEFAULT_RETRY.with_timeout(_CHECK_RETRY_S)


class GCSStore(BucketStore):
    scheme = "gs"

    def __init__(self, uri: str, **kwargs) -> None:
        super().__init__(uri, **kwargs)
        try:
            import google.cloud.storage  # noqa: F401
        except ImportError:
            raise missing_extra(uri, self.key, "gcp", "google-cloud-storage") from None

    @functools.cached_property
    def _bucket(self):
        """The bucket's handle, its client made at first use: finding the default
        credentials may ask the metadata server."""
        from google.auth.exceptions import GoogleAuthError
        from google.cloud import storage

        try:
            # No project: a bucket's objects need none, and finding one may fail.
            return storage.Client(project=None).bucket(self.bucket)
        except GoogleAuthError as e:
            raise ConfigError(
                f"{self.key}={self.where}: no Google Cloud credentials ({e}). Set "
                "GOOGLE_APPLICATION_CREDENTIALS to a service account's key file, run "
                "`gcloud auth application-default login`, or run on a VM with a service "
                "account; STORAGE_EMULATOR_HOST for an emulator.") from e

    def check_access(self) -> None:
        from google.api_core.exceptions import GoogleAPIError
        from google.auth.exceptions import GoogleAuthError
        from requests import RequestException

        try:
            next(iter(self._bucket.list_blobs(prefix=self._key(""), max_results=1,
                                              timeout=_TIMEOUT, retry=_check_retry())), None)
        except (GoogleAPIError, GoogleAuthError, RequestException) as e:
            raise self._unreachable(e, "Check the bucket name, the credentials "
                                    "(GOOGLE_APPLICATION_CREDENTIALS, gcloud's application "
                                    "default login, or the VM's service account) and "
                                    "STORAGE_EMULATOR_HOST if you use an emulator.") from e

    def sizes(self, prefix: str = "") -> dict[str, int]:
        blobs = self._bucket.list_blobs(prefix=self._key(prefix), page_size=self.list_page,
                                        timeout=_TIMEOUT)
        return {self._name(blob.name): blob.size for blob in blobs}

    def size(self, name: str) -> int:
        blob = self._bucket.get_blob(self._key(name), timeout=_TIMEOUT)
        if blob is None:
            raise self._missing(name)
        return blob.size

    def read(self, name: str) -> bytes:
        from google.api_core.exceptions import NotFound

        with self._as_missing(name, NotFound):
            return self._bucket.blob(self._key(name)).download_as_bytes(timeout=_TIMEOUT)

    def read_range(self, name: str, start: int, length: int) -> bytes:
        from google.api_core.exceptions import NotFound, RequestRangeNotSatisfiable

        if length <= 0:
            return b""
        with self._as_missing(name, NotFound):
            try:
                return self._bucket.blob(self._key(name)).download_as_bytes(
                    start=start, end=start + length - 1, checksum=None, timeout=_TIMEOUT)
            except RequestRangeNotSatisfiable:  # from the end on
                return b""

    def write(self, name: str, data: bytes) -> None:
        self._bucket.blob(self._key(name)).upload_from_string(data, timeout=_TIMEOUT)

    def upload(self, name: str, path: str | Path) -> None:
        # A chunk size makes it a resumable upload, sent in chunks of that size.
        blob = self._bucket.blob(self._key(name), chunk_size=self.part_bytes)
        blob.upload_from_filename(str(path), timeout=_TIMEOUT)

    def delete(self, name: str) -> None:
        from google.api_core.exceptions import NotFound

        with contextlib.suppress(NotFound):  # gone already
            self._bucket.blob(self._key(name)).delete(timeout=_TIMEOUT)
