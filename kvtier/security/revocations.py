"""Revocations between daemons: each change made on this node is published to a shared feed,
and the feed is read every few seconds for the changes other nodes made.

A revoke or grant applies here first, then is published; if publishing fails the call fails
with TierUnavailable saying so (the change stands on this node; repeating the call is safe).
A change from the feed applies through ``Policy.apply_remote`` (last writer wins per target,
recorded in the audit log), so every node converges whatever order it reads changes in. A feed
that cannot be read is retried on the next tick and counted; records that fail verification
are refused and counted. Each tick also puts back this node's own records if they disappeared
(``maintain``), and hands the feed's gaps to the policy (``Policy.set_holds``): a target whose
record is missing is refused until the record is read, so a deleted revocation is delayed,
never silently lost. After each read this node also *republishes* every change it holds in
force (its audit log's latest change per target, its own and those applied from others) that the
feed no longer holds anywhere (``present``): a revocation outlives its origin's records, its
origin's disk and its origin. Nodes without a remote tier have no feed: revocations reach them
at restart, as documented.
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
    """Where nodes share their changes (the S3 backend's ``S3RevocationFeed``)."""

    def publish(self, change: RevocationChange) -> str: ...

    def read_new(self) -> FeedReadLike: ...

    def close(self) -> None: ...


class FeedReadLike(Protocol):
    changes: list[RevocationChange]
    rejected: list[str]
    #: Target ids to refuse until their missing records are read; ``hold_all``: everyone but operators.
    holds: frozenset[str]
    hold_all: bool
    problems: dict[str, int]


def latest_changes(policy: Policy) -> dict[str, RevocationChange]:
    """The change in force per target, as the policy's audit log recorded it (the log the
    policy replays at start, so these are exactly its stamps); {} without a log."""
    out: dict[str, RevocationChange] = {}
    if policy.audit is None:
        return out
    for ev in policy.audit.events():
        if ev.action not in ("revoke", "grant"):
            continue
        d = ev.detail
        c = RevocationChange(ev.target, ev.action == "revoke", float(d.get("origin_at", ev.at)),
                             str(d.get("origin", "")), ev.actor, str(d.get("reason", "")),
                             str(d.get("authority", "operator")))
        if ev.target not in out or c.stamp > out[ev.target].stamp:
            out[ev.target] = c
    return out


class RevocationSync:
    """Publishes this node's changes and applies the others' on a timer.

    Invariants: ``counts`` (under ``_lock``) only grow: ``published``, ``applied`` (changes from
    other nodes that took effect), ``stale`` (older than what a target already had), ``rejected``
    (records that failed verification), ``read_errors``, ``republished`` (changes in force put
    back into a feed that lost them). ``_latest`` (under ``_lock``) is the change in force per
    target known here; a stamp in it only grows. One reader thread; ``sync_once`` may also be
    called directly (tests, start-up), serialized by ``_read_lock``.
    """

    def __init__(self, policy: Policy, feed: RevocationFeed, interval_s: float) -> None:
        if interval_s <= 0:
            raise ValueError("RevocationSync interval_s must be positive")
        self.policy = policy
        self.feed = feed
        self.interval_s = interval_s
        self.counts: Counter[str] = Counter()
        #: Current holds (gauges): targets held, and whether everyone but operators is held.
        self.held: dict[str, int] = {"held_targets": 0, "holding_all": 0}
        self._lock = threading.Lock()
        self._read_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._latest = latest_changes(policy)
        policy.subscribe(self.publish)

    def _note(self, change: RevocationChange) -> None:
        with self._lock:
            last = self._latest.get(change.target)
            if last is None or change.stamp > last.stamp:
                self._latest[change.target] = change

    def _count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self.counts[what] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts) | {k: v for k, v in self.held.items() if v}

    def publish(self, change: RevocationChange) -> None:
        """Subscribed to the policy: share a change made here."""
        what = "revocation" if change.revoked else "grant"
        self._note(change)
        try:
            self.feed.publish(change)
        except TierUnavailable as exc:
            self._count("publish_errors")
            raise TierUnavailable(f"the {what} of {change.target} applies on this node but was not published to "
                                  f"the other nodes yet ({exc}); it is retried every sync interval, and "
                                  "repeating the call is safe") from exc
        self._count("published")

    def sync_once(self) -> int:
        """Read the feed and apply what other nodes changed; returns how many changes took effect."""
        with self._read_lock:
            maintain = getattr(self.feed, "maintain", None)
            if maintain is not None:
                try:
                    repaired = maintain()  # this node's own records and head, put back if removed
                except TierUnavailable:
                    repaired = 0
                if repaired:
                    self._count("repaired", repaired)
                    log.warning("revocation feed objects of this node were missing and were put back",
                                extra={"event": "revocation_sync", "repaired": repaired})
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
                    self._note(change)
                    applied += 1
                    log.info("revocation applied", extra={
                        "event": "revoke" if change.revoked else "grant", "target": change.target,
                        "origin": change.origin})
                else:
                    self._count("stale")
            self._count("applied", applied)
            checkpoint = getattr(self.feed, "checkpoint", None)
            if checkpoint is not None:
                checkpoint()  # only now: what was read is applied (and audited), so it may be marked read
            self._hold(got)
            self._republish(getattr(got, "present", None))
            return applied

    def _republish(self, present: frozenset[str] | None) -> None:
        """Put back into the feed each change in force here that it holds nowhere any more."""
        change_id = getattr(self.feed, "change_id", None)
        if present is None or change_id is None:
            return
        with self._lock:
            missing = [c for c in self._latest.values() if change_id(c) not in present]
        for change in sorted(missing, key=lambda c: c.stamp):
            try:
                self.feed.publish(change)
            except TierUnavailable:
                self._count("publish_errors")
                return  # the next tick tries again
            self._count("republished")
            log.warning("revocation feed lacked a change in force here; republished it",
                        extra={"event": "revocation_republished", "target_id": getattr(self.feed, "target_id",
                                                                                      str)(change.target)})

    def _hold(self, got: FeedReadLike) -> None:
        """Fail closed on gaps: the policy refuses the targets whose records are missing (or
        everyone but operators when the missing target cannot be known) until they are read."""
        holds = getattr(got, "holds", frozenset())
        hold_all = bool(getattr(got, "hold_all", False))
        before = self.policy.holds()
        self.policy.set_holds(holds, hold_all, getattr(self.feed, "target_id", None))
        with self._lock:
            self.held = {"held_targets": len(holds), "holding_all": int(hold_all)}
        problems = getattr(got, "problems", {}) or {}
        for what, n in problems.items():
            self._count(f"gap_{what}", n)
        if (holds, hold_all) != before:
            log.warning("revocation feed gap: holding targets until their records are read",
                        extra={"event": "revocation_gap", "held_targets": len(holds), "holding_all": hold_all,
                               "problems": problems, "nodes": list(getattr(got, "holding_nodes", ()))})

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
        self.policy.unsubscribe(self.publish)
        self.feed.close()
