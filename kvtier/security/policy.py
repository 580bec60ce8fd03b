"""Principals and the access policy: who may read, write and delete which scope.

The server derives every scope (and so every scope domain) from the authenticated principal;
nothing a client supplies (an id, a salt) can name another tenant's scope. Scope ids are
``<tenant>/<id>`` and principal ids may not contain ``/``, so two tenants can never derive the
same scope (``acme`` + ``x.y`` and ``acme.x`` + ``y`` stay distinct).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Protocol

from kvtier.errors import AccessDenied, ScopeError
from kvtier.keys import PUBLIC, DomainDeriver, Scope, ScopeDomain, ScopeKind
from kvtier.security.audit import AuditLog, check_sizes

#: Roles that widen what a principal may write or delete.
ROLE_PUBLISH_PUBLIC = "publish:public"
ROLE_PUBLISH_ORG = "publish:org"
#: Tenant administrator: may delete and purge any scope of its own tenant (never another tenant's).
ROLE_ADMIN = "admin"
#: Service operator: may delete and purge any scope, public included. Reads stay its own.
ROLE_OPERATOR = "operator"
#: A request router: may ask where a request's prefix is cached (Locate), for the principal of the
#: request's salt, and nothing else; it has no scope of its own.
ROLE_ROUTER = "router"
#: An engine's credential: it acts only for the principal of the salt each call presents
#: (kvtier/security/salts.py), never for itself, and cannot mint salts.
ROLE_ENGINE = "engine"

#: Roles that confine a credential to a few methods of the daemon (every other method refused),
#: and leave it no scope of its own to read, write or delete. A credential holding several of
#: them may call only what all of them allow. The principal such a credential acts for (a
#: request's salt) keeps no role (``acted_for``): what it may do is this table's alone.
CONFINED_ROLES: dict[str, frozenset[str]] = {
    ROLE_ROUTER: frozenset({"Locate"}),
    # The data path only: a stolen salt reaches no Purge, Delete, ListScope, Stats or Revoke
    # through an engine (issue 32, point 4). HeldChanges and DataPlane are called saltless, as the
    # engine itself (salts.CREDENTIAL_METHODS).
    ROLE_ENGINE: frozenset({"Lookup", "Get", "Put", "Domains", "DataPlane", "Locate", "WatchHeld",
                            "HeldChanges"}),
}

_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@+=-]{0,127}")


def _check_id(name: str, value: str | None, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str) or not _ID.fullmatch(value):
        raise ScopeError(
            f"principal {name} must be 1-128 characters of letters, digits and ._@+=- (starting with a letter or"
            " digit)"
        )


@dataclass(frozen=True, slots=True)
class Principal:
    """An authenticated caller. Ids are namespaced by tenant when turned into scopes.

    ``credential_id`` names the credential (token id) it was authenticated with, so one credential
    can be revoked alone. ``scope_kinds``, when set, narrows what the principal reaches to those
    kinds of scope (a token minted for public reads only, say); it never widens anything.
    """

    tenant: str
    user: str
    org: str | None = None
    session: str | None = None
    roles: frozenset[str] = field(default_factory=frozenset)
    credential_id: str | None = None
    scope_kinds: frozenset[ScopeKind] | None = None

    def __post_init__(self) -> None:
        _check_id("tenant", self.tenant)
        _check_id("user", self.user)
        _check_id("org", self.org, optional=True)
        _check_id("session", self.session, optional=True)
        _check_id("credential_id", self.credential_id, optional=True)
        # Accept any iterable from callers but keep the frozen type (hashable, immutable).
        object.__setattr__(self, "roles", frozenset(self.roles))
        if self.scope_kinds is not None:
            object.__setattr__(self, "scope_kinds", frozenset(ScopeKind(k) for k in self.scope_kinds))

    @property
    def id(self) -> str:
        return f"{self.tenant}/{self.user}"

    def org_scope(self) -> Scope | None:
        return Scope.org(f"{self.tenant}/{self.org}") if self.org else None

    def user_scope(self) -> Scope:
        return Scope.user(f"{self.tenant}/{self.user}")

    def session_scope(self) -> Scope | None:
        return Scope.session(f"{self.tenant}/{self.user}/{self.session}") if self.session else None

    def readable_scopes(self) -> list[Scope]:
        every = (PUBLIC, self.org_scope(), self.user_scope(), self.session_scope())
        return [s for s in every if s is not None and (self.scope_kinds is None or s.kind in self.scope_kinds)]

    def own_scope(self, kind: ScopeKind | str) -> Scope:
        """The principal's own scope of a kind (``"user"`` -> ``user:<tenant>/<user>``).

        This is how a request names a scope: relative to the authenticated principal, so a caller
        can never name another tenant's scope.
        """
        k = _kind(kind)
        scope = {ScopeKind.PUBLIC: PUBLIC, ScopeKind.ORG: self.org_scope(), ScopeKind.USER: self.user_scope(),
                 ScopeKind.SESSION: self.session_scope()}[k]
        if scope is None:
            raise ScopeError(f"principal {self.id} has no {k.name.lower()} scope")
        return scope


def confined(p: Principal) -> bool:
    """Whether ``p`` holds a confined role (``CONFINED_ROLES``): it then has no scope of its own."""
    return not p.roles.isdisjoint(CONFINED_ROLES)


def acted_for(p: Principal) -> Principal:
    """``p`` as a confined credential (an engine, a router) acts for it, from a request's salt:
    without roles. A salt may claim any role (a token salt carries its token's, ``operator``
    included); none widens what the engine or router does for it (``CONFINED_ROLES``), and no
    role exempts it from a fail-closed hold."""
    return replace(p, roles=frozenset()) if p.roles else p


def _kind(kind: ScopeKind | str) -> ScopeKind:
    if isinstance(kind, ScopeKind):
        return kind
    try:
        return ScopeKind[str(kind).upper()]
    except KeyError:
        raise ScopeError(f"unknown scope kind {kind!r}: expected public, org, user or session") from None


def scope_tenant(scope: Scope) -> str | None:
    """The tenant a non-public scope belongs to (scope ids are ``<tenant>/...``)."""
    return None if scope.kind is ScopeKind.PUBLIC else scope.ident.split("/", 1)[0]


class Op(StrEnum):
    READ = "read"
    WRITE = "write"
    DELETE = "delete"


Rule = Callable[[Principal, Scope], bool]

#: The role a principal needs to write into a scope of each kind (None: its own scope, no role).
PUBLISH_ROLE: dict[ScopeKind, str | None] = {
    ScopeKind.PUBLIC: ROLE_PUBLISH_PUBLIC,
    ScopeKind.ORG: ROLE_PUBLISH_ORG,
    ScopeKind.USER: None,
    ScopeKind.SESSION: None,
}


def _reads(p: Principal, s: Scope) -> bool:
    return s in p.readable_scopes()


def _publishes(p: Principal, s: Scope) -> bool:
    role = PUBLISH_ROLE[s.kind]
    return _reads(p, s) and (role is None or role in p.roles)


def _owns(p: Principal, s: Scope) -> bool:
    return s.kind >= ScopeKind.USER and _reads(p, s)


def _publishes_in_tenant(p: Principal, s: Scope) -> bool:
    """A publisher deletes in the shared scope of its own tenant (its org); the public scope,
    shared by every tenant, is the operator's alone to delete from or purge."""
    return s.kind is not ScopeKind.PUBLIC and _publishes(p, s)


def _tenant_admin(p: Principal, s: Scope) -> bool:
    return ROLE_ADMIN in p.roles and scope_tenant(s) == p.tenant


def _operator(p: Principal, s: Scope) -> bool:
    return ROLE_OPERATOR in p.roles


#: Each operation is allowed when any of its rules allows it (and the principal is not revoked).
RULES: dict[Op, tuple[Rule, ...]] = {
    Op.READ: (_reads,),
    Op.WRITE: (_publishes,),
    Op.DELETE: (_operator, _tenant_admin, _owns, _publishes_in_tenant),
}

#: Revocation targets are typed strings, recorded verbatim in the audit log.
_PRINCIPAL, _TENANT, _CREDENTIAL = "principal:", "tenant:", "credential:"
_DOMAIN_CACHE_MAX = 65536


@dataclass(slots=True, frozen=True)
class RevocationChange:
    """One revoke or grant as it travels between nodes: what, who did it, and when and where it
    was made (``at``, ``origin``), which orders it against other changes of the same target."""

    target: str
    revoked: bool
    at: float
    origin: str
    actor: str
    reason: str = ""
    #: Who made it, as a role (``operator``, ``admin``, ``""``): a revocation may be lifted only
    #: with at least the authority that made it (kvtier/security/revoke_rules.py).
    authority: str = ROLE_OPERATOR

    @property
    def stamp(self) -> tuple[float, str]:
        return (self.at, self.origin)


class PublisherTrust(Protocol):
    """Who may write the public scope besides holding ``publish:public``
    (kvtier/security/public_trust.py's ``PublicTrust``)."""

    def trusts(self, tenant: str, user: str) -> bool: ...


#: Told of each change made on this node, after it is recorded and applied (it may raise: the
#: change then stands here, and the error says it did not reach the other nodes).
ChangeListener = Callable[[RevocationChange], None]


class Policy:
    """One decision function per operation, used on every path of every tier and of the directory.

    Invariants: a revoked principal (or every principal of a revoked tenant, or a revoked
    credential) is refused everything until re-granted, even while its blocks remain stored.
    ``_revoked`` and ``_stamps`` are guarded by ``_lock`` and mutated only by grant/revoke and by
    ``apply_remote``, each of which is first appended to the audit log (when one is configured)
    and then applied, so the persisted log is never behind the in-memory state; on start the
    state is rebuilt by replaying the log. Revocation is immediate within this process; other
    nodes learn it through the listeners ``subscribe``d to it (a revocation feed,
    kvtier/security/revocations.py) or on their next start. Changes of one target are ordered by
    their stamp ``(at, origin)``: a change older than the last one applied to its target is
    ignored (last writer wins), so nodes that see the same changes in any order agree.
    """

    def __init__(self, deriver: DomainDeriver, *, audit: AuditLog | None = None, node: str = "local",
                 clock: Callable[[], float] = time.time, public_trust: PublisherTrust | None = None) -> None:
        self.deriver = deriver
        self.audit = audit
        #: Who may write the shared public scope besides operators (kvtier/security/public_trust.py).
        #: None: every holder of ``publish:public``. That is for an embedding process, which makes
        #: every principal (and role) itself and so is its own operator; the daemon, where tenants
        #: authenticate, always passes the configured list, which trusts operators only by default.
        self.public_trust = public_trust
        self.node = node
        self._listeners: tuple[ChangeListener, ...] = ()
        self._clock = clock
        self._revoked: set[str] = set()
        self._stamps: dict[str, tuple[float, str]] = {}
        self._authority: dict[str, str] = {}
        # Fail-closed holds from a revocation feed with a gap (set_holds): target ids refused, or all.
        self._holds: frozenset[str] = frozenset()
        self._hold_all = False
        self._target_id: Callable[[str], str] | None = None
        self._lock = threading.Lock()
        self._domains: dict[Scope, ScopeDomain] = {}
        if audit is not None:
            # Every recorded change was applied when it was recorded: replaying in order rebuilds
            # the state and the stamps exactly.
            for ev in audit.events():
                if ev.action in ("revoke", "grant"):
                    stamp = (float(ev.detail.get("origin_at", ev.at)), str(ev.detail.get("origin", "")))
                    # Records from before authorities were recorded count as an operator's.
                    self._apply(ev.target, ev.action == "revoke", stamp,
                                str(ev.detail.get("authority", ROLE_OPERATOR)))

    # -- listeners --------------------------------------------------------------------------------
    def subscribe(self, listener: ChangeListener) -> None:
        """Tell ``listener`` of every change made on this node from now on (not of changes
        applied from other nodes: those came from a feed already)."""
        with self._lock:
            self._listeners = (*self._listeners, listener)

    def unsubscribe(self, listener: ChangeListener) -> None:
        """Stop telling ``listener`` (a listener not subscribed is ignored)."""
        with self._lock:
            self._listeners = tuple(x for x in self._listeners if x != listener)

    def _notify(self, change: RevocationChange) -> None:
        """Every listener hears of ``change``, even after one of them raised; the first error is
        raised after (the change stands here either way)."""
        with self._lock:
            listeners = list(self._listeners)
        first: Exception | None = None
        for listener in listeners:
            try:
                listener(change)
            except Exception as exc:  # re-raised below, once every listener was told
                first = first or exc
        if first is not None:
            raise first

    # -- decisions --------------------------------------------------------------------------------
    def is_active(self, p: Principal) -> bool:
        with self._lock:
            if self._hold_all and ROLE_OPERATOR not in p.roles:
                return False
            if not self._revoked and not self._holds:
                return True
            targets = {_PRINCIPAL + p.id, _TENANT + p.tenant}
            if p.credential_id is not None:
                targets.add(_CREDENTIAL + p.credential_id)
            if not self._revoked.isdisjoint(targets):
                return False
            if self._holds and self._target_id is not None:
                return self._holds.isdisjoint({self._target_id(t) for t in targets})
            return True

    def set_holds(self, holds: frozenset[str], hold_all: bool, target_id: Callable[[str], str] | None) -> None:
        """Fail closed while the revocation feed has a gap: refuse every principal one of whose
        targets (principal, tenant, credential) has an id in ``holds`` (``target_id`` maps a
        typed target to its id), or, with ``hold_all``, every principal but operators (who can
        still inspect and resolve). Replaced by the next call; not persisted (a restart re-reads
        the feed and finds the gaps that are still there)."""
        with self._lock:
            self._holds = frozenset(holds)
            self._hold_all = bool(hold_all)
            self._target_id = target_id

    def holds(self) -> tuple[frozenset[str], bool]:
        with self._lock:
            return self._holds, self._hold_all

    _active = is_active  # the skeleton's name

    def require_active(self, p: Principal) -> None:
        if not self.is_active(p):
            raise AccessDenied(f"principal {p.id} is revoked")

    def decide(self, op: Op, p: Principal, scope: Scope) -> bool:
        return (self.is_active(p) and not confined(p) and any(rule(p, scope) for rule in RULES[op])
                and self._trusted(op, p, scope))

    def _trusted(self, op: Op, p: Principal, scope: Scope) -> bool:
        """Writes into the public scope, which every tenant reads, need a trusted publisher: an
        operator (who may purge that scope anyway) or one the deployment's list names."""
        return (op is not Op.WRITE or scope.kind is not ScopeKind.PUBLIC or ROLE_OPERATOR in p.roles
                or self.public_trust is None or self.public_trust.trusts(p.tenant, p.user))

    def may_call(self, p: Principal, method: str) -> bool:
        """Whether ``p`` may call the daemon's ``method`` (its short name, ``Locate``) at all:
        every method unless a confined role (``CONFINED_ROLES``) leaves it out."""
        return all(method in CONFINED_ROLES[r] for r in p.roles if r in CONFINED_ROLES)

    @staticmethod
    def callable_methods(p: Principal) -> frozenset[str]:
        """The methods a confined principal may call (only meaningful when ``confined(p)``)."""
        sets = [CONFINED_ROLES[r] for r in p.roles if r in CONFINED_ROLES]
        return frozenset.intersection(*sets) if sets else frozenset()

    def may_read(self, p: Principal, scope: Scope) -> bool:
        return self.decide(Op.READ, p, scope)

    def may_write(self, p: Principal, scope: Scope) -> bool:
        return self.decide(Op.WRITE, p, scope)

    def may_delete(self, p: Principal, scope: Scope) -> bool:
        return self.decide(Op.DELETE, p, scope)

    def check(self, allowed: bool, p: Principal, op: str, scope: Scope) -> None:
        if not allowed:
            raise AccessDenied(f"{op} on {scope} refused for principal {p.id}")

    def authorize(self, op: Op, p: Principal, scope: Scope) -> None:
        """Raise AccessDenied unless ``p`` may do ``op`` on ``scope``."""
        self.require_active(p)
        self.check(self.decide(op, p, scope), p, str(op), scope)

    # -- domains ----------------------------------------------------------------------------------
    def domain(self, scope: Scope) -> ScopeDomain:
        dom = self._domains.get(scope)
        if dom is None:
            dom = self.deriver.domain(scope)
            if len(self._domains) >= _DOMAIN_CACHE_MAX:
                self._domains.clear()
            self._domains[scope] = dom
        return dom

    def readable_domains(self, p: Principal) -> dict[ScopeDomain, Scope]:
        if not self.is_active(p) or confined(p):
            return {}
        return {self.domain(s): s for s in p.readable_scopes()}

    # -- grants -----------------------------------------------------------------------------------
    # ``authority`` is the role the change is made with (the daemon passes the caller's; a direct
    # call is the process owner's, an operator's). It is recorded with the change.
    def revoke(self, principal_id: str, *, actor: str = "system", reason: str = "",
               authority: str = ROLE_OPERATOR) -> None:
        """Refuse every further call of principal ``<tenant>/<user>`` until ``grant``."""
        self._set(_PRINCIPAL + _principal_id(principal_id), True, actor, reason, authority)

    def grant(self, principal_id: str, *, actor: str = "system", reason: str = "",
              authority: str = ROLE_OPERATOR) -> None:
        """Lift a revocation of ``<tenant>/<user>`` (principals are allowed unless revoked)."""
        self._set(_PRINCIPAL + _principal_id(principal_id), False, actor, reason, authority)

    def revoke_tenant(self, tenant: str, *, actor: str = "system", reason: str = "",
                      authority: str = ROLE_OPERATOR) -> None:
        _check_id("tenant", tenant)
        self._set(_TENANT + tenant, True, actor, reason, authority)

    def grant_tenant(self, tenant: str, *, actor: str = "system", reason: str = "",
                     authority: str = ROLE_OPERATOR) -> None:
        _check_id("tenant", tenant)
        self._set(_TENANT + tenant, False, actor, reason, authority)

    def revoke_credential(self, credential_id: str, *, actor: str = "system", reason: str = "",
                          authority: str = ROLE_OPERATOR) -> None:
        _check_id("credential_id", credential_id)
        self._set(_CREDENTIAL + credential_id, True, actor, reason, authority)

    def revocation_authority(self, target: str) -> str | None:
        """The authority of the revocation now in force on a typed target (``principal:acme/alice``,
        ``tenant:acme``, ``credential:<id>``); None when it is not revoked."""
        with self._lock:
            return self._authority.get(target, ROLE_OPERATOR) if target in self._revoked else None

    def revocations(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._revoked)

    def apply_remote(self, change: RevocationChange) -> bool:
        """Apply a change another node made; False (and nothing recorded) when a change of the
        same target at least as recent is already applied."""
        with self._lock:
            if change.stamp <= self._stamps.get(change.target, (float("-inf"), "")):
                return False
            if self.audit is not None:
                self.audit.append(change.actor, "revoke" if change.revoked else "grant", change.target,
                                  reason=change.reason, origin=change.origin, origin_at=change.at,
                                  **_authority_detail(change.authority))
            self._apply(change.target, change.revoked, change.stamp, change.authority)
            return True

    def _set(self, target: str, revoked: bool, actor: str, reason: str, authority: str = ROLE_OPERATOR) -> None:
        check_sizes(target=target, reason=reason)  # before anything: the change must be auditable in full
        with self._lock:
            # Strictly after the target's last stamp, even if the clock stepped back or did not move.
            last = self._stamps.get(target)
            at = self._clock() if last is None else max(self._clock(), last[0] + 1e-6)
            change = RevocationChange(target, revoked, at, self.node, actor, reason, authority)
            if self.audit is not None:
                self.audit.append(actor, "revoke" if revoked else "grant", target, reason=reason,
                                  origin=self.node, origin_at=at, **_authority_detail(authority))
            self._apply(target, revoked, change.stamp, authority)
        self._notify(change)

    def _apply(self, target: str, revoked: bool, stamp: tuple[float, str], authority: str = ROLE_OPERATOR) -> None:
        self._stamps[target] = stamp
        if revoked:
            self._revoked.add(target)
            self._authority[target] = authority
        else:
            self._revoked.discard(target)
            self._authority.pop(target, None)


def _authority_detail(authority: str) -> dict[str, str]:
    """The audit detail of a change's authority: recorded unless it is an operator's (the default
    a record without one is replayed as)."""
    return {} if authority == ROLE_OPERATOR else {"authority": authority}


def _principal_id(principal_id: str) -> str:
    tenant, sep, user = principal_id.partition("/")
    if not sep:
        raise ScopeError(f"principal id {principal_id!r} must be <tenant>/<user>")
    _check_id("tenant", tenant)
    _check_id("user", user)
    return principal_id

