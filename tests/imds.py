"""A loopback stand-in for the EC2 instance metadata service (IMDSv2).

Nothing real can serve 169.254.169.254 off EC2, so tests run this server and point the
trainer at it with AWS_EC2_METADATA_SERVICE_ENDPOINT, as boto does. It answers what
spotring/preemption.py asks, the way EC2 documents it: a token from PUT /latest/api/token,
required on every GET (401 without it); 404 for spot/instance-action and for the
rebalance recommendation until the test announces them.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TOKEN = "stub-imds-token"


class MetadataStub:
    def __init__(self, unavailable: int = 0,
                 address: tuple[str, int] = ("127.0.0.1", 0)) -> None:
        """``unavailable``: answer the first that many token requests 503, as a busy
        new instance's metadata service may. ``address``: where to listen (port 0: any
        free one)."""
        self.unavailable = unavailable
        self.instance_action: dict | None = None
        self.rebalance: dict | None = None
        self.requests: list[tuple[str, str, bool]] = []  # (method, path, had a token)
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _reply(self, code: int, body: bytes = b"") -> None:
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_PUT(self) -> None:
                stub.requests.append(("PUT", self.path, False))
                if stub.unavailable > 0:
                    stub.unavailable -= 1
                    self._reply(503)
                elif self.path == "/latest/api/token" and self.headers.get(
                        "X-aws-ec2-metadata-token-ttl-seconds"):
                    self._reply(200, TOKEN.encode())
                else:
                    self._reply(400)

            def do_GET(self) -> None:
                authorised = self.headers.get("X-aws-ec2-metadata-token") == TOKEN
                stub.requests.append(("GET", self.path, authorised))
                if not authorised:
                    return self._reply(401)
                documents = {
                    "/latest/meta-data/spot/instance-action": stub.instance_action,
                    "/latest/meta-data/events/recommendations/rebalance": stub.rebalance,
                }
                document = documents.get(self.path)
                if document is None:
                    return self._reply(404)
                self._reply(200, json.dumps(document).encode())

        self.server = ThreadingHTTPServer(address, Handler)
        self.url = "http://{}:{}".format(*self.server.server_address)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def announce_interruption(self, seconds_ahead: int = 120) -> float:
        """Publish a spot termination notice; returns when (time.monotonic())."""
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + seconds_ahead))
        self.instance_action = {"action": "terminate", "time": when}
        return time.monotonic()

    def recommend_rebalance(self) -> None:
        self.rebalance = {"noticeTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
