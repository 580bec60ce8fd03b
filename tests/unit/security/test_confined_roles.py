"""Confined roles (``CONFINED_ROLES``): a router calls Locate only and has no scope of its own."""

from __future__ import annotations

from kvtier.keys import PUBLIC, ScopeKind
from kvtier.security.policy import ROLE_ROUTER, Op, Policy, Principal, confined
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
