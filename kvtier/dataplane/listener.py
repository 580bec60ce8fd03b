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

No single connection can stop the listener. Hellos are read before anything is authenticated,
so each is treated as hostile: every socket is non-blocking and one selector loop reads whatever
each connection has sent so far (``HelloReader``), so a client that trickles its hello holds
nobody else up; a message is bounded in size and nesting before it is parsed; a hello must
arrive within ``hello_deadline_s`` of the connection; at most ``max_pending`` connections may
be mid-hello (the oldest is let go for a new one); and anything unexpected raised while serving
one connection is logged with its traceback, counted (``crashed``), answered with a generic
refusal and ends that connection only. Every outcome is counted (``counts``, on /metrics as
``kvtier_data_plane_connections_total``).
"""

from __future__ import annotations

import logging
import os
import secrets
import selectors
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvtier.dataplane.handshake import Attached, Hello, HelloReader, send_attached, send_refusal
from kvtier.dataplane.region import RegionRefused, SharedRegion
from kvtier.dataplane.region_table import RegionTable, owner_of
from kvtier.errors import ConfigError, InvalidRequest, KvtierError, Overloaded
from kvtier.security.policy import Principal

log = logging.getLogger("kvtier.server")

#: Verifies a bearer token as a gRPC call's would be, returning the credential's principal.
Authenticate = Callable[[str], Principal]

#: What became of connections, as counted: a region attached; a hello refused (bad token, bad
#: region, malformed, bounds); a hello not complete by its deadline; a pending hello let go for a
#: newer connection; a client gone before its hello was complete; an unexpected error while
#: serving one connection; an attached region's connection ended; an accept that failed.
OUTCOMES = ("attached", "refused", "timed_out", "evicted", "abandoned", "crashed", "detached", "accept_failed")


@dataclass(slots=True, frozen=True)
class ListenerLimits:
    #: Seconds from accepting a connection to its complete hello (a client sends it at once).
    hello_deadline_s: float = 5.0
    #: Connections mid-hello at once; beyond it the oldest is let go.
    max_pending: int = 64
    #: Connections accepted per turn of the loop, so reads are never starved by a flood.
    accept_batch: int = 32


@dataclass(slots=True)
class _Pending:
    reader: HelloReader
    deadline: float


class DataPlaneListener:
    """Accepts region attachments on ``path`` until ``close``.

    Invariants: one thread serves the socket (a selector loop over non-blocking sockets; nothing
    in it waits on a client); each connection is either pending (a ``HelloReader`` with a deadline,
    at most ``limits.max_pending`` of them) or attached (holding exactly one region, detached when
    the connection ends); a hello that fails is answered with the error's class and message and
    leaves nothing attached; an error in serving one connection ends that connection, never the
    loop. ``instance`` is random per daemon process, so a client that reached some other daemon's
    socket at the same path notices and stays inline.
    """

    def __init__(self, path: Path, table: RegionTable, authenticate: Authenticate,
                 limits: ListenerLimits | None = None) -> None:
        self.path = path
        self.table = table
        self.limits = limits or ListenerLimits()
        self._authenticate = authenticate
        self.instance = secrets.token_hex(8)
        self._sel = selectors.DefaultSelector()
        # Insertion order is accept order: the first pending entry is the oldest.
        self._conns: dict[socket.socket, _Pending | str] = {}
        self._counts: Counter[str] = Counter()
        self._counts_lock = threading.Lock()
        self._stop = threading.Event()
        self._listen = self._bind(path)
        self._sel.register(self._listen, selectors.EVENT_READ)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
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

    def counts(self) -> dict[str, int]:
        """How many connections ended each way so far (every outcome of OUTCOMES, zeros included)."""
        with self._counts_lock:
            return {k: self._counts[k] for k in OUTCOMES}

    def _count(self, outcome: str) -> None:
        assert outcome in OUTCOMES, outcome
        with self._counts_lock:
            self._counts[outcome] += 1

    # -- the loop ---------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._turn()
            except Exception:
                # A bug in the loop's own bookkeeping, outside any one connection: counted and
                # logged; the loop goes on (after a pause, so a persistent fault cannot spin).
                self._count("crashed")
                log.exception("data-plane loop error", extra={"event": "data_plane_crashed"})
                self._stop.wait(0.1)

    def _turn(self) -> None:
        events = self._sel.select(self._until_next_deadline())
        # Connections first, the listening socket last: a hello already sent is read before a
        # flood of new connections can push its connection out of the pending set.
        accept = False
        for key, _ in events:
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            if sock is self._wake_r:
                self._drain_wake()
            elif sock is self._listen:
                accept = True
            else:
                self._serve(sock)
        if accept:
            self._accept()
        self._expire()

    def _until_next_deadline(self) -> float | None:
        oldest = next((s for s in self._conns.values() if isinstance(s, _Pending)), None)
        return None if oldest is None else max(0.0, oldest.deadline - time.monotonic())

    def _drain_wake(self) -> None:
        try:
            self._wake_r.recv(64)
        except BlockingIOError:
            pass

    def _accept(self) -> None:
        for _ in range(self.limits.accept_batch):
            try:
                conn, _ = self._listen.accept()
            except BlockingIOError:
                return
            except OSError as exc:  # out of descriptors, most likely: the pending set is the cure
                self._count("accept_failed")
                log.warning("data-plane accept failed", extra={"event": "data_plane_accept_failed",
                                                                "error": f"{type(exc).__name__}: {exc}"})
                self._evict_oldest()
                return
            conn.setblocking(False)
            if self._pending() >= self.limits.max_pending:
                self._evict_oldest()
            self._conns[conn] = _Pending(HelloReader(), time.monotonic() + self.limits.hello_deadline_s)
            self._sel.register(conn, selectors.EVENT_READ)

    def _pending(self) -> int:
        return sum(isinstance(s, _Pending) for s in self._conns.values())

    def _evict_oldest(self) -> None:
        oldest = next((c for c, s in self._conns.items() if isinstance(s, _Pending)), None)
        if oldest is not None:
            self._count("evicted")
            self._refuse(oldest, Overloaded("too many connections are mid-hello: this one waited longest"))

    def _expire(self) -> None:
        now = time.monotonic()
        late = [c for c, s in self._conns.items() if isinstance(s, _Pending) and s.deadline <= now]
        for conn in late:
            self._count("timed_out")
            self._refuse(conn, InvalidRequest(
                f"the hello did not arrive within {self.limits.hello_deadline_s:g} s of connecting"))

    # -- one connection ---------------------------------------------------------------------------
    def _serve(self, conn: socket.socket) -> None:
        state = self._conns.get(conn)
        if state is None:
            return  # dropped earlier in this turn
        try:
            if isinstance(state, _Pending):
                self._read_hello(conn, state)
            else:
                self._closed_or_violated(conn)
        except KvtierError as exc:
            self._count("refused")
            log.info("region refused", extra={"event": "region_refused", "error": str(exc)})
            self._refuse(conn, exc)
        except Exception:
            # A bug met by this connection alone: the client is told only that it failed.
            self._count("crashed")
            log.exception("data-plane connection crashed", extra={"event": "data_plane_crashed"})
            self._refuse(conn, KvtierError("the daemon could not attach the region (an internal error, logged)"))

    def _read_hello(self, conn: socket.socket, pending: _Pending) -> None:
        try:
            data, fds, flags, _ = socket.recv_fds(conn, pending.reader.room(), 2)
        except BlockingIOError:
            return
        except OSError:
            self._count("abandoned")
            self._drop(conn)
            return
        if flags & socket.MSG_CTRUNC:
            pending.reader.feed(b"", fds)
            raise InvalidRequest("a hello carries exactly one descriptor, got more")
        hello = pending.reader.feed(data, fds)
        if hello is not None:
            self._attach(conn, hello, pending.reader.take_fd())
        elif not data:
            self._count("abandoned")  # the client closed mid-hello
            self._drop(conn)

    def _attach(self, conn: socket.socket, hello: Hello, fd: int) -> None:
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
        self._count("attached")
        try:
            send_attached(conn, Attached(handle, self.instance, region.nbytes))
        except OSError:
            self._drop(conn)  # the client is gone already: its region goes with it
            return
        log.info("region attached", extra={"event": "region_attached", "principal": credential.id,
                                           "bytes": region.nbytes})

    def _closed_or_violated(self, conn: socket.socket) -> None:
        # An attached connection says nothing more: readable means closed, reset, or a violation.
        try:
            conn.recv(1)
        except BlockingIOError:
            return  # a spurious wake-up: still attached
        except OSError:
            pass  # reset by a dying client: the same as a close
        self._drop(conn)

    def _refuse(self, conn: socket.socket, exc: KvtierError) -> None:
        try:
            send_refusal(conn, exc)
        except OSError:
            pass  # the client is gone, or not reading: nothing more to tell it
        self._drop(conn)

    def _drop(self, conn: socket.socket) -> None:
        state = self._conns.pop(conn, None)
        try:
            self._sel.unregister(conn)
        except (KeyError, ValueError):
            pass  # already unregistered
        conn.close()
        if isinstance(state, _Pending):
            state.reader.close()
        elif state is not None:
            self.table.detach(state)
            self._count("detached")
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
