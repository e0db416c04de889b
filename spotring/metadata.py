"""The clouds' instance metadata services, as far as a spot notice needs them, free of
torch so that a launcher can ask them on a node in a fraction of a second. One class per
cloud (its ``name`` is what PreemptionOptions.notices chooses), each knowing how long its
cloud leaves between a notice and the end of the instance (``notice_seconds``):

    EC2    IMDSv2: PUT /latest/api/token for a session token, sent with every GET of
           /latest/meta-data/spot/instance-action            404, or {"action", "time"}
           /latest/meta-data/events/recommendations/rebalance   404, or {"noticeTime"}:
                                                             the risk of one went up
           120 s; endpoint $AWS_EC2_METADATA_SERVICE_ENDPOINT, as boto finds it
    GCP    GET /computeMetadata/v1/instance/preempted (Metadata-Flavor: Google)
                                                             "TRUE" once preempted, else
                                                             "FALSE"; an ETag header
           the same with ?wait_for_change=true&last_etag=E&timeout_sec=N
                                                             held until the flag's ETag
                                                             is not E (at once where it
                                                             is not already), or N s
           30 s; endpoint host[:port] $GCE_METADATA_HOST, as Google's client libraries
           find it
    Azure  GET /metadata/scheduledevents?api-version=2020-07-01 (Metadata: true)
                                                             {"DocumentIncarnation",
                                                             "Events": [...]}: an event
                                                             of EventType "Preempt" whose
                                                             Resources name this VM
           30 s at least; endpoint $SPOTRING_AZURE_METADATA_ENDPOINT (Azure's SDKs name
           no variable for it)

A service answers only as its cloud documents it, or the class raises OSError or
ValueError: the three share the address 169.254.169.254, where another cloud (or a
machine on none) answers something else or nothing. ``detect`` asks them all at once and
gives the first that answers. The job's watcher asks the one found again and again
(``Source.wait``: GCP's server holds the request until its flag changes, the others are
polled; spotring/preemption.py); `python -m spotring.metadata` asks once (what `spotring
launch` runs on a node to tell whether the node is doomed: launch/notice.py) and prints
the notice, exiting 0 where one is up and 1 where none is or no service answers.

Requests go to the service directly, never through a proxy that the environment names
(Azure and GCP say to bypass proxies for it), and ``Source.close`` ends the one in flight
at once, from any thread, however long the service would hold it.
"""

from __future__ import annotations

import abc
import contextlib
import http.client
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import ClassVar
from urllib.parse import urlencode, urlsplit

log = logging.getLogger(__name__)

# Where all three clouds serve their instance metadata. GCP documents this address beside
# the name metadata.google.internal; the address needs no DNS lookup, which off GCP may
# take seconds.
LINK_LOCAL = "169.254.169.254"
AZURE_ENDPOINT = "SPOTRING_AZURE_METADATA_ENDPOINT"


class StatusError(OSError):
    """A service's answer other than 200 OK, of HTTP status ``status``."""

    def __init__(self, url: str, status: int, reason: str) -> None:
        super().__init__(f"HTTP {status} {reason} from {url}")
        self.status = status


class Source(abc.ABC):
    """One cloud's metadata service at ``endpoint`` (default: where that cloud's own
    tools look), each request failing after ``timeout`` seconds (a request the service
    holds: that much after the time it was asked to hold it)."""

    name: ClassVar[str]  # as PreemptionOptions.notices names it
    cloud: ClassVar[str]  # as logs name it
    notice_seconds: ClassVar[int]  # from the notice to the instance's end

    def __init__(self, endpoint: str | None = None, timeout: float = 1.0) -> None:
        self.endpoint = (endpoint or self.default_endpoint()).rstrip("/")
        self.timeout = timeout
        # How this source logs a line, as Logger.log takes it: Preemption's watcher has
        # its lines logged by the training thread.
        self.say: Callable[..., None] = log.log
        # close() and the request in flight, from different threads.
        self._lock = threading.Lock()
        self._closed = False
        self._in_flight: http.client.HTTPConnection | None = None

    @staticmethod
    @abc.abstractmethod
    def default_endpoint() -> str:
        """Where this cloud's own tools find the service (an override's variable first)."""

    def probe(self) -> None:
        """Return if this cloud's service answers here as documented; else OSError or
        ValueError."""
        self.notice()

    @abc.abstractmethod
    def notice(self) -> str | None:
        """The notice up now, in a line that names the cloud, or None."""

    def wait(self) -> str | None:
        """The notice, as ``notice`` says it. A service that can hold a request until its
        notice changes is asked to (``holds``): the answer comes within moments of a
        change, or after GCP.HOLD_SECONDS without one. The others answer at once, and
        the caller asks again after an interval."""
        return self.notice()

    @property
    def holds(self) -> bool:
        """Whether the next ``wait`` asks the service to hold its request."""
        return False

    def rebalance(self) -> bool:
        """Whether the cloud recommends moving off this instance before a notice."""
        return False

    def close(self) -> None:
        """End the request in flight now, whichever thread waits for it (it raises
        OSError there), and refuse every later one."""
        with self._lock:
            self._closed = True
            sock = self._in_flight.sock if self._in_flight is not None else None
            if sock is not None:
                with contextlib.suppress(OSError):  # the service closed it already
                    sock.shutdown(socket.SHUT_RDWR)

    def _read(self, path: str, headers: dict[str, str], method: str = "GET",
              held: float = 0.0) -> tuple[bytes, http.client.HTTPMessage]:
        """The body and headers of the answer to ``path``, asked of the service itself
        (no proxy). StatusError for any status other than 200; another OSError where
        nothing came within the timeout (and ``held`` seconds more: the time the service
        was asked to hold the request), the answer is not HTTP, or close() ended it."""
        url = urlsplit(self.endpoint)
        connection = http.client.HTTPConnection(url.netloc, timeout=self.timeout)
        with self._lock:
            self._refuse_if_closed()
            self._in_flight = connection
        try:
            connection.connect()
            with self._lock:  # close() came while connecting, before there was a socket
                self._refuse_if_closed()
            connection.sock.settimeout(self.timeout + held)
            connection.request(method, f"{url.path}{path}", headers=headers)
            response = connection.getresponse()
            body = response.read()
        except http.client.HTTPException as e:  # not HTTP: not this cloud's service
            raise ConnectionError(f"{self.endpoint}{path}: {e!r}") from e
        finally:
            with self._lock:
                self._in_flight = None
            connection.close()
        if response.status != 200:
            raise StatusError(f"{self.endpoint}{path}", response.status, response.reason)
        return body, response.headers

    def _refuse_if_closed(self) -> None:
        """ConnectionAbortedError once close() was called (the caller holds _lock)."""
        if self._closed:
            raise ConnectionAbortedError(f"{self.cloud}'s metadata source is closed")


class EC2(Source):
    """EC2's instance metadata service, spoken IMDSv2 (a token on every request)."""

    name, cloud, notice_seconds = "ec2", "EC2", 120
    SPOT_NOTICE = "spot/instance-action"
    REBALANCE = "events/recommendations/rebalance"
    _TOKEN_TTL_SECONDS = 21600

    def __init__(self, endpoint: str | None = None, timeout: float = 1.0) -> None:
        super().__init__(endpoint, timeout)
        self._token: str | None = None
        self._token_expires = 0.0

    @staticmethod
    def default_endpoint() -> str:
        return os.environ.get("AWS_EC2_METADATA_SERVICE_ENDPOINT", f"http://{LINK_LOCAL}")

    def _token_header(self) -> dict[str, str]:
        if self._token is None or time.monotonic() > self._token_expires:
            body, _ = self._read("/latest/api/token", method="PUT", headers={
                "X-aws-ec2-metadata-token-ttl-seconds": str(self._TOKEN_TTL_SECONDS)})
            self._token = body.decode()
            self._token_expires = time.monotonic() + self._TOKEN_TTL_SECONDS / 2
        return {"X-aws-ec2-metadata-token": self._token}

    def get(self, path: str) -> dict | None:
        """The JSON document at meta-data/``path``, or None when there is none (404)."""
        try:
            body, _ = self._read(f"/latest/meta-data/{path}", self._token_header())
        except StatusError as e:
            if e.status == 404:
                return None
            if e.status == 401:  # the token expired early: get a new one next time
                self._token = None
            raise
        return json.loads(body or b"{}")

    def notice(self) -> str | None:
        action = self.get(self.SPOT_NOTICE)
        if action is None:
            return None
        return f"EC2 spot {action.get('action', 'interruption')} notice for " \
               f"{action.get('time', 'soon')}"

    def rebalance(self) -> bool:
        return self.get(self.REBALANCE) is not None


class GCP(Source):
    """The metadata server of a GCP spot or preemptible VM. ``wait`` holds a request
    until the preempted flag changes, as Google documents ("Wait for updates"): it names
    the ETag of the last answer (last_etag), so that a change between two requests is
    answered at once rather than missed. A server that sends no ETag is polled, and so is
    one that failed a held request (refused it, or did not answer it in time)."""

    name, cloud, notice_seconds = "gcp", "GCP", 30
    PREEMPTED = "/computeMetadata/v1/instance/preempted"
    # timeout_sec of a held request, in the whole seconds GCP takes: close() ends a held
    # request at once, so a long one costs nothing but a request a minute.
    HOLD_SECONDS = 60
    _HEADERS = {"Metadata-Flavor": "Google"}

    def __init__(self, endpoint: str | None = None, timeout: float = 1.0) -> None:
        super().__init__(endpoint, timeout)
        # The ETag of the last answer, where it said the flag was down: a held request
        # waits for a change from it. None where the flag was up (the notice is answered
        # at once, unheld) or the answer had none.
        self._etag: str | None = None
        self._hold_failed = False

    @staticmethod
    def default_endpoint() -> str:
        return f"http://{os.environ.get('GCE_METADATA_HOST', LINK_LOCAL)}"

    @property
    def holds(self) -> bool:
        return self._etag is not None and not self._hold_failed

    def notice(self) -> str | None:
        return self._flag(*self._read(self.PREEMPTED, self._HEADERS))

    def wait(self) -> str | None:
        if not self.holds:
            return self.notice()
        query = urlencode({"wait_for_change": "true", "last_etag": self._etag,
                           "timeout_sec": self.HOLD_SECONDS})
        try:
            return self._flag(*self._read(f"{self.PREEMPTED}?{query}", self._HEADERS,
                                          held=self.HOLD_SECONDS))
        except (OSError, ValueError) as e:
            if self._closed:
                raise
            self._hold_failed = True
            self.say(logging.INFO, "GCP's metadata server at %s failed a request held until "
                     "its preempted flag changes (%s): polling it instead", self.endpoint, e)
            return self.notice()

    def _flag(self, body: bytes, headers: http.client.HTTPMessage) -> str | None:
        """The notice an answer about instance/preempted gives (its ETag kept)."""
        answer = body.decode(errors="replace").strip()
        # GCE's server signs every answer with the flavor; another service may say 200.
        if headers.get("Metadata-Flavor") != "Google" or answer not in ("TRUE", "FALSE"):
            raise ValueError(f"not GCE's metadata server: {answer[:60]!r}")
        self._etag = headers.get("ETag") if answer == "FALSE" else None
        return "GCP preemption notice" if answer == "TRUE" else None


class Azure(Source):
    """Azure's Scheduled Events, of the Instance Metadata Service."""

    name, cloud, notice_seconds = "azure", "Azure", 30
    _HEADERS = {"Metadata": "true"}
    EVENTS = "/metadata/scheduledevents?api-version=2020-07-01"
    VM_NAME = "/metadata/instance/compute/name?api-version=2021-02-01&format=text"

    def __init__(self, endpoint: str | None = None, timeout: float = 1.0) -> None:
        super().__init__(endpoint, timeout)
        self._vm: str | None = None

    @staticmethod
    def default_endpoint() -> str:
        return os.environ.get(AZURE_ENDPOINT, f"http://{LINK_LOCAL}")

    def vm_name(self) -> str:
        """This VM's name, as events name the VMs they affect."""
        if self._vm is None:
            self._vm = self._read(self.VM_NAME, self._HEADERS)[0].decode().strip()
        return self._vm

    def probe(self) -> None:
        # Not the events: the first request for them turns the service on, which Azure
        # says may take minutes. Polls that time out meanwhile fail and are tried again.
        self.vm_name()

    def notice(self) -> str | None:
        document = json.loads(self._read(self.EVENTS, self._HEADERS)[0])
        if not isinstance(document, dict) or not isinstance(document.get("Events"), list):
            raise ValueError(f"not Azure's scheduled events: {str(document)[:60]!r}")
        # Every VM of an availability set or scale set placement group sees the events
        # of all of them: only those naming this VM are its own.
        for event in document["Events"]:
            if event.get("EventType") == "Preempt" and \
                    self.vm_name() in event.get("Resources", []):
                return f"Azure Preempt event {event.get('EventId', '')} not before " \
                       f"{event.get('NotBefore') or 'soon'}"
        return None


SOURCES: dict[str, type[Source]] = {source.name: source for source in (EC2, GCP, Azure)}


def sources(choice: str, timeout: float = 1.0) -> list[Source]:
    """The services PreemptionOptions.notices ``choice`` names: "auto" all of them, in
    the order SOURCES gives; "none" none; else that one."""
    if choice == "none":
        return []
    return [SOURCES[name](timeout=timeout) for name in SOURCES if choice in ("auto", name)]


def detect(candidates: Sequence[Source]) -> Source | None:
    """The first of ``candidates`` whose service answers here, or None. They are asked
    all at once, so that off every cloud this takes one request's timeout, not one per
    cloud."""
    def answers(source: Source) -> bool:
        try:
            source.probe()
            return True
        except (OSError, ValueError):
            return False

    if not candidates:
        return None
    with ThreadPoolExecutor(len(candidates)) as pool:
        found = list(pool.map(answers, candidates))
    return next((source for source, ok in zip(candidates, found, strict=True) if ok), None)


def main() -> int:
    source = detect(sources("auto", timeout=2.0))
    try:
        notice = source.notice() if source is not None else None
    except (OSError, ValueError):  # it answered the probe, then failed
        return 1
    if notice is None:
        return 1
    print(notice)
    return 0


if __name__ == "__main__":
    sys.exit(main())
