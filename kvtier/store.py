"""TieredStore: chains tiers fastest-first; longest-prefix lookup, promotion on hit, spill on eviction."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.block import Block
from kvtier.keys import BlockKey, ScopeDomain
from kvtier.metrics import RequestMetrics
from kvtier.tier import PinTable, Tier


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


@dataclass(slots=True)
class StorePutReport:
    stored: dict[str, int] = field(default_factory=dict)
    rejected: int = 0


class TieredStore:
    """A hierarchy of tiers, index 0 fastest.

    Invariants: every tier shares the store's PinTable, so a block being loaded or stored is
    never evicted from any tier; a lookup stops at the first position no tier holds (a block
    after a gap is useless); blocks are verified by each tier before they are returned, and the
    store additionally checks that each returned block is the key (and scope domain) asked for.
    Promotion copies hits from lower tiers into tier 0; what tier i evicts is put into tier i+1.
    Tiers hold their own locks; the store holds none, so concurrent callers proceed in parallel.
    """

    def __init__(self, tiers: Sequence[Tier], *, promote: bool = True) -> None:
        if not tiers:
            raise ValueError("TieredStore needs at least one tier")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}")
        self.tiers: list[Tier] = list(tiers)
        self.promote = promote
        self.pins = PinTable()
        for i, t in enumerate(self.tiers):
            t.pins = self.pins
            t.spill_evicted = i + 1 < len(self.tiers)
        self.requests = RequestMetrics()

    def tier(self, name: str) -> Tier:
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(name)

    # -- lookup / get -----------------------------------------------------------------------------
    def lookup(self, keys: Sequence[BlockKey]) -> Lookup:
        """Longest prefix held across tiers.

        At each run start the fastest tier holding that position serves the longest run it has
        from there; the next run starts where it stops. One ``contains`` per tier per run keeps
        remote tiers to a few batched probes instead of one round trip per block.
        """
        runs: list[TierRun] = []
        pos = 0
        while pos < len(keys):
            rest = keys[pos:]
            for level, t in enumerate(self.tiers):
                n = t.contains(rest)
                if n:
                    runs.append(TierRun(level, t.name, pos, n))
                    pos += n
                    break
            else:
                break
        return Lookup(tuple(runs), len(keys))

    def get(
        self,
        keys: Sequence[BlockKey],
        *,
        domains: Sequence[ScopeDomain] | None = None,
        lookup: Lookup | None = None,
    ) -> list[Block]:
        """Load the longest cached prefix of ``keys``; returns the verified blocks of that prefix.

        A block that vanished or failed verification between lookup and read shortens the prefix.
        """
        lk = lookup or self.lookup(keys)
        out: list[Block] = []
        with self.pins.hold(list(keys[: lk.length])):
            for run in lk.runs:
                want = keys[run.start : run.start + run.count]
                got = self.tiers[run.level].get(want)
                for i, blk in enumerate(got):
                    pos = run.start + i
                    if blk is None or blk.key != keys[pos] or (domains is not None and blk.meta.domain != domains[pos]):
                        if blk is not None:
                            self.tiers[run.level].metrics.error("wrong_block")
                        return out
                    out.append(blk)
                if self.promote and run.level > 0:
                    self._put_at(0, [b for b in got if b is not None])
        return out

    # -- put / delete -----------------------------------------------------------------------------
    def put(self, blocks: Sequence[Block]) -> StorePutReport:
        report = StorePutReport()
        with self.pins.hold([b.key for b in blocks]):
            self._put_at(0, blocks, report)
        return report

    def _put_at(self, level: int, blocks: Sequence[Block], report: StorePutReport | None = None) -> None:
        while blocks and level < len(self.tiers):
            res = self.tiers[level].put(blocks)
            if report is not None:
                report.stored[self.tiers[level].name] = len(res.stored)
                report.rejected = len(res.rejected)
            # Rejected blocks (no room, all pinned) fall through to the next tier; so do evictions.
            fallthrough = [b for b in blocks if b.key in set(res.rejected)]
            blocks = [*res.evicted, *fallthrough]
            report = None
            level += 1

    def delete(self, keys: Sequence[BlockKey]) -> dict[str, int]:
        return {t.name: t.delete(keys) for t in self.tiers}

    def delete_scope(self, domain: ScopeDomain) -> dict[str, int]:
        return {t.name: t.delete_scope(domain) for t in self.tiers}

    def record_request(self, input_tokens: int, hit_tokens: int) -> None:
        self.requests.record(input_tokens, hit_tokens)

    def stats(self) -> dict[str, object]:
        return {
            "requests": self.requests.snapshot(),
            "tiers": [t.metrics.snapshot() | {"usage": _usage(t)} for t in self.tiers],
            "time": time.time(),
        }

    def close(self) -> None:
        for t in self.tiers:
            t.close()


def _usage(t: Tier) -> dict[str, object]:
    u = t.usage()
    return {"blocks": u.blocks, "bytes": u.bytes, "capacity_bytes": u.capacity_bytes}
