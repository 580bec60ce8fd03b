"""TieredStore: chains tiers fastest-first; longest-prefix lookup, promotion on hit, spill on eviction."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Protocol

from kvtier.block import Block, BlockMeta
from kvtier.errors import CorruptRecord, LayoutMismatch, TierUnavailable
from kvtier.keys import BlockKey, ScopeDomain, key_domain
from kvtier.store.lookup import Lookup, TierRun
from kvtier.store.metrics import RequestMetrics
from kvtier.store.pin_table import PinTable
from kvtier.store.remote_writer import RemoteWriterOptions, WritePolicy, make_write_policy
from kvtier.store.tier import Tier
from kvtier.store.write_fence import WriteFence

if TYPE_CHECKING:
    from kvtier.codec import SealedRecord


class TransferObserver(Protocol):
    """Told the size and duration of every complete tier read (a cost model calibrating online)."""

    def observe_transfer(self, tier: str, blocks: int, nbytes: int, seconds: float) -> None: ...


class Readable(Protocol):
    """What a read hands back for one key: a Block, or the caller's own ready form of one (the
    daemon's wire frames). The store checks identity through ``meta`` and sizes through ``nbytes``."""

    @property
    def meta(self) -> BlockMeta: ...

    @property
    def nbytes(self) -> int: ...


#: Reads tier 0 in the caller's own form instead of ``tier.get`` (None where absent).
FirstTierReader = Callable[[Sequence[BlockKey]], Sequence[Readable | None]]


class PutOutcome(StrEnum):
    STORED = "stored"  # newly written into ``tier``
    PRESENT = "present"  # ``tier`` already held it (keys are content hashes: nothing to write)
    REJECTED = "rejected"  # no local tier took it (no room, or all pinned); the remote write policy may still
    FENCED = "fenced"  # its scope is being purged: written nowhere


@dataclass(slots=True, frozen=True)
class KeyPut:
    outcome: PutOutcome
    tier: str | None = None


@dataclass(slots=True, frozen=True)
class StorePutReport:
    """Where a put left each block it was given: the fastest tier that stored or held it."""

    outcomes: Mapping[BlockKey, KeyPut]

    def keys(self, outcome: PutOutcome) -> list[BlockKey]:
        return [k for k, o in self.outcomes.items() if o.outcome is outcome]

    @property
    def stored(self) -> dict[str, int]:
        """Blocks newly written, per tier."""
        out: dict[str, int] = {}
        for o in self.outcomes.values():
            if o.outcome is PutOutcome.STORED and o.tier is not None:
                out[o.tier] = out.get(o.tier, 0) + 1
        return out


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
        observer: TransferObserver | None = None,
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
        #: Keys in use by an in-flight load or store: handed to every tier's put, which never evicts them.
        self.pins = PinTable()
        # Whether tier i's evictions go somewhere (the next local tier, or the remote write policy):
        # only then does its put hand the evicted blocks back.
        self._spill = [i + 1 < self._local or (i + 1 == self._local and self.write_policy.wants_spill)
                       for i in range(len(self.tiers))]
        self.observer = observer
        self.requests = RequestMetrics()
        #: Purges close a domain here so no put, promotion, spill or upload writes it behind them.
        self.fence = WriteFence()

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
        return Lookup(tuple(runs), len(keys), tuple(keys[:pos]))

    def get(self, keys: Sequence[BlockKey]) -> list[Block]:
        """``load(lookup(keys))``: the verified blocks of the longest cached prefix of ``keys``."""
        return self.load(self.lookup(keys))  # type: ignore[return-value]

    def load(self, lookup: Lookup, *, first: FirstTierReader | None = None) -> list[Readable]:
        """Read what ``lookup`` found, run by run, and promote hits from lower tiers into tier 0.

        Each returned item is checked to be the key asked for, in that key's own scope domain; a
        block that vanished or failed verification since the lookup shortens the result (the
        prefix ends there). ``first`` reads tier 0 in the caller's own form (see Readable);
        without it, every item is a Block.
        """
        assert lookup.loadable, "a lookup built without its keys cannot be loaded"
        keys = lookup.keys
        out: list[Readable] = []
        with self.pins.hold(list(keys)):
            for run in lookup.runs:
                want = keys[run.start : run.start + run.count]
                got = self._read(run.level, want, first)
                for i, item in enumerate(got):
                    if not _is(item, want[i]):
                        if item is not None:
                            self.tiers[run.level].metrics.error("wrong_block")
                        return out
                    out.append(item)
                if self.promote and run.level > 0:
                    self._put_at(0, [b for b in got if isinstance(b, Block)])
        return out

    def get_each(self, keys: Sequence[BlockKey], *, first: FirstTierReader | None = None) -> list[Readable | None]:
        """Each key from the fastest tier that holds it (None where none does), with the same
        checks and promotion as ``load``: one batched read per tier for the keys still missing."""
        found: list[Readable | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        with self.pins.hold(list(keys)):
            for level, tier in enumerate(self.tiers):
                if not todo:
                    break
                got = self._read(level, [keys[i] for i in todo], first)
                left, hits = [], []
                for i, item in zip(todo, got, strict=True):
                    if _is(item, keys[i]):
                        found[i] = item
                        hits.append(item)
                    else:
                        if item is not None:
                            tier.metrics.error("wrong_block")
                        left.append(i)
                todo = left
                if self.promote and level > 0 and hits:
                    self._put_at(0, [b for b in hits if isinstance(b, Block)])
        return found

    def _read(self, level: int, keys: Sequence[BlockKey], first: FirstTierReader | None) -> Sequence[Readable | None]:
        t0 = time.perf_counter()
        got = first(keys) if level == 0 and first is not None else self.tiers[level].get(keys)
        # Only complete reads calibrate: a partial miss says nothing about the tier's speed.
        if self.observer is not None and got and all(b is not None for b in got):
            nbytes = sum(b.nbytes for b in got if b is not None)
            self.observer.observe_transfer(self.tiers[level].name, len(got), nbytes, time.perf_counter() - t0)
        return got

    # -- put / delete -----------------------------------------------------------------------------
    def put(self, blocks: Sequence[Block]) -> StorePutReport:
        """Store ``blocks`` in tier 0 (what does not fit falls to the next tier), hand them to the
        remote write policy, and report per key where each one ended up."""
        outcomes: dict[BlockKey, KeyPut] = {}
        with self.pins.hold([b.key for b in blocks]), self.fence.writing():
            admitted = self.fence.admit(blocks)
            if len(admitted) < len(blocks):
                kept = {b.key for b in admitted}
                outcomes.update((b.key, KeyPut(PutOutcome.FENCED)) for b in blocks if b.key not in kept)
            self._put_at(0, admitted, outcomes)
            self.write_policy.on_put(admitted)
        return StorePutReport(outcomes)

    def flush_remote(self, timeout_s: float | None = None) -> bool:
        """Wait for pending remote uploads (write-through/write-back); False on timeout."""
        return self.write_policy.flush(timeout_s)

    def _put_at(self, level: int, blocks: Sequence[Block], outcomes: dict[BlockKey, KeyPut] | None = None) -> None:
        """Put ``blocks`` into tier ``level``; rejected blocks and evictions fall to the next tier.
        With ``outcomes``, record where each of the original ``blocks`` ended up."""
        pending = {b.key for b in blocks} if outcomes is not None else set()
        with self.fence.writing():
            while level < len(self.tiers):
                blocks = self.fence.admit(blocks)  # before every tier: spills of a purged scope stop here
                if not blocks:
                    break
                if level == self._local:  # leaving the bottom local tier for the remote one
                    self.write_policy.on_spill(blocks)
                    break
                tier = self.tiers[level]
                res = tier.put(_opened(blocks, tier), pins=self.pins, spill=self._spill[level])
                if outcomes is not None:
                    for keys, outcome in ((res.stored, PutOutcome.STORED), (res.present, PutOutcome.PRESENT)):
                        for k in keys:
                            if k in pending:
                                outcomes[k] = KeyPut(outcome, tier.name)
                                pending.discard(k)
                # Rejected blocks (no room, all pinned) fall through to the next tier; so do evictions.
                rejected = set(res.rejected)
                blocks = [*res.evicted, *(b for b in blocks if b.key in rejected)]
                level += 1
        if outcomes is not None:
            outcomes.update((k, KeyPut(PutOutcome.REJECTED)) for k in pending)

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


def _opened(items: Sequence[Block | SealedRecord], tier: Tier) -> list[Block]:
    """Blocks for a tier's put: records spilled still sealed are opened here (a local tier below
    another that keeps records; the remote write policy takes them as they are). One that no
    longer verifies is counted against ``tier`` and dropped."""
    out = []
    for x in items:
        if not isinstance(x, Block):  # a SealedRecord
            try:
                x = x.open()
            except (CorruptRecord, LayoutMismatch):
                tier.metrics.error("corrupt_spill")
                continue
        out.append(x)
    return out


def _is(item: Readable | None, key: BlockKey) -> bool:
    """Whether a tier's answer for ``key`` is that block, in the key's own scope domain."""
    return item is not None and item.meta.key == key and item.meta.domain == key_domain(key)


def _usage(t: Tier) -> dict[str, object]:
    try:
        u = t.usage()
    except TierUnavailable as exc:  # a remote outage must not break stats; it shows as this
        return {"unavailable": str(exc)}
    return {"blocks": u.blocks, "bytes": u.bytes, "capacity_bytes": u.capacity_bytes}
