"""An HTTP fault-injecting proxy on 127.0.0.1 in front of the moto S3 server.

Requests pass through unchanged (Host header included, so SigV4 signatures stay valid) except
when a fault is drawn or a rule matches:

- "slowdown": answer 503 SlowDown (an S3 XML error), keep the connection;
- "error500": answer 500 InternalError;
- "reset": close the client connection with a TCP RST before anything is forwarded;
- "drop_response": forward the request, let the server act on it, then RST the client instead
  of relaying the reply (the client cannot know the write happened);
- "cut": forward the headers and half the body, then close both sides (an upload dying
  half-way);
- "not_found": answer 404 (e.g. a HEAD that misses an object another writer just created);
- `reject_if_none_match`: answer 501 NotImplemented to any request with If-None-Match, like a
  store without conditional writes.

Threads are bounded (`max_connections`); everything stops with `stop()`.
"""

from __future__ import annotations

import http.client
import http.server
import random
import socket
import struct
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

FAULT_KINDS = ("slowdown", "error500", "reset", "drop_response", "cut", "not_found")
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "upgrade", "expect"}


@dataclass
class Rule:
    """Apply `action` to requests for which `match(method, path)` is true, `times` times
    (None = always)."""

    match: Callable[[str, str], bool]
    action: str
    times: int | None = None


@dataclass
class FaultPlan:
    rate: float = 0.0  # fraction of requests that get a random fault
    kinds: tuple[str, ...] = ("slowdown", "reset")
    rules: list[Rule] = field(default_factory=list)
    reject_if_none_match: bool = False
    seed: int = 0


def _s3_error(status: int, code: str, message: str) -> tuple[int, bytes]:
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>{message}</Message><RequestId>fault-proxy</RequestId></Error>"
    ).encode()
    return status, body


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self, proxy: FaultProxy, max_connections: int) -> None:
        self.proxy = proxy
        self._slots = threading.BoundedSemaphore(max_connections)
        self.reset_sockets: set[int] = set()
        self.open_sockets: set[socket.socket] = set()
        self.sock_lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _Handler)

    def process_request(self, request, client_address):  # type: ignore[no-untyped-def]
        self._slots.acquire()  # bounded: at most max_connections handler threads
        with self.sock_lock:
            self.open_sockets.add(request)
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address):  # type: ignore[no-untyped-def]
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self.sock_lock:
                self.open_sockets.discard(request)
            self._slots.release()

    def shutdown_request(self, request):  # type: ignore[no-untyped-def]
        with self.sock_lock:
            reset = id(request) in self.reset_sockets
            self.reset_sockets.discard(id(request))
        if reset:
            # SO_LINGER 0 + close (no shutdown first, which would send a FIN) = a TCP RST.
            request.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            request.close()
        else:
            super().shutdown_request(request)


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 30  # idle keep-alive connections end on their own

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass

    def _handle(self) -> None:
        proxy: FaultProxy = self.server.proxy  # type: ignore[attr-defined]
        length = int(self.headers.get("Content-Length") or 0)
        if self.headers.get("Transfer-Encoding"):
            self._reply(*_s3_error(501, "NotImplemented", "fault proxy: chunked request bodies"))
            return
        action = proxy._draw(self.command, self.path, self.headers)
        if action == "cut":
            self._forward(self.rfile.read(length), cut=True)
            return
        body = self.rfile.read(length) if length else b""
        if action == "reset":
            self._reset()
        elif action == "slowdown":
            self._reply(*_s3_error(503, "SlowDown", "Please reduce your request rate."))
        elif action == "error500":
            self._reply(*_s3_error(500, "InternalError", "We encountered an internal error."))
        elif action == "not_found":
            self._reply(*_s3_error(404, "NoSuchKey", "The specified key does not exist."))
        elif action == "precondition_failed":
            self._reply(
                *_s3_error(412, "PreconditionFailed", "At least one of the pre-conditions did not hold")
            )
        elif action == "not_implemented":
            self._reply(
                *_s3_error(
                    501,
                    "NotImplemented",
                    "A header you provided implies functionality that is not implemented",
                )
            )
        else:
            self._forward(body, drop_response=action == "drop_response")

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

    def _reset(self) -> None:
        with self.server.sock_lock:  # type: ignore[attr-defined]
            self.server.reset_sockets.add(id(self.connection))  # type: ignore[attr-defined]
        self.close_connection = True

    def _reply(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _forward(self, body: bytes, cut: bool = False, drop_response: bool = False) -> None:
        proxy: FaultProxy = self.server.proxy  # type: ignore[attr-defined]
        upstream = http.client.HTTPConnection(proxy.upstream_host, proxy.upstream_port, timeout=30)
        try:
            upstream.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for name, value in self.headers.items():
                if name.lower() not in _HOP_BY_HOP:
                    upstream.putheader(name, value)
            upstream.endheaders()
            if cut:
                upstream.send(body[: len(body) // 2])
                upstream.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                upstream.close()
                self._reset()
                return
            if body:
                upstream.send(body)
            response = upstream.getresponse()
            payload = response.read()
            proxy._count(f"status_{response.status}")
            if drop_response:
                self._reset()
                return
            self.send_response_only(response.status, response.reason)
            for name, value in response.getheaders():
                if name.lower() in _HOP_BY_HOP or (
                    name.lower() == "content-length" and self.command != "HEAD"
                ):
                    continue
                self.send_header(name, value)
            if self.command != "HEAD":
                self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(payload)
        finally:
            upstream.close()


class FaultProxy:
    """Start with `start()`; `endpoint_url` is what the S3 client talks to; `stop()` ends it."""

    def __init__(
        self, upstream_host: str, upstream_port: int, plan: FaultPlan | None = None, max_connections: int = 64
    ):
        self.upstream_host, self.upstream_port = upstream_host, upstream_port
        self.plan = plan or FaultPlan()
        # "requests", "if_none_match", "status_NNN" (relayed replies), one entry per injected fault
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._random = random.Random(self.plan.seed)
        self._server = _Server(self, max_connections)
        self._thread = threading.Thread(target=self._server.serve_forever, name="fault-proxy", daemon=True)

    @property
    def endpoint_url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def set_plan(self, plan: FaultPlan) -> None:
        with self._lock:
            self.plan = plan
            self._random = random.Random(plan.seed)

    def _count(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1

    def _draw(self, method: str, path: str, headers: object) -> str | None:
        with self._lock:
            self.counts["requests"] += 1
            if headers.get("If-None-Match"):  # type: ignore[attr-defined]
                self.counts["if_none_match"] += 1
            plan = self.plan
            action = None
            if plan.reject_if_none_match and headers.get("If-None-Match"):  # type: ignore[attr-defined]
                action = "not_implemented"
            for rule in plan.rules:
                if action is None and (rule.times is None or rule.times > 0) and rule.match(method, path):
                    action = rule.action
                    if rule.times is not None:
                        rule.times -= 1
            if action is None and plan.rate > 0 and self._random.random() < plan.rate:
                action = self._random.choice(plan.kinds)
            if action:
                self.counts[action] += 1
            return action

    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        with self._server.sock_lock:
            sockets = list(self._server.open_sockets)
        for sock in sockets:  # wake handler threads parked on idle keep-alive connections
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._server.server_close()
        self._thread.join(timeout=5)
