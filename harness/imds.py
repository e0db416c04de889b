"""Loopback stand-ins for the clouds' instance metadata services: EC2's (IMDSv2), GCP's
metadata server and Azure's Scheduled Events.

Nothing real serves 169.254.169.254 off a cloud, so tests run these servers and point
spotring at them the way each cloud's own tools are pointed elsewhere:
AWS_EC2_METADATA_SERVICE_ENDPOINT (boto), GCE_METADATA_HOST (Google's client libraries,
host:port) and SPOTRING_AZURE_METADATA_ENDPOINT (spotring/metadata.py: Azure's SDKs name
none). Each answers what spotring/metadata.py asks, the way its cloud documents it, with
no notice until the test announces one; ``requests`` records what was asked.
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

TOKEN = "stub-imds-token"


def _soon(seconds_ahead: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + seconds_ahead))


class _Stub:
    """A threaded HTTP server on ``address`` (port 0: any free one) whose requests go to
    ``answer(method, path, headers) -> (status, body, extra headers)``."""

    variable: str  # what points spotring at it
    requests: list

    def __init__(self, address: tuple[str, int] = ("127.0.0.1", 0)) -> None:
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _handle(self) -> None:
                code, body, headers = stub.answer(self.command, self.path, self.headers)
                try:
                    self.send_response(code)
                    for name, value in {"Content-Length": str(len(body)),
                                        **headers}.items():
                        self.send_header(name, value)
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up on a request held for it (closed mid-way)

            do_GET = do_PUT = _handle

        self.server = ThreadingHTTPServer(address, Handler)
        self.host = "{}:{}".format(*self.server.server_address)
        self.url = f"http://{self.host}"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def answer(self, method: str, path: str, headers) -> tuple[int, bytes, dict[str, str]]:
        raise NotImplementedError

    @property
    def env(self) -> dict[str, str]:
        """The variable that points spotring at this stub."""
        return {self.variable: self.url}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class MetadataStub(_Stub):
    """EC2's: a token from PUT /latest/api/token, required on every GET (401 without
    it); 404 for spot/instance-action and for the rebalance recommendation until the
    test announces them."""

    cloud, variable = "EC2", "AWS_EC2_METADATA_SERVICE_ENDPOINT"

    def __init__(self, unavailable: int = 0,
                 address: tuple[str, int] = ("127.0.0.1", 0)) -> None:
        """``unavailable``: answer the first that many token requests 503, as a busy
        new instance's metadata service may."""
        self.unavailable = unavailable
        self.instance_action: dict | None = None
        self.rebalance: dict | None = None
        self.requests: list[tuple[str, str, bool]] = []  # (method, path, had a token)
        super().__init__(address)

    def answer(self, method, path, headers):
        if method == "PUT":
            self.requests.append(("PUT", path, False))
            if self.unavailable > 0:
                self.unavailable -= 1
                return 503, b"", {}
            if path == "/latest/api/token" and headers.get(
                    "X-aws-ec2-metadata-token-ttl-seconds"):
                return 200, TOKEN.encode(), {}
            return 400, b"", {}
        authorised = headers.get("X-aws-ec2-metadata-token") == TOKEN
        self.requests.append(("GET", path, authorised))
        if not authorised:
            return 401, b"", {}
        document = {"/latest/meta-data/spot/instance-action": self.instance_action,
                    "/latest/meta-data/events/recommendations/rebalance": self.rebalance,
                    }.get(path)
        if document is None:
            return 404, b"", {}
        return 200, json.dumps(document).encode(), {}

    def announce_interruption(self, seconds_ahead: int = 120) -> float:
        """Publish a spot termination notice; returns when (time.monotonic())."""
        self.instance_action = {"action": "terminate", "time": _soon(seconds_ahead)}
        return time.monotonic()

    announce = announce_interruption  # as the other clouds' stubs name it

    def recommend_rebalance(self) -> None:
        self.rebalance = {"noticeTime": _soon(0)}


class GCPStub(_Stub):
    """GCP's metadata server: instance/preempted says "FALSE", then "TRUE" once the test
    preempts the VM; a request without Metadata-Flavor: Google is refused (403), and
    every answer carries that header and the value's ETag.

    ?wait_for_change=true holds a request, as Google documents "Wait for updates", until
    the value's ETag differs from last_etag (at once where it already does; without
    last_etag, from the ETag when the request came), or for timeout_sec (whole seconds;
    400 for another number). ``wait_for_change``: "held", so; "ignored", answered at once
    as a plain request, as by a server that does not know the parameter; "refused": 400.
    ``exchanges`` records each request's path, and when it came and was answered
    (time.monotonic())."""

    cloud, variable = "GCP", "GCE_METADATA_HOST"
    PREEMPTED = "/computeMetadata/v1/instance/preempted"

    def __init__(self, wait_for_change: str = "held") -> None:
        self.preempted = False
        self.requests: list[str] = []
        self.exchanges: list[tuple[str, float, float]] = []
        self.wait_for_change = wait_for_change
        self.holding = 0  # requests held now
        self._changed = threading.Condition()  # the value, holding and closing
        self._closing = False
        super().__init__()

    @property
    def env(self) -> dict[str, str]:
        return {self.variable: self.host}  # host:port, no scheme, as Google's libraries

    @property
    def etag(self) -> str:
        """The ETag of instance/preempted now (GCP's are 16 hex digits)."""
        return hashlib.sha256(str(self.preempted).encode()).hexdigest()[:16]

    def answer(self, method, path, headers):
        came = time.monotonic()
        self.requests.append(path)
        url = urlsplit(path)
        query = parse_qs(url.query)
        code, body = 200, b""
        if headers.get("Metadata-Flavor") != "Google":
            code, body = 403, b"Missing Metadata-Flavor:Google header."
        elif url.path != self.PREEMPTED:
            code = 404
        elif query.get("wait_for_change") == ["true"] and self.wait_for_change != "ignored":
            code, body = self._hold(query)
        with self._changed:  # the value and its ETag of one moment (announce may come)
            etag = self.etag
            if code == 200:
                body = b"TRUE" if self.preempted else b"FALSE"
        self.exchanges.append((path, came, time.monotonic()))
        return code, body, {"Metadata-Flavor": "Google", "ETag": etag}

    def _hold(self, query: dict[str, list[str]]) -> tuple[int, bytes]:
        """Hold a wait_for_change request until its answer is due: its status, and the
        body of an error."""
        if self.wait_for_change == "refused":
            return 400, b"wait_for_change is not supported here"
        timeout = query.get("timeout_sec", [None])[0]
        if timeout is not None and not timeout.isdigit():
            return 400, b"timeout_sec must be a whole number of seconds"
        with self._changed:
            last = query.get("last_etag", [self.etag])[0]
            self.holding += 1
            self._changed.notify_all()
            self._changed.wait_for(lambda: self._closing or self.etag != last,
                                   None if timeout is None else int(timeout))
            self.holding -= 1
        return 200, b""

    def until_held(self, timeout: float = 30) -> None:
        """Return once a request is held; AssertionError after ``timeout`` seconds."""
        with self._changed:
            assert self._changed.wait_for(lambda: self.holding > 0, timeout), \
                f"no request held in {timeout} s: {self.requests}"

    def announce(self) -> float:
        """Preempt the VM, answering the requests held; returns when (time.monotonic())."""
        with self._changed:
            self.preempted = True
            self._changed.notify_all()
        return time.monotonic()

    def close(self) -> None:
        with self._changed:  # the requests still held are answered, unchanged
            self._closing = True
            self._changed.notify_all()
        super().close()


class AzureStub(_Stub):
    """Azure's Instance Metadata Service, as far as Scheduled Events go: requests need
    Metadata: true and an api-version (400 without); the VM's name at
    instance/compute/name (format=text); scheduledevents lists the events the test
    schedules, each raising DocumentIncarnation."""

    cloud, variable = "Azure", "SPOTRING_AZURE_METADATA_ENDPOINT"
    VM = "spot-vm_3"

    def __init__(self) -> None:
        self.incarnation = 1
        self.events: list[dict] = []
        self.requests: list[str] = []
        super().__init__()

    def answer(self, method, path, headers):
        self.requests.append(path)
        url = urlsplit(path)
        if headers.get("Metadata") != "true" or "api-version" not in parse_qs(url.query):
            return 400, json.dumps({"error": "Bad request"}).encode(), {}
        if url.path == "/metadata/instance/compute/name":
            return 200, self.VM.encode(), {"Content-Type": "text/plain"}
        if url.path == "/metadata/scheduledevents":
            document = {"DocumentIncarnation": self.incarnation, "Events": self.events}
            return 200, json.dumps(document).encode(), {"Content-Type": "application/json"}
        return 404, b"", {}

    def schedule(self, kind: str, vm: str = VM, seconds_ahead: int = 30) -> float:
        """An event of EventType ``kind`` ("Preempt", "Freeze", "Reboot"...) for ``vm``;
        returns when (time.monotonic())."""
        self.events.append({
            "EventId": str(uuid.uuid4()).upper(), "EventType": kind,
            "ResourceType": "VirtualMachine", "Resources": [vm], "EventStatus": "Scheduled",
            "NotBefore": time.strftime("%a, %d %b %Y %H:%M:%S GMT",
                                       time.gmtime(time.time() + seconds_ahead)),
            "Description": "", "EventSource": "Platform", "DurationInSeconds": -1})
        self.incarnation += 1
        return time.monotonic()

    def announce(self) -> float:
        """This VM's eviction: a Preempt event; returns when (time.monotonic())."""
        return self.schedule("Preempt")


STUBS = {"ec2": MetadataStub, "gcp": GCPStub, "azure": AzureStub}


def closed_port() -> str:
    """host:port where nothing listens: a connection is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return "{}:{}".format(*s.getsockname())


def pointed_at(stub: _Stub | None = None, *, others: str | None = None) -> dict[str, str]:
    """The variables that point every cloud's service at ``stub`` where it is that
    cloud's, else at ``others`` (host:port; default a closed port), so that the cloud
    spotring finds is the stub's whatever machine the tests run on (a CI runner on Azure
    has a real Azure service at 169.254.169.254)."""
    elsewhere = others or closed_port()
    env = {cls.variable: elsewhere if cls is GCPStub else f"http://{elsewhere}"
           for cls in STUBS.values()}
    return env | (stub.env if stub is not None else {})
