"""Who may revoke and lift what (kvtier/security/revoke_rules.py), driven directly on a real
Policy with its audit log: operators anywhere, tenant admins only over their own tenant's
principals, lifting only with at least the authority of the revocation in force, credentials
never lifted. A refusal changes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.errors import AccessDenied, InvalidRequest
from kvtier.rpc import kvtier_pb2 as pb
from kvtier.security.audit import AuditLog
from kvtier.security.policy import Policy, Principal, RevocationChange
from kvtier.security.revoke_rules import (
    REVOKE_RULES,
    CredentialNotLiftable,
    LiftRefused,
    RevokeKind,
    RevokeRefused,
    change_revocation,
)
from kvtier.server.service import REVOKE_KINDS
from tests.helpers import DERIVER
from tests.security.builders import ACME_ADMIN, ALICE, BOB, GLOBEX_ADMIN, OPERATOR

P, T, C = RevokeKind.PRINCIPAL, RevokeKind.TENANT, RevokeKind.CREDENTIAL
ALICE_TOKEN = Principal("acme", "alice", credential_id="tok-1")


@pytest.fixture
def policy(tmp_path: Path) -> Policy:
    return Policy(DERIVER, audit=AuditLog(tmp_path / "audit.log"))


def test_every_kind_has_a_rule_and_every_wire_kind_maps_to_one() -> None:
    assert set(REVOKE_RULES) == set(RevokeKind)
    assert set(REVOKE_KINDS) == set(pb.RevokeKind.values())
    assert sorted(REVOKE_KINDS.values()) == sorted(RevokeKind)


@pytest.mark.parametrize(("kind", "target", "refused_by"), [
    (P, "acme/alice", ALICE),  # a user: nothing
    (P, "globex/bob", ACME_ADMIN),  # an admin: not another tenant's principals
    (T, "acme", ACME_ADMIN),  # nor tenants, its own included
    (C, "tok-1", ACME_ADMIN),  # nor credentials
])
def test_who_may_not_revoke_is_refused_and_nothing_changes(policy: Policy, kind: RevokeKind, target: str,
                                                           refused_by: Principal) -> None:
    with pytest.raises(RevokeRefused):
        change_revocation(policy, kind, refused_by, target, lift=False)
    assert policy.revocations() == frozenset()
    assert list(policy.audit.events()) == []
    change_revocation(policy, kind, OPERATOR, target, lift=False)  # control: an operator may
    assert policy.revocations() == {REVOKE_RULES[kind].prefix + target}


def test_a_tenant_admin_revokes_and_lifts_within_its_tenant(policy: Policy) -> None:
    change_revocation(policy, P, ACME_ADMIN, ALICE.id, lift=False, reason="left the team")
    assert not policy.is_active(ALICE) and policy.is_active(BOB)
    assert policy.revocation_authority("principal:acme/alice") == "admin"
    ev = list(policy.audit.events())[-1]
    assert (ev.action, ev.target, ev.actor, ev.detail.get("authority")) == (
        "revoke", "principal:acme/alice", ACME_ADMIN.id, "admin")
    with pytest.raises(RevokeRefused):
        change_revocation(policy, P, GLOBEX_ADMIN, ALICE.id, lift=True)
    assert not policy.is_active(ALICE)
    change_revocation(policy, P, ACME_ADMIN, ALICE.id, lift=True)
    assert policy.is_active(ALICE)


def test_lifting_needs_the_authority_of_the_revocation_in_force(policy: Policy) -> None:
    change_revocation(policy, P, OPERATOR, ALICE.id, lift=False)
    with pytest.raises(LiftRefused):
        change_revocation(policy, P, ACME_ADMIN, ALICE.id, lift=True)
    assert not policy.is_active(ALICE)
    change_revocation(policy, P, OPERATOR, ALICE.id, lift=True)  # an operator lifts anything
    assert policy.is_active(ALICE)
    # An admin's revocation: an operator may lift it too; lifting what is not revoked is allowed.
    change_revocation(policy, P, ACME_ADMIN, ALICE.id, lift=False)
    change_revocation(policy, P, OPERATOR, ALICE.id, lift=True)
    change_revocation(policy, P, ACME_ADMIN, ALICE.id, lift=True)
    assert policy.is_active(ALICE)


def test_an_authority_this_node_does_not_know_ranks_as_an_operator_s(policy: Policy) -> None:
    """A change from another node recorded with a role this node has no rank for is read the
    strictest way: only an operator lifts it."""
    policy.apply_remote(RevocationChange("principal:acme/alice", True, 1.0, "other-node", "x", authority="auditor"))
    assert not policy.is_active(ALICE)
    with pytest.raises(LiftRefused):
        change_revocation(policy, P, ACME_ADMIN, ALICE.id, lift=True)
    change_revocation(policy, P, OPERATOR, ALICE.id, lift=True)
    assert policy.is_active(ALICE)


def test_a_revoked_credential_is_never_lifted(policy: Policy) -> None:
    change_revocation(policy, C, OPERATOR, "tok-1", lift=False)
    assert not policy.is_active(ALICE_TOKEN) and policy.is_active(ALICE)
    with pytest.raises(CredentialNotLiftable) as err:
        change_revocation(policy, C, OPERATOR, "tok-1", lift=True)
    assert isinstance(err.value, InvalidRequest)  # the daemon answers INVALID_ARGUMENT
    assert not policy.is_active(ALICE_TOKEN)


def test_tenants_are_revoked_and_lifted_by_operators_only(policy: Policy) -> None:
    change_revocation(policy, T, OPERATOR, "acme", lift=False)
    assert not policy.is_active(ALICE) and not policy.is_active(ACME_ADMIN) and policy.is_active(BOB)
    with pytest.raises(AccessDenied):  # RevokeRefused: an admin may not even lift its own tenant
        change_revocation(policy, T, ACME_ADMIN, "acme", lift=True)
    change_revocation(policy, T, OPERATOR, "acme", lift=True)
    assert policy.is_active(ALICE)
