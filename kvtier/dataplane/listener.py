"""DataPlaneListener: the daemon's unix socket where clients on its node attach shared memory.

gRPC stays the control plane. A client asks ``DataPlane`` where this socket is, connects, and
hands over a sealed memory file with its token (``kvtier.dataplane.handshake``); the listener
verifies the token through the call gate's ``credential`` (the same verification every gRPC call
gets), maps the region (``SharedRegion.adopt``: sealed memfds only, bounded size) and binds it to
that credential in the RegionTable. The connection then stays open and idle: when it ends, by a
close or by the client's death, the region is detached and its memory reclaimed.

The socket is created mode 0600 (renamed into place after the mode is set, so it is never
reachable with looser permissions): only processes of the daemon's user attach. Others (another
user, another node, another container) cannot, and their clients use the inline path.
"""

from __future__ import annotations

import logging
import os
import secrets
import selectors
import socket
import threading
from collections.abc import Callable
from pathlib import Path

from kvtier.dataplane.handshake import Attached, read_hello, send_attached, send_refusal
from kvtier.dataplane.region import RegionRefused, SharedRegion
from kvtier.dataplane.region_table import RegionTable, owner_of
from kvtier.errors import ConfigError, KvtierError
from kvtier.security.policy import Principal

log = logging.getLogger("kvtier.server")

#: Verifies a bearer token as a gRPC call's would be, returning the credential's principal.
Authenticate = Callable[[str], Principal]


class DataPlaneListener:
    """Accepts region attachments on ``path`` until ``close``.

    Invariants: one thread serves the socket (selector loop); each accepted connection holds at
    most one region, detached when the connection ends; a hello that fails (bad token, not a
    sealed memfd, too large, bounds reached) is answered with the error's class and message and
    leaves nothing attached. ``instance`` is random per daemon process, so a client that reached
    some other daemon's socket at the same path notices and stays inline.
    """

    def __init__(self, path: Path, table: RegionTable, authenticate: Authenticate) -> None:
        self.path = path
        self.table = table
        self._authenticate = authenticate
        self.instance = secrets.token_hex(8)
        self._sel = selectors.DefaultSelector()
        self._conns: dict[socket.socket, str | None] = {}
        self._stop = threading.Event()
        self._listen = self._bind(path)
        self._sel.register(self._listen, selectors.EVENT_READ)
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._run, name="kvtier-data-plane", daemon=True)
        self._thread.start()

    @staticmethod
    def _bind(path: Path) -> socket.socket:
        if len(os.fsencode(path)) >= 108:
            raise ConfigError(f"server.data_plane: socket path {path} is too long for a unix socket")
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(str(tmp))
            os.chmod(tmp, 0o600)
            os.replace(tmp, path)
            sock.listen(64)
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            tmp.unlink(missing_ok=True)
            raise ConfigError(f"server.data_plane: cannot listen on {path}: {exc}") from None
        return sock

    # -- the loop ---------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._sel.select():
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock is self._wake_r:
                    continue
                if sock is self._listen:
                    self._accept()
                elif self._conns.get(sock) is None:
                    self._hello(sock)
                else:
                    self._closed_or_violated(sock)

    def _accept(self) -> None:
        try:
            conn, _ = self._listen.accept()
        except BlockingIOError:
            return
        conn.setblocking(True)
        conn.settimeout(5.0)  # a hello is one small message; a client that stalls is dropped
        self._conns[conn] = None
        self._sel.register(conn, selectors.EVENT_READ)

    def _hello(self, conn: socket.socket) -> None:
        try:
            hello, fd = read_hello(conn)
            try:
                credential = self._authenticate(hello.token)
            except BaseException:
                os.close(fd)
                raise
            region = SharedRegion.adopt(fd, self.table.limits.max_region_bytes)  # owns fd from here
            if region.nbytes != hello.nbytes:
                region.close()
                raise RegionRefused(f"the hello says {hello.nbytes} bytes, the region has {region.nbytes}")
            handle = self.table.attach(owner_of(credential), region)
            self._conns[conn] = handle
            send_attached(conn, Attached(handle, self.instance, region.nbytes))
            log.info("region attached", extra={"event": "region_attached", "principal": credential.id,
                                               "bytes": region.nbytes})
        except KvtierError as exc:
            log.info("region refused", extra={"event": "region_refused", "error": str(exc)})
            try:
                send_refusal(conn, exc)
            except OSError:
                pass  # the client is gone: nothing to tell
            self._drop(conn)
        except (OSError, ConnectionError, ValueError) as exc:
            log.info("region refused", extra={"event": "region_refused", "error": f"{type(exc).__name__}: {exc}"})
            self._drop(conn)

    def _closed_or_violated(self, conn: socket.socket) -> None:
        # An attached connection says nothing more: readable means closed, reset, or a violation.
        try:
            conn.recv(1)
        except OSError:
            pass  # reset by a dying client: the same as a close
        self._drop(conn)

    def _drop(self, conn: socket.socket) -> None:
        handle = self._conns.pop(conn, None)
        self._sel.unregister(conn)
        conn.close()
        if handle is not None:
            self.table.detach(handle)
            log.info("region detached", extra={"event": "region_detached"})

    def close(self) -> None:
        self._stop.set()
        self._wake_w.send(b"x")
        self._thread.join(timeout=5)
        for conn in list(self._conns):
            self._drop(conn)
        self._sel.close()
        self._listen.close()
        self._wake_r.close()
        self._wake_w.close()
        self.path.unlink(missing_ok=True)
        self.table.close()
