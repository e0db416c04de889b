"""A store under az://container/prefix, through azure-storage-blob and azure-identity
(spotring[azure]).

The account and its credentials, as adlfs and the Azure CLI take them:
AZURE_STORAGE_CONNECTION_STRING names the account, its key or SAS and its endpoint (the
tests' Azurite too); else the account is AZURE_STORAGE_ACCOUNT_NAME (adlfs's name) or
AZURE_STORAGE_ACCOUNT (the Azure CLI's), reached at https://ACCOUNT.blob.core.windows.net
with azure-identity's DefaultAzureCredential: a service principal's AZURE_CLIENT_ID,
AZURE_TENANT_ID and AZURE_CLIENT_SECRET, workload identity, the VM's managed identity,
or `az login`.

A large file goes up as blocks of ``part_bytes``, several at once, committed by one
Put Block List at the end: the blob exists only then, so an upload cut midway is never
listed. Its uncommitted blocks cannot be deleted alone; Azure discards them once a week
has passed with no block written to that blob.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from spotring.exits import ConfigError
from spotring.stores.base import (
    CHECK_ATTEMPTS,
    CONNECT_TIMEOUT_S,
    PARALLEL_PARTS,
    READ_TIMEOUT_S,
    BucketStore,
    missing_extra,
)

CONNECTION_STRING = "AZURE_STORAGE_CONNECTION_STRING"
ACCOUNT_NAMES = ("AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT")
# Azure's answer to a range that starts at or past the blob's end.
_PAST_THE_END = 416


class AzureStore(BucketStore):
    scheme = "az"
    bucket_word = "container"

    def __init__(self, uri: str, **kwargs) -> None:
        super().__init__(uri, **kwargs)
        try:
            import azure.identity  # noqa: F401
            import azure.storage.blob  # noqa: F401
        except ImportError:
            raise missing_extra(uri, self.key, "azure",
                                "azure-storage-blob and azure-identity") from None
        # The SDK logs every request and answer at INFO: left to the user where set.
        http_log = logging.getLogger("azure.core.pipeline.policies.http_logging_policy")
        if http_log.level == logging.NOTSET:
            http_log.setLevel(logging.WARNING)

    def _container(self, **retry):
        """A client of the container; ``retry``: azure-storage-blob's ExponentialRetry
        settings, where not its defaults (3 retries, 15 s and more apart)."""
        from azure.storage.blob import BlobServiceClient, ExponentialRetry

        options = {"max_block_size": self.part_bytes, "max_single_put_size": self.part_bytes,
                   "connection_timeout": CONNECT_TIMEOUT_S, "read_timeout": READ_TIMEOUT_S,
                   "retry_policy": ExponentialRetry(**retry)}
        if connection := os.environ.get(CONNECTION_STRING):
            service = BlobServiceClient.from_connection_string(connection, **options)
        else:
            from azure.identity import DefaultAzureCredential

            account = next((os.environ[n] for n in ACCOUNT_NAMES if os.environ.get(n)), None)
            if account is None:
                raise ConfigError(
                    f"{self.key}={self.where}: no Azure storage account named. Set "
                    f"{CONNECTION_STRING}, or {' or '.join(ACCOUNT_NAMES)} with credentials "
                    "DefaultAzureCredential finds (a service principal's AZURE_CLIENT_ID, "
                    "AZURE_TENANT_ID and AZURE_CLIENT_SECRET, a managed identity, az login).")
            service = BlobServiceClient(f"https://{account}.blob.core.windows.net",
                                        credential=DefaultAzureCredential(), **options)
        return service.get_container_client(self.bucket)

    @functools.cached_property
    def _client(self):
        return self._container()

    def check_access(self) -> None:
        from azure.core.exceptions import AzureError

        client = self._container(retry_total=CHECK_ATTEMPTS - 1, initial_backoff=1,
                                 increment_base=1, random_jitter_range=1)
        try:
            next(iter(client.list_blobs(name_starts_with=self._key(""),
                                        results_per_page=1)), None)
        except AzureError as e:
            raise self._unreachable(e, f"Check the container name, the account and its "
                                    f"credentials ({CONNECTION_STRING}, or "
                                    f"{' or '.join(ACCOUNT_NAMES)} with a credential "
                                    "DefaultAzureCredential finds).") from e

    def sizes(self, prefix: str = "") -> dict[str, int]:
        blobs = self._client.list_blobs(name_starts_with=self._key(prefix),
                                        results_per_page=self.list_page)
        return {self._name(blob.name): blob.size for blob in blobs}

    def size(self, name: str) -> int:
        from azure.core.exceptions import ResourceNotFoundError

        with self._as_missing(name, ResourceNotFoundError):
            return self._client.get_blob_client(self._key(name)).get_blob_properties().size

    def read(self, name: str) -> bytes:
        from azure.core.exceptions import ResourceNotFoundError

        with self._as_missing(name, ResourceNotFoundError):
            return self._client.download_blob(self._key(name)).readall()

    def read_range(self, name: str, start: int, length: int) -> bytes:
        from azure.core.exceptions import HttpResponseError, ResourceNotFoundError

        if length <= 0:
            return b""
        with self._as_missing(name, ResourceNotFoundError):
            try:
                return self._client.download_blob(self._key(name), offset=start,
                                                   length=length).readall()
            except HttpResponseError as e:
                if e.status_code == _PAST_THE_END:
                    return b""
                raise

    def chunks(self, name: str) -> Iterator[bytes]:
        from azure.core.exceptions import ResourceNotFoundError

        with self._as_missing(name, ResourceNotFoundError):
            download = self._client.download_blob(self._key(name))
        yield from download.chunks()

    def write(self, name: str, data: bytes) -> None:
        self._client.upload_blob(self._key(name), data, overwrite=True)

    def upload(self, name: str, path: str | Path) -> None:
        with open(path, "rb") as f:
            self._client.upload_blob(self._key(name), f, length=os.fstat(f.fileno()).st_size,
                                     overwrite=True, max_concurrency=PARALLEL_PARTS)

    def delete(self, name: str) -> None:
        from azure.core.exceptions import ResourceNotFoundError

        with contextlib.suppress(ResourceNotFoundError):  # gone already
            self._client.delete_blob(self._key(name))
