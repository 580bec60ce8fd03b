"""Confined roles (``CONFINED_ROLES``): a router calls Locate only and has no scope of its own."""

from __future__ import annotations

import pytest

from kvtier.errors import AccessDenied
from kvtier.keys import PUBLIC, ScopeKind
from kvtier.security.policy import ROLE_ENGINE, ROLE_ROUTER, Op, Policy, Principal, confined
from kvtier.security.salts import CREDENTIAL_METHODS, RequestSalts, acting_principal
from tests.helpers import DERIVER


def test_a_router_may_call_locate_only_and_reads_nothing_of_its_own() -> None:
    policy = Policy(DERIVER)
    router = Principal(tenant="fleet", user="r1", roles=frozenset({ROLE_ROUTER}))
    tenant = Principal(tenant="acme", user="alice")
    assert confined(router) and not confined(tenant)
    assert policy.may_call(router, "Locate")
    assert not any(policy.may_call(router, m) for m in ("Get", "Put", "Lookup", "ListScope", "Stats", "Domains"))
    assert policy.callable_methods(router) == {"Locate"}
    # No scope of its own, not even the public one; a tenant (the control) has both.
    assert policy.readable_domains(router) == {}
    assert not policy.decide(Op.READ, router, PUBLIC) and not policy.decide(Op.READ, router, router.user_scope())
    assert policy.decide(Op.READ, tenant, PUBLIC) and policy.may_call(tenant, "Get")
    # Another role on top widens nothing.
    both = Principal(tenant="fleet", user="r2", roles=frozenset({ROLE_ROUTER, "operator", "engine"}))
    assert not policy.may_call(both, "Purge") and policy.readable_domains(both) == {}
    # The public-only principal Locate answers for a router without a salt is not confined.
    public_only = Principal(tenant="fleet", user="r1", scope_kinds=frozenset({ScopeKind.PUBLIC}))
    assert list(policy.readable_domains(public_only).values()) == [PUBLIC]


def test_an_engine_credential_calls_only_the_credential_methods_without_a_salt() -> None:
    """Saltless, an engine acts as itself for HeldChanges and DataPlane (which answer nothing about
    a tenant) and for nothing else; a non-engine credential calls them as itself, as anything."""
    engine = Principal(tenant="kvtier", user="engine", roles=frozenset({ROLE_ENGINE}))
    assert {"HeldChanges", "DataPlane"} == CREDENTIAL_METHODS
    for method in sorted(CREDENTIAL_METHODS):
        assert acting_principal(engine, None, RequestSalts(None, None), method) is engine
    for method in ("Get", "Put", "Lookup", "Domains", "Locate", "WatchHeld"):
        with pytest.raises(AccessDenied, match="acts only for a request's principal"):
            acting_principal(engine, None, RequestSalts(None, None), method)
    tenant = Principal(tenant="acme", user="alice")
    assert acting_principal(tenant, None, RequestSalts(None, None), "Get") is tenant
