"""Revocations between daemons: each change made on this node is published to a shared feed,
and the feed is read every few seconds for the changes other nodes made.

A revoke or grant applies here first, then is published; if publishing fails the call fails
with TierUnavailable saying so (the change stands on this node; repeating the call is safe).
A change from the feed applies through ``Policy.apply_remote`` (last writer wins per target,
recorded in the audit log), so every node converges whatever order it reads changes in. A feed
that cannot be read is retried on the next tick and counted; records that fail verification
are refused and counted. Nodes without a remote tier have no feed: revocations reach them at
restart, as documented.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Protocol

from kvtier.errors import TierUnavailable
from kvtier.security.policy import Policy, RevocationChange

log = logging.getLogger("kvtier.server.revocations")


class RevocationFeed(Protocol):
    """Where nodes share their changes (``storage_backends.s3_revocations.S3RevocationFeed``)."""

    def publish(self, change: RevocationChange) -> str: ...

    def read_new(self) -> FeedReadLike: ...

    def close(self) -> None: ...


class FeedReadLike(Protocol):
    changes: list[RevocationChange]
    rejected: list[str]


class RevocationSync:
    """Publishes this node's changes and applies the others' on a timer.

    Invariants: ``counts`` (under ``_lock``) only grow: ``published``, ``applied`` (changes from
    other nodes that took effect), ``stale`` (older than what a target already had), ``rejected``
    (records that failed verification), ``read_errors``. One reader thread; ``sync_once`` may also
    be called directly (tests, start-up), serialized by ``_read_lock``.
    """

    def __init__(self, policy: Policy, feed: RevocationFeed, interval_s: float) -> None:
        if interval_s <= 0:
            raise ValueError("RevocationSync interval_s must be positive")
        self.policy = policy
        self.feed = feed
        self.interval_s = interval_s
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._read_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        policy.on_change = self.publish

    def _count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self.counts[what] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)

    def publish(self, change: RevocationChange) -> None:
        """``Policy.on_change``: share a change made here."""
        what = "revocation" if change.revoked else "grant"
        try:
            self.feed.publish(change)
        except TierUnavailable as exc:
            self._count("publish_errors")
            raise TierUnavailable(f"the {what} of {change.target} applies on this node but was not published to "
                                  f"the other nodes ({exc}); repeat the call, it is idempotent") from exc
        self._count("published")

    def sync_once(self) -> int:
        """Read the feed and apply what other nodes changed; returns how many changes took effect."""
        with self._read_lock:
            try:
                got = self.feed.read_new()
            except TierUnavailable as exc:
                self._count("read_errors")
                log.warning("revocation feed unreadable", extra={"event": "revocation_sync", "error": str(exc)})
                return 0
            if got.rejected:
                self._count("rejected", len(got.rejected))
                log.warning("revocation records refused", extra={"event": "revocation_sync",
                                                                 "rejected": len(got.rejected)})
            applied = 0
            for change in got.changes:
                if change.origin == self.policy.node:
                    continue  # this process's own change, already applied when it was made
                if self.policy.apply_remote(change):
                    applied += 1
                    log.info("revocation applied", extra={
                        "event": "revoke" if change.revoked else "grant", "target": change.target,
                        "origin": change.origin})
                else:
                    self._count("stale")
            self._count("applied", applied)
            return applied

    def start(self) -> RevocationSync:
        assert self._thread is None, "started twice"
        self.sync_once()  # before serving: what the others revoked while this node was down
        self._thread = threading.Thread(target=self._run, name="kvtier-revocation-sync", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sync_once()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.policy.on_change = None
        self.feed.close()
