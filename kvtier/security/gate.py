"""The access gate: the one place that decides, per principal, what a request may touch.

Both fronts of a store call it and nothing else decides access: the in-process ``KVCache`` and
the daemon's ``KvCacheService``. A security fix therefore lands once, and a test drives the same
matrix of principals x scopes x operations through both fronts and compares the answers.

Protocol, in call order, for each kind of request (every step before any tier is touched, except
where a step says it reads the store):

- lookup:        ``lookup(p, keys)`` -> a ``GateLookup`` (probes the tiers once).
- load/prefix:   ``require_readable(p, keys)``, then ``lookup(p, keys, then_read=True)`` or, for a
                 lookup handed back, ``recheck(p, lookup)`` (in process) or ``handed_back(p, lookup)``
                 (across a trust boundary: it must carry the ticket ``seal`` put on it); read the
                 store; ``served(p, hit, wanted)``.
- per-key read:  ``require_readable(p, keys)``, ``admit(p)``, ``each(p, keys)``; read the store;
                 ``served(p, hit, wanted)``.
- write:         ``writable(p, domains)`` -> which domains to store (False: a shared scope the
                 principal may read but not publish: skipped, not refused).
- delete:        ``require_delete(p, domains)``.  list: ``require_list(p, domain)``.
- purge:         ``require_purge(actor, scope)``.  stats: ``visible_domains(p)``, ``sees_totals(p)``.
- write answers:  ``reveals_presence(p)``: may a write say "already present" rather than "stored".
- streams:       ``require_still_active(p)`` before every message of a read stream, and before every
                 copy into the caller's shared-memory region (each block, each group of layers).
- every call:    ``require_method(p, method)`` first: a confined role (``router``) calls only its methods.

Rules (docs/security.md): a key's scope domain is its routing prefix, never a field a caller
supplies; a principal reads the domains of its own readable scopes; a revoked principal is
refused everything; a domain under purge is neither read nor written (the store's write fence)
until the purge finishes; reading past a domain the caller may not read is refused for loads and
per-key reads and ends the prefix for lookups; the timing mitigations (``TimingGuard``) apply to
every read. Refusals and hidden hits are counted through ``count(what, n)``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

from kvtier.errors import AccessDenied
from kvtier.keys import BlockKey, Scope, ScopeDomain, ScopeKind, key_domain
from kvtier.security.lookup_tickets import LookupTickets
from kvtier.security.policy import ROLE_OPERATOR, Op, Policy, Principal
from kvtier.security.timing import TimingGuard, TimingMitigations
from kvtier.store.lookup import Lookup
from kvtier.store.tiered_store import TieredStore

Count = Callable[[str, int], None]


@dataclass(slots=True, frozen=True)
class GateLookup:
    """A lookup as the gate answered it: the store's ``lookup`` over the keys the principal may
    read (``requested`` is every key asked about), and how many leading keys were readable."""

    lookup: Lookup
    readable: int


class AccessGate:
    """The read/write/lookup/delete policy plus the timing guard, for one store.

    Invariants: every method re-checks that the principal is not revoked; no method touches a
    tier except ``lookup`` (one store lookup, through the timing guard); every refusal is
    counted before it is raised. Thread-safe (the policy, fence and guard are).
    """

    def __init__(
        self,
        policy: Policy,
        store: TieredStore,
        mitigations: TimingMitigations,
        count: Count,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = policy
        self._fence = store.fence
        self._count = count
        self.guard = TimingGuard(store, mitigations, count, clock)
        self.tickets = LookupTickets(clock=clock)

    # -- methods ----------------------------------------------------------------------------------
    def require_method(self, p: Principal, method: str) -> None:
        """Refuse a daemon method ``p``'s roles leave out (a ``router`` calls Locate only),
        before anything else of the call runs."""
        if not self.policy.may_call(p, method):
            self._count("denied", 1)
            raise AccessDenied(f"principal {p.id} may not call {method}: its role allows only "
                               f"{sorted(self.policy.callable_methods(p))}")

    # -- reads ------------------------------------------------------------------------------------
    def readable(self, p: Principal) -> dict[ScopeDomain, Scope]:
        """The principal's readable scope domains (empty when revoked)."""
        return self.policy.readable_domains(p)

    def require_scope(self, p: Principal, scope: Scope) -> None:
        """Refuse a scope ``p`` may not read (naming one is how a request reaches it)."""
        if not self.policy.may_read(p, scope):
            self._count("denied", 1)
            raise AccessDenied(f"principal {p.id} cannot use scope kind {scope.kind.name.lower()}")

    def require_readable(self, p: Principal, keys: Sequence[BlockKey]) -> dict[ScopeDomain, Scope]:
        """Refuse the whole request if any key lies in a domain ``p`` may not read."""
        self.policy.require_active(p)
        readable = self.readable(p)
        for i, k in enumerate(keys):
            if key_domain(k) not in readable:
                self._count("denied", 1)
                raise AccessDenied(f"block {i} is in a scope principal {p.id} cannot read")
        return readable

    def admit(self, p: Principal) -> None:
        """Raise RateLimited while ``p`` is over its missed-read budget (decided before any tier)."""
        self.guard.admit(p)

    def lookup(self, p: Principal, keys: Sequence[BlockKey], *, then_read: bool = False,
               local_only: bool = False) -> GateLookup:
        """The longest cached prefix of ``keys`` that ``p`` may read now (``local_only``: in this
        node's own tiers, TieredStore.lookup).

        The prefix ends at the first key ``p`` may not read (counted ``denied``) or whose scope
        is being purged (counted ``purging_miss``); the answer never depends on whether such a
        key is stored. A lookup short of ``keys`` counts as a miss for the rate limit, unless
        ``then_read``: the caller reads the prefix next and reports that outcome (``served``).
        """
        self.policy.require_active(p)
        self.admit(p)
        readable = self.readable(p)
        n = self._usable(keys, readable)
        lk = self.guard.lookup(keys[:n], readable, local_only=local_only)
        if not then_read:
            self.served(p, lk.length, len(keys))
        return GateLookup(Lookup(lk.runs, len(keys), lk.keys), n)

    def recheck(self, p: Principal, lookup: Lookup) -> Lookup:
        """A lookup handed back for loading, re-checked without touching a tier: the principal is
        still active and may still read each key, and the prefix ends where a scope is now being
        purged."""
        assert lookup.loadable, "only a lookup from the store can be loaded"
        readable = self.require_readable(p, lookup.keys)
        n = self._usable(lookup.keys, readable)
        return lookup if n == lookup.length else lookup.slice(0, n)

    def seal(self, p: Principal, lookup: Lookup) -> Lookup:
        """``lookup`` (this gate's answer to ``p``) with a ticket, so that ``p`` may hand it back
        later, from another process, and have it loaded without a second walk."""
        return replace(lookup, ticket=self.tickets.issue(p.id, lookup))

    def handed_back(self, p: Principal, lookup: Lookup) -> Lookup | None:
        """A sealed lookup handed back across a trust boundary: ``recheck``-ed when its ticket is
        this gate's, for ``p``, for these keys and runs, and not expired; None otherwise (counted
        ``lookup_ticket_stale``: the caller then looks up again, it never loads on the client's
        word, since a forged lookup could read a public prefix the timing rules hide)."""
        if not lookup.loadable or not self.tickets.verify(p.id, lookup, lookup.ticket):
            self._count("lookup_ticket_stale", 1)
            return None
        return self.recheck(p, lookup)

    def each(self, p: Principal, keys: Sequence[BlockKey]) -> list[bool]:
        """Which keys a per-key read may serve: not under purge, and, while the minimum public
        prefix rule is on, not public (a key alone does not say how long a prefix it ends)."""
        hidden: frozenset[ScopeDomain] = frozenset()
        if self.guard.hides_public_keys():
            hidden = frozenset(d for d, s in self.readable(p).items() if s.kind == ScopeKind.PUBLIC)
        ok = []
        n_hidden = 0
        for k in keys:
            dom = key_domain(k)
            if dom in hidden:
                n_hidden += 1
                ok.append(False)
            else:
                ok.append(not self._fence.is_closed(dom))
        if n_hidden:
            self._count("public_key_get_hidden", n_hidden)
        return ok

    def served(self, p: Principal, hit: int, wanted: int) -> None:
        """Record the outcome of a read: short of ``wanted`` counts as a miss."""
        self.guard.served(p, hit, wanted)

    # -- writes -----------------------------------------------------------------------------------
    def writable(self, p: Principal, domains: Iterable[ScopeDomain]) -> dict[ScopeDomain, bool]:
        """For each domain: True to store, False to skip (shared content ``p`` may read but lacks
        the role to publish). Refused (AccessDenied) for another's domain, a private scope ``p``
        may not write, or a scope under purge."""
        self.policy.require_active(p)
        readable = self.readable(p)
        out: dict[ScopeDomain, bool] = {}
        for dom in domains:
            if dom in out:
                continue
            scope = readable.get(dom)
            if scope is None:
                self._count("denied", 1)
                raise AccessDenied(f"write into a scope principal {p.id} cannot use")
            if self._fence.is_closed(dom):
                raise AccessDenied(f"scope {scope} is being purged; writes are refused until the purge finishes")
            if self.policy.may_write(p, scope):
                out[dom] = True
            elif scope.kind >= ScopeKind.USER:
                self._count("denied", 1)
                raise AccessDenied(f"write to {scope} refused for principal {p.id}")
            else:
                out[dom] = False
        return out

    # -- delete / list / purge / stats ------------------------------------------------------------
    def require_delete(self, p: Principal, domains: Iterable[ScopeDomain]) -> None:
        self.policy.require_active(p)
        readable = self.readable(p)
        for dom in domains:
            scope = readable.get(dom)
            if scope is None or not self.policy.may_delete(p, scope):
                self._count("denied", 1)
                raise AccessDenied(f"delete in this scope refused for principal {p.id}")

    def require_list(self, p: Principal, domain: ScopeDomain) -> Scope:
        """Listing a scope says which of its blocks are cached, all at once, with no miss counted:
        the principal's own readable scope; and while any timing mitigation is on, the public
        scope only for those who may write it (``publish:public``) or operators, since for
        everyone else a lookup of a short public prefix is hidden and misses are rate-limited."""
        self.policy.require_active(p)
        scope = self.readable(p).get(domain)
        if scope is None:
            self._count("denied", 1)
            raise AccessDenied(f"listing this scope refused for principal {p.id}")
        if (scope.kind is ScopeKind.PUBLIC and self.mitigations_on() and ROLE_OPERATOR not in p.roles
                and not self.policy.may_write(p, scope)):
            self._count("public_list_refused", 1)
            raise AccessDenied("listing the public scope needs the publish:public role (or operator) while the "
                               "timing mitigations are on")
        return scope

    def mitigations_on(self) -> bool:
        """Whether any timing mitigation is configured (the minimum public prefix or the miss limit)."""
        m = self.guard.mitigations
        return m.min_public_prefix_blocks > 0 or m.miss_limit is not None

    def reveals_presence(self, p: Principal, n: int = 1) -> bool:
        """Whether a write's answer may tell "already present" from "stored now". Not while the
        timing mitigations are on: a publisher would learn which shared blocks someone cached, so
        every accepted block is answered as stored (``n`` such answers counted as hidden)."""
        if not self.mitigations_on():
            return True
        if n:
            self._count("put_presence_hidden", n)
        return False

    def require_still_active(self, p: Principal) -> None:
        """Re-checked before every message of a read stream and before every copy into the
        caller's region: a stream opened before a revocation ends (PERMISSION_DENIED) at its
        next message or copy, a Get laid out by layers at its next group of layers."""
        if not self.policy.is_active(p):
            self._count("revoked_mid_stream", 1)
            raise AccessDenied(f"principal {p.id} was revoked while its stream was open")

    def sees_totals(self, p: Principal) -> bool:
        """Tier-wide totals (blocks, bytes, hit/miss and traffic counters, server call counts) are
        everyone's usage together: operators only. Others see their own scopes' usage."""
        self.policy.require_active(p)
        return ROLE_OPERATOR in p.roles

    def require_purge(self, actor: Principal, scope: Scope) -> ScopeDomain:
        try:
            self.policy.authorize(Op.DELETE, actor, scope)
        except AccessDenied:
            self._count("denied", 1)
            raise
        return self.policy.domain(scope)

    def visible_domains(self, p: Principal) -> dict[ScopeDomain, Scope] | None:
        """The domains whose usage ``p`` may see: its own readable ones; None (every domain, as
        opaque ids) for operators. While a timing mitigation is on, the public scope's usage only
        to those who may write it (its growth would say that someone cached a public prefix)."""
        self.policy.require_active(p)
        if ROLE_OPERATOR in p.roles:
            return None
        readable = self.readable(p)
        if self.mitigations_on():
            readable = {d: s for d, s in readable.items()
                        if s.kind is not ScopeKind.PUBLIC or self.policy.may_write(p, s)}
        return readable

    # -- internals --------------------------------------------------------------------------------
    def _usable(self, keys: Sequence[BlockKey], readable: dict[ScopeDomain, Scope]) -> int:
        """Leading keys ``p`` may read and that are not under purge (each stop counted)."""
        usable: set[ScopeDomain] = set()  # domains already found usable: a chain has few
        for i, k in enumerate(keys):
            dom = key_domain(k)
            if dom in usable:
                continue
            if dom not in readable:
                self._count("denied", 1)
                return i
            if self._fence.is_closed(dom):
                self._count("purging_miss", 1)
                return i
            usable.add(dom)
        return len(keys)
