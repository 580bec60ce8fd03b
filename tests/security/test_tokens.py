"""Capability tokens: forged, expired, tampered and confused tokens are refused with AuthError."""

from __future__ import annotations

import base64
import json

import pytest

from kvtier.errors import AuthError
from kvtier.keys import ScopeKind
from kvtier.security.policy import ROLE_PUBLISH_PUBLIC, Policy, Principal
from kvtier.security.tokens import Ed25519SigningKey, HmacKey, MintRequest, TokenVerifier, mint
from tests.helpers import DERIVER

NOW = 1_800_000_000.0
ALICE = Principal("acme", "alice", org="eng", session="s1", roles=frozenset({ROLE_PUBLISH_PUBLIC}))
HMAC = HmacKey("h1", b"k" * 32)
ED = Ed25519SigningKey("e1")


def verifier(*keys, **kw) -> TokenVerifier:
    return TokenVerifier(keys or (HMAC, ED.verify_key()), clock=lambda: NOW, **kw)


def token(key=HMAC, principal=ALICE, ttl=300.0, now=NOW, **kw) -> str:
    return mint(key, MintRequest(principal, ttl, **kw), now=now)


def claims_of(tok: str) -> dict:
    body = tok.split(".")[1]
    return json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))


def reencode(tok: str, claims: dict) -> str:
    """Swap the claims and keep the old signature (what a forger without the key can do)."""
    parts = tok.split(".")
    parts[1] = base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=").decode()
    return ".".join(parts)


@pytest.mark.parametrize("key", [HMAC, ED], ids=["hmac", "ed25519"])
def test_roundtrip_keeps_every_principal_field(key) -> None:
    c = verifier().verify(token(key))
    p = c.principal
    assert (p.tenant, p.user, p.org, p.session, p.roles) == ("acme", "alice", "eng", "s1", ALICE.roles)
    assert p.credential_id == c.token_id and len(c.token_id) == 24
    assert c.expires_at == NOW + 300


def test_scopes_narrow_the_principal() -> None:
    p = verifier().principal(token(scopes=["public"]))
    assert p.scope_kinds == frozenset({ScopeKind.PUBLIC})
    policy = Policy(DERIVER)
    assert policy.may_read(p, p.own_scope("public")) and not policy.may_read(p, p.user_scope())


@pytest.mark.parametrize("key", [HMAC, ED], ids=["hmac", "ed25519"])
def test_tampered_claims_are_refused(key) -> None:
    tok = token(key)
    for field, value in [("ten", "globex"), ("usr", "bob"), ("rol", ["operator"]), ("exp", NOW + 10**6),
                         ("scp", ["public", "user"])]:
        forged = reencode(tok, claims_of(tok) | {field: value})
        with pytest.raises(AuthError, match="signature"):
            verifier().verify(forged)


def test_tampered_signature_is_refused() -> None:
    tok = token()
    head, sig = tok.rsplit(".", 1)
    flipped = "A" if sig[0] != "A" else "B"
    with pytest.raises(AuthError, match="signature"):
        verifier().verify(f"{head}.{flipped}{sig[1:]}")


B64URL = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"


@pytest.mark.parametrize("key", [HMAC, ED], ids=["hmac", "ed25519"])
def test_another_encoding_of_the_same_signature_is_refused(key) -> None:
    """The last base64url character of a signature has unused low bits (2 for HMAC's 32 bytes, 4
    for Ed25519's 64), which Python's decoder ignores: set one and the string differs while the
    bytes do not. Such a token is an altered one, refused as malformed."""
    tok = token(key)
    head, sig = tok.rsplit(".", 1)
    unused = {2: 4, 3: 2}[len(sig) % 4]
    assert B64URL.index(sig[-1]) % (1 << unused) == 0  # the minter writes them as zeros
    altered = sig[:-1] + B64URL[B64URL.index(sig[-1]) | 1]
    # Control: the same bytes, so only the encoding check can refuse it; the original passes.
    decode = base64.urlsafe_b64decode
    assert altered != sig and decode(altered + "=" * (-len(sig) % 4)) == decode(sig + "=" * (-len(sig) % 4))
    assert verifier().verify(tok).principal.user == "alice"
    with pytest.raises(AuthError, match="non-canonical"):
        verifier().verify(f"{head}.{altered}")


def test_forged_with_another_key_is_refused() -> None:
    with pytest.raises(AuthError, match="signature"):
        verifier().verify(token(HmacKey("h1", b"x" * 32)))  # right kid, wrong secret
    with pytest.raises(AuthError, match="signature"):
        verifier().verify(token(Ed25519SigningKey("e1")))  # right kid, another private key
    # No configured key made the signature: refused for it before a byte of the claims is read.
    with pytest.raises(AuthError, match="signature"):
        verifier().verify(token(HmacKey("nobody", b"x" * 32)))


def test_algorithm_confusion_is_refused() -> None:
    # An HS256 token made with the Ed25519 key id: the verifier uses the key's algorithm, not the token's.
    confused = mint(HmacKey("e1", b"p" * 32), MintRequest(ALICE, 60), now=NOW)
    with pytest.raises(AuthError, match="signature"):
        verifier().verify(confused)
    # Signed by the HMAC key but claiming the Ed25519 key's id or algorithm: still refused.
    for override in ({"kid": "e1"}, {"alg": "EdDSA"}):
        c = claims_of(token()) | override
        body = base64.urlsafe_b64encode(json.dumps(c).encode()).rstrip(b"=").decode()
        signed = f"kvt1.{body}"
        sig = base64.urlsafe_b64encode(HMAC.sign(signed.encode())).rstrip(b"=").decode()
        with pytest.raises(AuthError, match=r"another key|algorithm"):
            verifier().verify(f"{signed}.{sig}")


def test_expiry_and_not_before() -> None:
    with pytest.raises(AuthError, match="expired"):
        verifier().verify(token(now=NOW - 1000, ttl=300))
    verifier().verify(token(now=NOW - 310, ttl=300))  # within the 30 s leeway
    with pytest.raises(AuthError, match="not valid yet"):
        verifier().verify(token(now=NOW + 600))
    with pytest.raises(AuthError, match="lifetime"):
        verifier(max_lifetime_s=3600).verify(token(ttl=7200))


def test_audience() -> None:
    with pytest.raises(AuthError, match="audience"):
        verifier(audience="cluster-a").verify(token(audience="cluster-b"))
    with pytest.raises(AuthError, match="audience"):
        verifier(audience="cluster-a").verify(token())
    verifier(audience="cluster-a").verify(token(audience="cluster-a"))


@pytest.mark.parametrize(
    "tok",
    ["", "kvt1", "kvt1.a.b.c", "jwt.e30.e30", "kvt1.!!.AAAA", "kvt1.e30.", "kvt1." + "A" * 5000 + ".AA", None, 42],
)
def test_malformed_tokens(tok) -> None:
    with pytest.raises(AuthError):
        verifier().verify(tok)


def test_claims_that_verify_but_are_malformed_are_refused() -> None:
    # Signed by the real key (an insider bug or a confused minter) but not a valid principal.
    bad = []
    for override in ({"ten": "a/b"}, {"rol": "admin"}, {"scp": ["tenant"]}, {"iat": "now"}, {"jti": None}):
        c = claims_of(token()) | override
        body = base64.urlsafe_b64encode(json.dumps(c).encode()).rstrip(b"=").decode()
        signed = f"kvt1.{body}"
        bad.append(f"{signed}.{base64.urlsafe_b64encode(HMAC.sign(signed.encode())).rstrip(b'=').decode()}")
    for tok in bad:
        with pytest.raises(AuthError):
            verifier().verify(tok)


def test_revoked_credential_is_refused_by_policy() -> None:
    policy = Policy(DERIVER)
    p = verifier().principal(token())
    assert policy.is_active(p)
    policy.revoke_credential(p.credential_id)
    assert not policy.is_active(p)
    assert policy.is_active(verifier().principal(token()))  # a new credential of the same principal


def test_errors_never_echo_secrets_or_tokens() -> None:
    tok = token()
    forged = reencode(tok, claims_of(tok) | {"usr": "mallory"})
    with pytest.raises(AuthError) as exc:
        verifier().verify(forged)
    msg = str(exc.value)
    assert "k" * 32 not in msg and forged.split(".")[1] not in msg and "mallory" not in msg
    assert "k" * 32 not in repr(HMAC)
