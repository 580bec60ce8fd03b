"""Revocations and grants shared through the remote tier's bucket, so every node sharing it
refuses a revoked principal without waiting for a restart.

Format v2 (what nodes write). Each node has an opaque random id (``node_id``, 16 hex
characters) and numbers its changes 1, 2, 3, ...; a node with a state directory (``FeedState``:
a daemon with an audit log) keeps both across restarts, else they are new at every start:

- ``<prefix>/_revocations/<node id>/<seq, 12 digits>``: one change, AES-256-GCM under a key
  derived from the deployment's server secret, with the object's name as associated data. A
  bucket reader learns the node id, the sequence number, the time and the size; never a tenant,
  user, credential, actor, reason or host.
- ``<prefix>/_revocations/<node id>/head``: the node's highest sequence number and, for each
  number, the *target id* of its change (HMAC-SHA256 of the target under another derived key,
  128 bits) and its *change id* (the same over target, direction, time and origin): sealed the
  same way, rewritten after every change and whenever it is missing.

A reader applies every record that opens (last writer wins per target, in Policy). A record that
is missing or does not open, below a sequence number the reader knows of (a later record, or the
node's head), is a *gap*: the reader holds the gap's target id (from the head: every principal
the target names is refused) until the record is back; a gap whose target it cannot know (no
head lists it), a head that disappeared after it was seen, or a head whose number went back
(an old head copied over a new one) holds *every* non-operator principal until resolved. A gap
whose change the reader already knows (it opened the same change under another name: a node
republished it) is no gap. The writing node lists its own records on every tick and puts back
any that disappeared, so a deleted record is restored within one interval while its node runs,
and, with a state directory, again when it starts after a stop. A reader with a state directory
remembers what it saw of every other node across its own restarts, so a restart neither forgets
a hold nor admits what it held. A record or head listed but gone when fetched counts as
missing. Someone who can write the bucket but lacks the secret can delay a change by deleting
it, never cancel it silently; ``present`` (which changes the feed holds now) lets the caller put
back changes whose every record is gone (kvtier/security/revocations.py republishes them).

Format v1 records (``<at ns>-<origin>-<random>`` at the top of the feed, JSON tagged with
HMAC-SHA256) from nodes of earlier releases are still read and applied; they carry identities in
clear, so delete them once every node runs v2. Failures of the endpoint raise TierUnavailable.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import re
import secrets
import threading
from dataclasses import dataclass, field
from typing import Any

import botocore.exceptions as bce
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvtier.errors import CorruptRecord
from kvtier.security.policy import RevocationChange
from storage_backends.s3.config import S3Config
from storage_backends.s3.feed_state import OWN, SEEN, FeedState
from storage_backends.s3.objects import S3Objects

FEED_DIR = "_revocations"
#: A change's record is a few hundred bytes; anything larger is not one of ours.
MAX_RECORD_BYTES = 16 << 10
#: A head lists one target id per change of its node's run (about 50 bytes each).
MAX_HEAD_BYTES = 8 << 20
HEAD = "head"
_V2_NAME = re.compile(r"([0-9a-f]{16})/(\d{12}|head)")
_AAD = b"kvtier-revocation-v2\x00"
#: A listed object that was deleted before its GET (a 404 from the endpoint).
_GONE = object()


@dataclass(slots=True, frozen=True)
class FeedRead:
    """What one read of the feed found: changes not seen before (verified), and the names of
    records that failed verification."""

    changes: list[RevocationChange]
    rejected: list[str]
    #: Target ids (``target_id``) to refuse until their missing record is read.
    holds: frozenset[str] = frozenset()
    #: A gap whose target cannot be known: refuse every non-operator principal until resolved.
    hold_all: bool = False
    #: Why, for logs and metrics: gap / unknown_gap / head_missing / head_rollback -> count.
    problems: dict[str, int] = field(default_factory=dict)
    #: Change ids (``change_id``) of the changes the feed holds now: this node's own records
    #: and every other node's that is listed and was opened.
    present: frozenset[str] = frozenset()
    #: The nodes whose feed makes this reader hold everyone (for the operator: logs).
    holding_nodes: tuple[str, ...] = ()


@dataclass(slots=True)
class _Origin:
    """What this reader knows of one other node's feed (v2)."""

    have: dict[int, str] = field(default_factory=dict)  # seq -> change id of each record read and opened
    head_etag: str | None = None
    head_seq: int = 0
    targets: dict[int, str] = field(default_factory=dict)  # seq -> target id, from the head
    changes: dict[int, str] = field(default_factory=dict)  # seq -> change id, from the head

    def to_doc(self) -> dict[str, Any]:
        return {"have": {str(k): v for k, v in self.have.items()}, "head_etag": self.head_etag,
                "head_seq": self.head_seq, "targets": {str(k): v for k, v in self.targets.items()},
                "changes": {str(k): v for k, v in self.changes.items()}}

    @classmethod
    def of_doc(cls, d: dict[str, Any]) -> _Origin:
        return cls({int(k): str(v) for k, v in d["have"].items()},
                   None if d["head_etag"] is None else str(d["head_etag"]), int(d["head_seq"]),
                   {int(k): str(v) for k, v in d["targets"].items()},
                   {int(k): str(v) for k, v in d["changes"].items()})


@dataclass(slots=True, frozen=True)
class _Mine:
    """One of this node's records: its target and change ids, and the record as sealed."""

    target_id: str
    change_id: str
    sealed: bytes


class S3RevocationFeed(S3Objects):
    """The bucket's revocation feed: this node's records and head (``publish``, ``maintain``)
    and every other node's (``read_new``). ``read_new`` lists the whole feed each time, fetches
    only records it has not opened and heads whose ETag changed, and reports the gaps.

    Invariants: ``_seq`` only grows and every number it took is in ``_mine`` (so ``maintain``
    can put back any record), durably before the record is written when there is a ``state``;
    a reader's ``_Origin.have`` only grows and is committed only after a whole read succeeded, so
    a change is handed out exactly once per process, and is saved (``checkpoint``) only once the
    caller applied what it was handed, so a crash re-reads a change and never skips one; ``_seen``
    only grows (names refused once). ``_pub_lock`` serialises publish and maintain; reading and
    ``checkpoint`` belong to one thread.
    """

    what = "revocation feed"

    def __init__(self, config: S3Config, key: bytes, *, state: FeedState | None = None,
                 retired: frozenset[str] = frozenset()) -> None:
        if len(key) < 32:
            raise ValueError("revocation feed key must be at least 32 bytes")
        super().__init__(config, FEED_DIR)
        self._key = key
        self._seen: set[str] = set()
        self._aead = AESGCM(hmac.new(key, b"kvtier-revocation-seal-v2", hashlib.sha256).digest())
        self._id_key = hmac.new(key, b"kvtier-revocation-target-id-v2", hashlib.sha256).digest()
        #: This node's opaque id in the feed (random; kept across restarts with a ``state``).
        self.node_id = secrets.token_hex(8)
        self._pub_lock = threading.Lock()
        self._seq = 0
        self._mine: dict[int, _Mine] = {}
        self._etags: dict[int, str] = {}  # seq -> ETag of the record as this node last wrote it
        self._head_etag: str | None = None
        self._origins: dict[str, _Origin] = {}
        #: Nodes an operator declared gone for good (``security.revocation_retired_nodes``): their
        #: records are still read, but nothing of theirs that is missing holds anyone.
        self.retired = retired
        self.repaired = 0
        self._state = state
        if state is not None:
            self._restore(state)

    # -- durable state ----------------------------------------------------------------------------
    def _restore(self, state: FeedState) -> None:
        own, seen = state.load(OWN), state.load(SEEN)
        try:
            if own is not None:
                self.node_id = str(own["node_id"])
                self._seq = int(own["seq"])
                self._mine = {int(k): _Mine(str(v["tid"]), str(v["cid"]), base64.b64decode(v["sealed"]))
                              for k, v in own["mine"].items()}
                self._etags = {int(k): str(v) for k, v in own["etags"].items()}
                self._head_etag = own["head_etag"]
            if seen is not None:
                self._origins = {str(n): _Origin.of_doc(d) for n, d in seen["origins"].items()}
        except (KeyError, TypeError, ValueError, AttributeError):
            raise CorruptRecord(f"revocation feed state in {state.path} is malformed: move it away to start "
                                "the feed afresh (see docs/security.md 2.5)") from None
        if _V2_NAME.fullmatch(f"{self.node_id}/head") is None or set(self._mine) != set(range(1, self._seq + 1)):
            raise CorruptRecord(f"revocation feed state in {state.path} is inconsistent: move it away to start "
                                "the feed afresh (see docs/security.md 2.5)")
        if own is None:
            self._save_own()  # the id is this node's from its first start on

    def _save_own(self) -> None:
        if self._state is None:
            return
        self._state.save(OWN, {
            "node_id": self.node_id, "seq": self._seq, "head_etag": self._head_etag,
            "mine": {str(k): {"tid": m.target_id, "cid": m.change_id, "sealed": base64.b64encode(m.sealed).decode()}
                     for k, m in self._mine.items()},
            "etags": {str(k): v for k, v in self._etags.items()}})

    def checkpoint(self) -> None:
        """Save what this reader knows of the other nodes (call once the changes ``read_new``
        handed out are applied)."""
        if self._state is not None:
            self._state.save(SEEN, {"origins": {n: o.to_doc() for n, o in self._origins.items()}})

    # -- v2: sealed records and heads ---------------------------------------------------------------
    def target_id(self, target: str) -> str:
        """The opaque id of a typed target (``principal:acme/alice``) in heads and holds."""
        return hmac.new(self._id_key, target.encode(), hashlib.sha256).hexdigest()[:32]

    def change_id(self, change: RevocationChange) -> str:
        """The opaque id of one change (target, direction, time and node made): the same change
        published again, under any name, has the same id."""
        what = json.dumps(["change", change.target, change.revoked, change.at, change.origin], separators=(",", ":"))
        return hmac.new(self._id_key, what.encode(), hashlib.sha256).hexdigest()[:32]

    def _seal(self, rel: str, body: dict[str, Any]) -> bytes:
        nonce = os.urandom(12)
        data = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        return nonce + self._aead.encrypt(nonce, data, _AAD + rel.encode())

    def _open(self, rel: str, raw: bytes) -> dict[str, Any]:
        try:
            body = json.loads(self._aead.decrypt(raw[:12], raw[12:], _AAD + rel.encode()))
        except (InvalidTag, ValueError, UnicodeDecodeError):
            raise CorruptRecord("revocation record does not open (not written by a node of this deployment, "
                                "or moved)") from None
        if not isinstance(body, dict) or body.get("v") != 2:
            raise CorruptRecord("revocation record has an unknown version")
        return body

    def seal_change(self, rel: str, seq: int, change: RevocationChange) -> bytes:
        return self._seal(rel, {"v": 2, "seq": seq, "target": change.target, "revoked": change.revoked,
                                "at": change.at, "origin": change.origin, "actor": change.actor,
                                "reason": change.reason, "authority": change.authority})

    def open_change(self, rel: str, raw: bytes) -> RevocationChange:
        c = self._open(rel, raw)
        try:
            if f"{int(c['seq']):012d}" != rel.rsplit("/", 1)[1]:
                raise ValueError("sequence number disagrees with the name")
            return RevocationChange(str(c["target"]), bool(c["revoked"]), float(c["at"]), str(c["origin"]),
                                    str(c["actor"]), str(c.get("reason", "")), str(c.get("authority", "operator")))
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptRecord(f"revocation record is malformed: {type(exc).__name__}") from None

    # -- records ----------------------------------------------------------------------------------
    def _tag(self, body: bytes) -> str:
        return hmac.new(self._key, b"kvtier-revocation-v1\x00" + body, hashlib.sha256).hexdigest()

    def encode(self, change: RevocationChange) -> bytes:
        body = json.dumps({"target": change.target, "revoked": change.revoked, "at": change.at,
                           "origin": change.origin, "actor": change.actor, "reason": change.reason},
                          sort_keys=True, separators=(",", ":")).encode()
        return json.dumps({"change": body.decode(), "tag": self._tag(body)}, separators=(",", ":")).encode()

    def decode(self, raw: bytes) -> RevocationChange:
        """The change a record holds; CorruptRecord unless it is whole and tagged with our key."""
        try:
            outer = json.loads(raw)
            body = outer["change"].encode()
            tag = outer["tag"]
            c: dict[str, Any] = json.loads(body)
            change = RevocationChange(str(c["target"]), bool(c["revoked"]), float(c["at"]), str(c["origin"]),
                                      str(c["actor"]), str(c.get("reason", "")))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptRecord(f"revocation record is malformed: {type(exc).__name__}") from None
        if not isinstance(tag, str) or not hmac.compare_digest(tag, self._tag(body)):
            raise CorruptRecord("revocation record's tag does not verify (not written by a node of this deployment)")
        return change

    # -- the bucket -------------------------------------------------------------------------------
    def publish(self, change: RevocationChange) -> str:
        """Write the change as this node's next record, then its head. The number is used even
        if the write fails: ``maintain`` puts the record back later, and readers hold its target
        meanwhile (a gap), so nothing is reused or lost."""
        with self._pub_lock:
            self._seq += 1
            seq = self._seq
            rel = f"{self.node_id}/{seq:012d}"
            self._mine[seq] = _Mine(self.target_id(change.target), self.change_id(change),
                                    self.seal_change(rel, seq, change))
            self._save_own()  # the number is taken durably before anything is written
            self._etags[seq] = self._put(rel, self._mine[seq].sealed)
            self._put_head()
            self._save_own()
            return self.root + rel

    def maintain(self) -> int:
        """Put back this node's records and head if they disappeared from the bucket (and the
        head if it changed); returns how many objects were put back."""
        with self._pub_lock:
            listed = self._listing(f"{self.root}{self.node_id}/")
            n = 0
            wrote = False
            for seq, mine in self._mine.items():
                etag = listed.get(f"{self.node_id}/{seq:012d}")
                if etag is None or etag != self._etags.get(seq):  # removed, or replaced by other bytes
                    self._etags[seq] = self._put(f"{self.node_id}/{seq:012d}", mine.sealed)
                    n += 1
                    wrote = True
            head = listed.get(f"{self.node_id}/{HEAD}")
            if head is None or head != self._head_etag:
                self._put_head()
                n += head is not None or self._seq > 0
                wrote = True
            if wrote:
                self._save_own()
            self.repaired += n
            return n

    def present_own(self) -> frozenset[str]:
        """The change ids of this node's own records (``maintain`` keeps them in the bucket)."""
        with self._pub_lock:
            return frozenset(m.change_id for m in self._mine.values())

    def _put_head(self) -> None:
        rel = f"{self.node_id}/{HEAD}"
        body = {"v": 2, "seq": self._seq, "targets": {str(k): m.target_id for k, m in self._mine.items()},
                "changes": {str(k): m.change_id for k, m in self._mine.items()}}
        self._head_etag = self._put(rel, self._seal(rel, body))

    def _put(self, rel: str, body: bytes) -> str:
        resp = self._call("put", lambda: self._client.put_object(Bucket=self.config.bucket, Key=self.root + rel,
                                                                 Body=body))
        return str(resp.get("ETag", ""))

    def _listing(self, prefix: str) -> dict[str, str]:
        """Names (relative to the feed) -> ETag, all pages."""
        return {o["Key"][len(self.root):]: str(o.get("ETag", "")) for o in self._objects(prefix)}

    def read_new(self) -> FeedRead:
        """The changes not read before, and what the feed's gaps hold. If the endpoint fails,
        TierUnavailable (nothing is marked read, so the next call reads it all again)."""
        listed = self._listing(self.root)
        out = FeedRead([], [])
        problems: dict[str, int] = {}
        holds: set[str] = set()
        holding: set[str] = set()
        by_node: dict[str, dict[str, str]] = {}
        opened: list[tuple[_Origin, int, str]] = []  # committed only once the whole read succeeded
        v1: list[str] = []
        for rel, etag in listed.items():
            m = _V2_NAME.fullmatch(rel)
            if m is None:
                if "/" not in rel:
                    self._read_v1(self.root + rel, out, v1)
                elif rel not in self._seen:
                    self._seen.add(rel)
                    out.rejected.append(self.root + rel)
                continue
            if m.group(1) != self.node_id:
                by_node.setdefault(m.group(1), {})[m.group(2)] = etag
        known = set(self.present_own()) | {c for o in self._origins.values() for c in o.have.values()}
        present = set(self.present_own())
        gaps: list[tuple[str, _Origin, int]] = []
        for node in set(by_node) | set(self._origins):
            objs = by_node.get(node, {})
            st = self._origins.setdefault(node, _Origin())
            why = self._read_head(node, objs.get(HEAD), st, out)
            if why is not None and node not in self.retired:
                problems[why] = problems.get(why, 0) + 1
                holding.add(node)
            # The highest number known comes only from what verified (the head, records that
            # opened): names planted by someone without the key neither raise nor hold anything.
            top = max([st.head_seq, *st.have])
            for name in sorted(n for n in objs if n != HEAD):
                seq = int(name)
                if seq in st.have:
                    present.add(st.have[seq])
                    continue
                rel = f"{node}/{name}"
                try:
                    raw = self._call("get", lambda rel=rel: self._get(self.root + rel))
                    if raw is _GONE:
                        continue  # deleted since the listing: missing, as if never listed
                    if raw is None:
                        raise CorruptRecord("revocation record is too large")
                    assert isinstance(raw, bytes)
                    change = self.open_change(rel, raw)
                except CorruptRecord:
                    if rel not in self._seen:
                        self._seen.add(rel)
                        out.rejected.append(self.root + rel)
                    continue
                cid = self.change_id(change)
                opened.append((st, seq, cid))
                known.add(cid)
                present.add(cid)
                top = max(top, seq)
                out.changes.append(change)
            gaps.extend((node, st, seq) for seq in range(1, top + 1) if seq not in st.have)
        # Opened records never go missing for this reader: it applied them already. A number
        # below the highest one known that was never read is a gap, unless its change (as the
        # head names it) was read under another name.
        now_opened = {(id(st), seq) for st, seq, _ in opened}
        for node, st, seq in gaps:
            if (id(st), seq) in now_opened or st.changes.get(seq, "") in known or node in self.retired:
                continue
            tid = st.targets.get(seq)
            if tid is None:
                problems["unknown_gap"] = problems.get("unknown_gap", 0) + 1
                holding.add(node)
            else:
                problems["gap"] = problems.get("gap", 0) + 1
                holds.add(tid)
        for st, seq, cid in opened:
            st.have[seq] = cid
        self._seen.update(v1)
        out.changes.sort(key=lambda c: c.stamp)
        return FeedRead(out.changes, out.rejected, frozenset(holds), bool(holding), problems, frozenset(present),
                        tuple(sorted(holding)))

    def _read_head(self, node: str, etag: str | None, st: _Origin, out: FeedRead) -> str | None:
        """Refresh what ``node``'s head says; the problem's name when it must hold everything."""
        if etag is None:
            return "head_missing" if st.head_etag is not None else None
        if etag == st.head_etag:
            return None
        rel = f"{node}/{HEAD}"
        try:
            raw = self._call("get", lambda: self._get(self.root + rel, MAX_HEAD_BYTES))
            if raw is _GONE:  # deleted since the listing
                return "head_missing" if st.head_etag is not None else None
            if raw is None:
                raise CorruptRecord("revocation head is too large")
            assert isinstance(raw, bytes)
            body = self._open(rel, raw)
            seq = int(body["seq"])
            targets = {int(k): str(v) for k, v in dict(body["targets"]).items()}
            changes = {int(k): str(v) for k, v in dict(body.get("changes", {})).items()}
        except (CorruptRecord, ValueError, KeyError, TypeError):
            if rel + "@" + etag not in self._seen:
                self._seen.add(rel + "@" + etag)
                out.rejected.append(self.root + rel)
            # A head seen before and now replaced by one that does not open: as if removed.
            return "head_missing" if st.head_etag is not None else None
        if seq < st.head_seq:
            return "head_rollback"  # an old head copied over a newer one
        st.head_etag, st.head_seq, st.targets, st.changes = etag, seq, targets, changes
        return None

    def _read_v1(self, name: str, out: FeedRead, seen: list[str]) -> None:
        if name in self._seen:
            return
        raw = self._call("get", lambda: self._get(name))
        if raw is _GONE:
            return
        seen.append(name)
        try:
            if not isinstance(raw, bytes):
                raise CorruptRecord("revocation record is too large")
            out.changes.append(self.decode(raw))
        except CorruptRecord:
            out.rejected.append(name)

    def _get(self, name: str, limit: int = MAX_RECORD_BYTES) -> bytes | object | None:
        """The object's bytes; None when larger than ``limit``; ``_GONE`` when it does not exist."""
        try:
            obj = self._client.get_object(Bucket=self.config.bucket, Key=name)
        except bce.ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return _GONE
            raise
        if int(obj.get("ContentLength", 0)) > limit:
            obj["Body"].close()
            return None
        return obj["Body"].read(limit + 1)
