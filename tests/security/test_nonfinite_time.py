"""Issue 17, point 6: NaN and infinite numbers never make a token that does not expire.

Every comparison with NaN is false, so a check written as ``if exp <= now: refuse`` fails open
when ``exp`` or ``now`` is NaN. Both sides refuse non-finite numbers: ``mint`` (ttl, clock) and
the verifier (claims, its own clock, its settings).
"""

from __future__ import annotations

import base64
import json
import math

import pytest

from kvtier.errors import AuthError
from kvtier.security.policy import Principal
from kvtier.security.tokens import PREFIX, HmacKey, MintRequest, TokenVerifier, mint

NOW = 1_800_000_000.0
ALICE = Principal("acme", "alice")
KEY = HmacKey("h1", b"k" * 32)
NONFINITE = [math.nan, math.inf, -math.inf]


def signed(claims: dict) -> str:
    """A correctly signed token with arbitrary claims (what a buggy or compromised minter emits)."""
    body = base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=").decode()
    signed_part = f"{PREFIX}.{body}"
    sig = base64.urlsafe_b64encode(KEY.sign(signed_part.encode())).rstrip(b"=").decode()
    return f"{signed_part}.{sig}"


def claims(**over) -> dict:
    c = {"alg": "HS256", "kid": "h1", "ten": "acme", "usr": "alice", "org": None, "ses": None, "rol": [],
         "scp": None, "iat": NOW, "exp": NOW + 60, "jti": "t1", "aud": None}
    return c | over


@pytest.mark.parametrize("ttl", [*NONFINITE, True])
def test_mint_refuses_a_non_finite_ttl(ttl) -> None:
    with pytest.raises(ValueError, match="finite"):
        mint(KEY, MintRequest(ALICE, ttl), now=NOW)


@pytest.mark.parametrize("now", NONFINITE)
def test_mint_refuses_a_non_finite_clock(now) -> None:
    with pytest.raises(ValueError, match="finite"):
        mint(KEY, MintRequest(ALICE, 60.0), now=now)


@pytest.mark.parametrize("field", ["iat", "exp"])
@pytest.mark.parametrize("value", NONFINITE)
def test_verifier_refuses_non_finite_claims(field, value) -> None:
    v = TokenVerifier([KEY], clock=lambda: NOW)
    assert v.principal(signed(claims())) == ALICE.__class__("acme", "alice", credential_id="t1")
    with pytest.raises(AuthError):
        v.verify(signed(claims(**{field: value})))


@pytest.mark.parametrize("clock", NONFINITE)
def test_verifier_with_a_non_finite_clock_refuses_everything(clock) -> None:
    good = mint(KEY, MintRequest(ALICE, 60.0), now=NOW)
    expired = mint(KEY, MintRequest(ALICE, 60.0), now=NOW - 10 * 86400)
    v = TokenVerifier([KEY], clock=lambda: clock)
    for tok in (good, expired):
        with pytest.raises(AuthError, match="clock"):
            v.verify(tok)


def test_verifier_settings_must_be_finite() -> None:
    for kw in ({"leeway_s": math.nan}, {"max_lifetime_s": math.nan}, {"max_lifetime_s": math.inf}):
        with pytest.raises(ValueError, match="finite"):
            TokenVerifier([KEY], **kw)


def test_a_token_that_expires_before_it_was_issued_is_refused() -> None:
    with pytest.raises(AuthError):
        TokenVerifier([KEY], clock=lambda: NOW).verify(signed(claims(iat=NOW, exp=NOW - 1)))
