"""The revocation feed's local, durable state: what a node must not forget when it restarts.

Two JSON documents in a private directory (``<audit log's directory>/revocation-feed/``), each
replaced atomically (written to a temporary file, fsynced, renamed, the directory fsynced):

- ``own.json``: this node's id in the feed (kept across restarts, so the others recognise it),
  its last sequence number, and each of its records exactly as sealed, with the ETag it last
  wrote: after a restart the node puts back any of them that disappeared from the bucket.
- ``seen.json``: what this node knows of every other node's feed (the head's ETag and number,
  the target and change id of each number, the records it opened): after a restart a head that
  vanished, or a record that went missing, is still noticed and still held.

Neither file names a tenant, user or credential: records are sealed, targets and changes are
opaque ids. A file that exists but does not parse is CorruptRecord naming it: the daemon does not
start on a state it cannot trust (move the file away to start afresh, and see docs/security.md
2.5 for what that forgets).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kvtier.durable import fsync_dir
from kvtier.errors import CorruptRecord
from kvtier.security.secrets import PRIVATE_FILE_MODE, private_dir

OWN = "own.json"
SEEN = "seen.json"


class FeedState:
    """The two documents under ``directory`` (created 0700). Not thread-safe: the feed calls
    ``save(OWN, ...)`` under its publish lock and ``save(SEEN, ...)`` from its one reader."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.dir = private_dir(directory)

    def load(self, name: str) -> dict[str, Any] | None:
        """The document ``name`` (``OWN``/``SEEN``), None if it was never written."""
        path = self.dir / name
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            doc = json.loads(raw)
        except ValueError:
            doc = None
        if not isinstance(doc, dict) or doc.get("v") != 1:
            raise CorruptRecord(f"revocation feed state {path} is not readable: move it away to start the feed "
                                "afresh (this node then forgets what it held; see docs/security.md 2.5)")
        return doc

    def save(self, name: str, doc: dict[str, Any]) -> None:
        final = self.dir / name
        tmp = self.dir / f".{name}.tmp"
        data = json.dumps({"v": 1, **doc}, sort_keys=True, separators=(",", ":")).encode()
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE_MODE), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        fsync_dir(self.dir)

    @property
    def path(self) -> Path:
        return self.dir
