"""TieredStore: chains tiers fastest-first; longest-prefix lookup, promotion on hit, spill on eviction."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtier.block import Block
from kvtier.errors import ConfigError, TierUnavailable
from kvtier.keys import BlockKey, ScopeDomain
from kvtier.store.lookup import Lookup, TierRun
from kvtier.store.metrics import RequestMetrics
from kvtier.store.pin_table import PinTable
from kvtier.store.remote_writer import RemoteWriterOptions, WritePolicy, make_write_policy
from kvtier.store.tier import Tier
from kvtier.store.write_fence import WriteFence

if TYPE_CHECKING:
    from kvtier.layout import KVLayout
    from kvtier.planning.cost_model import CostModel
    from kvtier.planning.plans import Plan


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
    An optional ``remote`` tier is appended last: looked up and read like any tier, but written
    only through ``write_policy`` (asynchronous uploads, see kvtier.remote_writer), never by a
    synchronous spill; ``close()`` drains pending uploads before closing the tiers.
    """

    def __init__(
        self,
        tiers: Sequence[Tier],
        *,
        promote: bool = True,
        remote: Tier | None = None,
        write_policy: str = "none",
        writer_options: RemoteWriterOptions | None = None,
    ) -> None:
        if not tiers:
            raise ValueError("TieredStore needs at least one tier")
        all_tiers = [*tiers, *([remote] if remote is not None else [])]
        names = [t.name for t in all_tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}")
        self.write_policy: WritePolicy = make_write_policy(write_policy, remote, writer_options)
        self._local = len(tiers)  # tiers[_local], when present, is the remote tier
        self.tiers: list[Tier] = all_tiers
        self.promote = promote
        self.pins = PinTable()
        for i, t in enumerate(self.tiers):
            t.pins = self.pins
            t.spill_evicted = i + 1 < self._local or (i + 1 == self._local and self.write_policy.wants_spill)
        self.requests = RequestMetrics()
        #: Purges close a domain here so no put, promotion, spill or upload writes it behind them.
        self.fence = WriteFence()

    #: Optional kvtier.costmodel.CostModel: when set, get() feeds it each tier read's size and
    #: duration (online calibration) and plan() asks it whether to reload or recompute.
    cost_model: CostModel | None = None

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
                t0 = time.perf_counter()
                got = self.tiers[run.level].get(want)
                self._observe_transfer(run.level, got, time.perf_counter() - t0)
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

    def _observe_transfer(self, level: int, got: Sequence[Block | None], seconds: float) -> None:
        # Only complete runs calibrate: a partial miss says nothing about the tier's speed.
        if self.cost_model is not None and got and all(b is not None for b in got):
            nbytes = sum(b.nbytes for b in got if b is not None)
            self.cost_model.observe_transfer(self.tiers[level].name, len(got), nbytes, seconds)

    def plan(self, keys: Sequence[BlockKey], new_tokens: int, layout: KVLayout) -> Plan:
        """How to obtain the KV of ``keys`` (a chain) before computing ``new_tokens`` more: which
        tier runs to load, how many tokens to recompute, with every plan's predicted time."""
        if self.cost_model is None:
            raise ConfigError("TieredStore.plan needs a cost model: set store.cost_model first")
        return self.cost_model.plan(self.lookup(keys), new_tokens, layout)

    # -- put / delete -----------------------------------------------------------------------------
    def put(self, blocks: Sequence[Block]) -> StorePutReport:
        report = StorePutReport()
        with self.pins.hold([b.key for b in blocks]), self.fence.writing():
            blocks = self.fence.admit(blocks)
            self._put_at(0, blocks, report)
            self.write_policy.on_put(blocks)
        return report

    def flush_remote(self, timeout_s: float | None = None) -> bool:
        """Wait for pending remote uploads (write-through/write-back); False on timeout."""
        return self.write_policy.flush(timeout_s)

    def _put_at(self, level: int, blocks: Sequence[Block], report: StorePutReport | None = None) -> None:
        with self.fence.writing():
            while level < len(self.tiers):
                blocks = self.fence.admit(blocks)  # before every tier: spills of a purged scope stop here
                if not blocks:
                    return
                if level == self._local:  # leaving the bottom local tier for the remote one
                    self.write_policy.on_spill(blocks)
                    return
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
        self.write_policy.forget(keys)
        return {t.name: t.delete(keys) for t in self.tiers}

    def delete_scope(self, domain: ScopeDomain) -> dict[str, int]:
        self.write_policy.forget(domain=domain)
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
        self.write_policy.close()
        for t in self.tiers:
            t.close()


def _usage(t: Tier) -> dict[str, object]:
    try:
        u = t.usage()
    except TierUnavailable as exc:  # a remote outage must not break stats; it shows as this
        return {"unavailable": str(exc)}
    return {"blocks": u.blocks, "bytes": u.bytes, "capacity_bytes": u.capacity_bytes}
