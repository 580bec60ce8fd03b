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
"""

from __future__ import annotations

import json
import os
import socket
import struct
from dataclasses import dataclass
from typing import Any

from kvtier.errors import InvalidRequest

VERSION = 1
#: Largest handshake message either way (a token and a few numbers).
MAX_MESSAGE = 64 << 10
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
    assert len(body) <= MAX_MESSAGE
    return _LEN.pack(len(body)) + body


def _parse(body: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidRequest(f"data-plane message is not JSON ({exc})") from None
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
def read_hello(sock: socket.socket) -> tuple[Hello, int]:
    """The client's hello and the descriptor it carried (the caller owns the descriptor).
    Raises InvalidRequest for a malformed hello (closing any descriptor that came with it)."""
    data, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE + _LEN.size, 4)
    try:
        if len(fds) != 1:
            raise InvalidRequest(f"a hello carries exactly one descriptor, got {len(fds)}")
        if len(data) < _LEN.size:
            raise InvalidRequest("hello shorter than its length prefix")
        (n,) = _LEN.unpack_from(data)
        if n > MAX_MESSAGE:
            raise InvalidRequest(f"hello of {n} bytes exceeds {MAX_MESSAGE}")
        body = data[_LEN.size :]
        if len(body) < n:
            body += _recv_exact(sock, n - len(body))
        elif len(body) > n:
            raise InvalidRequest("bytes after the hello")
        doc = _parse(body)
        if doc.get("v") != VERSION:
            raise InvalidRequest(f"data-plane protocol version {doc.get('v')!r} is not {VERSION}")
        token, nbytes = doc.get("token"), doc.get("bytes")
        if not isinstance(token, str) or not isinstance(nbytes, int) or isinstance(nbytes, bool):
            raise InvalidRequest("hello needs a string token and an integer byte count")
        return Hello(token, nbytes), fds[0]
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def send_attached(sock: socket.socket, attached: Attached) -> None:
    sock.sendall(_frame({"ok": True, "region": attached.region, "instance": attached.instance,
                         "bytes": attached.nbytes}))


def send_refusal(sock: socket.socket, error: Exception) -> None:
    sock.sendall(_frame({"ok": False, "error": type(error).__name__, "message": str(error)}))
