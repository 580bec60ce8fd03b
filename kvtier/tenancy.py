"""Principals and the access policy: who may read, write and delete which scope.

The server derives every scope (and so every scope domain) from the authenticated principal;
nothing a client supplies (an id, a salt) can name another tenant's scope.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from kvtier.errors import AccessDenied
from kvtier.keys import PUBLIC, DomainDeriver, Scope, ScopeDomain, ScopeKind

#: Roles that widen what a principal may write or delete.
ROLE_PUBLISH_PUBLIC = "publish:public"
ROLE_PUBLISH_ORG = "publish:org"
ROLE_ADMIN = "admin"


@dataclass(frozen=True, slots=True)
class Principal:
    """An authenticated caller. Ids are namespaced by tenant when turned into scopes."""

    tenant: str
    user: str
    org: str | None = None
    session: str | None = None
    roles: frozenset[str] = field(default_factory=frozenset)

    @property
    def id(self) -> str:
        return f"{self.tenant}/{self.user}"

    def org_scope(self) -> Scope | None:
        return Scope.org(f"{self.tenant}.{self.org}") if self.org else None

    def user_scope(self) -> Scope:
        return Scope.user(f"{self.tenant}.{self.user}")

    def session_scope(self) -> Scope | None:
        return Scope.session(f"{self.tenant}.{self.user}.{self.session}") if self.session else None

    def readable_scopes(self) -> list[Scope]:
        return [s for s in (PUBLIC, self.org_scope(), self.user_scope(), self.session_scope()) if s is not None]


class Policy:
    """One decision function per operation, used on every path of every tier and of the directory.

    Invariant: a revoked principal id is refused everything until re-granted, even while its
    blocks remain stored. ``_revoked`` is guarded by ``_lock``.
    """

    def __init__(self, deriver: DomainDeriver) -> None:
        self.deriver = deriver
        self._revoked: set[str] = set()
        self._lock = threading.Lock()

    # -- decisions --------------------------------------------------------------------------------
    def _active(self, p: Principal) -> bool:
        with self._lock:
            return p.id not in self._revoked

    def may_read(self, p: Principal, scope: Scope) -> bool:
        return self._active(p) and scope in p.readable_scopes()

    def may_write(self, p: Principal, scope: Scope) -> bool:
        if not self._active(p) or scope not in p.readable_scopes():
            return False
        if scope.kind is ScopeKind.PUBLIC:
            return ROLE_PUBLISH_PUBLIC in p.roles
        if scope.kind is ScopeKind.ORG:
            return ROLE_PUBLISH_ORG in p.roles
        return True

    def may_delete(self, p: Principal, scope: Scope) -> bool:
        if not self._active(p):
            return False
        if ROLE_ADMIN in p.roles:
            return True
        return scope in (p.user_scope(), p.session_scope())

    def check(self, allowed: bool, p: Principal, op: str, scope: Scope) -> None:
        if not allowed:
            raise AccessDenied(f"{op} on {scope} refused for principal {p.id}")

    # -- domains ----------------------------------------------------------------------------------
    def readable_domains(self, p: Principal) -> dict[ScopeDomain, Scope]:
        if not self._active(p):
            return {}
        return {self.deriver.domain(s): s for s in p.readable_scopes()}

    # -- grants -----------------------------------------------------------------------------------
    def revoke(self, principal_id: str) -> None:
        with self._lock:
            self._revoked.add(principal_id)

    def grant(self, principal_id: str) -> None:
        with self._lock:
            self._revoked.discard(principal_id)
