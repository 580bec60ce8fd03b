"""A revocation made on this node reaches every listener subscribed to the policy (a revocation
feed, say) through ``Policy.subscribe``, not through an attribute set from outside; one listener
that fails neither keeps the others from hearing nor undoes the change here."""

from __future__ import annotations

import pytest

from kvtier.security.policy import Policy, RevocationChange
from kvtier.security.revoke_rules import RevokeKind, change_revocation
from tests.helpers import DERIVER
from tests.security.builders import ALICE, BOB, OPERATOR


def test_every_subscriber_hears_each_change_made_here_until_it_unsubscribes() -> None:
    p = Policy(DERIVER, node="a")
    first: list[RevocationChange] = []
    second: list[RevocationChange] = []
    p.subscribe(first.append)
    p.subscribe(second.append)
    change_revocation(p, RevokeKind.PRINCIPAL, OPERATOR, ALICE.id, lift=False, reason="leak")
    assert [(c.target, c.revoked, c.origin, c.reason) for c in first] == [("principal:acme/alice", True, "a", "leak")]
    assert second == first
    p.unsubscribe(first.append)
    p.grant(ALICE.id)
    assert len(first) == 1 and [c.revoked for c in second] == [True, False]
    # Changes applied from another node came from a feed already: not told again.
    p.apply_remote(RevocationChange("tenant:globex", True, 1e12, "b", "ops"))
    assert len(second) == 2 and not p.is_active(BOB)


def test_a_failing_listener_leaves_the_change_applied_and_the_others_told() -> None:
    p = Policy(DERIVER)
    heard: list[RevocationChange] = []

    def offline(_c: RevocationChange) -> None:
        raise RuntimeError("feed down")

    p.subscribe(offline)
    p.subscribe(heard.append)
    with pytest.raises(RuntimeError, match="feed down"):
        p.revoke_tenant("globex")
    assert not p.is_active(BOB)
    assert [c.target for c in heard] == ["tenant:globex"]
