"""A relay in front of an HTTP server (the moto server) that cuts answers midway: a store's
read cut mid-shard, as a dropped connection leaves it, for tests/test_shards.py. It is
harness/stores.py's Relay (which it never holds) with the answers' direction cut.

    relay = CuttingRelay(s3["AWS_ENDPOINT_URL"], after_bytes=4000)
    os.environ["AWS_ENDPOINT_URL"] = relay.endpoint   # the clients made from now on
    relay.cut(1)  # the next answer longer than 4000 bytes stops there, its connection closed

Answers of at most ``after_bytes`` (listings, small reads) always pass whole.
"""

from __future__ import annotations

import contextlib
import socket
import sys
import threading
from urllib.parse import urlparse

from harness.stores import Relay


class CuttingRelay(Relay):
    def __init__(self, upstream: str, after_bytes: int) -> None:
        parsed = urlparse(upstream)
        super().__init__((parsed.hostname, parsed.port), hold_after=sys.maxsize)
        self.endpoint = f"http://{self.address[0]}:{self.address[1]}"
        self.after_bytes, self.cuts = after_bytes, 0
        self._cutting = threading.Lock()

    def cut(self, answers: int) -> None:
        """Cut the next ``answers`` answers longer than after_bytes."""
        with self._cutting:
            self.cuts = answers

    def _pump(self, source: socket.socket, target: socket.socket, from_client: bool) -> None:
        """The requests pass as Relay passes them; an answer to be cut (each begins with
        HTTP/) stops once after_bytes of it passed, and both connections close."""
        if from_client:
            return super()._pump(source, target, from_client)
        passed = 0
        with contextlib.suppress(OSError), source, target:
            while data := source.recv(1 << 16):
                passed = len(data) if data.startswith(b"HTTP/") else passed + len(data)
                if passed > self.after_bytes and self._take():
                    target.sendall(data[:self.after_bytes // 2])
                    # shutdown, not close alone: it ends the other direction's recv too,
                    # and the client sees the connection drop at once.
                    for end in (source, target):
                        end.shutdown(socket.SHUT_RDWR)
                    return None
                target.sendall(data)
            target.shutdown(socket.SHUT_WR)
        return None

    def _take(self) -> bool:
        with self._cutting:
            if self.cuts:
                self.cuts -= 1
                return True
            return False
