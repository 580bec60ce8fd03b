"""Principals, the policy's decisions per operation and scope, revocation and its persistence."""

from __future__ import annotations

import pytest

from kvtier.errors import AccessDenied, ScopeError
from kvtier.keys import PUBLIC, Scope, ScopeKind
from kvtier.security.audit import AuditLog
from kvtier.security.policy import (
    ROLE_ADMIN,
    ROLE_OPERATOR,
    ROLE_PUBLISH_ORG,
    ROLE_PUBLISH_PUBLIC,
    Op,
    Policy,
    Principal,
    RevocationChange,
)
from tests.helpers import DERIVER

ALICE = Principal("acme", "alice", org="eng", session="s1")
BOB = Principal("globex", "bob", org="eng")
CAROL = Principal("acme", "carol", org="eng")


@pytest.fixture
def policy() -> Policy:
    return Policy(DERIVER)


@pytest.mark.parametrize(
    "field,value",
    [("tenant", ""), ("tenant", "a/b"), ("user", "x y"), ("user", "a:b"), ("org", "e/ng"), ("session", "\n"),
     ("user", "-lead"), ("tenant", "t" * 129)],
)
def test_malformed_principal_ids_are_refused(field: str, value: str) -> None:
    kwargs = {"tenant": "acme", "user": "alice"} | {field: value}
    with pytest.raises(ScopeError):
        Principal(**kwargs)


def test_scopes_are_namespaced_by_tenant_and_injective() -> None:
    a = Principal("a", "b.c")
    b = Principal("a.b", "c")
    assert a.user_scope() != b.user_scope()
    assert DERIVER.domain(a.user_scope()) != DERIVER.domain(b.user_scope())
    assert ALICE.user_scope() == Scope.user("acme/alice")
    assert ALICE.org_scope() == Scope.org("acme/eng")
    assert BOB.org_scope() == Scope.org("globex/eng") != ALICE.org_scope()  # same org name, other tenant
    assert ALICE.session_scope() == Scope.session("acme/alice/s1")
    assert ALICE.readable_scopes() == [PUBLIC, ALICE.org_scope(), ALICE.user_scope(), ALICE.session_scope()]


def test_own_scope_is_relative_and_refuses_missing_ones() -> None:
    assert ALICE.own_scope("user") == ALICE.user_scope()
    assert ALICE.own_scope(ScopeKind.PUBLIC) == PUBLIC
    with pytest.raises(ScopeError, match="no session"):
        BOB.own_scope("session")
    with pytest.raises(ScopeError, match="unknown scope kind"):
        ALICE.own_scope("tenant")


def test_roles_accept_any_iterable_and_stay_frozen() -> None:
    p = Principal("acme", "x", roles=["admin", "admin"])  # type: ignore[arg-type]
    assert p.roles == frozenset({ROLE_ADMIN})
    assert hash(p)


def test_reads(policy: Policy) -> None:
    for s in ALICE.readable_scopes():
        assert policy.may_read(ALICE, s)
    for s in (BOB.user_scope(), BOB.org_scope(), CAROL.user_scope(), Scope.session("acme/alice/s2")):
        assert not policy.may_read(ALICE, s), s
    assert policy.may_read(BOB, PUBLIC)


def test_writes_need_a_publish_role_for_shared_scopes(policy: Policy) -> None:
    assert policy.may_write(ALICE, ALICE.user_scope())
    assert policy.may_write(ALICE, ALICE.session_scope())
    assert not policy.may_write(ALICE, PUBLIC)
    assert not policy.may_write(ALICE, ALICE.org_scope())
    pub = Principal("acme", "alice", org="eng", roles=frozenset({ROLE_PUBLISH_PUBLIC}))
    org = Principal("acme", "alice", org="eng", roles=frozenset({ROLE_PUBLISH_ORG}))
    assert policy.may_write(pub, PUBLIC) and not policy.may_write(pub, pub.org_scope())
    assert policy.may_write(org, org.org_scope()) and not policy.may_write(org, PUBLIC)
    # A role never reaches another tenant's scope.
    assert not policy.may_write(org, BOB.org_scope())
    assert not policy.may_write(Principal("acme", "root", roles=frozenset({ROLE_OPERATOR})), BOB.user_scope())


def test_deletes(policy: Policy) -> None:
    assert policy.may_delete(ALICE, ALICE.user_scope())
    assert policy.may_delete(ALICE, ALICE.session_scope())
    assert not policy.may_delete(ALICE, PUBLIC)
    assert not policy.may_delete(ALICE, ALICE.org_scope())
    assert not policy.may_delete(ALICE, CAROL.user_scope())
    admin = Principal("acme", "boss", roles=frozenset({ROLE_ADMIN}))
    assert policy.may_delete(admin, CAROL.user_scope())
    assert policy.may_delete(admin, ALICE.org_scope())
    assert not policy.may_delete(admin, BOB.user_scope()), "a tenant admin stays inside its tenant"
    assert not policy.may_delete(admin, PUBLIC)
    operator = Principal("kvtier", "ops", roles=frozenset({ROLE_OPERATOR}))
    assert all(policy.may_delete(operator, s) for s in (PUBLIC, BOB.user_scope(), ALICE.session_scope()))
    # Shared public content is every tenant's: only an operator deletes it (issue 32), while a
    # publisher of its org still deletes in its org.
    publisher = Principal("acme", "pub", org="eng", roles=frozenset({ROLE_PUBLISH_PUBLIC, ROLE_PUBLISH_ORG}))
    assert policy.may_write(publisher, PUBLIC) and not policy.may_delete(publisher, PUBLIC)
    assert policy.may_delete(publisher, publisher.org_scope())


def test_credential_scope_kinds_narrow_never_widen(policy: Policy) -> None:
    narrow = Principal("acme", "alice", org="eng", scope_kinds=frozenset({ScopeKind.PUBLIC}))
    assert policy.may_read(narrow, PUBLIC)
    assert not policy.may_read(narrow, narrow.user_scope())
    assert not policy.may_write(narrow, narrow.user_scope())
    assert narrow.readable_scopes() == [PUBLIC]


def test_authorize_raises_named_error(policy: Policy) -> None:
    policy.authorize(Op.READ, ALICE, ALICE.user_scope())
    with pytest.raises(AccessDenied, match="read on user:globex/bob refused"):
        policy.authorize(Op.READ, ALICE, BOB.user_scope())


def test_revoke_and_grant_principal(policy: Policy) -> None:
    policy.revoke(ALICE.id)
    assert not policy.may_read(ALICE, PUBLIC)
    assert not policy.may_write(ALICE, ALICE.user_scope())
    assert not policy.may_delete(ALICE, ALICE.user_scope())
    assert policy.readable_domains(ALICE) == {}
    with pytest.raises(AccessDenied, match="revoked"):
        policy.require_active(ALICE)
    # Same user name in another session is the same principal; another user is untouched.
    assert not policy.is_active(Principal("acme", "alice", session="s9"))
    assert policy.is_active(CAROL)
    policy.grant(ALICE.id)
    assert policy.may_read(ALICE, ALICE.user_scope())


def test_revoke_tenant_and_credential(policy: Policy) -> None:
    policy.revoke_tenant("acme")
    assert not policy.is_active(ALICE) and not policy.is_active(CAROL) and policy.is_active(BOB)
    policy.grant_tenant("acme")
    assert policy.is_active(ALICE)
    t1 = Principal("acme", "alice", credential_id="tok1")
    t2 = Principal("acme", "alice", credential_id="tok2")
    policy.revoke_credential("tok1")
    assert not policy.is_active(t1) and policy.is_active(t2)


@pytest.mark.parametrize("bad", ["alice", "acme/", "/alice", "acme/al ice", "acme/a/b"])
def test_revoke_refuses_malformed_ids(policy: Policy, bad: str) -> None:
    with pytest.raises(ScopeError):
        policy.revoke(bad)
    assert policy.revocations() == frozenset()


def test_revocations_persist_through_the_audit_log(tmp_path) -> None:
    log = AuditLog(tmp_path / "audit.log")
    p1 = Policy(DERIVER, audit=log, node="node-a", clock=lambda: 100.0)  # a clock that does not move
    p1.revoke(ALICE.id, actor="acme/boss", reason="left the company")
    p1.revoke_tenant("globex", actor="kvtier/ops")
    p1.grant_tenant("globex", actor="kvtier/ops")
    log.close()
    # A restart rebuilds the same state from the log.
    p2 = Policy(DERIVER, audit=AuditLog(tmp_path / "audit.log"))
    assert not p2.is_active(ALICE)
    assert p2.is_active(BOB)
    events = p2.audit.events()
    assert [(e.actor, e.action, e.target) for e in events] == [
        ("acme/boss", "revoke", "principal:acme/alice"),
        ("kvtier/ops", "revoke", "tenant:globex"),
        ("kvtier/ops", "grant", "tenant:globex"),
    ]
    assert events[0].detail == {"reason": "left the company", "origin": "node-a", "origin_at": 100.0}
    assert events[2].detail["origin_at"] > events[1].detail["origin_at"]  # stamps of one target only go up
    p2.grant(ALICE.id, actor="acme/boss")
    p3 = Policy(DERIVER, audit=AuditLog(tmp_path / "audit.log"))
    assert p3.is_active(ALICE)


def test_domains_are_derived_never_supplied(policy: Policy) -> None:
    doms = policy.readable_domains(ALICE)
    assert set(doms.values()) == set(ALICE.readable_scopes())
    assert all(policy.domain(s) == d for d, s in doms.items())
    assert not set(doms) & set(policy.readable_domains(BOB)) - {policy.domain(PUBLIC)}


# -- changes between nodes -------------------------------------------------------------------------
def test_nodes_agree_whatever_order_they_see_changes_in(tmp_path) -> None:
    clock = {"a": 10.0, "b": 20.0}
    a = Policy(DERIVER, audit=AuditLog(tmp_path / "a.log"), node="a", clock=lambda: clock["a"])
    b = Policy(DERIVER, audit=AuditLog(tmp_path / "b.log"), node="b", clock=lambda: clock["b"])
    sent: dict[str, list[RevocationChange]] = {"a": [], "b": []}
    a.subscribe(sent["a"].append)
    b.subscribe(sent["b"].append)
    a.revoke(ALICE.id, actor="acme/boss")  # at 10
    b.grant(ALICE.id, actor="acme/boss")  # at 20: the later change wins everywhere
    assert [c.stamp for c in sent["a"] + sent["b"]] == [(10.0, "a"), (20.0, "b")]
    assert b.apply_remote(sent["a"][0]) is False  # older than what b has: ignored, not recorded
    assert a.apply_remote(sent["b"][0]) is True
    assert a.is_active(ALICE) and b.is_active(ALICE)
    assert a.apply_remote(sent["b"][0]) is False  # seen twice: applied once
    assert [e.action for e in b.audit.events()] == ["grant"]
    assert [(e.action, e.detail["origin"], e.detail["origin_at"]) for e in a.audit.events()] == [
        ("revoke", "a", 10.0), ("grant", "b", 20.0)]
    # A restart replays the log to the same state and stamps: b's change is still not new.
    a2 = Policy(DERIVER, audit=AuditLog(tmp_path / "a.log"), node="a2")
    assert a2.is_active(ALICE) and a2.apply_remote(sent["b"][0]) is False


def test_a_listener_failure_leaves_the_change_applied_here() -> None:
    p = Policy(DERIVER)

    def offline(_c: RevocationChange) -> None:
        raise RuntimeError("feed down")

    p.subscribe(offline)
    with pytest.raises(RuntimeError, match="feed down"):
        p.revoke_tenant("globex")
    assert not p.is_active(BOB)
