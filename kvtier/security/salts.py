"""Request salts: an engine's opaque per-request ``cache_salt`` proven to belong to a principal.

Engines such as vLLM carry a ``cache_salt`` string on each request. The API server takes it from
the client's request body, so it is *untrusted input*: a mapper never turns a salt into a tenant
by reading a name out of it. A salt is accepted only when it carries proof minted with
deployment key material:

- ``hmac``: ``kvs3:<tenant>:<user>:<id>:<issued>:<expires>:<mac>``, the MAC being the first 128
  bits of HMAC-SHA256(salt key, every field before it), as 32 hex digits. ``id`` is 12 random hex
  digits: the salt's credential id, so one salt is revoked alone (``revoke credential <id>``,
  ``Principal.credential_id``) while its user's other salts and tokens keep working. ``issued``
  and ``expires`` are Unix seconds: the salt is refused once expired (``SALT_LEEWAY_S`` of clock
  skew allowed), before it is issued, or when its lifetime exceeds the verifier's maximum
  (``auth.salt_max_lifetime_s``, ``kvtier.salt_max_lifetime_s``). So a stolen salt is its user's
  for at most that long, and not a moment after it is revoked (issue 32, point 4). Minted by the
  gateway with ``mint_salt``, which picks a new id each time: a gateway keeps one salt per user
  and mints the next before it expires, so the engine's own local prefix cache (which hashes the
  salt into block 0) keeps working across that user's requests meanwhile. Grants no roles. The
  form fits what vLLM's OpenAI server accepts as a ``cache_salt`` (at most 128 characters, no
  ``/``, ``@``, ``\\`` or NUL): ids of at most 54 characters together, without ``@``.
  The older forms ``kvs2:<tenant>:<user>:<mac>`` and ``kvs1:<tenant>/<user>:<mac>`` never expire
  and have no id: they are refused (AuthError saying so, once their MAC is checked, so a forged
  one still reads "invalid signature"). There is no transition period: a gateway that upgrades
  mints kvs3 salts from its next request on, and the engines' cached KV is keyed by principal,
  not by salt, so nothing cached is lost.
- ``token``: a kvtier capability token (``kvt1.…``, kvtier.security.tokens) verified by a
  TokenVerifier: expiry, audience and revocation by credential id all apply; roles come from the
  token. Each token is a new salt, so the engine's local prefix cache does not carry across tokens.

A missing salt maps to no principal (the request is served without kvtier); a malformed, forged,
expired or retired salt raises AuthError. Salts are verified where the salt key lives: in the engine
process for the in-process caches, in the daemon when engines reach it with an engine credential
(``ROLE_ENGINE``), so the engines of a node never hold the salt key. An engine acting for a salt
reaches the data path only and the salt's roles are dropped (``policy.CONFINED_ROLES``,
``policy.acted_for``).
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import re
import time
from abc import ABC, abstractmethod
from collections.abc import Callable

from kvtier.errors import AccessDenied, AuthError, ConfigError, ScopeError
from kvtier.security.policy import ROLE_ENGINE, Principal, acted_for, confined
from kvtier.security.secrets import read_secret_file
from kvtier.security.tokens import TokenVerifier

SALT_PREFIX = "kvs3"
#: Salts without an expiry or an id, refused since issue 32 (point 4).
V2_SALT_PREFIX = "kvs2"
LEGACY_SALT_PREFIX = "kvs1"
MIN_SALT_KEY_BYTES = 32
MAX_SALT_CHARS = 4096
#: What vLLM's OpenAI server accepts as a cache_salt.
MAX_ENGINE_SALT_CHARS = 128
#: How long ``mint_salt`` makes a salt valid by default, and the longest a verifier accepts by
#: default (``auth.salt_max_lifetime_s``): a stolen salt is its user's for at most this long.
DEFAULT_SALT_TTL_S = 3600.0
DEFAULT_SALT_MAX_LIFETIME_S = 24 * 3600.0
#: Clock skew allowed between the gateway that mints and the process that verifies (as for tokens).
SALT_LEEWAY_S = 30
SALT_ID_HEX = 12
_SALT_ID = re.compile(r"[0-9a-f]{12}")
_SECONDS = re.compile(r"[0-9]{1,12}")


def _salt_mac(key: bytes, fields: tuple[str, ...]) -> str:
    """The MAC over a kvs3 salt's fields as they are written (none may hold ``:`` or NUL)."""
    return hmac.new(key, "\x00".join(("kvtier-salt-v3", *fields)).encode(), hashlib.sha256).hexdigest()[:32]


def _v2_salt_mac(key: bytes, tenant: str, user: str) -> str:
    return hmac.new(key, f"kvtier-salt-v2\x00{tenant}\x00{user}".encode(), hashlib.sha256).hexdigest()[:32]


def _legacy_salt_mac(key: bytes, tenant: str, user: str) -> str:
    return hmac.new(key, f"kvtier-salt-v1\x00{tenant}/{user}".encode(), hashlib.sha256).hexdigest()


def mint_salt(key: bytes, tenant: str, user: str, *, ttl_s: float = DEFAULT_SALT_TTL_S,
              now: float | None = None) -> str:
    """A new salt for requests of ``tenant``/``user`` (``hmac`` mapper), valid for ``ttl_s``
    seconds (rounded up to whole seconds) from ``now`` (rounded down), under a new random id."""
    if len(key) < MIN_SALT_KEY_BYTES:
        raise ConfigError(f"salt key must be at least {MIN_SALT_KEY_BYTES} bytes")
    Principal(tenant=tenant, user=user)  # validates both ids
    t = time.time() if now is None else now
    if not _finite(ttl_s) or ttl_s <= 0:
        raise ValueError("salt ttl_s must be a positive, finite number of seconds")
    if not _finite(t) or t < 0:
        raise ValueError("salt issue time must be a finite, non-negative number (check the clock)")
    issued = math.floor(t)
    fields = (tenant, user, os.urandom(SALT_ID_HEX // 2).hex(), str(issued), str(issued + math.ceil(ttl_s)))
    salt = ":".join((SALT_PREFIX, *fields, _salt_mac(key, fields)))
    if len(salt) > MAX_ENGINE_SALT_CHARS or "@" in salt:
        raise ConfigError(f"a salt for {tenant}/{user} would not fit an engine's cache_salt "
                          f"(at most {MAX_ENGINE_SALT_CHARS} characters, no '@'): use shorter ids")
    return salt


def salt_id(salt: str) -> str:
    """The id of a kvs3 salt, read without verifying it: what ``revoke credential`` takes to
    revoke that salt alone (ValueError for any other string)."""
    parts = salt.split(":") if isinstance(salt, str) else []
    if len(parts) != 7 or parts[0] != SALT_PREFIX or not _SALT_ID.fullmatch(parts[3]):
        raise ValueError("not a kvs3 salt: kvs3:<tenant>:<user>:<id>:<issued>:<expires>:<mac>")
    return parts[3]


def _finite(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


class SaltMapper(ABC):
    """Maps an engine's request salt to the principal kvtier serves it as.

    Implementations are stateless after construction (safe from any thread).
    """

    name: str

    def principal(self, salt: str | None) -> Principal | None:
        """None for a request without a salt; AuthError for a salt that proves nothing (for any
        input: malformed, over-large, not ASCII, or a token whose claims are)."""
        if salt is None or salt == "":
            return None
        if not isinstance(salt, str) or len(salt) > MAX_SALT_CHARS:
            raise AuthError("cache salt is not a string of acceptable length")
        # Every salt kvtier mints is printable ASCII; anything else is refused before it is split,
        # encoded or compared (hmac.compare_digest raises TypeError on non-ASCII strings).
        if not (salt.isascii() and salt.isprintable()):
            raise AuthError("cache salt is not printable ASCII")
        return self._verify(salt)

    @abstractmethod
    def _verify(self, salt: str) -> Principal: ...


class HmacSaltMapper(SaltMapper):
    """Salts bound to a tenant/user, an id and a validity window by an HMAC under a deployment
    secret (see module docstring). ``clock`` is the only time source."""

    name = "hmac"

    def __init__(self, key: bytes, *, max_lifetime_s: float = DEFAULT_SALT_MAX_LIFETIME_S,
                 leeway_s: float = SALT_LEEWAY_S, clock: Callable[[], float] = time.time) -> None:
        if len(key) < MIN_SALT_KEY_BYTES:
            raise ConfigError(f"salt key must be at least {MIN_SALT_KEY_BYTES} bytes")
        if not _finite(max_lifetime_s) or max_lifetime_s <= 0:
            raise ConfigError("salt max_lifetime_s must be a positive, finite number of seconds")
        if not _finite(leeway_s) or leeway_s < 0:
            raise ConfigError("salt leeway_s must be a finite number >= 0")
        self._key = bytes(key)
        self.max_lifetime_s = float(max_lifetime_s)
        self.leeway_s = float(leeway_s)
        self._clock = clock

    def _verify(self, salt: str) -> Principal:
        parts = salt.split(":")
        if len(parts) == 7 and parts[0] == SALT_PREFIX:
            fields = tuple(parts[1:6])
            self._check_mac(_salt_mac(self._key, fields), parts[-1])
            return self._claims(*fields)  # only now is a field parsed: they are the minter's
        if len(parts) == 4 and parts[0] == V2_SALT_PREFIX:
            self._check_mac(_v2_salt_mac(self._key, parts[1], parts[2]), parts[-1])
        elif len(parts) == 3 and parts[0] == LEGACY_SALT_PREFIX and "/" in parts[1]:
            tenant, _, user = parts[1].partition("/")
            self._check_mac(_legacy_salt_mac(self._key, tenant, user), parts[-1])
        else:
            raise AuthError("cache salt is malformed (expected kvs3:<tenant>:<user>:<id>:<issued>:<expires>:<mac>)")
        raise AuthError(f"cache salt is a {parts[0]} salt, which has no expiry and no id: no longer accepted; "
                        "mint a kvs3 salt (kvtier.security.salts.mint_salt)")

    @staticmethod
    def _check_mac(want: str, got: str) -> None:
        # _verify is also reached from RequestSalts: the ASCII rule of ``principal`` holds here too.
        if not got.isascii() or not hmac.compare_digest(want, got):
            raise AuthError("cache salt has an invalid signature")

    def _claims(self, tenant: str, user: str, sid: str, issued: str, expires: str) -> Principal:
        if not (_SALT_ID.fullmatch(sid) and _SECONDS.fullmatch(issued) and _SECONDS.fullmatch(expires)):
            raise AuthError("cache salt is malformed (its id or times)")
        now = self._clock()
        # Every comparison below is false for NaN: a non-finite clock would fail open.
        if not _finite(now):
            raise AuthError("the verifier's clock is not a finite number; refusing every salt")
        iat, exp = int(issued), int(expires)
        if exp <= iat:
            raise AuthError("cache salt expires before it was issued")
        if exp - iat > self.max_lifetime_s:
            raise AuthError("cache salt lifetime exceeds the allowed maximum")
        if exp <= now - self.leeway_s:
            raise AuthError("cache salt has expired")
        if iat > now + self.leeway_s:
            raise AuthError("cache salt is not valid yet")
        try:
            return Principal(tenant=tenant, user=user, credential_id=sid)
        except ScopeError:
            raise AuthError("cache salt names a malformed principal") from None

    def __repr__(self) -> str:  # never print the key
        return "HmacSaltMapper(<key>)"


class TokenSaltMapper(SaltMapper):
    """Salts that are kvtier capability tokens, verified by ``verifier``."""

    name = "token"

    def __init__(self, verifier: TokenVerifier) -> None:
        self.verifier = verifier

    def _verify(self, salt: str) -> Principal:
        return self.verifier.principal(salt)


class RequestSalts(SaltMapper):
    """Both kinds of salt, told apart by their form: ``kvs3:...`` (and the refused ``kvs2:``,
    ``kvs1:``) under the hmac key (when one is configured), anything else as a capability token
    under ``tokens``."""

    name = "any"

    def __init__(self, hmac_mapper: HmacSaltMapper | None, tokens: TokenVerifier) -> None:
        self.hmac = hmac_mapper
        self.tokens = TokenSaltMapper(tokens)

    def _verify(self, salt: str) -> Principal:
        if salt.startswith((SALT_PREFIX + ":", V2_SALT_PREFIX + ":", LEGACY_SALT_PREFIX + ":")):
            if self.hmac is None:
                raise AuthError("this daemon holds no salt key (auth.salt_key_file): hmac salts cannot be verified")
            return self.hmac._verify(salt)
        return self.tokens._verify(salt)


#: Daemon methods that act for no request: an engine calls them as itself, without a salt. Each
#: answers only about what that credential did itself (HeldChanges: the blocks it watches) or
#: about the daemon, the same for every caller (DataPlane: where its data-plane socket is; the
#: socket checks the token itself, and a region belongs to the credential that attached it). So an
#: engine attaches its region at start-up, before any request (issue 31: first-use costs).
CREDENTIAL_METHODS = frozenset({"HeldChanges", "DataPlane"})


def acting_principal(credential: Principal, salt: str | None, salts: SaltMapper, method: str = "") -> Principal:
    """Who a call acts for. An engine credential acts for the principal of the salt it presents
    and for nobody else (except in ``CREDENTIAL_METHODS``, which it calls as itself, saltless);
    any other credential acts for itself and may not present a salt. ``method``: the short name."""
    if ROLE_ENGINE in credential.roles:
        if not salt and method in CREDENTIAL_METHODS:
            return credential
        if not salt:
            raise AccessDenied(f"engine credential {credential.id} acts only for a request's principal: send its salt")
        acting = salts.principal(salt)
        assert acting is not None
        if ROLE_ENGINE in acting.roles or confined(acting):
            raise AccessDenied("a salt may not name another engine (or a router)")
        return acted_for(acting)  # no role a salt claims widens what the engine does for it
    if salt:
        raise AccessDenied(f"credential {credential.id} is not an engine's: it may not act for a request salt")
    return credential


def read_salt_key(path: str, what: str = "auth.salt_key_file") -> bytes:
    """A salt (or token) key file, hex or raw bytes, under the one secret-file rule."""
    raw = read_secret_file(path, what).strip()
    try:
        return bytes.fromhex(raw.decode())
    except (UnicodeDecodeError, ValueError):
        return raw
