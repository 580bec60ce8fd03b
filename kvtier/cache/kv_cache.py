"""KVCache: the in-process facade every user goes through (connectors, the daemon, the main job).

Every call takes the authenticated principal and runs the policy before touching a tier:

- ``chain`` derives keys from segments whose scopes are *relative* to the principal (``public``,
  ``org``, ``user``, ``session``); a caller can never name another tenant's scope or domain.
- ``lookup``/``load``/``save``/``delete`` never trust the scope or domain fields of a chain handed
  back to them: the domain is read from each key's routing prefix and checked against the
  principal's own domains, so a forged chain carrying another tenant's keys is refused before
  any tier is asked.
- ``purge`` deletes a scope from every tier and destroys its data key, journaled so a crash in the
  middle resumes on the next start.
- ``stats`` reports usage only for scopes the principal may read.

Timing side channel (docs/security.md): cross-tenant hits on private content cannot happen (keys
differ by construction); hits on public content are shared on purpose. ``TimingMitigations``
offers a minimum shared-prefix length before a public-only hit is served and a per-principal
limit on lookups that end in misses.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtier.block import Block
from kvtier.cache.purge import NOTHING_TO_COMPACT, Compactor, PurgeJournal, PurgeReport, ScopePurger
from kvtier.errors import ConfigError, LayoutMismatch, ScopeError
from kvtier.keys import (
    LAYOUT_TAG_BYTES,
    BlockKey,
    ChainBlock,
    Scope,
    ScopeDomain,
    ScopeKind,
    Segment,
    block_chain,
    key_domain,
    key_layout_tag,
)
from kvtier.layout import KVLayout
from kvtier.security.audit import check_sizes
from kvtier.security.gate import AccessGate
from kvtier.security.keyring import KeyRing
from kvtier.security.policy import Policy, Principal
from kvtier.security.timing import TimingMitigations
from kvtier.store.layer_sink import LayerSink
from kvtier.store.lookup import Lookup
from kvtier.store.tiered_store import TieredStore


# =================================================================================================
# Requests
# =================================================================================================
@dataclass(slots=True, frozen=True)
class RequestSegment:
    """A run of tokens and who may reuse its KV, relative to the caller: ``public``, ``org``,
    ``user`` (the default: a principal's content lands in its own scope) or ``session``."""

    tokens: Sequence[int]
    scope: ScopeKind | str = ScopeKind.USER


# =================================================================================================
# The facade
# =================================================================================================
@dataclass(slots=True, frozen=True)
class CacheOptions:
    #: The key ring of the encrypting tiers: a purge destroys the scope's data keys in it.
    keyring: KeyRing | None = None
    #: Where purge intents are journaled (None: in memory, no resume after a crash).
    journal_dir: str | os.PathLike[str] | None = None
    mitigations: TimingMitigations = field(default_factory=TimingMitigations)
    #: Holders of scope data outside the store's tiers (a location directory), purged too.
    extra_purgers: tuple[ScopePurger, ...] = ()
    #: Run after a purge's deletions, before it counts as done: make deleted bytes leave storage
    #: that keeps them (a SeaweedFS volume vacuum). Reported in ``PurgeReport.compacted``.
    compactors: tuple[Compactor, ...] = ()
    clock: Callable[[], float] = time.monotonic
    #: Also told of every refusal and mitigation the gate counts (a daemon's metrics).
    on_count: Callable[[str, int], None] | None = None


@dataclass(slots=True, frozen=True)
class SaveReport:
    """``stored``: blocks newly written per tier; ``not_published``: chain indices skipped
    because they are shared (public/org) content the principal may read but not publish."""

    stored: dict[str, int]
    offered: int
    not_published: tuple[int, ...]


class KVCache:
    """The policy-checked front of a TieredStore, for one or more KV layouts.

    Every access decision is the ``AccessGate``'s (kvtier/security/gate.py), the same gate the
    daemon's service calls. Invariants: no tier is touched for a principal that is revoked, or
    for a block whose key domain the principal may not use for that operation; blocks of a
    domain under purge are neither served nor written (the store's write fence) until the purge
    finishes. The cache itself holds no block data; ``counters`` (guarded by ``_lock``) count
    refusals and mitigations. Unfinished purges found in the journal are resumed by the
    constructor.

    Protocol, per request: ``chain`` -> ``lookup`` -> ``load(..., lookup=)`` (reads what the
    lookup found, no second lookup) -> compute the rest -> ``save``.
    """

    def __init__(
        self,
        store: TieredStore,
        layouts: KVLayout | Sequence[KVLayout],
        policy: Policy,
        options: CacheOptions | None = None,
    ) -> None:
        self.store = store
        self.policy = policy
        self.options = options or CacheOptions()
        layouts = [layouts] if isinstance(layouts, KVLayout) else list(layouts)
        # No layouts is allowed: the gRPC daemon serves blocks by key and uses the cache only for
        # policy-checked purges and stats; chain/save then raise LayoutMismatch (no layout to use).
        self._layouts: dict[bytes, KVLayout] = {}
        for lay in layouts:
            tag = lay.fingerprint[:LAYOUT_TAG_BYTES]
            if tag in self._layouts and self._layouts[tag] != lay:
                raise ConfigError(f"two layouts share the tag {tag.hex()}")
            self._layouts[tag] = lay
        self.journal = PurgeJournal(self.options.journal_dir)
        self._lock = threading.Lock()
        self.counters: Counter[str] = Counter()
        #: The one access gate; a daemon's service is handed this same object.
        self.gate = AccessGate(policy, store, self.options.mitigations, self._count, self.options.clock)
        self.resumed: list[PurgeReport] = self.resume_purges()

    # -- keys -------------------------------------------------------------------------------------
    def layout(self, which: KVLayout | str | None = None) -> KVLayout:
        """The layout to use: the only one, or one named by model id or fingerprint hex."""
        if isinstance(which, KVLayout):
            if which.fingerprint[:LAYOUT_TAG_BYTES] not in self._layouts:
                raise LayoutMismatch("layout is not served by this cache")
            return which
        if which is None:
            if len(self._layouts) != 1:
                raise LayoutMismatch(f"this cache serves {len(self._layouts)} layouts: name one")
            return next(iter(self._layouts.values()))
        found = [lay for lay in self._layouts.values() if which in (lay.model_id, lay.fingerprint.hex())]
        if len(found) != 1:
            raise LayoutMismatch(f"no single layout named {which!r}")
        return found[0]

    def chain(
        self,
        principal: Principal,
        segments: Iterable[RequestSegment | Segment],
        *,
        layout: KVLayout | str | None = None,
        after: ChainBlock | None = None,
    ) -> list[ChainBlock]:
        """Keys of every full block of a request, with scopes mapped to the principal's own.

        ``keys.Segment`` (absolute scope) is accepted only when its scope is one the principal
        can read, so a caller cannot reach another tenant's scope by naming it. ``after``: the
        segments continue a chain this principal computed, whose last block so far is ``after``
        (``keys.block_chain``). Under the minimum public prefix, a public run at the start that
        is too short to be shared, followed by the caller's own content, is keyed in that
        content's scope (``TimingMitigations.rescope``): the request's blocks are then all the
        caller's, stored by its save and found by its lookup, and whether anyone else cached
        the document never enters the answer (docs/security.md 2.8).
        """
        self.policy.require_active(principal)
        lay = self.layout(layout)
        if after is not None:
            self.gate.require_scope(principal, after.scope)
        resolved = []
        for seg in segments:
            scope = principal.own_scope(seg.scope) if isinstance(seg, RequestSegment) else seg.scope
            self.gate.require_scope(principal, scope)
            resolved.append(Segment(seg.tokens, scope))
        if after is None:
            resolved = self.options.mitigations.rescope(resolved, lay.block_tokens)
        return block_chain(lay, resolved, self.policy.deriver, after)

    # -- reads ------------------------------------------------------------------------------------
    def lookup(self, principal: Principal, chain: Sequence[ChainBlock], *, local_only: bool = False) -> Lookup:
        """Longest cached prefix of ``chain`` that ``principal`` may read (``AccessGate.lookup``;
        ``local_only``: in this node's own tiers).

        Hand the result back to ``load`` to read it without a second lookup.
        """
        return self.gate.lookup(principal, [cb.key for cb in chain], local_only=local_only).lookup

    def load(
        self,
        principal: Principal,
        chain: Sequence[ChainBlock],
        n: int | None = None,
        *,
        lookup: Lookup | None = None,
        sink: LayerSink | None = None,
    ) -> list[Block]:
        """The verified blocks of the longest cached prefix of ``chain[:n]``.

        ``sink``: hand them over layer by layer as they land, where the store's tier can (see
        LayerSink: check ``sink.complete(len(result))`` before relying on it).

        With ``lookup`` (what ``lookup(principal, chain...)`` returned) the blocks it found are
        read without probing the tiers again; it must describe a prefix of ``chain``. Asking for
        a block the principal may not read is refused (AccessDenied) before any tier is touched;
        a block that vanished or failed verification shortens the result.
        """
        n = len(chain) if n is None else n
        if not 0 <= n <= len(chain):
            raise ValueError(f"load: n={n} outside [0, {len(chain)}]")
        keys = [cb.key for cb in chain[:n]]
        if lookup is not None:
            if tuple(keys[: len(lookup.keys)]) != lookup.keys[:n] or not lookup.loadable:
                raise ScopeError("load: the lookup handed back is not one of this chain")
            return self.load_found(principal, lookup.slice(0, n) if lookup.length > n else lookup, sink=sink)
        gate = self.gate
        gate.require_readable(principal, keys)
        lk = gate.lookup(principal, keys, then_read=True).lookup
        blocks = self.store.load(lk, sink=sink)
        gate.served(principal, len(blocks), n)
        return blocks  # type: ignore[return-value]

    def load_found(self, principal: Principal, lookup: Lookup, *, start: int = 0, end: int | None = None,
                   sink: LayerSink | None = None) -> list[Block]:
        """The verified blocks ``lookup`` found at chain positions ``[start, end)``
        (``lookup(principal, chain)``'s answer, handed back, possibly by another process of the
        same engine: vLLM's scheduler looks up, its worker loads). The gate re-checks that
        ``principal`` may still read every key of it, so a lookup made for someone else is
        refused (AccessDenied) before any tier is touched; a block that vanished or failed
        verification since shortens the result."""
        if not lookup.loadable:
            raise ScopeError("load_found: a lookup built without its keys cannot be loaded")
        end = lookup.length if end is None else end
        if not 0 <= start <= end:
            raise ValueError(f"load_found: [{start}, {end})")
        lk = self.gate.recheck(principal, lookup)
        if start or end < lk.length:
            lk = lk.slice(start, min(end, lk.length))
        blocks = self.store.load(lk, sink=sink)
        self.gate.served(principal, len(blocks), lk.length)
        return blocks  # type: ignore[return-value]

    # -- writes -----------------------------------------------------------------------------------
    def save(
        self,
        principal: Principal,
        chain: Sequence[ChainBlock],
        tensors: Sequence[torch.Tensor],
        *,
        start: int = 0,
    ) -> SaveReport:
        """Store ``tensors[i]`` as block ``chain[start + i]``.

        Everything is validated before anything is written: a block in a scope the principal
        cannot read (another tenant's), a malformed chain, a tensor of the wrong layout, or a
        scope under purge raises and stores nothing. Shared blocks (public/org) the principal may
        read but lacks the role to publish are skipped and listed in ``not_published``.
        """
        self.policy.require_active(principal)
        if start < 0 or start + len(tensors) > len(chain):
            raise LayoutMismatch(f"save: {len(tensors)} tensors from block {start} overrun a {len(chain)}-block chain")
        check_links(chain)
        part = chain[start : start + len(tensors)]
        writable = self.gate.writable(principal, [key_domain(cb.key) for cb in part])
        blocks: list[Block] = []
        skipped: list[int] = []
        for i, (cb, data) in enumerate(zip(part, tensors, strict=True)):
            dom = key_domain(cb.key)
            if not writable[dom]:
                skipped.append(start + i)
                continue
            blocks.append(Block.build(self._layout_of(cb.key), cb.key, dom, data, parent=cb.parent, index=cb.index))
        if skipped:
            self._count("not_published", len(skipped))
        report = self.store.put(blocks) if blocks else None
        return SaveReport(report.stored if report else {}, len(blocks), tuple(skipped))

    def delete(self, principal: Principal, chain: Sequence[ChainBlock]) -> dict[str, int]:
        """Delete these blocks from every tier; every block must be deletable by the principal."""
        self.gate.require_delete(principal, {key_domain(cb.key) for cb in chain})
        return self.store.delete([cb.key for cb in chain])

    # -- purge ------------------------------------------------------------------------------------
    def resolve_scope(self, actor: Principal, scope: Scope | ScopeKind | str) -> Scope:
        """``"user"``/``ScopeKind.USER`` -> the actor's own; ``"user:<tenant>/<id>"`` or a Scope -> as named.

        Naming a scope absolutely only works for principals the policy lets delete it (tenant
        admins within their tenant, operators): purge checks ``may_delete`` on the result.
        """
        if isinstance(scope, Scope):
            return scope
        if isinstance(scope, ScopeKind) or ":" not in scope:
            return actor.own_scope(scope)
        return Scope.parse(scope)

    def purge(self, actor: Principal, scope: Scope | ScopeKind | str, *, reason: str = "") -> PurgeReport:
        """Remove every copy of ``scope`` from every tier and destroy its data keys.

        Order: the intent is journaled; the store's write fence closes the domain (no put,
        promotion, spill or upload can land behind the purge); the data keys are destroyed
        first, so any copy still anywhere is unreadable from that moment; then each tier and
        each extra purger deletes the domain; the keys are destroyed once more (a no-op unless
        something raced); the journal entry is removed. Idempotent: purging an already purged
        scope succeeds and removes nothing. A crash leaves the journal entry, and the next
        KVCache resumes it.
        """
        # Sizes first (INVALID_ARGUMENT, nothing done): an action runs only if it can be audited in full.
        check_sizes(target=scope if isinstance(scope, str) else str(scope), reason=reason)
        target = self.resolve_scope(actor, scope)
        domain = self.gate.require_purge(actor, target)
        audit = self.policy.audit
        if audit is not None:
            audit.append(actor.id, "purge.start", str(target), domain=domain.hex(), reason=reason)
        try:
            report = self._purge_domain(domain, actor.id, scope_name=str(target))
        except Exception as exc:
            # Every purge.start ends in purge.done or purge.failed (a crash ends in purge.resume +
            # purge.done on the next start, from the journal).
            if audit is not None:
                audit.append(actor.id, "purge.failed", str(target), domain=domain.hex(), error=type(exc).__name__,
                             pending=domain.hex() in {e.domain for e in self.journal.pending()})
            raise
        if audit is not None:
            audit.append(actor.id, "purge.done", str(target), domain=domain.hex(), removed=report.removed,
                         keys_destroyed=report.keys_destroyed, resumed=report.resumed, compacted=report.compacted)
        return report

    def resume_purges(self) -> list[PurgeReport]:
        """Finish every purge the journal says was started and not finished (run on construction)."""
        out = []
        for entry in self.journal.pending():
            domain = ScopeDomain(bytes.fromhex(entry.domain))
            if self.policy.audit is not None:
                self.policy.audit.append(entry.actor, "purge.resume", entry.domain, domain=entry.domain)
            try:
                report = self._purge_domain(domain, entry.actor, scope_name=None)
            except Exception as exc:
                if self.policy.audit is not None:
                    self.policy.audit.append(entry.actor, "purge.failed", entry.domain, domain=entry.domain,
                                             error=type(exc).__name__, pending=True)
                raise
            if self.policy.audit is not None:
                self.policy.audit.append(entry.actor, "purge.done", entry.domain, domain=entry.domain,
                                         removed=report.removed, keys_destroyed=report.keys_destroyed, resumed=True)
            out.append(report)
        return out

    def _purge_domain(self, domain: ScopeDomain, actor_id: str, *, scope_name: str | None) -> PurgeReport:
        entry, resumed = self.journal.begin(domain, actor_id)
        keyring = self.options.keyring
        with self.store.fence.closed(domain):
            if keyring is not None:
                entry.keys_destroyed += keyring.destroy(domain)
                self.journal.progress(entry)
            # Uploads of the scope queued before the fence closed: cancel them, wait out those in flight.
            self.store.write_policy.forget(domain=domain)
            holders: list[Any] = [*self.store.tiers, *self.options.extra_purgers]
            for holder in holders:
                entry.removed[holder.name] = entry.removed.get(holder.name, 0) + holder.delete_scope(domain)
                self.journal.progress(entry)
            if keyring is not None:
                entry.keys_destroyed += keyring.destroy(domain)
            # Deleted objects and keys may still sit in storage files (volumes) until compacted:
            # the purge is done only once they are gone (a failure leaves it journaled). A purge
            # that deleted nothing (counted over every attempt of it, from the journal) left
            # nothing to compact: it costs no vacuum.
            if entry.keys_destroyed or any(entry.removed.values()):
                compacted = {c.name: c.compact() for c in self.options.compactors}
            else:
                compacted = {c.name: NOTHING_TO_COMPACT for c in self.options.compactors}
            self.journal.finish(entry)
        return PurgeReport(domain.hex(), dict(entry.removed), entry.keys_destroyed, resumed, scope_name, compacted)

    def remaining(self, actor: Principal, scope: Scope | ScopeKind | str) -> dict[str, int]:
        """What is left of a scope in every holder (keys listed from the tiers' own storage) and
        in the key ring: all zeros after a purge. Needs delete rights on the scope."""
        domain = self.gate.require_purge(actor, self.resolve_scope(actor, scope))
        left = {name: len(keys) for name, keys in self.store.keys_by_tier(domain).items()}
        left.update((h.name, len(h.keys_in_scope(domain))) for h in self.options.extra_purgers)
        keyring = self.options.keyring
        if keyring is not None:
            left["data_keys"] = len(keyring.store.wrapped_for(domain))
        return left

    # -- stats ------------------------------------------------------------------------------------
    def stats(self, principal: Principal, scope: ScopeKind | str | None = None) -> dict[str, Any]:
        """Stored bytes per tier for each scope the principal may read (or only ``scope``), named
        relative to the principal (``public``, ``org``, ``user``, ``session``)."""
        self.policy.require_active(principal)
        readable = self.gate.readable(principal)
        visible = self.gate.visible_domains(principal)  # the gate's rule (public usage under mitigations)
        if visible is not None:
            readable = {d: s for d, s in readable.items() if d in visible}
        if scope is not None:
            target = principal.own_scope(scope)
            self.gate.require_scope(principal, target)
            readable = {d: s for d, s in readable.items() if s == target}
        usage = self.store.usage()
        scopes = {
            s.kind.name.lower(): {name: int(u.by_domain.get(d, 0)) for name, u in usage.items()}
            for d, s in readable.items()
        }
        return {"principal": principal.id, "scopes": scopes}

    def record_request(self, input_tokens: int, hit_tokens: int) -> None:
        """Count a request's input tokens and those whose KV came from the cache (token hit rate)."""
        self.store.record_request(input_tokens, hit_tokens)

    def traffic(self) -> list[dict[str, object]]:
        """Each tier's counters (hits, misses, bytes, puts...)."""
        return [t.metrics.snapshot() for t in self.store.tiers]

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counters)

    # -- internals --------------------------------------------------------------------------------
    def _count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self.counters[what] += n
        if self.options.on_count is not None:
            self.options.on_count(what, n)

    def _layout_of(self, key: BlockKey) -> KVLayout:
        lay = self._layouts.get(key_layout_tag(key))
        if lay is None:
            raise LayoutMismatch("chain key belongs to a layout this cache does not serve")
        return lay


def check_links(chain: Sequence[ChainBlock]) -> None:
    """A chain handed back by a caller must still be a chain: each block's parent is the previous key."""
    for prev, cur in itertools.pairwise(chain):
        if cur.parent != prev.key or cur.index != prev.index + 1:
            raise ScopeError(f"malformed chain: block {cur.index} does not follow block {prev.index}")
