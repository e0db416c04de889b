"""Where checkpoints (and streamed datasets) live: one interface, Store, over a local
directory, S3, GCS and Azure Blob, chosen by the URI's scheme (``open_store``).

    a path, file:///path     DirectoryStore (local.py): a disk, or a file system every
                             host mounts
    s3://bucket/prefix       S3Store (s3.py): boto3, in spotring itself
    gs://bucket/prefix       GCSStore (gcs.py): google-cloud-storage, spotring[gcp]
    az://container/prefix    AzureStore (azure.py): azure-storage-blob, spotring[azure]

Each gives what a checkpoint or a streamed dataset needs (base.Store): a listing with
sizes, stat, whole and ranged reads, sha256 as a stream, small writes, the upload of a
large file in parts, delete, and check_access, which raises ConfigError (exit 2) naming
the store where it is out of reach or refuses the credentials. What every store
promises: an object is listed only once written whole, so a write or an upload cut
midway leaves nothing a reader lists; each module says how its store keeps that.

A client library is imported when a store of its scheme is made, never by
``import spotring``. Each cloud's credentials come from its own standard chain (each
module says which), and so does the endpoint of an emulator: AWS_ENDPOINT_URL,
STORAGE_EMULATOR_HOST, AZURE_STORAGE_CONNECTION_STRING.

Another store is one module with a Store subclass, and its line in SCHEMES.
"""

from __future__ import annotations

import importlib
from urllib.parse import urlparse

from spotring.exits import ConfigError
from spotring.stores.base import PART_BYTES, BucketStore, Store
from spotring.stores.local import DirectoryStore, write_atomic
from spotring.stores.s3 import S3Store

__all__ = ["PART_BYTES", "SCHEMES", "BucketStore", "DirectoryStore", "S3Store", "Store",
           "open_store", "uri_problem", "write_atomic"]

# Each scheme: the class that serves it, as "module:Class" (imported only when a URI of
# that scheme is opened), and the form of its URIs. A URI without a scheme is a path.
SCHEMES = {
    "s3": ("spotring.stores.s3:S3Store", "s3://bucket/prefix"),
    "gs": ("spotring.stores.gcs:GCSStore", "gs://bucket/prefix"),
    "az": ("spotring.stores.azure:AzureStore", "az://container/prefix"),
    "file": ("spotring.stores.local:DirectoryStore", "file:///path"),
}


def open_store(uri: str, *, key: str = "checkpoint.uri", part_bytes: int = PART_BYTES,
               paths: bool = False) -> Store:
    """The store ``uri`` names (a URI of SCHEMES; with ``paths``, a directory's path too);
    ``key``: the option it came from, which messages name; ``part_bytes``: the size of an
    upload's parts. ConfigError (``uri_problem``'s line) for a URI of no known form, or a
    store whose client library is not installed (naming the extra to install). Makes no
    request: check_access does."""
    if problem := uri_problem(uri, key, paths=paths):
        raise ConfigError(problem)
    module, name = SCHEMES[urlparse(uri).scheme or "file"][0].split(":")
    return getattr(importlib.import_module(module), name).from_uri(uri, key=key,
                                                                   part_bytes=part_bytes)


def uri_problem(uri: str, key: str = "checkpoint.uri", *, paths: bool = False) -> str | None:
    """None if ``uri`` has the form of a store's URI, else the line that says what is
    wrong with it and names the valid forms: the one check of a store's URI, whichever
    way it came (an option, an environment variable, a launcher's setting). ``paths``: a
    bare path counts, as a directory: for a dataset, which a path that holds nothing
    refuses anyway. Never for a checkpoint's store, where a value without a scheme is
    more likely a bucket whose s3:// was forgotten (checkpoint.uri=bucket/prefix), and
    would send every checkpoint to a local folder that goes with the machine: file:///
    says a directory is meant."""
    parsed = urlparse(uri)
    scheme = parsed.scheme or ("file" if paths else "")
    if scheme == "file":
        if parsed.path and parsed.netloc in ("", "localhost"):
            return None
    elif scheme in SCHEMES and parsed.netloc:
        return None
    forms = [form for _, form in SCHEMES.values()] + (["a directory's path"] if paths else [])
    return f"{key}={uri}: expected {', '.join(forms[:-1])} or {forms[-1]}"
