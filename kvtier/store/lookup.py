"""What a lookup found: the longest cached prefix of a chain, as runs over tiers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass


@dataclass(slots=True, frozen=True)
class TierRun:
    """``count`` consecutive blocks starting at chain position ``start`` found in tier ``level``."""

    level: int
    tier: str
    start: int
    count: int


@dataclass(slots=True, frozen=True)
class Lookup:
    """The longest cached prefix of a chain, as runs over tiers (fastest tier that holds each run)."""

    runs: tuple[TierRun, ...]
    requested: int

    @property
    def length(self) -> int:
        return sum(r.count for r in self.runs)

    def blocks_in(self, tier: str) -> int:
        return sum(r.count for r in self.runs if r.tier == tier)
