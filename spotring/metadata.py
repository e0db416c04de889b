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
                                                             "FALSE"
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
gives the first that answers. The job's watcher polls the one found
(spotring/preemption.py); `python -m spotring.metadata` asks once (what `spotring launch`
runs on a node to tell whether the node is doomed: launch/notice.py) and prints the
notice, exiting 0 where one is up and 1 where none is or no service answers.
"""

from __future__ import annotations

import abc
import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from email.message import Message
from typing import ClassVar

# Where all three clouds serve their instance metadata. GCP documents this address beside
# the name metadata.google.internal; the address needs no DNS lookup, which off GCP may
# take seconds.
LINK_LOCAL = "169.254.169.254"
AZURE_ENDPOINT = "SPOTRING_AZURE_METADATA_ENDPOINT"


class Source(abc.ABC):
    """One cloud's metadata service at ``endpoint`` (default: where that cloud's own
    tools look), each request failing after ``timeout`` seconds."""

    name: ClassVar[str]  # as PreemptionOptions.notices names it
    cloud: ClassVar[str]  # as logs name it
    notice_seconds: ClassVar[int]  # from the notice to the instance's end

    def __init__(self, endpoint: str | None = None, timeout: float = 1.0) -> None:
        self.endpoint = (endpoint or self.default_endpoint()).rstrip("/")
        self.timeout = timeout

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

    def rebalance(self) -> bool:
        """Whether the cloud recommends moving off this instance before a notice."""
        return False

    def _read(self, path: str, headers: dict[str, str], method: str = "GET"
              ) -> tuple[bytes, Message]:
        """The body and headers of the answer to ``path``; HTTPError (an OSError) for
        any status other than 200."""
        request = urllib.request.Request(f"{self.endpoint}{path}", headers=headers,
                                         method=method)
        with urllib.request.urlopen(request, timeout=self.timeout) as response:
            return response.read(), response.headers


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
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return None
            if e.code == 401:  # the token expired early: get a new one next time
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
    """The metadata server of a GCP spot or preemptible VM."""

    name, cloud, notice_seconds = "gcp", "GCP", 30
    _HEADERS = {"Metadata-Flavor": "Google"}

    @staticmethod
    def default_endpoint() -> str:
        return f"http://{os.environ.get('GCE_METADATA_HOST', LINK_LOCAL)}"

    def notice(self) -> str | None:
        body, headers = self._read("/computeMetadata/v1/instance/preempted", self._HEADERS)
        answer = body.decode(errors="replace").strip()
        # GCE's server signs every answer with the flavor; another service may say 200.
        if headers.get("Metadata-Flavor") != "Google" or answer not in ("TRUE", "FALSE"):
            raise ValueError(f"not GCE's metadata server: {answer[:60]!r}")
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
