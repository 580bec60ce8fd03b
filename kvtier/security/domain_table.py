"""DomainTable: the caller's scopes and their key domains as a daemon hands them out
(``GrpcTier.domains()``), so keys derived against a daemon match those it derives itself."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.errors import ScopeError
from kvtier.keys import Scope, ScopeDomain, ScopeKind


@dataclass(slots=True, frozen=True)
class ScopeGrant:
    """One of the caller's scopes as the daemon reports it."""

    scope: Scope
    domain: ScopeDomain
    may_read: bool
    may_write: bool
    may_delete: bool


class DomainTable:
    """The caller's scope -> domain map, fetched from the daemon; a drop-in for DomainDeriver in
    ``keys.block_chain``. Asking for a scope the caller does not have raises ScopeError."""

    def __init__(self, principal: str, grants: Sequence[ScopeGrant]) -> None:
        self.principal = principal
        self.grants = {g.scope: g for g in grants}

    def domain(self, scope: Scope) -> ScopeDomain:
        g = self.grants.get(scope)
        if g is None:
            raise ScopeError(f"scope {scope} is not one of principal {self.principal}'s scopes")
        return g.domain

    def own(self, kind: ScopeKind | str) -> Scope:
        """The caller's scope of a kind (``"user"`` -> ``user:<tenant>/<user>``)."""
        k = kind if isinstance(kind, ScopeKind) else ScopeKind[str(kind).upper()]
        for s in self.grants:
            if s.kind is k:
                return s
        raise ScopeError(f"principal {self.principal} has no {k.name.lower()} scope")

    def __repr__(self) -> str:
        return f"DomainTable({self.principal}, {len(self.grants)} scopes)"


__all__ = ["DomainTable", "ScopeGrant"]
