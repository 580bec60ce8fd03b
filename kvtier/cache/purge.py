"""Purge bookkeeping: the crash-safe journal of purge intents and the report a purge returns."""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from kvtier.durable import fsync_dir
from kvtier.keys import (
    BlockKey,
    ScopeDomain,
)
from kvtier.security.secrets import private_dir


# =================================================================================================
# Purge
# =================================================================================================
class ScopePurger(Protocol):
    """Anything besides the store's tiers that holds a scope's data (a location directory)."""

    name: str

    def delete_scope(self, domain: ScopeDomain) -> int: ...

    def keys_in_scope(self, domain: ScopeDomain) -> list[BlockKey]: ...


#: What a purge that deleted nothing reports for each compactor, which it did not run.
NOTHING_TO_COMPACT = "skipped: the purge removed nothing"


class Compactor(Protocol):
    """Something that makes a purge's deletions final in storage that keeps deleted bytes (a
    SeaweedFS volume vacuum). ``compact`` returns a short description for the report and raises
    TierUnavailable when it cannot (the purge then stays journaled and is resumed). Run only by
    a purge that deleted something (else reported as ``NOTHING_TO_COMPACT``)."""

    name: str

    def compact(self) -> str: ...


@dataclass(slots=True, frozen=True)
class PurgeReport:
    """What a purge removed: blocks per tier (and per extra purger) and data keys destroyed.

    Counts accumulate over a resumed purge, so a crash in the middle does not lose them.
    """

    domain: str
    removed: dict[str, int]
    keys_destroyed: int
    resumed: bool
    scope: str | None = None
    #: What each compactor did after the deletions (``{"seaweedfs_vacuum": "vacuumed (1 rounds)"}``).
    compacted: dict[str, str] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.removed.values())


@dataclass(slots=True)
class _JournalEntry:
    domain: str
    actor: str
    started_at: float
    removed: dict[str, int] = field(default_factory=dict)
    keys_destroyed: int = 0


class PurgeJournal:
    """Purge intents on disk: ``<domain hex>.purge`` (JSON, 0600), written atomically.

    Protocol: ``begin`` is durable before anything is deleted; ``progress`` after each step; the
    file is removed by ``finish`` once every tier is clean and the data key destroyed. A file left
    behind means a purge that did not finish: ``pending()`` lists it and KVCache resumes it. The
    journal names only the opaque domain and the actor id (the audit log holds the scope name).
    With ``path=None`` intents live in memory only (no crash resume). Guarded by ``_lock``.
    """

    def __init__(self, path: str | os.PathLike[str] | None) -> None:
        self.path = Path(path) if path is not None else None
        self._mem: dict[str, _JournalEntry] = {}
        self._lock = threading.Lock()
        if self.path is not None:
            private_dir(self.path)  # 0700 (and its files 0600) whatever the umask
            for f in self.path.glob("*.purge"):
                self._mem[f.stem] = _load_entry(f)

    def begin(self, domain: ScopeDomain, actor: str) -> tuple[_JournalEntry, bool]:
        """The journal entry for ``domain``; True when an unfinished one already existed."""
        with self._lock:
            existing = self._mem.get(domain.hex())
            if existing is not None:
                return existing, True
            entry = self._mem[domain.hex()] = _JournalEntry(domain.hex(), actor, time.time())
            self._write(entry)
            return entry, False

    def progress(self, entry: _JournalEntry) -> None:
        with self._lock:
            self._write(entry)

    def finish(self, entry: _JournalEntry) -> None:
        with self._lock:
            self._mem.pop(entry.domain, None)
            if self.path is not None:
                (self.path / f"{entry.domain}.purge").unlink(missing_ok=True)
                fsync_dir(self.path)

    def pending(self) -> list[_JournalEntry]:
        with self._lock:
            return list(self._mem.values())

    def _write(self, entry: _JournalEntry) -> None:
        if self.path is None:
            return
        final = self.path / f"{entry.domain}.purge"
        tmp = self.path / f"{entry.domain}.tmp"
        data = json.dumps({"domain": entry.domain, "actor": entry.actor, "started_at": entry.started_at,
                           "removed": entry.removed, "keys_destroyed": entry.keys_destroyed}).encode()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
        fsync_dir(self.path)


def _load_entry(f: Path) -> _JournalEntry:
    try:
        d = json.loads(f.read_bytes())
        entry = _JournalEntry(str(d["domain"]), str(d["actor"]), float(d["started_at"]),
                              {str(k): int(v) for k, v in d["removed"].items()}, int(d["keys_destroyed"]))
        bytes.fromhex(entry.domain)
    except (ValueError, KeyError, TypeError, AttributeError):
        # A journal file is written atomically, so it is never torn; a damaged one still names its
        # domain in the file name, which is enough to redo the purge from scratch.
        entry = _JournalEntry(f.stem, "unknown", f.stat().st_mtime)
    return entry
