"""A fault-injecting HTTP proxy in front of the moto server: AWS that fails one call,
or S3 as slow as a test wants.

The clients talk to it through AWS_ENDPOINT_URL as they would to AWS; every request goes
on to moto, except the attempts of the call chosen to fail, which get an AWS error over
HTTP (an internal error, throttling) or a connection dropped without an answer.
botocore's own retries see them as they would AWS's. While the proxy is held, requests
wait there, unanswered, until it is released.

A call is one botocore operation: its retries carry the same amz-sdk-invocation-id
header, so the proxy counts calls, not attempts, and can fail a call's first attempt
only (a fault that passes) or all of them (an outage that outlasts the retries).
"""

from __future__ import annotations

import http.client
import json
import socket
import struct
import threading
import urllib.parse
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# Each kind of fault: the HTTP status and AWS's error code, as EC2 and STS (the query
# protocol) and the JSON services (SSM) send them; "reset" drops the connection instead.
FAULTS = {
    "500": (500, "InternalError", "InternalServerError"),
    "throttled": (503, "RequestLimitExceeded", "ThrottlingException"),
    "reset": None,
}
UPSTREAM_TIMEOUT_S = 30  # moto answers in milliseconds; a hung moto fails the test instead
HELD_AT_MOST_S = 120  # a test that never releases the proxy fails instead of hanging


def in_turn(i: int) -> str:
    """The faults taking turns: the i-th of a series gets this one."""
    kinds = list(FAULTS)
    return kinds[i % len(kinds)]


# Which fault (a key of FAULTS) the given attempt of the given call gets, or None; calls
# and attempts count from 1.
Rule = Callable[[int, int], "str | None"]


def outage(call: int, fault: str) -> Rule:
    """Every attempt of the ``call``-th call fails: an outage that outlasts the retries."""
    return lambda n, attempt: fault if n == call else None


def blips(fault_of: Callable[[int], str | None]) -> Rule:
    """The first attempt of call n fails with ``fault_of(n)`` (None: it does not), and
    its retry goes through: faults that pass."""
    return lambda n, attempt: fault_of(n) if attempt == 1 else None


class FaultProxy:
    """Start it with the moto server's address; point AWS_ENDPOINT_URL at ``endpoint``.
    ``calls`` lists every call made since the last ``reset`` as "service:Operation",
    one entry per call however often it was retried."""

    def __init__(self, upstream: str):
        self.upstream = urllib.parse.urlsplit(upstream).netloc
        self.calls: list[str] = []
        self.failed: list[str] = []  # "service:Operation attempt N: fault" for each fault sent
        self._ids: dict[str, int] = {}  # invocation id -> its call's number
        self._rule: Rule | None = None
        self._lock = threading.Lock()
        self._open = threading.Event()
        self._open.set()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def reset(self, rule: Rule | None = None) -> None:
        """Count calls from 1 again, and fail them as ``rule`` says (None: none)."""
        with self._lock:
            self.calls, self.failed, self._ids = [], [], {}
            self._rule = rule

    def hold(self) -> None:
        """Requests from now on wait here, unanswered, until ``release``."""
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    def stop(self) -> None:
        self._open.set()
        self._server.shutdown()
        self._server.server_close()

    def _fault_for(self, invocation: str, operation: str, attempt: int) -> str | None:
        with self._lock:
            if invocation not in self._ids:
                self.calls.append(operation)
                self._ids[invocation] = len(self.calls)
            fault = self._rule and self._rule(self._ids[invocation], attempt)
            if fault:
                self.failed.append(f"{operation} attempt {attempt}: {fault}")
            return fault


def _handler(proxy: FaultProxy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as botocore's connection pool expects

        def log_message(self, *args):  # a line per request otherwise
            pass

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            target = self.headers.get("X-Amz-Target")  # the JSON protocol names it here
            # The service is in the signature's credential scope: KEY/DATE/REGION/SERVICE/...
            scope = self.headers.get("Authorization", "").split("Credential=")[-1].split("/")
            service = scope[3] if len(scope) > 3 else "?"
            if target:
                operation = target.rsplit(".", 1)[-1]
            elif service == "s3":  # REST: the method and the object say what it is
                operation = f"{self.command} {urllib.parse.urlsplit(self.path).path}"
            else:
                operation = urllib.parse.parse_qs(body.decode()).get("Action", ["?"])[0]
            # "ttl=...; attempt=2; max=2" on a retry, "attempt=1; max=2" before
            retry = dict(item.strip().split("=", 1) for item in
                         self.headers.get("amz-sdk-request", "attempt=1").split(";"))
            fault = proxy._fault_for(self.headers.get("amz-sdk-invocation-id", ""),
                                     f"{service}:{operation}", int(retry["attempt"]))
            if fault == "reset":
                # An RST instead of an answer: SO_LINGER with a zero timeout, then close.
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                           struct.pack("ii", 1, 0))
                self.close_connection = True
                return
            if fault:
                status, query_code, json_code = FAULTS[fault]
                self._answer(status, *_error(json_code if target else query_code, bool(target)))
                return
            if not proxy._open.wait(HELD_AT_MOST_S):
                raise TimeoutError(f"the proxy was held over {HELD_AT_MOST_S} s")
            self._forward(body)

        do_GET = do_PUT = do_HEAD = do_DELETE = do_POST  # noqa: N815 (http.server's naming)

        def _forward(self, body: bytes) -> None:
            upstream = http.client.HTTPConnection(proxy.upstream, timeout=UPSTREAM_TIMEOUT_S)
            try:
                # This server answered any "Expect: 100-continue" itself.
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in ("host", "expect")}
                upstream.request(self.command, self.path, body=body, headers=headers)
                reply = upstream.getresponse()
                data = reply.read()
                kept = [(k, v) for k, v in reply.getheaders() if k.lower() not in (
                    "content-length", "transfer-encoding", "connection")]
                # A HEAD's answer has no body but the length of the object it describes.
                length = reply.getheader("Content-Length") if self.command == "HEAD" else None
                self._answer(reply.status, kept, data, length)
            finally:
                upstream.close()

        def _answer(self, status: int, headers: list[tuple[str, str]], data: bytes,
                    length: str | None = None) -> None:
            self.send_response(status)
            for key, value in headers:
                self.send_header(key, value)
            self.send_header("Content-Length", length or str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler


def _error(code: str, json_protocol: bool) -> tuple[list[tuple[str, str]], bytes]:
    message = f"injected by harness/faults.py: {code}"
    if json_protocol:
        return ([("Content-Type", "application/x-amz-json-1.1")],
                json.dumps({"__type": code, "message": message}).encode())
    return ([("Content-Type", "text/xml")],
            (f"<Response><Errors><Error><Code>{code}</Code><Message>{message}</Message>"
             "</Error></Errors><RequestID>injected</RequestID></Response>").encode())
