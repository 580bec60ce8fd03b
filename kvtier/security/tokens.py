"""Signed capability tokens: a principal, the scope kinds it may reach, and an expiry.

Wire form: ``kvt1.<base64url(claims json)>.<base64url(signature)>``; the signature covers the
exact ASCII of ``kvt1.<claims>``. Algorithms are strategies in ``ALGORITHMS``: ``HS256``
(HMAC-SHA256, a secret shared by minter and daemon) and ``EdDSA`` (Ed25519: the daemon holds
only the public key, so it cannot mint).

Verification, in order: the token's length (``MAX_TOKEN_CHARS``) and shape; the base64 of both
parts; the signature, tried against each key of the verifier's own set (a daemon has one or two)
so that not a byte of unsigned claims is parsed; only then the claims, bounded in size and
nesting (``kvtier.bounded_json``) before ``json`` reads them, and their ``kid`` and ``alg`` must
name the key that verified them: a token never chooses how it is verified. Every failure
(malformed, over-large, deeply nested, bad signature, another key's claims, expired, not yet
valid, lifetime too long, wrong audience, bad claims) raises AuthError, with a message that quotes
no token or key bytes; nothing else escapes ``verify`` for any input.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import math
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from kvtier.bounded_json import JsonRefused, loads_bounded
from kvtier.errors import AuthError, ScopeError
from kvtier.keys import ScopeKind
from kvtier.security.policy import Principal

PREFIX = "kvt1"
MAX_TOKEN_CHARS = 4096
#: Decoded claims: all that fits in a token of MAX_TOKEN_CHARS.
MAX_CLAIMS_BYTES = 3072
#: Claims are one object of strings, numbers and lists of strings: two levels.
MAX_CLAIMS_DEPTH = 2
DEFAULT_LEEWAY_S = 30.0
DEFAULT_MAX_LIFETIME_S = 24 * 3600.0
_SCOPE_NAMES = {k.name.lower(): k for k in ScopeKind}


def _b64e(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _b64d(text: str) -> bytes:
    """The bytes of unpadded base64url ``text`` as ``_b64e`` writes them, and only so: Python's
    decoder ignores the unused low bits of the last character, so without the round trip several
    strings would decode to one signature or one set of claims, and a token could be altered
    without being refused."""
    if not text or any(c not in "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_" for c in text):
        raise AuthError("token is malformed (bad base64url)")
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        raise AuthError("token is malformed (bad base64url)") from None
    if _b64e(raw) != text:
        raise AuthError("token is malformed (non-canonical base64url)")
    return raw


# -- algorithms -----------------------------------------------------------------------------------
class SigningKey(ABC):
    """A key that signs tokens. ``kid`` names it in the token; ``alg`` is its algorithm."""

    alg: str
    kid: str

    @abstractmethod
    def sign(self, data: bytes) -> bytes: ...

    @abstractmethod
    def verify_key(self) -> VerifyKey: ...

    def __reduce__(self) -> Any:
        raise TypeError("signing keys cannot be pickled")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(kid={self.kid!r})"


class VerifyKey(ABC):
    """A key that checks signatures; ``verify`` raises AuthError on any mismatch."""

    alg: str
    kid: str

    @abstractmethod
    def verify(self, data: bytes, signature: bytes) -> None: ...

    def __repr__(self) -> str:
        return f"{type(self).__name__}(kid={self.kid!r})"


class HmacKey(SigningKey, VerifyKey):
    """HMAC-SHA256 with a shared secret of at least 32 bytes (signs and verifies)."""

    alg = "HS256"

    def __init__(self, kid: str, secret: bytes) -> None:
        if len(secret) < 32:
            raise ValueError("HMAC token secret must be at least 32 bytes")
        self.kid = kid
        self._secret = bytes(secret)

    def sign(self, data: bytes) -> bytes:
        return hmac.new(self._secret, data, hashlib.sha256).digest()

    def verify(self, data: bytes, signature: bytes) -> None:
        if not hmac.compare_digest(self.sign(data), signature):
            raise AuthError("token signature is invalid")

    def verify_key(self) -> VerifyKey:
        return self


class Ed25519SigningKey(SigningKey):
    alg = "EdDSA"

    def __init__(self, kid: str, private_key: Ed25519PrivateKey | None = None) -> None:
        self.kid = kid
        self._key = private_key or Ed25519PrivateKey.generate()

    def sign(self, data: bytes) -> bytes:
        return self._key.sign(data)

    def verify_key(self) -> Ed25519VerifyKey:
        return Ed25519VerifyKey(self.kid, self._key.public_key())


class Ed25519VerifyKey(VerifyKey):
    alg = "EdDSA"

    def __init__(self, kid: str, public_key: Ed25519PublicKey) -> None:
        self.kid = kid
        self._key = public_key

    def verify(self, data: bytes, signature: bytes) -> None:
        try:
            self._key.verify(signature, data)
        except InvalidSignature:
            raise AuthError("token signature is invalid") from None


#: Algorithm name -> signing-key class (the verify side is the key's ``verify_key()``).
ALGORITHMS: dict[str, type[SigningKey]] = {HmacKey.alg: HmacKey, Ed25519SigningKey.alg: Ed25519SigningKey}


# -- claims ---------------------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class TokenClaims:
    """What a token says. ``scopes`` are scope kinds relative to the principal (never scope ids)."""

    principal: Principal
    issued_at: float
    expires_at: float
    token_id: str
    audience: str | None = None


@dataclass(slots=True, frozen=True)
class MintRequest:
    principal: Principal
    ttl_s: float
    scopes: Iterable[str] | None = None
    audience: str | None = None


def mint(key: SigningKey, request: MintRequest, *, now: float | None = None) -> str:
    """A signed token for ``request.principal`` valid for ``ttl_s`` seconds.

    ``scopes`` (``public``/``org``/``user``/``session``) narrows what the token reaches; None
    means every scope the principal has.
    """
    p = request.principal
    if not _finite(request.ttl_s) or request.ttl_s <= 0:
        raise ValueError("token ttl_s must be a positive, finite number of seconds")
    iat = time.time() if now is None else now
    if not _finite(iat):
        raise ValueError("token issue time must be a finite number (check the clock)")
    if not _finite(iat + request.ttl_s):
        raise ValueError("token expiry must be a finite number")
    kinds = None
    if request.scopes is not None:
        kinds = sorted({_scope_kind(s).name.lower() for s in request.scopes})
    elif p.scope_kinds is not None:
        kinds = sorted(k.name.lower() for k in p.scope_kinds)
    claims: dict[str, Any] = {
        "alg": key.alg, "kid": key.kid, "ten": p.tenant, "usr": p.user, "org": p.org, "ses": p.session,
        "rol": sorted(p.roles), "scp": kinds, "iat": iat, "exp": iat + request.ttl_s,
        "jti": os.urandom(12).hex(), "aud": request.audience,
    }
    body = _b64e(json.dumps(claims, separators=(",", ":"), sort_keys=True).encode())
    signed = f"{PREFIX}.{body}"
    token = f"{signed}.{_b64e(key.sign(signed.encode()))}"
    if len(token) > MAX_TOKEN_CHARS:
        raise ValueError(f"the token would be too long ({len(token)} characters, verifiers accept "
                         f"{MAX_TOKEN_CHARS}): fewer roles or shorter ids")
    return token


def _finite(x: object) -> bool:
    """A real, finite number (bools, NaN, infinities and integers beyond a float are not)."""
    if not isinstance(x, int | float) or isinstance(x, bool):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:  # an int too large to be a float
        return False


def _scope_kind(name: str) -> ScopeKind:
    try:
        return _SCOPE_NAMES[name]
    except KeyError:
        raise ScopeError(f"unknown scope kind {name!r}: expected one of {sorted(_SCOPE_NAMES)}") from None


class TokenVerifier:
    """Verifies tokens against a fixed key set (by kid) and turns them into Principals.

    Invariants: the key set is read-only after construction; ``clock`` is the only time source.
    """

    def __init__(
        self,
        keys: Iterable[VerifyKey],
        *,
        audience: str | None = None,
        leeway_s: float = DEFAULT_LEEWAY_S,
        max_lifetime_s: float = DEFAULT_MAX_LIFETIME_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._keys: Mapping[str, VerifyKey] = {k.kid: k for k in keys}
        if not self._keys:
            raise ValueError("TokenVerifier needs at least one key")
        if not _finite(leeway_s) or leeway_s < 0:
            raise ValueError("TokenVerifier leeway_s must be a finite number >= 0")
        if not _finite(max_lifetime_s) or max_lifetime_s <= 0:
            raise ValueError("TokenVerifier max_lifetime_s must be a positive, finite number")
        self.audience = audience
        self.leeway_s = leeway_s
        self.max_lifetime_s = max_lifetime_s
        self._clock = clock

    def verify(self, token: str) -> TokenClaims:
        if not isinstance(token, str) or len(token) > MAX_TOKEN_CHARS:
            raise AuthError("token is missing or too long")
        parts = token.split(".")
        if len(parts) != 3 or parts[0] != PREFIX:
            raise AuthError("token is malformed (expected kvt1.<claims>.<signature>)")
        raw = _b64d(parts[1])
        key = self._signer(f"{parts[0]}.{parts[1]}".encode(), _b64d(parts[2]))
        # From here the claims are the signer's own bytes; they are still bounded before parsing
        # (a minter's bug, or a leaked key, must not crash the daemon either).
        try:
            claims = loads_bounded(raw, max_bytes=MAX_CLAIMS_BYTES, max_depth=MAX_CLAIMS_DEPTH)
        except JsonRefused as exc:
            raise AuthError(f"token claims are malformed ({exc})") from None
        if not isinstance(claims, dict):
            raise AuthError("token claims are not an object")
        if claims.get("kid") != key.kid:
            raise AuthError("token names another key than the one that signed it")
        if claims.get("alg") != key.alg:
            raise AuthError("token algorithm does not match its key")
        return self._claims(claims)

    def _signer(self, signed: bytes, signature: bytes) -> VerifyKey:
        """The key of this verifier's set whose signature ``signature`` is; AuthError when none.
        Each key checks with its own algorithm (the set is small: one HMAC and one Ed25519 key)."""
        for key in self._keys.values():
            try:
                key.verify(signed, signature)
            except AuthError:
                continue
            return key
        raise AuthError("token signature is invalid")

    def principal(self, token: str) -> Principal:
        return self.verify(token).principal

    def _claims(self, c: dict[str, Any]) -> TokenClaims:
        now = self._clock()
        # Every comparison below is false for NaN, so a non-finite number anywhere (a claim, or
        # the clock) would fail open: refuse it before comparing.
        if not _finite(now):
            raise AuthError("the verifier's clock is not a finite number; refusing every token")
        iat, exp = c.get("iat"), c.get("exp")
        if not _finite(iat) or not _finite(exp):
            raise AuthError("token has no valid iat/exp")
        if exp < iat:
            raise AuthError("token expires before it was issued")
        if exp <= now - self.leeway_s:
            raise AuthError("token has expired")
        if iat > now + self.leeway_s:
            raise AuthError("token is not valid yet")
        if exp - iat > self.max_lifetime_s:
            raise AuthError("token lifetime exceeds the allowed maximum")
        if c.get("aud") != self.audience:
            raise AuthError("token is for another audience")
        if not isinstance(c.get("jti"), str):
            raise AuthError("token has no id")
        roles, scopes = c.get("rol"), c.get("scp")
        if not isinstance(roles, list) or not all(isinstance(r, str) for r in roles):
            raise AuthError("token roles are malformed")
        if scopes is not None and (not isinstance(scopes, list)
                                   or not all(isinstance(s, str) and s in _SCOPE_NAMES for s in scopes)):
            raise AuthError("token scopes are malformed")
        if not all(c.get(f) is None or isinstance(c.get(f), str) for f in ("ten", "usr", "org", "ses", "aud")):
            raise AuthError("token names a malformed principal")
        try:
            p = Principal(
                tenant=c.get("ten"), user=c.get("usr"), org=c.get("org"), session=c.get("ses"),
                roles=frozenset(roles), credential_id=c.get("jti"),
                scope_kinds=None if scopes is None else frozenset(_SCOPE_NAMES[s] for s in scopes),
            )
        except ScopeError:
            raise AuthError("token names a malformed principal") from None
        return TokenClaims(p, float(iat), float(exp), str(c.get("jti")), c.get("aud"))
