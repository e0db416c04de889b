"""The object stores' emulators, started by the project's own files on free ports, each
waited for until it answers HTTP and stopped at the end:

    moto                  S3 (harness/aws.py's start_moto), the test extra's moto[server]:
                          AWS_ENDPOINT_URL
    Azurite               Azure Blob, Microsoft's emulator from npm, which `make install`
                          puts in harness/azurite/node_modules (pinned by its
                          package-lock.json): AZURE_STORAGE_CONNECTION_STRING with the
                          well-known account devstoreaccount1
    gcp-storage-emulator  GCS, from PyPI (the test extra): STORAGE_EMULATOR_HOST, with
                          anonymous credentials

Each session fixture (moto_s3, azurite, gcs_emulator) yields an Emulator: a bucket (a
container) made there, and ``env(address)``, the environment that points a client at
it, or at a relay in front of it (Relay). Azurite and the GCS emulator listen on every
address, so that the nodes of a local cluster or SLURM (network namespaces) reach them at
the bridge's address: ``env((bridge, emulator.address[1]))``. Nothing is set in this
process's environment: a test sets what it needs (monkeypatch) or hands it to a process
it starts. Every test sees these fixtures once tests/conftest.py says
pytest_plugins = ["harness.stores"].
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness import REPO
from harness.slurm import free_port
from spotring.polling import poll

AZURITE = REPO / "harness/azurite/node_modules/.bin/azurite-blob"
GCS_EMULATOR = Path(sys.executable).with_name("gcp-storage-emulator")
# Azurite's one account, and its key, which Microsoft publishes for the emulator.
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = ("Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr"
               "/KBHBeksoGMGw==")
BUCKET = "spotring-tests"  # Azure's containers need at least 3 characters
STARTED_WITHIN_S = 60  # an emulator that does not answer by then fails the test instead
HELD_AT_MOST_S = 120  # a test that never releases a Relay fails instead of hanging


@dataclass
class Emulator:
    """A store's emulator: ``scheme`` and ``bucket`` make its URIs; ``env(address)`` is
    what points a client at ``address`` (its own, or a relay's); ``part_bytes`` the
    part size the tests upload with: small, so that a few parts make a test's file,
    but S3's parts are at least 5 MiB (but for the last), and google-cloud-storage
    sends a file of up to 8 MB in one request, so 4 MiB chunks make 3 of them resumable."""

    scheme: str
    bucket: str
    address: tuple[str, int]
    env_for: Callable[[tuple[str, int]], dict[str, str]]
    part_bytes: int

    def uri(self, prefix: str) -> str:
        return f"{self.scheme}://{self.bucket}/{prefix}"

    def env(self, address: tuple[str, int] | None = None) -> dict[str, str]:
        return self.env_for(address or self.address)


def wait_answering(url: str, process: subprocess.Popen | None, what: str) -> None:
    """Until ``url`` answers HTTP, with any status; RuntimeError with the output where
    ``process`` exits first, TimeoutError after STARTED_WITHIN_S."""
    def answers() -> bool | None:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{what} exited {process.returncode} before answering")
        try:
            urllib.request.urlopen(url, timeout=5).close()
        except urllib.error.HTTPError:
            return True
        except OSError:  # not listening yet
            return None
        return True

    poll(answers, timeout_s=STARTED_WITHIN_S, interval_s=0.05, what=f"{what} at {url}")


@contextlib.contextmanager
def running(command: list[str], url: str, log: Path, what: str) -> Iterator[None]:
    """``command`` running, its output in ``log``, until the block ends."""
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL)
    try:
        try:
            wait_answering(url, process, what)
        except (RuntimeError, TimeoutError) as e:
            raise RuntimeError(f"{e}; its output:\n{log.read_text()[-3000:]}") from e
        yield
    finally:
        process.kill()  # an emulator keeps nothing a test reads after it
        process.wait()


def s3_env(home: Path) -> Callable[[tuple[str, int]], dict[str, str]]:
    from harness.aws import aws_env

    return lambda address: aws_env(f"http://{address[0]}:{address[1]}", home)


def azurite_env(address: tuple[str, int], key: str = AZURITE_KEY) -> dict[str, str]:
    host, port = address
    return {"AZURE_STORAGE_CONNECTION_STRING": (
        f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={key};"
        f"BlobEndpoint=http://{host}:{port}/{AZURITE_ACCOUNT};")}


def gcs_env(address: tuple[str, int]) -> dict[str, str]:
    return {"STORAGE_EMULATOR_HOST": f"http://{address[0]}:{address[1]}"}


@contextlib.contextmanager
def running_moto(home: Path) -> Iterator[Emulator]:
    """moto's S3 in a process of its own (moto_server), with BUCKET."""
    port = free_port()
    with running([str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1",
                  "-p", str(port)], f"http://127.0.0.1:{port}/", home / "moto.log", "moto"):
        emulator = Emulator("s3", BUCKET, ("127.0.0.1", port), s3_env(home), 5 * 2**20)
        _create(emulator)
        yield emulator


@contextlib.contextmanager
def running_azurite(folder: Path) -> Iterator[Emulator]:
    """Azurite's Blob service, its data in ``folder``, with container BUCKET. Skips the
    test where `make install` has not installed it."""
    if not AZURITE.exists():
        pytest.skip(f"Azurite is not installed ({AZURITE}): run `make install`")
    port = free_port()
    # --skipApiVersionCheck: the current azure-storage-blob sends an API version newer
    # than Azurite knows; --loose: headers Azurite does not implement are ignored.
    command = [str(AZURITE), "--blobHost", "0.0.0.0", "--blobPort", str(port),
               "--location", str(folder), "--skipApiVersionCheck", "--loose", "--silent"]
    with running(command, f"http://127.0.0.1:{port}/{AZURITE_ACCOUNT}",
                 folder / "azurite.log", "Azurite"):
        emulator = Emulator("az", BUCKET, ("127.0.0.1", port), azurite_env, 2**20)
        _create(emulator)
        yield emulator


@contextlib.contextmanager
def running_gcs_emulator(folder: Path) -> Iterator[Emulator]:
    """gcp-storage-emulator, in memory, with bucket BUCKET."""
    port = free_port()
    command = [str(GCS_EMULATOR), "start", "--host", "0.0.0.0", "--port", str(port),
               "--default-bucket", BUCKET, "--in-memory"]
    with running(command, f"http://127.0.0.1:{port}/", folder / "gcs.log",
                 "gcp-storage-emulator"):
        yield Emulator("gs", BUCKET, ("127.0.0.1", port), gcs_env, 4 * 2**20)


def _create(emulator: Emulator) -> None:
    """The emulator's bucket (container), made with the cloud's own client."""
    with environment(emulator.env()):
        if emulator.scheme == "s3":
            import boto3

            boto3.client("s3").create_bucket(Bucket=emulator.bucket)
        else:
            from azure.storage.blob import BlobServiceClient

            BlobServiceClient.from_connection_string(
                os.environ["AZURE_STORAGE_CONNECTION_STRING"]).create_container(emulator.bucket)


@contextlib.contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """This process's environment with ``env`` set, until the block ends."""
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        yield


class Relay:
    """A TCP relay in front of ``upstream``: a client pointed at ``address`` reaches the
    emulator through it. Once the clients have sent more than ``hold_after`` bytes
    through it, ``midway`` is set and the relay holds what they send, forwarding nothing
    more, until ``release``: an upload stopped midway for as long as a test needs."""

    def __init__(self, upstream: tuple[str, int], hold_after: int) -> None:
        self.upstream, self.hold_after = upstream, hold_after
        self.midway = threading.Event()
        self._sent = 0
        self._open = threading.Event()
        self._open.set()
        self._lock = threading.Lock()
        self._server = socket.create_server(("127.0.0.1", 0))
        self.address = self._server.getsockname()[:2]
        threading.Thread(target=self._accept, daemon=True).start()

    def release(self) -> None:
        self._open.set()

    def close(self) -> None:
        self.release()
        self._server.close()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):  # closed
            while True:
                client, _ = self._server.accept()
                upstream = socket.create_connection(self.upstream)
                threading.Thread(target=self._pump, args=(client, upstream, True),
                                 daemon=True).start()
                threading.Thread(target=self._pump, args=(upstream, client, False),
                                 daemon=True).start()

    def _pump(self, source: socket.socket, target: socket.socket, from_client: bool) -> None:
        with contextlib.suppress(OSError), source, target:
            while data := source.recv(1 << 16):
                if from_client:
                    self._count(len(data))
                if not self._open.wait(HELD_AT_MOST_S):
                    raise TimeoutError(f"the relay was held over {HELD_AT_MOST_S} s")
                target.sendall(data)
            target.shutdown(socket.SHUT_WR)

    def _count(self, n: int) -> None:
        with self._lock:
            self._sent += n
            if self._sent > self.hold_after and not self.midway.is_set():
                self._open.clear()
                self.midway.set()


@pytest.fixture(scope="session")
def moto_s3(tmp_path_factory) -> Iterator[Emulator]:
    with running_moto(tmp_path_factory.mktemp("moto")) as emulator:
        yield emulator


@pytest.fixture(scope="session")
def azurite(tmp_path_factory) -> Iterator[Emulator]:
    with running_azurite(tmp_path_factory.mktemp("azurite")) as emulator:
        yield emulator


@pytest.fixture(scope="session")
def gcs_emulator(tmp_path_factory) -> Iterator[Emulator]:
    with running_gcs_emulator(tmp_path_factory.mktemp("gcs")) as emulator:
        yield emulator
