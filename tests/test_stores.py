"""The stores' contract (spotring/stores/), proven on each of the four: a directory, S3
on moto, Azure Blob on Azurite and GCS on gcp-storage-emulator, every emulator a real
server speaking HTTP on 127.0.0.1 (harness/stores.py), reached by the clouds' own client
libraries through their standard settings.

What checkpoints and streamed datasets rely on: objects listed with their sizes (all
the pages), read whole, in ranges and as a sha256 stream, deleted; a file larger than a
part uploaded in parts and stored whole; an upload interrupted midway listing nothing
and leaving the object it would have replaced as it was; a store out of reach, or one
refusing the credentials, reported by check_access as bad input naming it.
"""

from __future__ import annotations

import errno
import hashlib
import os
import pickle
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness.slurm import free_port
from harness.stores import Emulator, Relay, azurite_env
from spotring.exits import ConfigError
from spotring.polling import poll
from spotring.stores import DirectoryStore, S3Store, Store, open_store, uri_problem

REPO = Path(__file__).resolve().parents[1]
EMULATORS = {"s3": "moto_s3", "az": "azurite", "gs": "gcs_emulator"}
KINDS = ["directory", *EMULATORS]
# How long a test waits for an upload to reach its midpoint, or a process to end, before
# it fails: the events come in seconds.
WITHIN_S = 120
# An upload in a process of its own: URI, part size, name, source file. SIGINT raises
# KeyboardInterrupt there even where the test runs with SIGINT ignored (as a shell's
# background job does), which the process would inherit.
UPLOADER = ("import signal, sys\nfrom spotring.stores import open_store\n"
            "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "open_store(sys.argv[1], part_bytes=int(sys.argv[2])).upload(*sys.argv[3:])")


@dataclass
class Case:
    """A store under a prefix of its own, made in an environment pointing at its
    emulator (None: the directory)."""

    store: Store
    uri: str
    emulator: Emulator | None
    part_bytes: int


@pytest.fixture(params=KINDS)
def case(request, tmp_path, monkeypatch) -> Iterator[Case]:
    kind = request.param
    if kind == "directory":
        uri, emulator, part_bytes = (tmp_path / "store").as_uri(), None, 2**20
    else:
        emulator = request.getfixturevalue(EMULATORS[kind])
        uri, part_bytes = emulator.uri(f"t-{uuid.uuid4().hex[:8]}"), emulator.part_bytes
        for key, value in emulator.env().items():
            monkeypatch.setenv(key, value)
    yield Case(open_store(uri, part_bytes=part_bytes), uri, emulator, part_bytes)


def test_objects_are_listed_with_their_sizes_read_whole_in_ranges_and_hashed(case):
    store = case.store
    objects = {"ckpt-000000200.json": b'{"step": 200}',
               "ckpt-000000200/__0_0.distcp": os.urandom(3000),
               "ckpt-000000200/.metadata": b"m" * 10,
               "ckpt-000000100/__1_0.distcp": b"",
               "data/train/shard-000001.tar": os.urandom(1000)}
    for name, data in objects.items():
        store.write(name, data)
    assert store.sizes() == {name: len(data) for name, data in objects.items()}
    assert sorted(store.names()) == sorted(objects)
    assert store.sizes("ckpt-000000200/") == {"ckpt-000000200/__0_0.distcp": 3000,
                                              "ckpt-000000200/.metadata": 10}
    assert store.sizes("ckpt-000000200") == {n: len(d) for n, d in objects.items()
                                             if n.startswith("ckpt-000000200")}
    assert store.sizes("data/train/shard-") == {"data/train/shard-000001.tar": 1000}
    assert store.sizes("nothing/") == {}

    part = objects["ckpt-000000200/__0_0.distcp"]
    name = "ckpt-000000200/__0_0.distcp"
    assert store.size(name) == 3000
    assert store.read(name) == part
    assert store.read_range(name, 0, 100) == part[:100]
    assert store.read_range(name, 1234, 500) == part[1234:1734]
    assert store.read_range(name, 2900, 500) == part[2900:]  # fewer at the end
    assert store.read_range(name, 3000, 10) == b""  # none from the end on
    assert store.read_range(name, 5000, 10) == b""
    assert store.sha256(name) == hashlib.sha256(part).hexdigest()
    assert store.sha256("ckpt-000000100/__1_0.distcp") == hashlib.sha256(b"").hexdigest()
    assert store.location(name).startswith(store.where)
    assert store.location(name).endswith("/ckpt-000000200/__0_0.distcp")

    store.write("ckpt-000000200.json", b"replaced")
    assert store.read("ckpt-000000200.json") == b"replaced"

    store.delete(name)
    store.delete(name)  # gone already: no error (another host's cleaner)
    assert name not in store.sizes()
    for call in (store.size, store.read, store.sha256,
                 lambda n: store.read_range(n, 0, 10)):
        with pytest.raises(FileNotFoundError, match=store.location(name)):
            call(name)


def test_a_listing_follows_every_page(case):
    if case.emulator is None:
        pytest.skip("a directory is read in one scan, not in pages")
    case.store.list_page = 2
    names = {f"shards/{i:03d}.tar": i for i in range(7)}
    for name, size in names.items():
        case.store.write(name, b"x" * size)
    # gcp-storage-emulator answers every listing in one page, whatever the page size
    # asked: there, the listing's pages are not exercised.
    assert case.store.sizes("shards/") == names


def test_a_file_larger_than_a_part_is_uploaded_in_parts_and_stored_whole(case, tmp_path):
    data = os.urandom(3 * case.part_bytes + case.part_bytes // 2)
    source = tmp_path / "part.bin"
    source.write_bytes(data)
    store = case.store
    store.upload("ckpt-000000300/__0_0.distcp", source)
    name = "ckpt-000000300/__0_0.distcp"
    assert store.sizes("ckpt-000000300/") == {name: len(data)}
    assert store.sha256(name) == hashlib.sha256(data).hexdigest()
    assert b"".join(store.chunks(name)) == data
    for start in (case.part_bytes - 10, 2 * case.part_bytes, len(data) - 7):
        assert store.read_range(name, start, 20) == data[start:start + 20]
    assert parts_stored(case, name) in (None, 4)


def parts_stored(case: Case, name: str) -> int | None:
    """How many parts the store says the object was uploaded in, where it says."""
    if isinstance(case.store, S3Store):
        etag = case.store.client.head_object(Bucket=case.store.bucket,
                                             Key=case.store._key(name))["ETag"]
        return int(etag.strip('"').split("-")[1])  # a multipart upload's: MD5-PARTS
    if case.uri.startswith("az://"):
        blocks, _ = case.store._client.get_blob_client(case.store._key(name)) \
            .get_block_list("committed")
        return len(blocks)
    return None  # a directory; GCS's resumable upload leaves no trace of its chunks


def test_an_upload_interrupted_midway_lists_nothing_and_keeps_the_object_it_replaces(
        case, tmp_path):
    store, name = case.store, "ckpt-000000400/__0_0.distcp"
    store.write(name, b"the previous upload")
    size = 8 * case.part_bytes
    if case.emulator is None:
        process = interrupted_from_a_pipe(case, name, size, tmp_path)
    else:
        process = interrupted_through_a_relay(case, name, size, tmp_path)
    assert process.returncode == -signal.SIGINT, process.stderr
    assert "KeyboardInterrupt" in process.stderr

    assert store.sizes() == {name: len(b"the previous upload")}
    assert store.read(name) == b"the previous upload"
    if isinstance(store, DirectoryStore):  # nor a temporary file left on the disk
        assert sorted(p.name for p in (store.path / "ckpt-000000400").iterdir()) == \
            ["__0_0.distcp"]
    if isinstance(store, S3Store):  # no multipart upload left to bill: boto3 aborted it
        uploads = store.client.list_multipart_uploads(Bucket=store.bucket,
                                                      Prefix=store._key(""))
        assert uploads.get("Uploads", []) == []
    # Azure keeps the blocks sent until it discards them a week later (no call deletes
    # uncommitted blocks alone), and GCS the resumable session's bytes: neither is an
    # object, and no listing shows them.


def interrupted_through_a_relay(case: Case, name: str, size: int,
                                tmp_path: Path) -> subprocess.CompletedProcess:
    """An upload of ``size`` bytes in a process of its own, through a relay in front of
    the emulator that holds it once a part and a half has gone through, interrupted
    there (SIGINT: KeyboardInterrupt, as Ctrl-C or a launcher's stop). The relay then
    lets the rest through: what the interrupted client still sends (S3's abort)."""
    source = tmp_path / "upload.bin"
    source.write_bytes(os.urandom(size))
    relay = Relay(case.emulator.address, hold_after=3 * case.part_bytes // 2)
    try:
        process = uploader(case, [name, str(source)], case.emulator.env(relay.address))
        assert relay.midway.wait(WITHIN_S), "the upload never got a part and a half through"
        process.send_signal(signal.SIGINT)
        relay.release()
        return finished(process)
    finally:
        relay.close()


def interrupted_from_a_pipe(case: Case, name: str, size: int,
                            tmp_path: Path) -> subprocess.CompletedProcess:
    """The same for a directory: the upload's source is a named pipe, which this test
    fills with a part and a half, then holds open while it interrupts the copy."""
    source = tmp_path / "upload.fifo"
    os.mkfifo(source)
    process = uploader(case, [name, str(source)], {})
    # Opening the pipe's writing end succeeds once the uploader opened its reading end.
    fd = poll(lambda: _open_writer(source, process), timeout_s=WITHIN_S, interval_s=0.02,
              what="the uploader opening its source")
    try:
        os.set_blocking(fd, True)
        os.write(fd, os.urandom(3 * case.part_bytes // 2))  # returns once mostly read
        process.send_signal(signal.SIGINT)
        return finished(process)
    finally:
        os.close(fd)


def _open_writer(fifo: Path, process: subprocess.Popen) -> int | None:
    if process.poll() is not None:
        raise AssertionError(f"the uploader exited {process.returncode} before reading: "
                             f"{process.communicate()}")
    try:
        return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ENXIO:  # no reader yet
            return None
        raise


def uploader(case: Case, args: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", UPLOADER, case.uri, str(case.part_bytes),
                             *args], cwd=REPO, env=os.environ | env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finished(process: subprocess.Popen) -> subprocess.CompletedProcess:
    stdout, stderr = process.communicate(timeout=WITHIN_S)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


@pytest.mark.parametrize("kind", ["directory", *EMULATORS])
def test_a_store_out_of_reach_is_bad_input_naming_it(kind, request, tmp_path, monkeypatch):
    if kind == "directory":
        (tmp_path / "a-file").write_text("")
        uri = str(tmp_path / "a-file" / "checkpoints")
    else:
        emulator = request.getfixturevalue(EMULATORS[kind])
        closed = ("127.0.0.1", free_port())  # nothing listens there
        for key, value in emulator.env(closed).items():
            monkeypatch.setenv(key, value)
        uri = emulator.uri("runs/a")
    with pytest.raises(ConfigError, match=f"checkpoint.uri={uri}: "):
        open_store(uri).check_access()


@pytest.mark.parametrize("kind", list(EMULATORS))
def test_a_bucket_that_does_not_exist_is_bad_input_naming_it(kind, request, monkeypatch):
    emulator = request.getfixturevalue(EMULATORS[kind])
    for key, value in emulator.env().items():
        monkeypatch.setenv(key, value)
    uri = f"{kind}://no-such-bucket/runs/a"
    word = "container" if kind == "az" else "bucket"
    with pytest.raises(ConfigError, match=f"checkpoint.uri={uri}: cannot reach {word} "
                                          "no-such-bucket"):
        open_store(uri).check_access()


def test_refused_credentials_are_bad_input_naming_the_store(request, monkeypatch):
    # Azurite checks the account key's signature; moto and gcp-storage-emulator accept
    # any credentials, so there the refusal cannot be shown.
    emulator = request.getfixturevalue("azurite")
    wrong = "d3Jvbmcga2V5IGZvciBkZXZzdG9yZWFjY291bnQxIGluIGEgdGVzdA=="
    for key, value in azurite_env(emulator.address, key=wrong).items():
        monkeypatch.setenv(key, value)
    uri = emulator.uri("runs/a")
    with pytest.raises(ConfigError, match=f"checkpoint.uri={uri}: cannot reach container "
                                          f"{emulator.bucket} .*AuthorizationFailure"):
        open_store(uri).check_access()


def test_a_store_pickles_as_its_uri_and_lists_the_same_in_another_process(case):
    case.store.write("ckpt-000000500.json", b"{}")
    copy = pickle.loads(pickle.dumps(case.store))
    assert (copy.where, copy.part_bytes) == (case.store.where, case.store.part_bytes)
    assert copy.sizes() == {"ckpt-000000500.json": 2}


@pytest.mark.parametrize("uri, store", [
    ("s3://bucket/runs/a", "S3Store"), ("gs://bucket/runs/a", "GCSStore"),
    ("az://container/runs/a", "AzureStore"), ("file:///mnt/shared/runs/a", "DirectoryStore"),
    ("/mnt/shared/runs/a", "DirectoryStore"), ("runs/a", "DirectoryStore")])
def test_the_scheme_chooses_the_store(uri, store):
    made = open_store(uri, key="dataset.uri", paths=True)
    assert type(made).__name__ == store
    assert made.where == uri.removeprefix("file://")


@pytest.mark.parametrize("uri", ["bucket/prefix", "http://host/x", "s3:///prefix",
                                 "file://otherhost/x", ""])
def test_a_uri_of_no_store_is_refused_naming_every_valid_form(uri):
    forms = "s3://bucket/prefix, gs://bucket/prefix, az://container/prefix or file:///path"
    assert uri_problem(uri, "checkpoint.uri") == f"checkpoint.uri={uri}: expected {forms}"
    with pytest.raises(ConfigError, match=f"checkpoint.uri={uri}: expected {forms}$"):
        open_store(uri, key="checkpoint.uri")  # a checkpoint's store: never a bare path
    if uri != "bucket/prefix":  # a dataset's may be a bare path, a directory
        with pytest.raises(ConfigError, match=f"dataset.uri={uri}: expected .*, file:///path "
                                              "or a directory's path"):
            open_store(uri, key="dataset.uri", paths=True)


def test_importing_spotring_and_its_launchers_imports_neither_gcs_nor_azure_client():
    code = ("import sys, spotring, spotring.stores, spotring.launch, spotring.sweep\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('google', 'azure')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=REPO).stdout
    assert out.strip() == "[]"
