"""What a lookup found: the longest cached prefix of a chain, as runs over tiers.

A ``Lookup`` is a boundary object: ``TieredStore.lookup`` (and the access gate above it) returns
one, and ``TieredStore.load`` takes it back and reads exactly what it describes, so a caller
never pays for a second lookup between deciding and loading.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.keys import BlockKey


@dataclass(slots=True, frozen=True)
class TierRun:
    """``count`` consecutive blocks starting at chain position ``start`` found in tier ``level``."""

    level: int
    tier: str
    start: int
    count: int


@dataclass(slots=True, frozen=True)
class Lookup:
    """The longest cached prefix of a chain, as runs over tiers (fastest tier that holds each run).

    Invariants: runs are contiguous from position 0 and ordered; ``keys`` are the chain's keys of
    that prefix (``len(keys) == length``) when the lookup came from a store, and empty for a
    lookup built by hand for planning only (which cannot be loaded). ``ticket``: a daemon's seal
    on this exact lookup (kvtier/security/lookup_tickets.py), so it can be handed back to that
    daemon and loaded without a second walk; a slice is another lookup and carries none.
    """

    runs: tuple[TierRun, ...]
    requested: int
    keys: tuple[BlockKey, ...] = ()
    ticket: bytes = b""

    @property
    def length(self) -> int:
        return sum(r.count for r in self.runs)

    @property
    def loadable(self) -> bool:
        return len(self.keys) == self.length

    def blocks_in(self, tier: str) -> int:
        return sum(r.count for r in self.runs if r.tier == tier)

    def slice(self, a: int, b: int) -> Lookup:
        """The part of this lookup that covers chain positions [a, b), renumbered from 0."""
        runs = []
        for r in self.runs:
            lo, hi = max(r.start, a), min(r.start + r.count, b)
            if lo < hi:
                runs.append(TierRun(r.level, r.tier, lo - a, hi - lo))
        hit = max(0, min(b, self.length) - a)
        return Lookup(tuple(runs), b - a, self.keys[a : a + hit] if self.loadable else ())

    @staticmethod
    def miss(requested: int) -> Lookup:
        return Lookup((), requested)
