"""Issue 32 point 2, credentials: a token's signature is checked before a byte of its claims is
parsed; claims and salts are bounded in size and nesting; every malformed, over-large or deeply
nested token or salt is an AuthError, which the daemon answers UNAUTHENTICATED (never UNKNOWN with
a Python exception's text), on the bearer token and on an engine's request salt alike.
"""

from __future__ import annotations

import base64
import json
import logging

import grpc
import pytest

from benchmarks.localdeploy import LocalDeployment
from kvtier.errors import AuthError
from kvtier.keys import DomainDeriver
from kvtier.rpc import kvtier_pb2 as pb
from kvtier.rpc.names import AUTH_METADATA, SALT_METADATA, SERVICE_NAME
from kvtier.rpc.status import ERROR_METADATA
from kvtier.security.policy import Policy, Principal
from kvtier.security.salts import HmacSaltMapper, RequestSalts, SaltMapper, mint_salt, salt_id
from kvtier.security.tokens import MAX_TOKEN_CHARS, Ed25519SigningKey, HmacKey, MintRequest, TokenVerifier, mint
from kvtier.server.auth import CallGate, GateOptions
from kvtier.server.daemon import Daemon
from kvtier.server.limits import ByteBudget, ConcurrencyLimit, DeadlineReaper
from kvtier.server.observability import ServerMetrics
from tests.helpers import SECRET

NOW = 1_800_000_000.0
ALICE = Principal("acme", "alice", org="eng")
HMAC = HmacKey("h1", b"k" * 32)
ED = Ed25519SigningKey("e1")
SALT_KEY = b"s" * 32


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def verifier() -> TokenVerifier:
    return TokenVerifier((HMAC, ED.verify_key()), clock=lambda: NOW)


def forged(claims: bytes, signature: bytes = b"\x01" * 32) -> str:
    """A token with these raw claim bytes and a signature made without any key."""
    return f"kvt1.{_b64(claims)}.{_b64(signature)}"


def signed(claims: bytes, key: HmacKey = HMAC) -> str:
    """These raw claim bytes signed by a configured key: what a buggy or compromised minter makes."""
    head = f"kvt1.{_b64(claims)}"
    return f"{head}.{_b64(key.sign(head.encode()))}"


def good_claims(**override: object) -> dict:
    tok = mint(HMAC, MintRequest(ALICE, 300.0), now=NOW)
    body = tok.split(".")[1]
    return json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))) | override


#: Claim bytes an attacker sends unsigned. Each one must be refused for its signature: nothing of
#: it is parsed (today the first ones raise RecursionError, the others "not valid JSON").
UNSIGNED = {
    "nested-list": b"[" * 3000,
    "nested-object": b'{"a":' * 600,
    "not-json": b"\xff\xfe not json",
    "huge-int": b"1" * 3000,
    "plain-object": json.dumps(good_claims(usr="mallory")).encode(),
}


@pytest.mark.parametrize("claims", UNSIGNED.values(), ids=UNSIGNED.keys())
def test_a_forged_token_is_refused_for_its_signature_before_its_claims_are_read(claims: bytes) -> None:
    with pytest.raises(AuthError, match="signature"):
        verifier().verify(forged(claims))
    with pytest.raises(AuthError, match="signature"):  # an Ed25519-sized signature, the same answer
        verifier().verify(forged(claims, b"\x02" * 64))


#: Claims a configured key signed that are still not a credential: each one an AuthError.
SIGNED_BAD = {
    "nested-in-a-field": json.dumps(good_claims()).encode()[:-1] + b',"x":' + b"[" * 1200 + b"]" * 1200 + b"}",
    "nested-list": b"[" * 2500,
    "unhashable-scope": json.dumps(good_claims(scp=[["user"]])).encode(),
    "int-beyond-float": json.dumps(good_claims(exp=10**400)).encode(),
    "dict-roles": json.dumps(good_claims(rol=[{"a": 1}])).encode(),
    "tenant-a-number": json.dumps(good_claims(ten=5)).encode(),
    "not-an-object": b"[1,2,3]",
    "not-utf8": b"\xff\xfe",
    "kid-of-another-key": json.dumps(good_claims(kid="e1")).encode(),
    "alg-of-another-key": json.dumps(good_claims(alg="EdDSA")).encode(),
}


@pytest.mark.parametrize("claims", SIGNED_BAD.values(), ids=SIGNED_BAD.keys())
def test_signed_but_malformed_claims_are_auth_errors(claims: bytes) -> None:
    with pytest.raises(AuthError):
        verifier().verify(signed(claims))


def test_good_tokens_still_verify_and_the_old_form_reads() -> None:
    for key in (HMAC, ED):
        assert verifier().principal(mint(key, MintRequest(ALICE, 300.0), now=NOW)).id == "acme/alice"
    # A token minted before this change (kvt1, kid and alg inside the claims) reads unchanged.
    legacy = signed(json.dumps(good_claims(), separators=(",", ":"), sort_keys=True).encode())
    assert verifier().principal(legacy).id == "acme/alice"


def test_mint_refuses_a_token_the_verifier_would_refuse_for_its_size() -> None:
    many = Principal("acme", "alice", roles=frozenset(f"role-{i:04d}" for i in range(400)))
    with pytest.raises(ValueError, match="too long"):
        mint(HMAC, MintRequest(many, 60.0), now=NOW)


#: Salts that prove nothing; each one an AuthError (today: RecursionError, UnicodeEncodeError,
#: TypeError from the parser or the MAC comparison).
BAD_SALTS = {
    "nested-token": forged(b"[" * 3000),
    "non-ascii-ids": "kvs2:\udc80:alice:" + "0" * 32,
    "non-ascii-mac": "kvs2:acme:alice:" + "\u00e9" * 32,
    "legacy-non-ascii-mac": "kvs1:acme/alice:" + "\u00e9" * 64,
    "too-long": "kvs2:acme:alice:" + "0" * MAX_TOKEN_CHARS,
    "empty-fields": "kvs2:::",
    "too-many-fields": "kvs2:a:b:c:d",
    "wrong-mac": "kvs2:acme:alice:" + "0" * 32,
    "not-a-string": b"kvs2:acme:alice:00",
    "kvs3-too-few-fields": "kvs3:acme:alice:" + "0" * 32,
    "kvs3-non-ascii-mac": "kvs3:acme:alice:0123456789ab:1:2:" + "\u00e9" * 32,
    "kvs3-wrong-mac": "kvs3:acme:alice:0123456789ab:1700000000:1700000060:" + "0" * 32,
}


@pytest.mark.parametrize("salt", BAD_SALTS.values(), ids=BAD_SALTS.keys())
def test_bad_salts_are_auth_errors(salt: object) -> None:
    salts = RequestSalts(HmacSaltMapper(SALT_KEY), verifier())
    with pytest.raises(AuthError):
        salts.principal(salt)  # type: ignore[arg-type]
    good = mint_salt(SALT_KEY, "acme", "alice")
    assert salts.principal(good) == Principal("acme", "alice", credential_id=salt_id(good))


# -- on the wire --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    dep = LocalDeployment(tmp_path_factory.mktemp("cred") / "d", server_secret=SECRET)
    dep.write_config(memory_bytes=16 << 20, server={"data_plane": "off"})
    d = Daemon(dep.config()).start()
    yield dep, d
    d.stop(grace_s=0)


def _stats(daemon: Daemon, metadata: tuple[tuple[str, str], ...]) -> grpc.RpcError:
    with grpc.insecure_channel(daemon.address) as ch:
        call = ch.unary_unary(f"/{SERVICE_NAME}/Stats", request_serializer=pb.StatsRequest.SerializeToString,
                              response_deserializer=pb.StatsResponse.FromString)
        with pytest.raises(grpc.RpcError) as err:
            call(pb.StatsRequest(), metadata=metadata, timeout=10)
    return err.value


def _assert_unauthenticated(err: grpc.RpcError) -> None:
    assert err.code() is grpc.StatusCode.UNAUTHENTICATED, (err.code(), err.details())
    assert dict(err.trailing_metadata() or ()).get(ERROR_METADATA) == "AuthError"
    for leak in ("Exception", "Recursion", "Traceback", "Error:"):
        assert leak not in err.details(), err.details()


WIRE_TOKENS = {
    "nested-claims": forged(b"[" * 3000),
    "nested-object-claims": forged(b'{"a":' * 600),
    "not-json-claims": forged(b"\xff\xfe"),
    "over-large": "kvt1." + "A" * (MAX_TOKEN_CHARS + 10) + ".AA",
}


@pytest.mark.parametrize("token", WIRE_TOKENS.values(), ids=WIRE_TOKENS.keys())
def test_a_bad_bearer_token_is_unauthenticated_on_the_wire(daemon, token: str) -> None:
    _, d = daemon
    _assert_unauthenticated(_stats(d, ((AUTH_METADATA, f"Bearer {token}"),)))


WIRE_SALTS = {
    "nested-token": forged(b"[" * 3000),
    "nested-object-token": forged(b'{"a":' * 600),
    "over-large": "kvs2:acme:alice:" + "0" * (MAX_TOKEN_CHARS + 10),
    "malformed-hmac": "kvs2:acme:alice:zz",
    "too-many-fields": "kvs2:a:b:c:d",
}


@pytest.mark.parametrize("salt", WIRE_SALTS.values(), ids=WIRE_SALTS.keys())
def test_a_bad_request_salt_is_unauthenticated_on_the_wire(daemon, salt: str) -> None:
    dep, d = daemon
    engine = dep.token("acme", "engine-1", roles=("engine",))
    _assert_unauthenticated(_stats(d, ((AUTH_METADATA, f"Bearer {engine}"), (SALT_METADATA, salt))))
    # The control: the same engine credential with a good salt is served (on the data path: an
    # engine calls no Stats, docs/security.md 2.14).
    with grpc.insecure_channel(d.address) as ch:
        call = ch.unary_unary(f"/{SERVICE_NAME}/Domains", request_serializer=pb.DomainsRequest.SerializeToString,
                              response_deserializer=pb.DomainsResponse.FromString)
        call(pb.DomainsRequest(), metadata=((AUTH_METADATA, f"Bearer {engine}"),
                                            (SALT_METADATA, dep.salt("acme", "alice"))), timeout=10)


class _BrokenSalts(SaltMapper):
    """A salt check with a bug in it (what no input should be able to reach, but might)."""

    name = "broken"

    def _verify(self, salt: str) -> Principal:
        raise RuntimeError("a bug in the salt check")


def test_a_credential_check_that_crashes_fails_closed_logged_and_counted(caplog) -> None:
    metrics, reaper = ServerMetrics(), DeadlineReaper()
    gate = CallGate(verifier(), Policy(DomainDeriver(SECRET)), ByteBudget(10, 10), ConcurrencyLimit(1),
                    GateOptions(5.0, metrics, reaper), _BrokenSalts())
    engine = mint(HMAC, MintRequest(Principal("acme", "engine-1", roles=frozenset({"engine"})), 60.0), now=NOW)
    try:
        with caplog.at_level(logging.ERROR, logger="kvtier.server"), pytest.raises(AuthError) as err:
            gate._authenticated("/kvtier.v1.KvCache/Stats", ((AUTH_METADATA, f"Bearer {engine}"),
                                                              (SALT_METADATA, "kvs2:acme:alice:" + "0" * 32)))
    finally:
        reaper.close()
    assert str(err.value) == "the credential could not be verified"
    assert metrics.snapshot()["access"] == {"credential_check_crashed": 1}
    crashed = [r for r in caplog.records if getattr(r, "event", None) == "credential_check_crashed"]
    assert len(crashed) == 1 and crashed[0].exc_info is not None
