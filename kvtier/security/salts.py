"""Request salts: an engine's opaque per-request ``cache_salt`` proven to belong to a principal.

Engines such as vLLM carry a ``cache_salt`` string on each request. The API server takes it from
the client's request body, so it is *untrusted input*: a mapper never turns a salt into a tenant
by reading a name out of it. A salt is accepted only when it carries proof minted with
deployment key material:

- ``hmac``: ``kvs2:<tenant>:<user>:<32 hex: HMAC-SHA256(salt key, tenant, user), first 128 bits>``.
  Stable for a user, so the engine's own local prefix cache (which hashes the salt into block 0)
  keeps working across that user's requests. Minted by the gateway with ``mint_salt``. Grants no
  roles. The form fits what vLLM's OpenAI server accepts as a ``cache_salt`` (at most 128
  characters, no ``/``, ``@``, ``\\`` or NUL): ids of at most 89 characters together, without
  ``@``. The older ``kvs1:<tenant>/<user>:<64 hex>`` form is still verified.
- ``token``: a kvtier capability token (``kvt1.…``, kvtier.security.tokens) verified by a
  TokenVerifier: expiry, audience and revocation by credential id all apply; roles come from the
  token. Each token is a new salt, so the engine's local prefix cache does not carry across tokens.

A missing salt maps to no principal (the request is served without kvtier); a malformed, forged
or expired salt raises AuthError. Salts are verified where the salt key lives: in the engine
process for the in-process caches, in the daemon when engines reach it with an engine credential
(``ROLE_ENGINE``), so the engines of a node never hold the salt key.
"""

from __future__ import annotations

import hashlib
import hmac
from abc import ABC, abstractmethod

from kvtier.errors import AccessDenied, AuthError, ConfigError, ScopeError
from kvtier.security.policy import Principal
from kvtier.security.secrets import read_secret_file
from kvtier.security.tokens import TokenVerifier

SALT_PREFIX = "kvs2"
LEGACY_SALT_PREFIX = "kvs1"
MIN_SALT_KEY_BYTES = 32
MAX_SALT_CHARS = 4096
#: What vLLM's OpenAI server accepts as a cache_salt.
MAX_ENGINE_SALT_CHARS = 128


def _salt_mac(key: bytes, tenant: str, user: str) -> str:
    return hmac.new(key, f"kvtier-salt-v2\x00{tenant}\x00{user}".encode(), hashlib.sha256).hexdigest()[:32]


def _legacy_salt_mac(key: bytes, tenant: str, user: str) -> str:
    return hmac.new(key, f"kvtier-salt-v1\x00{tenant}/{user}".encode(), hashlib.sha256).hexdigest()


def mint_salt(key: bytes, tenant: str, user: str) -> str:
    """The salt a gateway puts on requests of ``tenant``/``user`` (``hmac`` mapper)."""
    if len(key) < MIN_SALT_KEY_BYTES:
        raise ConfigError(f"salt key must be at least {MIN_SALT_KEY_BYTES} bytes")
    Principal(tenant=tenant, user=user)  # validates both ids
    salt = f"{SALT_PREFIX}:{tenant}:{user}:{_salt_mac(key, tenant, user)}"
    if len(salt) > MAX_ENGINE_SALT_CHARS or "@" in salt:
        raise ConfigError(f"a salt for {tenant}/{user} would not fit an engine's cache_salt "
                          f"(at most {MAX_ENGINE_SALT_CHARS} characters, no '@'): use shorter ids")
    return salt


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
    """Salts bound to a tenant/user by an HMAC under a deployment secret (see module docstring)."""

    name = "hmac"

    def __init__(self, key: bytes) -> None:
        if len(key) < MIN_SALT_KEY_BYTES:
            raise ConfigError(f"salt key must be at least {MIN_SALT_KEY_BYTES} bytes")
        self._key = bytes(key)

    def _verify(self, salt: str) -> Principal:
        parts = salt.split(":")
        if len(parts) == 4 and parts[0] == SALT_PREFIX:
            tenant, user, mac = parts[1], parts[2], _salt_mac(self._key, parts[1], parts[2])
        elif len(parts) == 3 and parts[0] == LEGACY_SALT_PREFIX and "/" in parts[1]:
            tenant, _, user = parts[1].partition("/")
            mac = _legacy_salt_mac(self._key, tenant, user)
        else:
            raise AuthError("cache salt is malformed (expected kvs2:<tenant>:<user>:<mac>)")
        # _verify is also reached from RequestSalts: the ASCII rule of ``principal`` holds here too.
        if not parts[-1].isascii() or not hmac.compare_digest(mac, parts[-1]):
            raise AuthError("cache salt has an invalid signature")
        try:
            return Principal(tenant=tenant, user=user)
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


#: The role of an engine's credential: it acts only for the principal of the salt each call
#: presents (verified by whoever holds the salt key), never for itself, and cannot mint salts.
ROLE_ENGINE = "engine"


class RequestSalts(SaltMapper):
    """Both kinds of salt, told apart by their form: ``kvs1:...`` under the hmac key (when one is
    configured), anything else as a capability token under ``tokens``."""

    name = "any"

    def __init__(self, hmac_mapper: HmacSaltMapper | None, tokens: TokenVerifier) -> None:
        self.hmac = hmac_mapper
        self.tokens = TokenSaltMapper(tokens)

    def _verify(self, salt: str) -> Principal:
        if salt.startswith((SALT_PREFIX + ":", LEGACY_SALT_PREFIX + ":")):
            if self.hmac is None:
                raise AuthError("this daemon holds no salt key (auth.salt_key_file): hmac salts cannot be verified")
            return self.hmac._verify(salt)
        return self.tokens._verify(salt)


#: Daemon methods that act for no request: an engine calls them as itself, without a salt. Each
#: answers only about what that credential did itself (HeldChanges: the blocks it watches).
CREDENTIAL_METHODS = frozenset({"HeldChanges"})


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
        if ROLE_ENGINE in acting.roles:
            raise AccessDenied("a salt may not name another engine")
        return acting
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
