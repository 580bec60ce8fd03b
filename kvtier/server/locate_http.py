"""Locate's HTTP/JSON twin: ``POST /v1/locate`` on ``locate.http_listen``.

For routers that speak HTTP rather than gRPC. It is the same call as the RPC, made of the same
parts: the bearer token in ``Authorization`` is verified by the daemon's CallGate (verifier,
revocation, salt rules), the call is admitted under the same concurrency limit and counted in the
same metrics (as method ``LocateHTTP``), the method check (a ``router`` calls Locate only) is the
access gate's, and the answer is the same Locator's, written by ``located_json``. A kvtier error
becomes the HTTP status of its gRPC code (``HTTP_STATUS``) and a body
``{"error": {"code": "<gRPC code name>", "message": "..."}}``. Nothing of a request is logged.

Served by the standard library's threading HTTP server (one thread per connection), with TLS
from ``server.tls_*`` when the daemon has it.
"""

from __future__ import annotations

import json
import logging
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc

from kvtier.errors import InvalidRequest, KvtierError, TierUnavailable
from kvtier.rpc.names import AUTH_METADATA
from kvtier.rpc.status import status_of
from kvtier.security.gate import AccessGate
from kvtier.security.secrets import read_public_file
from kvtier.server.auth import CallGate
from kvtier.server.locate import Locator
from kvtier.server.locate_wire import located_json, query_from_json

log = logging.getLogger("kvtier.server")

PATH = "/v1/locate"
#: How this front's calls are named in the daemon's call metrics.
METHOD = "LocateHTTP"
#: A body larger than this is refused unread (413): 131072 token ids in JSON fit in ~1.5 MB.
MAX_BODY_BYTES = 8 << 20

#: gRPC status code -> HTTP status: the error table's codes as an HTTP client knows them.
HTTP_STATUS: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.FAILED_PRECONDITION: 412,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}

Answer = tuple[int, dict[str, Any]]


class HttpLocate:
    """One Locate over HTTP, from header and body to status and JSON (see the module docstring).

    Thread-safe: every part it holds is.
    """

    def __init__(self, calls: CallGate, access: AccessGate, locator: Locator) -> None:
        self.calls = calls
        self.access = access
        self.locator = locator
        self._draining = False

    def drain(self) -> None:
        """Refuse new calls (503) while the daemon shuts down."""
        self._draining = True

    def answer(self, authorization: str | None, body: bytes) -> Answer:
        metrics = self.calls.metrics
        metrics.call_started(METHOD)
        t0 = time.monotonic()
        entered = False
        try:
            if self._draining:
                raise TierUnavailable("the daemon is shutting down")
            metadata = [(AUTH_METADATA, authorization)] if authorization is not None else []
            credential, principal = self.calls.authenticate(metadata)
            self.calls.limit.try_enter()
            entered = True
            self.access.require_method(principal, "Locate")
            self.access.require_method(credential, "Locate")
            try:
                data = json.loads(body)
            except (ValueError, UnicodeDecodeError):
                raise InvalidRequest("the body is not JSON") from None
            query = query_from_json(data, self.locator.settings.max_keys)
            return 200, located_json(self.locator.locate(credential, principal, query))
        except KvtierError as exc:
            code = status_of(exc)
            metrics.call_failed(METHOD, code.name)
            return HTTP_STATUS.get(code, 500), {"error": {"code": code.name, "message": str(exc)}}
        except Exception:
            metrics.call_failed(METHOD, grpc.StatusCode.UNKNOWN.name)
            log.exception("call crashed", extra={"event": "call_crashed", "method": METHOD})
            return 500, {"error": {"code": grpc.StatusCode.UNKNOWN.name, "message": "internal error"}}
        finally:
            if entered:
                self.calls.limit.exit()
            metrics.call_finished(METHOD, time.monotonic() - t0)


class _Handler(BaseHTTPRequestHandler):
    server_version = "kvtier-locate"
    protocol_version = "HTTP/1.1"
    #: Seconds a connection may sit idle (or mid-request) before its thread lets it go.
    timeout = 30

    def do_POST(self) -> None:
        if self.path != PATH:
            self._send(404, {"error": {"code": "NOT_FOUND", "message": f"no such path; POST {PATH}"}})
            return
        raw = self.headers.get("Content-Length")
        if raw is None or not raw.isdigit():
            self._send(411, {"error": {"code": "INVALID_ARGUMENT", "message": "a Content-Length is required"}})
            return
        n = int(raw)
        if n > MAX_BODY_BYTES:
            self.close_connection = True  # the body is not read
            self._send(413, {"error": {"code": "INVALID_ARGUMENT",
                                       "message": f"the body is {n} bytes; at most {MAX_BODY_BYTES}"}})
            return
        front: HttpLocate = self.server.front  # type: ignore[attr-defined]
        self._send(*front.answer(self.headers.get("Authorization"), self.rfile.read(n)))

    def do_GET(self) -> None:
        self._send(405, {"error": {"code": "INVALID_ARGUMENT", "message": f"POST {PATH} with a JSON body"}})

    def _send(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload, separators=(",", ":")).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # request lines are not logged: the daemon logs calls without their contents


class LocateHttpServer:
    """The listener: ``HttpLocate`` on ``host:port`` (port 0: any free port), TLS with ``tls``.

    Lifecycle: constructed bound and serving on its own thread; ``close`` stops it and waits.
    """

    def __init__(self, front: HttpLocate, host: str, port: int, tls: ssl.SSLContext | None = None) -> None:
        self.front = front
        self._httpd = ThreadingHTTPServer((host, port), _Handler)
        self._httpd.daemon_threads = True
        self._httpd.front = front  # type: ignore[attr-defined]
        if tls is not None:
            # The handshake happens in each connection's own thread, on its first read.
            self._httpd.socket = tls.wrap_socket(self._httpd.socket, server_side=True,
                                                 do_handshake_on_connect=False)
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="kvtier-locate-http", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    def close(self) -> None:
        self.front.drain()
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()


def tls_context(cert: str, key: str, client_ca: str | None) -> ssl.SSLContext:
    """A server TLS context from the daemon's ``server.tls_*`` files (mutual TLS with a client CA)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    if client_ca is not None:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(cadata=read_public_file(client_ca, "server.tls_client_ca").decode())
    return ctx
