"""HeldWatch: which blocks a watcher follows this node still holds, told as changes.

An engine that reports kvtier's blocks in its own KV-event stream (connectors/vllm_events.py)
must hear when the node stops holding them: evicted, spilled to a slower tier, deleted, purged,
or no longer usable because the principal they were stored for was revoked. Tiers evict on
their own, so nothing announces a removal; instead each poll compares what the node holds now
with what it last told the watcher, for the watcher's own keys only.

Protocol, per stream (one watcher: an engine's scheduler), in call order::

    watch(owner, stream, principal, keys) -> Watched        # follow keys; the tier of each now
    changes(owner, stream, ack) -> HeldChanges               # what changed since the last answer
    changes(owner, stream, ack=<that answer's cursor>) ...   # applied: the next changes

``ack`` makes delivery at-least-once: an answer whose cursor the next call does not acknowledge
(lost on the way) is sent again, unchanged except for keys watched again since (a watch answer
is newer). ``instance`` names this watch table and the stream's state in it: when it changes
(the daemon restarted, or the stream was dropped for room), the watcher knows nothing it was
told still stands, watches its keys again and takes their tiers from that answer.

What counts as held: a key some *local* tier holds (the remote tier lives on no node and is
never named); not while its scope is being purged; for a key of a non-public scope, only while
the principal it was watched for may still read that scope (a revocation makes it gone).

Bounds: ``max_keys`` keys per stream (the oldest watched go first; one that was told held is
then told gone, so the watcher never keeps a block this table forgot), ``max_changes`` changes
per answer (the rest follow in the next), ``max_scan`` keys looked at per poll (round the
stream: with more keys than that, a change is told within ``ceil(keys / max_scan)`` polls),
``max_streams`` streams in all and ``max_streams_per_owner`` per owner (least recently used
dropped first). A poll's work is one batched ``holds`` per local tier over at most ``max_scan``
keys and one dictionary probe per key; the rules are asked once per domain and principal.

Invariants: a stream's ``keys`` hold exactly what it follows, each with the tier it was last
told (None: not held); ``pending`` is the one answer not yet acknowledged. Thread-safe (one lock;
a poll walks the store's index under it, ``max_keys`` keys at most).
"""

from __future__ import annotations

import secrets
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.errors import AccessDenied, InvalidRequest
from kvtier.keys import DOMAIN_BYTES, BlockKey, ScopeDomain, ScopeKind
from kvtier.security.policy import Policy, Principal
from kvtier.store.tiered_store import TieredStore

#: A stream's name: what the watcher calls it (several schedulers share one credential).
MAX_STREAM_CHARS = 64


@dataclass(slots=True, frozen=True)
class Watched:
    """A watch's answer: the tier that holds each key now (None: not held), aligned with the keys."""

    instance: str
    tiers: tuple[str | None, ...]


@dataclass(slots=True, frozen=True)
class HeldChanges:
    """A poll's answer: keys whose tier changed since the last answer (None: no longer held)."""

    instance: str
    cursor: int
    changes: tuple[tuple[BlockKey, str | None], ...]


@dataclass(slots=True)
class _Followed:
    principal: Principal
    #: Not of the public scope: held only while ``principal`` may read it.
    private: bool
    #: The tier the watcher was last told (None: not held).
    told: str | None
    #: ``principal.id`` (asked once per distinct principal and domain in a poll).
    pid: str = ""


@dataclass(slots=True)
class _Stream:
    epoch: int
    keys: OrderedDict[BlockKey, _Followed] = field(default_factory=OrderedDict)
    cursor: int = 0
    #: Where the next poll's scan starts (a poll looks at ``max_scan`` keys, round the stream).
    scan_at: int = 0
    #: The answer not yet acknowledged (key -> tier told), or None.
    pending: dict[BlockKey, str | None] | None = None
    #: Keys dropped for room after being told held: told gone in the next answer.
    forgotten: set[BlockKey] = field(default_factory=set)


def check_stream(name: str) -> str:
    """A stream name: 1-64 letters, digits, ``.``, ``_`` or ``-`` (InvalidRequest otherwise)."""
    if not 0 < len(name) <= MAX_STREAM_CHARS or not all(c.isalnum() or c in "._-" for c in name) \
            or not name.isascii():
        raise InvalidRequest(f"a watch stream is named by 1-{MAX_STREAM_CHARS} ASCII letters, digits, '.', '_' or '-'")
    return name


class HeldWatch:
    """The node's table of watched keys (see the module docstring)."""

    def __init__(self, store: TieredStore, policy: Policy, *, max_keys: int = 65536, max_changes: int = 16384,
                 max_scan: int = 16384, max_streams: int = 16, max_streams_per_owner: int = 8) -> None:
        if min(max_keys, max_changes, max_scan, max_streams, max_streams_per_owner) <= 0:
            raise ValueError("HeldWatch bounds must be positive")
        self.max_scan = max_scan
        self.store = store
        self.policy = policy
        self.max_keys = max_keys
        self.max_changes = max_changes
        self.max_streams = max_streams
        self.max_streams_per_owner = max_streams_per_owner
        #: This table's name: a restarted daemon has another, so its watchers start over.
        self._name = secrets.token_hex(8)
        self._epochs = 0
        self._lock = threading.Lock()
        self._streams: OrderedDict[tuple[str, str], _Stream] = OrderedDict()

    # -- the protocol -----------------------------------------------------------------------------
    def watch(self, owner: str, stream: str, principal: Principal, keys: Sequence[BlockKey]) -> Watched:
        """Follow ``keys`` for ``principal`` (every one must lie in a scope it may read, else
        AccessDenied and nothing is followed); the tier holding each now."""
        readable = {d: s.kind is not ScopeKind.PUBLIC for d, s in self.policy.readable_domains(principal).items()}
        pid = principal.id
        followed = []
        for i, k in enumerate(keys):
            private = readable.get(k[:DOMAIN_BYTES])
            if private is None:
                raise AccessDenied(f"key {i} lies in a scope principal {pid} cannot read: it may not watch it")
            followed.append((k, _Followed(principal, private, None, pid)))
        with self._lock:
            s = self._stream(owner, check_stream(stream))
            tiers = self._now(followed)
            pending = s.pending
            for (k, f), t in zip(followed, tiers, strict=True):
                f.told = t
                s.keys.pop(k, None)  # (re)inserted last: the most recently watched
                s.keys[k] = f
                s.forgotten.discard(k)
                if pending is not None:
                    pending.pop(k, None)  # this answer is newer than the unacknowledged one
            while len(s.keys) > self.max_keys:
                k, f = s.keys.popitem(last=False)
                if f.told is not None:
                    s.forgotten.add(k)
            return Watched(self._instance(s), tuple(tiers))

    def changes(self, owner: str, stream: str, ack: int) -> HeldChanges:
        """What changed since the last answer ``ack`` acknowledges (that answer again if it does not)."""
        with self._lock:
            s = self._stream(owner, check_stream(stream))
            if s.pending is not None:
                if ack != s.cursor:  # the last answer was not applied: send it again
                    return HeldChanges(self._instance(s), s.cursor, tuple(s.pending.items()))
                self._commit(s, s.pending)
                s.pending = None
            every = list(s.keys.items())
            start = s.scan_at % len(every) if every else 0
            followed = (every[start:] + every[:start])[: self.max_scan]
            now = self._now(followed)
            out: dict[BlockKey, str | None] = dict.fromkeys(list(s.forgotten)[: self.max_changes])
            seen = 0
            for (k, f), t in zip(followed, now, strict=True):
                if t != f.told:
                    if len(out) >= self.max_changes:
                        break  # the rest of the window is looked at again next time
                    out[k] = t
                seen += 1
            s.scan_at = start + seen
            if out:
                s.cursor += 1
                s.pending = out
            return HeldChanges(self._instance(s), s.cursor, tuple(out.items()))

    def streams(self) -> int:
        with self._lock:
            return len(self._streams)

    # -- internals --------------------------------------------------------------------------------
    def _instance(self, s: _Stream) -> str:
        return f"{self._name}.{s.epoch}"

    def _stream(self, owner: str, name: str) -> _Stream:
        """The stream (created empty, with a new epoch, if unknown), most recently used last."""
        key = (owner, name)
        s = self._streams.get(key)
        if s is not None:
            self._streams.move_to_end(key)
            return s
        mine = [k for k in self._streams if k[0] == owner]
        if len(mine) >= self.max_streams_per_owner:
            del self._streams[mine[0]]
        while len(self._streams) >= self.max_streams:
            self._streams.popitem(last=False)
        self._epochs += 1
        s = self._streams[key] = _Stream(self._epochs)
        return s

    @staticmethod
    def _commit(s: _Stream, told: dict[BlockKey, str | None]) -> None:
        """The watcher applied ``told``: remember it; keys told gone are followed no more."""
        for k, t in told.items():
            s.forgotten.discard(k)
            f = s.keys.get(k)
            if f is None:
                continue
            if t is None and f.told is not None:
                del s.keys[k]
            else:
                f.told = t

    def _now(self, followed: Sequence[tuple[BlockKey, _Followed]]) -> list[str | None]:
        """Where each followed key is held now, as the watcher may be told. The rules (a scope
        under purge, a principal that may no longer read) are asked once per domain and principal."""
        if not followed:
            return []
        tiers = self.store.local_tier_of([k for k, _ in followed])
        usable: dict[tuple[bytes, str], bool] = {}
        out: list[str | None] = []
        for (k, f), t in zip(followed, tiers, strict=True):
            if t is not None:
                at = (k[:DOMAIN_BYTES], f.pid if f.private else "")
                ok = usable.get(at)
                if ok is None:
                    ok = usable[at] = self._usable(at[0], f)
                if not ok:
                    t = None
            out.append(t)
        return out

    def _usable(self, domain: bytes, f: _Followed) -> bool:
        """Not being purged (gone for every reader), and, for a private scope, still readable by
        the principal it was watched for (not revoked)."""
        if self.store.fence.is_closed(ScopeDomain(domain)):
            return False
        return not f.private or ScopeDomain(domain) in self.policy.readable_domains(f.principal)


__all__ = ["HeldChanges", "HeldWatch", "Watched", "check_stream"]
