"""TieredStore: chains tiers fastest-first; longest-prefix lookup, promotion on hit, spill on eviction."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Protocol

from kvtier.block import Block, BlockMeta
from kvtier.errors import CorruptRecord, LayoutMismatch, TierUnavailable
from kvtier.keys import BlockKey, ScopeDomain, key_domain
from kvtier.store.layer_sink import LayerSink
from kvtier.store.lookup import Lookup, TierRun
from kvtier.store.metrics import RequestMetrics
from kvtier.store.miss_budget import MissBudget
from kvtier.store.pin_table import PinTable
from kvtier.store.remote_writer import RemoteWriterOptions, WritePolicy, make_write_policy
from kvtier.store.spill_queue import SpillFailed, SpillOptions, SpillQueue
from kvtier.store.tier import Tier, TierUsage, held_by_runs
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

    With ``spill`` options (and a local tier below tier 0), tier 0's evictions go into tier 1
    through ``spills`` (kvtier.store.spill_queue), off the put's critical path; blocks rejected by
    tier 0 still go down at once. A queued block counts as tier 0's: lookups, loads and per-key
    gets find it there (and promote it), and since the queue lets go of a block only once the
    tier below holds it, a block on its way down is never a miss. Deletes drop queued blocks;
    purges drop them through the write fence. ``put(durable=True)`` returns once the blocks are
    in the first durable local tier and everything queued before it returned was written.
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
        spill: SpillOptions | None = None,
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
        #: The first local tier below tier 0 whose contents survive a crash of this process.
        self._durable = next((i for i in range(1, self._local) if self.tiers[i].durable), None)
        #: Tier 0's evictions on their way into tier 1 (None: spilled synchronously, in the put).
        self.spills: SpillQueue | None = None
        if spill is not None and self._local >= 2:
            self.spills = SpillQueue(self._spill_from_first, spill, metrics=self.tiers[1].metrics)
            self.fence.track(self.spills)

    def tier(self, name: str) -> Tier:
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(name)

    # -- lookup / get -----------------------------------------------------------------------------
    def lookup(self, keys: Sequence[BlockKey], *, local_only: bool = False) -> Lookup:
        """Longest prefix held across tiers (``local_only``: this node's own tiers; the remote
        tier, shared by every node, is not asked).

        At each run start the fastest tier holding that position serves the longest run it has
        from there; the next run starts where it stops, and the tier that served the run is not
        asked again there (it has just said it lacks that key; asking again would cost a daemon
        client one more round trip on every lookup that ends short). One ``contains`` per tier
        per run keeps remote tiers to a few batched probes instead of one round trip per block.
        """
        self.requests.walked()
        runs: list[TierRun] = []
        pos = 0
        ended = -1  # the tier whose run stopped at pos: it does not hold keys[pos], so it is not asked
        tiers = self.tiers[: self._local] if local_only else self.tiers
        while pos < len(keys):
            rest = keys[pos:]
            for level, t in enumerate(tiers):
                if level == ended:
                    continue
                n = self._first_contains(rest) if level == 0 else t.contains(rest)
                if n:
                    runs.append(TierRun(level, t.name, pos, n))
                    pos += n
                    ended = level
                    break
            else:
                break
        return Lookup(tuple(runs), len(keys), tuple(keys[:pos]))

    def get(self, keys: Sequence[BlockKey]) -> list[Block]:
        """``load(lookup(keys))``: the verified blocks of the longest cached prefix of ``keys``."""
        return self.load(self.lookup(keys))  # type: ignore[return-value]

    def load(self, lookup: Lookup, *, first: FirstTierReader | None = None,
             sink: LayerSink | None = None) -> list[Readable]:
        """Read what ``lookup`` found, run by run, and promote hits from lower tiers into tier 0.

        Each returned item is checked to be the key asked for, in that key's own scope domain; a
        block that vanished or failed verification since the lookup shortens the result (the
        prefix ends there). ``first`` reads tier 0 in the caller's own form (see Readable);
        without it, every item is a Block. ``sink`` is offered the first run's blocks layer by
        layer (see LayerSink; whoever passes it checks ``sink.complete`` afterwards).
        """
        assert lookup.loadable, "a lookup built without its keys cannot be loaded"
        keys = lookup.keys
        out: list[Readable] = []
        with self.pins.hold(list(keys)):
            for run in lookup.runs:
                want = keys[run.start : run.start + run.count]
                offer = sink if run.start == 0 else None
                if run.level == 0:
                    got, promote = self._read_first(want, first, offer)
                else:
                    got = self._read(run.level, want, first, offer)
                    promote = [b for b in got if isinstance(b, Block)]
                for i, item in enumerate(got):
                    if not _is(item, want[i]):
                        if item is not None:
                            self.tiers[run.level].metrics.error("wrong_block")
                        return out
                    out.append(item)
                if self.promote and promote:
                    self._put_at(0, promote)
        return out

    def get_each(self, keys: Sequence[BlockKey], *, first: FirstTierReader | None = None,
                 misses: MissBudget | None = None) -> list[Readable | None]:
        """Each key from the fastest tier that holds it (None where none does), with the same
        checks and promotion as ``load``: one batched read per tier for the keys still missing.
        With ``misses`` (the call's), shared tiers are read in waves and no more once it is spent."""
        self.requests.walked()
        with self.pins.hold(list(keys)):
            return self._each(keys, first, 0, misses)

    def _each(self, keys: Sequence[BlockKey], first: FirstTierReader | None, start: int,
              misses: MissBudget | None = None) -> list[Readable | None]:
        """``get_each`` from tier ``start`` down (pins held by the caller)."""
        found: list[Readable | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        for level in range(start, len(self.tiers)):
            if not todo:
                break
            tier = self.tiers[level]
            if misses is not None and tier.shared_across_processes:
                got = self._read_bounded(level, [keys[i] for i in todo], first, misses)
            else:
                got = list(self._read(level, [keys[i] for i in todo], first))
            promote: list[Block] = []
            if level == 0 and self.spills is not None:
                # Evicted from tier 0 but still queued: tier 0's as far as readers can tell.
                gone = [j for j, g in enumerate(got) if g is None]
                for j, b in zip(gone, self.spills.get([keys[todo[j]] for j in gone]) if gone else (), strict=True):
                    got[j] = b
                    if b is not None:
                        promote.append(b)
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
            if level > 0:
                promote = [b for b in hits if isinstance(b, Block)]
            if self.promote and promote:
                self._put_at(0, promote)
        return found

    def _read_bounded(self, level: int, keys: Sequence[BlockKey], first: FirstTierReader | None,
                      misses: MissBudget) -> list[Readable | None]:
        """``_read`` of a shared tier in waves of at most what ``misses`` has left, stopping once it
        is spent; the keys never asked are misses, counted as ``probes_skipped``."""
        got: list[Readable | None] = [None] * len(keys)
        pos = 0
        while pos < len(keys) and misses.left > 0:
            wave = keys[pos : pos + misses.left]
            part = self._read(level, wave, first)
            got[pos : pos + len(wave)] = part
            misses.spend(sum(not _is(x, k) for x, k in zip(part, wave, strict=True)))
            pos += len(wave)
        if pos < len(keys):
            tier = self.tiers[level]
            tier.metrics.miss(len(keys) - pos)
            tier.metrics.error("probes_skipped", len(keys) - pos)
        return got

    def _first_contains(self, keys: Sequence[BlockKey]) -> int:
        """Longest prefix of ``keys`` held by tier 0 or queued on its way down from it."""
        first = self.tiers[0]
        n = first.contains(keys)
        if self.spills is None:
            return n
        while n < len(keys):
            queued = self.spills.contains(keys[n:])
            if not queued:
                break
            n += queued
            n += first.contains(keys[n:]) if n < len(keys) else 0
        return n

    def _read_first(
        self, keys: Sequence[BlockKey], first: FirstTierReader | None, sink: LayerSink | None = None
    ) -> tuple[list[Readable | None], list[Block]]:
        """Tier 0's part of a lookup: from tier 0, else from the spill queue, else from below (a
        block the lookup saw queued may have landed in tier 1 since: the queue lets go of a block
        only once the tier below holds it). Returns the items and the blocks to promote."""
        got = list(self._read(0, keys, first, sink))
        if self.spills is None:
            return got, []
        gone = [i for i, g in enumerate(got) if g is None]
        if not gone:
            return got, []
        promote = []
        for i, b in zip(gone, self.spills.get([keys[i] for i in gone]), strict=True):
            if b is not None:
                got[i] = b
                promote.append(b)
        moved = [i for i in gone if got[i] is None]
        if moved:
            for i, item in zip(moved, self._each([keys[i] for i in moved], None, 1), strict=True):
                got[i] = item  # promoted by _each
        return got, promote

    def _read(self, level: int, keys: Sequence[BlockKey], first: FirstTierReader | None,
              sink: LayerSink | None = None) -> Sequence[Readable | None]:
        t0 = time.perf_counter()
        if level == 0 and first is not None:
            got: Sequence[Readable | None] = first(keys)
        elif sink is not None:
            got = self.tiers[level].get_layers(keys, sink)
        else:
            got = self.tiers[level].get(keys)
        # Only complete reads calibrate: a partial miss says nothing about the tier's speed.
        if self.observer is not None and got and all(b is not None for b in got):
            nbytes = sum(b.nbytes for b in got if b is not None)
            self.observer.observe_transfer(self.tiers[level].name, len(got), nbytes, time.perf_counter() - t0)
        return got

    # -- put / delete -----------------------------------------------------------------------------
    def put(self, blocks: Sequence[Block], *, durable: bool = False) -> StorePutReport:
        """Store ``blocks`` in tier 0 (what does not fit falls to the next tier), hand them to the
        remote write policy, and report per key where each one ended up.

        Returns once the blocks are in their first tier; what they evicted may still be queued
        (``spills``). With ``durable`` it returns once the blocks are also in the first durable
        local tier (one that survives this process: LMDB) and every block queued before it
        returns was written down; SpillFailed if a spill failed meanwhile. A store without a
        durable local tier only waits for the queue."""
        outcomes: dict[BlockKey, KeyPut] = {}
        failures = self.spills.failures() if durable and self.spills is not None else 0
        with self.pins.hold([b.key for b in blocks]):
            with self.fence.writing():
                admitted = self.fence.admit(blocks)
                if len(admitted) < len(blocks):
                    kept = {b.key for b in admitted}
                    outcomes.update((b.key, KeyPut(PutOutcome.FENCED)) for b in blocks if b.key not in kept)
                self._put_at(0, admitted, outcomes)
                self.write_policy.on_put(admitted)
                if durable:
                    self._write_durable(admitted, outcomes)
            # Waiting outside the fence: a purge need not wait for the queue, it cancels its part.
            if durable and self.spills is not None:
                self.spills.wait(self.spills.mark())
                if self.spills.failures() > failures:
                    raise SpillFailed("a spill into the tier below failed while this durable put waited; "
                                      "blocks it evicted may be lost")
        return StorePutReport(outcomes)

    def _write_durable(self, blocks: Sequence[Block], outcomes: Mapping[BlockKey, KeyPut]) -> None:
        """Also write into the first durable local tier the ``blocks`` that only a faster,
        volatile tier holds (pins and fence held by the caller)."""
        if self._durable is None:
            return
        volatile = {t.name for t in self.tiers[: self._durable]}
        todo = [b for b in blocks if outcomes.get(b.key, KeyPut(PutOutcome.REJECTED)).tier in volatile]
        if todo:
            self._put_at(self._durable, todo)

    def _spill_from_first(self, items: list[Block | SealedRecord]) -> None:
        """The spill queue's writer: tier 0's evictions into tier 1 (and what that evicts, on down)."""
        self._put_at(1, items)

    def flush_spills(self, timeout_s: float | None = None) -> bool:
        """Wait until every block queued for spilling so far is written down; False on timeout.
        Raises SpillFailed for spill failures not raised before."""
        return True if self.spills is None else self.spills.flush(timeout_s)

    def flush_remote(self, timeout_s: float | None = None) -> bool:
        """Wait for queued spills, then pending remote uploads (write-through/write-back); False
        on timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        if not self.flush_spills(timeout_s):
            return False
        return self.write_policy.flush(None if deadline is None else max(0.0, deadline - time.monotonic()))

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
                # Rejected blocks (no room, all pinned) fall through to the next tier; so do evictions,
                # tier 0's through the spill queue (off this put's path) when there is one.
                rejected = set(res.rejected)
                evicted = res.evicted
                if level == 0 and self.spills is not None and evicted:
                    evicted = self.spills.submit(self.fence.admit(evicted))  # what it does not take goes now
                blocks = [*evicted, *(b for b in blocks if b.key in rejected)]
                level += 1
        if outcomes is not None:
            outcomes.update((k, KeyPut(PutOutcome.REJECTED)) for k in pending)

    def delete(self, keys: Sequence[BlockKey]) -> dict[str, int]:
        """Remove ``keys`` everywhere; queued blocks count as tier 0's (as lookups report them)."""
        self.write_policy.forget(keys)
        queued = self.spills.forget(keys) if self.spills is not None else 0
        removed = {t.name: t.delete(keys) for t in self.tiers}
        removed[self.tiers[0].name] += queued
        return removed

    def delete_scope(self, domain: ScopeDomain) -> dict[str, int]:
        self.write_policy.forget(domain=domain)
        queued = self.spills.forget(domain=domain) if self.spills is not None else 0
        removed = {t.name: t.delete_scope(domain) for t in self.tiers}
        removed[self.tiers[0].name] += queued
        return removed

    # -- what the store holds ------------------------------------------------------------------
    def held(self, keys: Sequence[BlockKey]) -> set[BlockKey]:
        """Which of ``keys`` some tier holds (queued spills count as tier 0's, as lookups see
        them). Tier by tier, fastest first, one batched ``holds`` per tier for the keys no faster
        tier holds: a key found locally never costs a remote request, and no tier is asked key by
        key. A tier that cannot tell (a remote outage) answers absent, as its lookups do."""
        todo = list(dict.fromkeys(keys))
        found: set[BlockKey] = set()
        for level, t in enumerate(self.tiers):
            if not todo:
                break
            here = t.holds(todo)
            if level == 0 and self.spills is not None:
                # Evicted from tier 0 but still queued: tier 0's as far as readers can tell.
                gone = [k for k, h in zip(todo, here, strict=True) if not h]
                queued = {k for k, q in zip(gone, held_by_runs(self.spills.contains, gone), strict=True) if q}
                here = [h or k in queued for k, h in zip(todo, here, strict=True)]
            found.update(k for k, h in zip(todo, here, strict=True) if h)
            todo = [k for k, h in zip(todo, here, strict=True) if not h]
        return found

    def local_tier_of(self, keys: Sequence[BlockKey]) -> list[str | None]:
        """The fastest local tier holding each key, aligned with ``keys`` (queued spills count as
        tier 0's, as lookups see them); None where no local tier does. The remote tier is never
        named: it lives on no node. One batched ``holds`` per local tier, for the keys still unplaced."""
        out: list[str | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        for level, t in enumerate(self.tiers[: self._local]):
            if not todo:
                break
            here = t.holds([keys[i] for i in todo])
            if level == 0 and self.spills is not None:
                gone = [keys[i] for i, h in zip(todo, here, strict=True) if not h]
                queued = dict(zip(gone, held_by_runs(self.spills.contains, gone), strict=True))
                here = [h or queued.get(keys[i], False) for i, h in zip(todo, here, strict=True)]
            for i, h in zip(todo, here, strict=True):
                if h:
                    out[i] = t.name
            todo = [i for i, h in zip(todo, here, strict=True) if not h]
        return out

    def keys_by_tier(self, domain: ScopeDomain) -> dict[str, list[BlockKey]]:
        """Every key each tier lists under scope ``domain`` from its own storage, by tier name,
        fastest first. Blocks queued on their way from tier 0 to tier 1 are listed once they
        land (the spill queue offers lookups and deletes, not listings). TierUnavailable
        propagates: a listing that could not be made is not an empty one."""
        return {t.name: t.keys_in_scope(domain) for t in self.tiers}

    def keys_in_scope(self, domain: ScopeDomain) -> set[BlockKey]:
        """Every key of scope ``domain`` that some tier holds (the union of ``keys_by_tier``)."""
        return set().union(*self.keys_by_tier(domain).values())

    def usage(self, *, remote: bool = True, domains: Collection[ScopeDomain] | None = None) -> dict[str, TierUsage]:
        """Each tier's usage by name, fastest first; the remote tier only with ``remote`` (a
        store whose one tier is the remote one counts it as local).

        With ``domains``: each tier's usage as seen by someone who may see only those scope
        domains: their bytes and blocks per domain (``blocks_by_domain`` always filled, listed
        where the tier does not count it) and summed as the totals, and the tier's capacity.
        TierUnavailable propagates (a remote listing that failed)."""
        tiers = self.tiers if remote else self.tiers[: self._local]
        out = {t.name: t.usage() for t in tiers}
        if domains is None:
            return out
        for t in tiers:
            u = out[t.name]
            by_domain = {d: n for d, n in u.by_domain.items() if d in domains}
            counted = u.blocks_by_domain
            blocks = {d: counted.get(d, 0) if counted is not None else len(t.keys_in_scope(d)) for d in by_domain}
            out[t.name] = TierUsage(sum(blocks.values()), sum(by_domain.values()), u.capacity_bytes, by_domain,
                                    blocks)
        return out

    def record_request(self, input_tokens: int, hit_tokens: int) -> None:
        self.requests.record(input_tokens, hit_tokens)

    def stats(self) -> dict[str, object]:
        out: dict[str, object] = {
            "requests": self.requests.snapshot(),
            "tiers": [t.metrics.snapshot() | {"usage": _usage(t)} for t in self.tiers],
            "time": time.time(),
        }
        if self.spills is not None:
            out["spill"] = asdict(self.spills.stats())
        return out

    def close(self) -> None:
        """Write queued spills down, drain remote uploads, close every tier (even when one of
        those steps raises: the first error is raised after)."""
        try:
            if self.spills is not None:
                self.spills.close()
        finally:
            try:
                self.write_policy.close()
            finally:
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
