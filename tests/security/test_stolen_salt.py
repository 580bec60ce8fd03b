"""Issue 32, point 4: an engine credential plus a stolen request salt is no longer that user forever.

A ``kvs3`` salt carries an id, an issue time and an expiry under its MAC: it expires on the
verifier's clock, lives at most the configured lifetime, and is revoked alone by its id as a
credential (``kvtier admin revoke credential <id>``) while the user's other salts and tokens keep
working. An engine credential is confined to the data path (``CONFINED_ROLES``): acting for any
salt it cannot purge, delete, list, read usage or revoke, and the roles a salt claims (a token
salt may claim ``operator``) are dropped, so they widen nothing. The audit log records which
engine credential acted for which salt's principal. Real daemon, real gRPC; the expiry on the
daemon is checked with a salt minted to expire a second after the test starts (no long sleep),
and on a verifier with a clock the test moves.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.localdeploy import LocalDeployment
from kvtier.errors import AccessDenied, AuthError
from kvtier.keys import Scope
from kvtier.security.audit import AuditLog
from kvtier.security.policy import ROLE_ENGINE, ROLE_OPERATOR
from kvtier.security.salts import SALT_LEEWAY_S, HmacSaltMapper, mint_salt, salt_id
from kvtier.security.tokens import TokenVerifier
from kvtier.server.auth import hmac_key_from_file
from kvtier.server.daemon import Daemon
from storage_backends.grpc import GrpcTier, GrpcTierConfig
from tests.helpers import SECRET, SMALL, ManualClock, chain_blocks

KEY = b"k" * 32


# -- the salt itself, on a clock the test moves ---------------------------------------------------
def test_a_salt_expires_on_its_verifiers_clock_and_lives_no_longer_than_allowed() -> None:
    clock = ManualClock(1_700_000_000.0)
    mapper = HmacSaltMapper(KEY, max_lifetime_s=3600, clock=clock)
    salt = mint_salt(KEY, "acme", "alice", ttl_s=600, now=clock())
    p = mapper.principal(salt)
    assert p is not None and p.id == "acme/alice" and p.credential_id == salt_id(salt)
    clock.now += 600 + SALT_LEEWAY_S - 1  # within the leeway for clock skew
    assert mapper.principal(salt) == p
    clock.now += 2
    with pytest.raises(AuthError, match="expired"):
        mapper.principal(salt)
    # Longer than the verifier allows: refused outright, even while fresh.
    with pytest.raises(AuthError, match="lifetime"):
        mapper.principal(mint_salt(KEY, "acme", "alice", ttl_s=7200, now=clock()))
    # Not yet valid (issued in the verifier's future beyond the leeway).
    with pytest.raises(AuthError, match="not valid yet"):
        mapper.principal(mint_salt(KEY, "acme", "alice", ttl_s=60, now=clock() + 10 * SALT_LEEWAY_S))
    # Control: a fresh salt verifies; two salts of one user have different ids.
    a, b = mint_salt(KEY, "acme", "alice", now=clock()), mint_salt(KEY, "acme", "alice", now=clock())
    assert mapper.principal(a).id == mapper.principal(b).id == "acme/alice" and salt_id(a) != salt_id(b)


def test_a_salt_without_expiry_is_refused_with_a_clear_error() -> None:
    """kvs2 (and kvs1) salts never expire: refused once their MAC is checked, naming the fix."""
    mac = hmac.new(KEY, b"kvtier-salt-v2\x00acme\x00alice", hashlib.sha256).hexdigest()[:32]
    with pytest.raises(AuthError, match=r"no expiry.*mint_salt"):
        HmacSaltMapper(KEY).principal(f"kvs2:acme:alice:{mac}")
    with pytest.raises(AuthError, match="invalid signature"):  # a forged one is told apart
        HmacSaltMapper(KEY).principal("kvs2:acme:alice:" + "0" * 32)


def test_tampering_with_the_time_or_the_id_breaks_the_mac() -> None:
    clock = ManualClock(1_700_000_000.0)
    salt = mint_salt(KEY, "acme", "alice", ttl_s=60, now=clock())
    prefix, tenant, user, sid, iat, exp, mac = salt.split(":")
    mapper = HmacSaltMapper(KEY, clock=clock)
    for forged in (f"{prefix}:{tenant}:{user}:{sid}:{iat}:{int(exp) + 86000}:{mac}",
                   f"{prefix}:{tenant}:{user}:{'0' * len(sid)}:{iat}:{exp}:{mac}",
                   f"{prefix}:{tenant}:bob:{sid}:{iat}:{exp}:{mac}"):
        with pytest.raises(AuthError, match="invalid signature"):
            mapper.principal(forged)
    assert mapper.principal(salt).id == "acme/alice"  # control


# -- through a daemon -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, LocalDeployment, Path]]:
    root = tmp_path_factory.mktemp("stolen-salt")
    audit = root / "audit.log"
    dep = LocalDeployment(root / "dep", server_secret=SECRET)
    dep.write_config(memory_bytes=64 * SMALL.bytes_per_block, security={"audit_log_file": str(audit)})
    d = Daemon(dep.config()).start()
    yield d, dep, audit
    d.stop(grace_s=0)


def _client(d: Daemon, token: str) -> GrpcTier:
    return GrpcTier(GrpcTierConfig(d.address, token, max_attempts=1))


@pytest.fixture
def engine(node) -> Iterator[GrpcTier]:
    d, dep, _ = node
    tier = _client(d, dep.token("node1", "engine", roles=(ROLE_ENGINE,)))
    yield tier
    tier.close()


@pytest.fixture
def operator(node) -> Iterator[GrpcTier]:
    d, dep, _ = node
    tier = _client(d, dep.token("kvtier", "ops", roles=(ROLE_OPERATOR,)))
    yield tier
    tier.close()


def _own_blocks(user: str, seed: int, n: int = 2) -> list:
    return chain_blocks(n, scope=Scope.user(f"acme/{user}"), seed=seed, token_base=1000 * seed)


def test_a_stolen_salt_stops_working_on_the_daemon_when_it_expires(node, engine) -> None:
    _, dep, _ = node
    # Expires (leeway included) one to two seconds from now: no long sleep.
    expires = math.floor(time.time()) - SALT_LEEWAY_S + 2
    salt = mint_salt(dep.salt_key, "acme", "alice", ttl_s=60, now=expires - 60)
    blocks = _own_blocks("alice", 1)
    assert len(engine.acting_for(salt).put(blocks).stored) == 2  # valid now: the engine acts for alice
    while time.time() < expires + SALT_LEEWAY_S + 0.05:
        time.sleep(0.05)
    with pytest.raises(AuthError, match="expired"):
        engine.acting_for(salt).get([b.key for b in blocks])
    # Control: a fresh salt of the same user reads the same blocks.
    got = engine.acting_for(dep.salt("acme", "alice")).get([b.key for b in blocks])
    assert all(g is not None and g.equal_bytes(b) for g, b in zip(got, blocks, strict=True))


def test_a_stolen_salt_is_revoked_alone(node, engine, operator) -> None:
    d, dep, _ = node
    stolen, other = dep.salt("acme", "carol"), dep.salt("acme", "carol")
    blocks = _own_blocks("carol", 2)
    assert len(engine.acting_for(stolen).put(blocks).stored) == 2
    operator.revoke("credential", salt_id(stolen), reason="salt leaked")
    with pytest.raises(AccessDenied, match="revoked"):
        engine.acting_for(stolen).get([b.key for b in blocks])
    with pytest.raises(AccessDenied, match="revoked"):
        engine.acting_for(stolen).domains(refresh=True)
    # Control: carol's other salt and her own token still work, and read what the stolen one wrote.
    got = engine.acting_for(other).get([b.key for b in blocks])
    assert all(g is not None and g.equal_bytes(b) for g, b in zip(got, blocks, strict=True))
    carol = _client(d, dep.token("acme", "carol"))
    try:
        assert carol.domains(refresh=True).principal == "acme/carol"
        assert all(g is not None for g in carol.get([b.key for b in blocks]))
    finally:
        carol.close()


def test_an_engine_acting_for_a_salt_never_purges_or_administers(node, engine, operator) -> None:
    _, dep, _ = node
    acting = engine.acting_for(dep.salt("acme", "dave"))
    blocks = _own_blocks("dave", 3)
    assert len(acting.put(blocks).stored) == 2
    dave_domain = blocks[0].meta.domain
    refused = {
        "Purge": lambda: acting.purge("user"),
        "Revoke": lambda: acting.revoke("principal", "acme/erin"),
        "Delete": lambda: acting.delete([b.key for b in blocks]),
        "ListScope": lambda: acting.keys_in_scope(dave_domain),
        "Stats": lambda: acting.stats(),
    }
    for name, call in refused.items():
        with pytest.raises(AccessDenied, match=f"may not call {name}"):
            call()
    assert all(g is not None for g in acting.get([b.key for b in blocks])), "nothing was purged or deleted"
    # Control: an operator purges the same scope.
    res = operator.purge("user:acme/dave", reason="control")
    assert sum(res.removed.values()) == 2
    assert acting.get([b.key for b in blocks]) == [None, None]


def test_a_salt_claiming_operator_does_not_make_the_engine_an_operator(node, engine) -> None:
    d, dep, _ = node
    # A token salt may carry roles; this one claims every widening role there is.
    claims = dep.token("acme", "frank", roles=(ROLE_OPERATOR, "admin", "publish:public"))
    acting = engine.acting_for(claims)
    grants = {str(g.scope): g for g in acting.domains(refresh=True).grants.values()}
    assert not grants["public"].may_delete and not grants["public"].may_write
    public = chain_blocks(2, seed=4, token_base=40_000)
    with pytest.raises(AccessDenied, match="may not call"):
        acting.purge("public")
    with pytest.raises(AccessDenied, match="may not call"):
        acting.revoke("tenant", "globex")
    assert len(acting.put(public).stored) == 0, "no publish:public through a salt: skipped"
    # Control: the same token, used as itself, is an operator and a publisher.
    frank = _client(d, claims)
    try:
        assert len(frank.put(public).stored) == 2
        assert sum(frank.purge("public", reason="control").removed.values()) >= 2
    finally:
        frank.close()


def test_the_audit_log_names_the_engine_credential_and_the_salts_principal(node) -> None:
    d, dep, audit = node
    token = dep.token("node7", "engine", roles=(ROLE_ENGINE,))
    engine_id = TokenVerifier([hmac_key_from_file(str(dep.token_key_file))]).verify(token).token_id
    salt = dep.salt("acme", "gina")
    tier = _client(d, token)
    try:
        before = len(AuditLog.read(audit))
        tier.acting_for(salt).domains(refresh=True)
        tier.acting_for(salt).domains(refresh=True)  # the same pair again: recorded once
        events = [e for e in AuditLog.read(audit)[before:] if e.action == "act_for"]
        assert [(e.actor, e.target, e.detail) for e in events] == [
            ("node7/engine", "principal:acme/gina", {"engine_credential": engine_id, "salt": salt_id(salt)})]
        # Control: another salt of the same user is a new record.
        tier.acting_for(dep.salt("acme", "gina")).domains(refresh=True)
        assert len([e for e in AuditLog.read(audit)[before:] if e.action == "act_for"]) == 2
    finally:
        tier.close()
