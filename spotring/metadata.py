"""EC2's instance metadata service (IMDSv2), as far as spot instances need it, free of
torch so that a launcher can ask it on a node in a fraction of a second:

    PUT  /latest/api/token                                an IMDSv2 session token
    GET  /latest/meta-data/spot/instance-action           404, or {"action": "terminate",
                                                          "time": ...}: a notice is up
    GET  /latest/meta-data/events/recommendations/rebalance
                                                          404, or {"noticeTime": ...}:
                                                          the risk of one went up

The endpoint follows AWS_EC2_METADATA_SERVICE_ENDPOINT as boto does, so that tests point
it at a local server. The job's watcher polls it (spotring/preemption.py); `python -m
spotring.metadata` asks it once (what `spotring launch` runs on a node to tell whether
the node is doomed: launch/notice.py) and prints the notice, exiting 0 where one is up
and 1 where none is or nothing answers.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.request

DEFAULT_ENDPOINT = "http://169.254.169.254"
SPOT_NOTICE = "spot/instance-action"
REBALANCE = "events/recommendations/rebalance"
_TOKEN_TTL_SECONDS = 21600


def endpoint() -> str:
    """This machine's metadata service, as boto finds it."""
    return os.environ.get("AWS_EC2_METADATA_SERVICE_ENDPOINT", DEFAULT_ENDPOINT)


class Metadata:
    """The instance metadata service, spoken IMDSv2 (a token on every request)."""

    def __init__(self, endpoint: str, timeout: float = 1.0) -> None:
        self.endpoint = endpoint.rstrip("/")
        self.timeout = timeout
        self._token: str | None = None
        self._token_expires = 0.0

    def _token_header(self) -> dict[str, str]:
        if self._token is None or time.monotonic() > self._token_expires:
            request = urllib.request.Request(
                f"{self.endpoint}/latest/api/token", method="PUT",
                headers={"X-aws-ec2-metadata-token-ttl-seconds": str(_TOKEN_TTL_SECONDS)})
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                self._token = response.read().decode()
            self._token_expires = time.monotonic() + _TOKEN_TTL_SECONDS / 2
        return {"X-aws-ec2-metadata-token": self._token}

    def get(self, path: str) -> dict | None:
        """The JSON document at meta-data/``path``, or None when there is none (404)."""
        request = urllib.request.Request(f"{self.endpoint}/latest/meta-data/{path}",
                                         headers=self._token_header())
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return None
            if e.code == 401:  # the token expired early: get a new one next time
                self._token = None
            raise


def main() -> int:
    try:
        notice = Metadata(endpoint(), timeout=2.0).get(SPOT_NOTICE)
    except (OSError, ValueError):  # no metadata service here (off EC2), or it failed
        return 1
    if notice is None:
        return 1
    print(json.dumps(notice))
    return 0


if __name__ == "__main__":
    sys.exit(main())
