"""Append-only, hash-chained audit log of grants, revocations and purges (who, what, when).

One JSON object per line. Each event carries the sha256 digest of its predecessor, so editing,
deleting or reordering lines breaks the chain and ``verify()`` names the first bad line. The log
is also the persistent state of revocations: the Policy rebuilds its revocation set by replaying
it, so a revocation survives a restart exactly when its audit record does.

Nothing secret is ever written here: events name principals, scopes and scope domains, never key
material (callers pass only ids; ``append`` refuses bytes values so a key cannot slip in).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.errors import CorruptRecord, InvalidRequest

GENESIS = "0" * 64
_MAX_LINE = 64 << 10
#: Longest free-text reason an action may carry (purge, revoke, grant); checked before acting.
MAX_REASON_CHARS = 1024
#: Longest target (scope name, revocation target) an audited action may name; checked before acting.
MAX_TARGET_CHARS = 512


def check_sizes(*, target: str | None = None, reason: str | None = None) -> None:
    """Refuse (InvalidRequest, INVALID_ARGUMENT on the wire) a target or reason too large to be
    audited, *before* the action runs: every action that runs must be audited in full, so one
    whose audit record could not be written must not start. The message quotes neither value."""
    if target is not None and (not isinstance(target, str) or len(target) > MAX_TARGET_CHARS):
        raise InvalidRequest(f"target/scope name longer than {MAX_TARGET_CHARS} characters")
    if reason is not None and (not isinstance(reason, str) or len(reason) > MAX_REASON_CHARS):
        raise InvalidRequest(f"reason longer than {MAX_REASON_CHARS} characters")


@dataclass(slots=True, frozen=True)
class AuditEvent:
    """One recorded action. ``digest`` = sha256(prev || canonical json of the other fields)."""

    seq: int
    at: float
    actor: str
    action: str
    target: str
    detail: dict[str, Any]
    prev: str
    digest: str

    def body(self) -> dict[str, Any]:
        return {"seq": self.seq, "at": self.at, "actor": self.actor, "action": self.action,
                "target": self.target, "detail": self.detail}


def _digest(prev: str, body: dict[str, Any]) -> str:
    canon = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(prev.encode() + canon.encode()).hexdigest()


def _plain(value: Any, where: str) -> Any:
    """Only JSON scalars, lists and str-keyed maps; bytes are refused so key material cannot leak in."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [_plain(v, where) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _plain(v, where) for k, v in value.items()}
    raise TypeError(f"audit detail {where!r} must be JSON scalars, lists or str-keyed maps, not {type(value).__name__}")


class AuditLog:
    """The log file at ``path`` (created 0600).

    Invariants: lines are only ever appended (O_APPEND) and each append is fsynced before it
    returns, so an acknowledged event survives a crash. Appends are serialised by ``_lock`` within
    the process and by an exclusive ``flock`` across processes; under that lock the tail is re-read
    when another process grew the file, so the chain stays linear. A torn last line (a crash in
    the middle of an append that was never acknowledged) is cut off on open.
    """

    def __init__(self, path: str | os.PathLike[str], *, clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._clock = clock
        self._lock = threading.Lock()
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        os.fchmod(self._fd, 0o600)  # a log created earlier under a looser rule is tightened too
        self._size = -1
        self._tail: tuple[int, str] = (0, GENESIS)
        with self._locked():
            self._repair_torn_tail()
            self._tail = self._scan_tail()

    # -- writing ----------------------------------------------------------------------------------
    def append(self, actor: str, action: str, target: str, **detail: Any) -> AuditEvent:
        body_detail = _plain(detail, action)
        with self._locked():
            if os.fstat(self._fd).st_size != self._size:
                self._tail = self._scan_tail()  # another process appended since our last look
            seq, prev = self._tail
            body = {"seq": seq + 1, "at": float(self._clock()), "actor": str(actor), "action": str(action),
                    "target": str(target), "detail": body_detail}
            digest = _digest(prev, body)
            line = json.dumps(body | {"prev": prev, "digest": digest}, sort_keys=True, separators=(",", ":"))
            data = (line + "\n").encode()
            if len(data) > _MAX_LINE:
                raise InvalidRequest("audit event too large")
            os.write(self._fd, data)
            os.fsync(self._fd)
            self._size = os.fstat(self._fd).st_size
            self._tail = (seq + 1, digest)
            return AuditEvent(seq + 1, body["at"], body["actor"], action, body["target"], body_detail, prev, digest)

    # -- reading ----------------------------------------------------------------------------------
    def events(self, action: str | None = None) -> list[AuditEvent]:
        """Every event in order (verifying the chain); optionally only one action."""
        return [e for e in self._read_all() if action is None or e.action == action]

    def verify(self) -> int:
        """Check the whole chain; returns the number of events, raises CorruptRecord at the first bad line."""
        return len(self._read_all())

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    # -- internals --------------------------------------------------------------------------------
    def _locked(self) -> _FileLock:
        return _FileLock(self._lock, self._fd)

    @staticmethod
    def read(path: str | os.PathLike[str]) -> list[AuditEvent]:
        """Every event of the log at ``path``, chain verified, without opening it for writing."""
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"audit log {p} does not exist")
        return _read_events(p)

    def _read_all(self) -> list[AuditEvent]:
        return _read_events(self.path)

    def _scan_tail(self) -> tuple[int, str]:
        events = self._read_all()
        self._size = os.fstat(self._fd).st_size
        return (events[-1].seq, events[-1].digest) if events else (0, GENESIS)

    def _repair_torn_tail(self) -> None:
        size = os.fstat(self._fd).st_size
        if size == 0:
            return
        with open(self.path, "rb") as f:
            data = f.read()
        cut = data.rfind(b"\n") + 1
        if cut != size:
            os.truncate(self.path, cut)
            os.fsync(self._fd)


def _read_events(path: Path) -> list[AuditEvent]:
    out: list[AuditEvent] = []
    prev, seq = GENESIS, 0
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            if not raw.endswith(b"\n"):
                break  # torn tail written by a crashed append; never acknowledged
            ev = _parse(raw, n)
            if ev.prev != prev or ev.seq != seq + 1 or _digest(prev, ev.body()) != ev.digest:
                raise CorruptRecord(f"audit log {path} hash chain broken at line {n}")
            out.append(ev)
            prev, seq = ev.digest, ev.seq
    return out


def _parse(raw: bytes, n: int) -> AuditEvent:
    try:
        d = json.loads(raw)
        return AuditEvent(int(d["seq"]), float(d["at"]), str(d["actor"]), str(d["action"]), str(d["target"]),
                          dict(d["detail"]), str(d["prev"]), str(d["digest"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptRecord(f"audit log line {n} is malformed: {type(exc).__name__}") from None


class _FileLock:
    """Thread lock plus an exclusive flock on the log file, held together."""

    __slots__ = ("_fd", "_lock")

    def __init__(self, lock: threading.Lock, fd: int) -> None:
        self._lock = lock
        self._fd = fd

    def __enter__(self) -> None:
        self._lock.acquire()
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        except OSError:
            self._lock.release()
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._lock.release()
