"""DaemonCache: the engine side of the node's daemon, for one principal (a ``PrefixCache``).

The daemon holds the store and the one access gate; this client derives keys with the scope
domains the daemon handed out for its principal (``DomainTable``: the server secret never leaves
the daemon) and moves blocks. It holds no policy of its own: each call is decided by the daemon,
and the only checks here are the ones that need no authority (a scope the table lacks cannot be
keyed at all; a chain handed back must still be a chain).

One lookup, end to end: ``lookup`` returns what the daemon found, runs per daemon tier and the
daemon's ticket; ``load_found`` hands that back in one Get, which the daemon re-checks
(revocation, purges, the ticket) and serves with no second tier walk. The lookup may travel to
another process of the engine first (vLLM's scheduler looks up, its workers load).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from kvtier.block import Block
from kvtier.cache.kv_cache import RequestSegment, SaveReport, check_links
from kvtier.errors import AccessDenied, LayoutMismatch, ScopeError
from kvtier.keys import LAYOUT_TAG_BYTES, ChainBlock, Segment, block_chain, key_domain, key_layout_tag
from kvtier.layout import KVLayout
from kvtier.security.domain_table import DomainTable
from kvtier.security.policy import Principal
from kvtier.store.layer_sink import LayerSink
from kvtier.store.lookup import Lookup
from kvtier.store.tiered_store import TransferObserver

if TYPE_CHECKING:  # the client module needs grpc; an engine without a daemon never imports it
    from storage_backends.grpc import GrpcTier


class DaemonCache:
    """A daemon client acting for one principal (the token's, or a request salt's).

    Invariants: every key is derived from ``table`` (the daemon's domains for this principal),
    so the daemon derives the same keys; calls for another principal are refused here before
    any byte is sent (the daemon would refuse them too: the client's credential is this one).
    Thread-safe (the client and the table are).
    """

    def __init__(self, client: GrpcTier, layouts: KVLayout | Sequence[KVLayout], table: DomainTable,
                 principal: Principal, *, observer: TransferObserver | None = None) -> None:
        self.client = client
        #: Told the size and duration of every complete read that lies in one daemon tier, under
        #: that tier's name as the lookup gives it (``daemon/memory``): a cost model.
        self.observer = observer
        self.table = table
        self.principal = principal
        layouts = [layouts] if isinstance(layouts, KVLayout) else list(layouts)
        self._layouts = {lay.fingerprint[:LAYOUT_TAG_BYTES]: lay for lay in layouts}

    def _check(self, principal: Principal) -> None:
        if principal.id != self.principal.id:
            raise AccessDenied(f"this daemon client acts for {self.principal.id}, not {principal.id}")

    # -- keys -------------------------------------------------------------------------------------
    def layout(self, which: KVLayout | str | None = None) -> KVLayout:
        if isinstance(which, KVLayout):
            if which.fingerprint[:LAYOUT_TAG_BYTES] not in self._layouts:
                raise LayoutMismatch("layout is not served by this cache")
            return which
        found = [lay for lay in self._layouts.values()
                 if which is None or which in (lay.model_id, lay.fingerprint.hex())]
        if len(found) != 1:
            raise LayoutMismatch(f"no single layout named {which!r}" if which else "name one layout")
        return found[0]

    def chain(self, principal: Principal, segments: Iterable[RequestSegment | Segment], *,
              layout: KVLayout | str | None = None, after: ChainBlock | None = None) -> list[ChainBlock]:
        """Keys of every full block, scopes named relative to the principal (see KVCache.chain)."""
        self._check(principal)
        resolved = []
        for seg in segments:
            scope = principal.own_scope(seg.scope) if isinstance(seg, RequestSegment) else seg.scope
            self._require_readable(scope)
            resolved.append(Segment(seg.tokens, scope))
        if after is not None:
            self._require_readable(after.scope)
        return block_chain(self.layout(layout), resolved, self.table, after)

    def _require_readable(self, scope: object) -> None:
        grant = self.table.grants.get(scope)  # type-agnostic: a Scope not in the table is refused
        if grant is None or not grant.may_read:
            raise AccessDenied(f"principal {self.principal.id} cannot use scope {scope}")

    # -- reads ------------------------------------------------------------------------------------
    def lookup(self, principal: Principal, chain: Sequence[ChainBlock]) -> Lookup:
        """The daemon's answer for ``chain``: its runs and ticket (see the module docstring)."""
        self._check(principal)
        return self.client.lookup([cb.key for cb in chain])

    def load_found(self, principal: Principal, lookup: Lookup, *, start: int = 0, end: int | None = None,
                   sink: LayerSink | None = None) -> list[Block]:
        """The blocks ``lookup`` found at chain positions ``[start, end)``, in one Get that hands
        it back (``GrpcTier.load``)."""
        self._check(principal)
        if not lookup.loadable:
            raise ScopeError("load_found: a lookup built without its keys cannot be loaded")
        stop = min(lookup.length if end is None else end, lookup.length)
        # One Get reads every run: its time is a tier's only when the range lies in one run.
        runs = {r.tier for r in lookup.runs if r.start < stop and start < r.start + r.count}
        t0 = time.perf_counter()
        blocks = self.client.load(lookup, start, end, sink=sink)
        if self.observer is not None and len(runs) == 1 and blocks and len(blocks) == stop - start:
            self.observer.observe_transfer(runs.pop(), len(blocks), sum(b.nbytes for b in blocks),
                                           time.perf_counter() - t0)
        return blocks

    def load(self, principal: Principal, chain: Sequence[ChainBlock], n: int | None = None, *,
             lookup: Lookup | None = None, sink: LayerSink | None = None) -> list[Block]:
        """The longest cached prefix of ``chain[:n]``: the ``lookup`` handed back, or (without one)
        one Get that looks up and reads in a single walk of the daemon's tiers."""
        n = len(chain) if n is None else n
        if not 0 <= n <= len(chain):
            raise ValueError(f"load: n={n} outside [0, {len(chain)}]")
        if lookup is None:  # which daemon tier served it is not reported: nothing to observe
            self._check(principal)
            return self.client.get_prefix([cb.key for cb in chain[:n]], sink=sink)
        if list(lookup.keys[: min(n, lookup.length)]) != [cb.key for cb in chain[: min(n, lookup.length)]]:
            raise ScopeError("load: the lookup handed back is not one of this chain")
        return self.load_found(principal, lookup, end=n, sink=sink)

    # -- writes -----------------------------------------------------------------------------------
    def save(self, principal: Principal, chain: Sequence[ChainBlock], tensors: Sequence[torch.Tensor], *,
             start: int = 0) -> SaveReport:
        """Store ``tensors[i]`` as block ``chain[start + i]``; the daemon decides what is written
        (a shared block the principal may read but not publish comes back rejected and is listed
        in ``not_published``)."""
        self._check(principal)
        if start < 0 or start + len(tensors) > len(chain):
            raise LayoutMismatch(f"save: {len(tensors)} tensors from block {start} overrun a {len(chain)}-block chain")
        check_links(chain)
        part = chain[start : start + len(tensors)]
        blocks = [Block.build(self._layout_of(cb), cb.key, key_domain(cb.key), data, parent=cb.parent,
                              index=cb.index) for cb, data in zip(part, tensors, strict=True)]
        res = self.client.put(blocks, degrade=False)
        rejected = set(res.rejected)
        skipped = tuple(start + i for i, cb in enumerate(part) if cb.key in rejected)
        return SaveReport({self.client.name: len(res.stored)} if res.stored else {}, len(blocks), skipped)

    def record_request(self, input_tokens: int, hit_tokens: int) -> None:
        """Counted by the daemon per read; nothing is kept here."""

    def traffic(self) -> list[dict[str, object]]:
        """This client's counters, as one tier named after the daemon (the daemon's own tiers are
        everyone's: an operator reads them through Stats)."""
        return [self.client.metrics.snapshot()]

    def close(self) -> None:
        """Close the client (its channel, when it owns one)."""
        self.client.close()

    def _layout_of(self, cb: ChainBlock) -> KVLayout:
        lay = self._layouts.get(key_layout_tag(cb.key))
        if lay is None:
            raise LayoutMismatch("chain key belongs to a layout this cache does not serve")
        return lay
