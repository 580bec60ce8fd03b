"""Who may revoke, and lift, what: one small rule per kind of revocation target.

The daemon's Revoke call maps its wire kind to a ``RevokeKind`` and calls ``change_revocation``;
nothing here knows the wire. Rules:
- revoking needs an operator, except that a tenant admin may revoke (and lift) the principals of
  its own tenant;
- lifting also needs at least the authority the revocation in force was made with
  (``AUTHORITY_RANK``): a tenant admin cannot lift an operator's revocation of one of its users,
  an operator can lift anything;
- a revoked credential is never lifted (a new token is minted instead).
The policy records every change, with its authority, in its audit log.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from enum import StrEnum

from kvtier.errors import AccessDenied, InvalidRequest
from kvtier.security.policy import ROLE_ADMIN, ROLE_OPERATOR, Policy, Principal


class RevokeKind(StrEnum):
    """What a revocation names: a principal (``<tenant>/<user>``), a whole tenant, or one
    credential (a token id)."""

    PRINCIPAL = "principal"
    TENANT = "tenant"
    CREDENTIAL = "credential"


#: Authority of a revoke or grant, weakest first: a revocation is lifted only by a caller whose
#: authority is at least that of the revocation in force. A recorded authority this table does not
#: know ranks as an operator's (the strictest reading).
AUTHORITY_RANK: dict[str, int] = {"": 0, ROLE_ADMIN: 1, ROLE_OPERATOR: 2}


def authority_of(p: Principal) -> str:
    """The strongest revoking role ``p`` holds (``""``: none)."""
    return ROLE_OPERATOR if ROLE_OPERATOR in p.roles else ROLE_ADMIN if ROLE_ADMIN in p.roles else ""


class RevokeRule(ABC):
    """Who may revoke what, for one target kind (registry ``REVOKE_RULES``). By default only
    operators may; lifting also needs at least the authority the revocation in force was made
    with (``may_lift``)."""

    #: The policy's typed-target prefix for this kind.
    prefix: str = ""

    def allowed(self, actor: Principal, target: str) -> bool:
        return ROLE_OPERATOR in actor.roles

    def may_lift(self, policy: Policy, actor: Principal, target: str) -> bool:
        held = policy.revocation_authority(self.prefix + target)
        return held is None or AUTHORITY_RANK[authority_of(actor)] >= AUTHORITY_RANK.get(held, 2)

    @abstractmethod
    def apply(self, policy: Policy, target: str, *, lift: bool, actor: Principal, reason: str) -> None: ...


class RevokePrincipal(RevokeRule):
    """Operators anywhere; tenant admins within their own tenant."""

    prefix = "principal:"

    def allowed(self, actor: Principal, target: str) -> bool:
        tenant = target.partition("/")[0]
        return ROLE_OPERATOR in actor.roles or (ROLE_ADMIN in actor.roles and tenant == actor.tenant)

    def apply(self, policy: Policy, target: str, *, lift: bool, actor: Principal, reason: str) -> None:
        (policy.grant if lift else policy.revoke)(target, actor=actor.id, reason=reason,
                                                  authority=authority_of(actor))


class RevokeTenant(RevokeRule):
    """Operators only (a tenant admin revoking its own tenant would lock itself out)."""

    prefix = "tenant:"

    def apply(self, policy: Policy, target: str, *, lift: bool, actor: Principal, reason: str) -> None:
        (policy.grant_tenant if lift else policy.revoke_tenant)(target, actor=actor.id, reason=reason,
                                                                authority=authority_of(actor))


class RevokeCredential(RevokeRule):
    """Operators only; never lifted."""

    prefix = "credential:"

    def apply(self, policy: Policy, target: str, *, lift: bool, actor: Principal, reason: str) -> None:
        if lift:
            raise CredentialNotLiftable("a revoked credential stays revoked: mint a new token instead")
        policy.revoke_credential(target, actor=actor.id, reason=reason, authority=authority_of(actor))


REVOKE_RULES: dict[RevokeKind, RevokeRule] = {
    RevokeKind.PRINCIPAL: RevokePrincipal(),
    RevokeKind.TENANT: RevokeTenant(),
    RevokeKind.CREDENTIAL: RevokeCredential(),
}


class RevokeRefused(AccessDenied):
    """The actor may not revoke targets of this kind (or this one: another tenant's principal)."""


class LiftRefused(AccessDenied):
    """The revocation in force was made with more authority than the actor has."""


class CredentialNotLiftable(InvalidRequest):
    """A revoked credential is never lifted."""


def change_revocation(policy: Policy, kind: RevokeKind, actor: Principal, target: str, *, lift: bool,
                      reason: str = "") -> None:
    """Revoke ``target`` (or, with ``lift``, lift its revocation) on ``policy`` if ``actor`` may.

    Raises RevokeRefused or LiftRefused (AccessDenied) before anything changes, and
    CredentialNotLiftable for a credential; the policy's own checks (target syntax, sizes)
    raise as they do for a direct call."""
    rule = REVOKE_RULES[kind]
    if not rule.allowed(actor, target):
        raise RevokeRefused(f"principal {actor.id} may not revoke {kind} targets")
    if lift and not rule.may_lift(policy, actor, target):
        raise LiftRefused(f"principal {actor.id} may not lift a revocation made with more authority "
                          "(an operator's): ask an operator")
    rule.apply(policy, target, lift=lift, actor=actor, reason=reason)
