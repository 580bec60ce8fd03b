"""Compaction after a purge for a SeaweedFS bucket: deleted objects' bytes leave the volumes."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

from kvtier.errors import TierUnavailable


class SeaweedVacuum:
    """A purge's compaction step for a SeaweedFS bucket (a ``kvtier.cache.purge.Compactor``).

    SeaweedFS keeps a deleted object's bytes in its volume file until the volume is vacuumed,
    so after a purge the scope's records and wrapped keys would still sit in the data directory.
    ``compact`` waits for the filer to pass the purge's deletions on to the volumes, then asks the
    master (``GET /vol/vacuum``) to compact every volume holding any garbage, and repeats until
    the master reports no deleted bytes left in any volume twice, ``settle_s`` apart (a deletion
    passed on late gets its own round), or ``timeout_s`` passes
    (TierUnavailable: the purge stays journaled and is resumed). Other S3 services compact on
    their own schedule; see docs/security.md 2.6.

    Purges share vacuums: one runs at a time, and a purge whose deletions were done before a
    vacuum that completed had started is served by it (that vacuum left no garbage in any
    volume). So however many purges arrive together, they cost at most the vacuum running and
    one more. (A purge that deleted nothing runs none: kvtier/cache/kv_cache.py.)

    Invariants (under ``_lock``): ``_covered_until`` is when the last vacuum that completed
    started; ``runs`` counts vacuums run.
    """

    name = "seaweedfs_vacuum"

    def __init__(self, master_url: str, *, settle_s: float = 1.5, timeout_s: float = 60.0) -> None:
        self.master_url = master_url.rstrip("/")
        self.settle_s = settle_s
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._covered_until = float("-inf")
        self.runs = 0

    def _get(self, path: str) -> Any:
        import json
        import urllib.error
        import urllib.request

        try:
            with urllib.request.urlopen(f"{self.master_url}{path}", timeout=self.timeout_s) as resp:
                return json.loads(resp.read() or b"{}")
        except (OSError, ValueError, urllib.error.URLError) as exc:
            raise TierUnavailable(f"SeaweedFS master {self.master_url}: {path.split('?')[0]} failed: "
                                  f"{type(exc).__name__}") from exc

    def garbage(self) -> int:
        """Deleted bytes still held by volumes, over every volume the master knows."""
        return sum(int(v.get("DeletedByteCount", 0)) for v in _volumes(self._get("/vol/status")))

    def compact(self) -> str:
        asked = time.monotonic()  # the caller's deletions are done by now
        with self._lock:
            if self._covered_until >= asked:
                return "vacuumed (by a concurrent purge's vacuum)"
            started = time.monotonic()
            done = self._vacuum()
            self._covered_until = started
            return done

    def _vacuum(self) -> str:
        self.runs += 1
        deadline = time.monotonic() + self.timeout_s
        rounds = 0
        while True:
            time.sleep(self.settle_s)  # the filer hands deletions to the volumes in batches
            self._get("/vol/vacuum?garbageThreshold=0.0000001")
            rounds += 1
            left = self.garbage()
            if left == 0:
                # Confirm after another batch interval: a deletion the filer passed on late would
                # show up as new garbage, and gets its own round.
                time.sleep(self.settle_s)
                left = self.garbage()
                if left == 0:
                    return f"vacuumed ({rounds} rounds)"
            if time.monotonic() > deadline:
                raise TierUnavailable(f"SeaweedFS vacuum left {left} deleted bytes after {rounds} rounds")


def _volumes(status: Any) -> Iterator[dict[str, Any]]:
    """Every volume record in a ``/vol/status`` answer (nested by data center, rack and node)."""
    if isinstance(status, dict):
        if "DeletedByteCount" in status and "Id" in status:
            yield status
            return
        for v in status.values():
            yield from _volumes(v)
    elif isinstance(status, list):
        for v in status:
            yield from _volumes(v)
