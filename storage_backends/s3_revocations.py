"""Revocations and grants shared through the remote tier's bucket, so every node sharing it
refuses a revoked principal without waiting for a restart.

Objects are named ``<prefix>/_revocations/<at ns>-<origin>-<random>``, beside the block objects
(``_revocations`` is not a layout tag, so never parsed as one). Each holds one change as
canonical JSON with an HMAC-SHA256 tag under a key derived from the deployment's server secret:
whoever can write the bucket but does not hold the secret cannot lift a revocation (or revoke
anyone); such a record is refused and counted, never applied. Failures of the endpoint raise
TierUnavailable.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import uuid
from dataclasses import dataclass
from typing import Any

from kvtier.errors import CorruptRecord, TierUnavailable
from kvtier.security.policy import RevocationChange
from storage_backends.s3_config import S3Config
from storage_backends.s3_objects import S3Objects

FEED_DIR = "_revocations"
#: A change's record is a few hundred bytes; anything larger is not one of ours.
MAX_RECORD_BYTES = 16 << 10


@dataclass(slots=True, frozen=True)
class FeedRead:
    """What one read of the feed found: changes not seen before (verified), and the names of
    records that failed verification."""

    changes: list[RevocationChange]
    rejected: list[str]


class S3RevocationFeed(S3Objects):
    """The bucket's revocation records. ``read_new`` lists the whole feed and fetches only
    records it has not seen (names are unique; a node with a slow clock may add a name that
    sorts before ones already seen, so no listing cursor is trusted).

    Invariants: ``_seen`` only grows, and holds exactly the names fetched and handed out (in
    ``changes`` or ``rejected``), so a record is applied or refused once per process. Thread-safe
    for one reader and any number of publishers (``_seen`` belongs to the reader).
    """

    what = "revocation feed"

    def __init__(self, config: S3Config, key: bytes) -> None:
        if len(key) < 32:
            raise ValueError("revocation feed key must be at least 32 bytes")
        super().__init__(config, FEED_DIR)
        self._key = key
        self._seen: set[str] = set()

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
        name = f"{self.root}{int(change.at * 1e9):020d}-{change.origin}-{uuid.uuid4().hex[:12]}"
        body = self.encode(change)
        self._call("put", lambda: self._client.put_object(Bucket=self.config.bucket, Key=name, Body=body))
        return name

    def read_new(self) -> FeedRead:
        """The records not read before. If the endpoint fails part-way, what was read so far is
        returned and the rest is read next time; if it fails before any record, TierUnavailable."""
        out = FeedRead([], [])
        try:
            for name in self._names(self.root):
                if name in self._seen:
                    continue
                raw = self._call("get", lambda name=name: self._get(name))
                self._seen.add(name)
                try:
                    if raw is None:
                        raise CorruptRecord("revocation record is too large")
                    out.changes.append(self.decode(raw))
                except CorruptRecord:
                    out.rejected.append(name)
        except TierUnavailable:
            if not out.changes and not out.rejected:
                raise
        out.changes.sort(key=lambda c: c.stamp)
        return out

    def _get(self, name: str) -> bytes | None:
        obj = self._client.get_object(Bucket=self.config.bucket, Key=name)
        if int(obj.get("ContentLength", 0)) > MAX_RECORD_BYTES:
            obj["Body"].close()
            return None
        return obj["Body"].read(MAX_RECORD_BYTES + 1)
