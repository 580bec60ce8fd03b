"""The one exchange on the data-plane socket: a client hands the daemon a region's descriptor.

Protocol, in order, on a unix stream socket:
1. client -> daemon: one message, ``u32 length`` + JSON ``{"v": 1, "token": ..., "bytes": n}``,
   sent with the region's descriptor as SCM_RIGHTS ancillary data;
2. daemon -> client: ``u32 length`` + JSON ``{"ok": true, "region": handle, "instance": id,
   "bytes": n}`` or ``{"ok": false, "error": class name, "message": ...}``;
3. nothing more: the connection stays open for as long as the region is attached. Its end
   (close, or the client's death) detaches the region; any further byte from the client is a
   protocol violation that detaches it too.
The token is verified by the daemon's one call gate, exactly as for a gRPC call; the region is
then bound to that credential, and only calls authenticated with it may name the handle.

Bounds (the daemon reads hellos from any local process of its user, before authenticating it):
a message is at most ``MAX_MESSAGE`` bytes and a flat JSON object (``MAX_DEPTH``), checked before
it is parsed (``kvtier.bounded_json``); the daemon reads a hello incrementally (``HelloReader``),
never blocking on one client, and gives each at most a deadline to arrive (the listener's).
"""

from __future__ import annotations

import json
import os
import socket
import struct
from dataclasses import dataclass
from typing import Any

from kvtier.bounded_json import JsonRefused, loads_bounded
from kvtier.errors import InvalidRequest

VERSION = 1
#: Largest handshake message either way (a token of at most 4 KiB and a few numbers).
MAX_MESSAGE = 16 << 10
#: Messages are flat JSON objects.
MAX_DEPTH = 1
_LEN = struct.Struct(">I")


@dataclass(slots=True, frozen=True)
class Hello:
    token: str
    nbytes: int


@dataclass(slots=True, frozen=True)
class Attached:
    region: str
    instance: str
    nbytes: int


def _frame(doc: dict[str, Any]) -> bytes:
    body = json.dumps(doc).encode()
    if len(body) > MAX_MESSAGE:
        raise InvalidRequest(f"data-plane message of {len(body)} bytes exceeds {MAX_MESSAGE}")
    return _LEN.pack(len(body)) + body


def _parse(body: bytes) -> dict[str, Any]:
    try:
        doc = loads_bounded(body, max_bytes=MAX_MESSAGE, max_depth=MAX_DEPTH)
    except JsonRefused as exc:
        raise InvalidRequest(f"data-plane message refused: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidRequest("data-plane message must be a JSON object")
    return doc


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        got = sock.recv(n - len(out))
        if not got:
            raise ConnectionError("data-plane peer closed the connection mid-message")
        out += got
    return bytes(out)


# -- client side ----------------------------------------------------------------------------------
def send_hello(sock: socket.socket, hello: Hello, fd: int) -> None:
    socket.send_fds(sock, [_frame({"v": VERSION, "token": hello.token, "bytes": hello.nbytes})], [fd])


def read_reply(sock: socket.socket) -> Attached | tuple[str, str]:
    """The daemon's answer: ``Attached``, or ``(error class name, message)``."""
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > MAX_MESSAGE:
        raise InvalidRequest(f"data-plane reply of {n} bytes exceeds {MAX_MESSAGE}")
    doc = _parse(_recv_exact(sock, n))
    if doc.get("ok") is True:
        return Attached(str(doc["region"]), str(doc["instance"]), int(doc["bytes"]))
    return str(doc.get("error", "KvtierError")), str(doc.get("message", ""))


# -- daemon side ----------------------------------------------------------------------------------
class HelloReader:
    """One connection's hello, assembled from whatever a non-blocking read returns.

    Protocol: ``room()`` bytes at most for the next read -> ``feed(data, fds)`` until it returns
    the ``Hello`` -> ``take_fd()`` hands over the descriptor. ``feed`` raises InvalidRequest as
    soon as the bytes so far break a rule (a length over MAX_MESSAGE, bytes after the message, a
    descriptor too many or none, a body that is not a flat JSON hello). Invariant: until
    ``take_fd`` the reader owns every descriptor received, and ``close`` closes them.
    """

    __slots__ = ("_buf", "_fds", "_need")

    def __init__(self) -> None:
        self._buf = bytearray()
        self._fds: list[int] = []
        self._need: int | None = None  # whole message length, once the prefix is in

    def room(self) -> int:
        """How many bytes the next read may take: the rest of the message, and one more (a byte
        beyond it is a violation the next ``feed`` reports)."""
        total = _LEN.size + MAX_MESSAGE if self._need is None else self._need
        return total + 1 - len(self._buf)

    def feed(self, data: bytes, fds: list[int]) -> Hello | None:
        self._fds.extend(fds)
        if len(self._fds) > 1:
            raise InvalidRequest(f"a hello carries exactly one descriptor, got {len(self._fds)}")
        self._buf += data
        if self._need is None and len(self._buf) >= _LEN.size:
            (n,) = _LEN.unpack_from(self._buf)
            if n > MAX_MESSAGE:
                raise InvalidRequest(f"hello of {n} bytes exceeds {MAX_MESSAGE}")
            self._need = _LEN.size + n
        if self._need is None or len(self._buf) < self._need:
            return None
        if len(self._buf) > self._need:
            raise InvalidRequest("bytes after the hello")
        if not self._fds:
            raise InvalidRequest("a hello carries exactly one descriptor, got 0")
        return _hello_of(bytes(self._buf[_LEN.size :]))

    def take_fd(self) -> int:
        """The hello's descriptor; the caller owns it from here."""
        assert len(self._fds) == 1, "take_fd before a complete hello"
        return self._fds.pop()

    def close(self) -> None:
        while self._fds:
            os.close(self._fds.pop())


def _hello_of(body: bytes) -> Hello:
    doc = _parse(body)
    if doc.get("v") != VERSION:
        raise InvalidRequest(f"data-plane protocol version {doc.get('v')!r} is not {VERSION}")
    token, nbytes = doc.get("token"), doc.get("bytes")
    if not isinstance(token, str) or not isinstance(nbytes, int) or isinstance(nbytes, bool):
        raise InvalidRequest("hello needs a string token and an integer byte count")
    return Hello(token, nbytes)


def send_attached(sock: socket.socket, attached: Attached) -> None:
    sock.sendall(_frame({"ok": True, "region": attached.region, "instance": attached.instance,
                         "bytes": attached.nbytes}))


#: A refusal's message is cut to this many characters (it must fit a message).
MAX_REFUSAL_CHARS = 1024


def send_refusal(sock: socket.socket, error: Exception) -> None:
    sock.sendall(_frame({"ok": False, "error": type(error).__name__, "message": str(error)[:MAX_REFUSAL_CHARS]}))
